"""How much work a call does, counted instead of timed: the Python and C functions it calls.

A wall-time limit in a unit test measures the machine's load as much as the code, and flakes on a busy
one. What such a limit guards is that the work stays bounded (a spec refused before a billion-value
alias expansion or a 10^18-request coverage proof runs); a count of function calls says that exactly and
is the same on every machine and under any load.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


def count_calls(fn: Callable[[], T]) -> tuple[T, int]:
    """`fn()` and the number of function calls (Python and C) made in this thread while it ran."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(previous)
    return result, calls
