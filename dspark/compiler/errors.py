"""Compiler errors that are the user's to fix (as opposed to compiler bugs)."""

from __future__ import annotations


class CompileError(Exception):
    """A build or check cannot proceed; the message says what to do."""
