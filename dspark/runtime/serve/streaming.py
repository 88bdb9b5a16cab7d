"""Pieces of streamed text: cutting at stop strings, server-sent events, and the chunk shapes of a route."""

from __future__ import annotations

import json
from typing import Any, Protocol


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a possible stop-string prefix."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        # A longer stop string that begins before the first match may still complete with later text
        # (stops "a" and " aa" on " a" + "a"): the text must end before it, so wait for that text.
        if hits and (final or not self._may_begin_before(min(hits))):
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        if final or not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def _may_begin_before(self, end: int) -> bool:
        """Whether a stop string may begin before `end`, its start seen but its end not yet arrived."""
        for start in range(max(len(self.pending) - self.hold, 0), end):
            tail = self.pending[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return True
        return False


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <JSON>` (or a bare string such as `[DONE]`) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Chunks(Protocol):
    """The server-sent chunks of one streamed response, in a route's shape (completions or chat)."""

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any text (chat: the assistant's role)."""
        ...

    def event(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """Chunks for new text and, on the last event, the finish reason."""
        ...

    def usage(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when the client asked for usage."""
        ...
