"""One streamed completion as `dspark bench` reads it: SSE parsing, the timings and counts of a response.

Every way a response can be malformed (an error event, a chunk that is not a completion chunk, no usage
chunk, no `[DONE]`) is a `StreamError`, so that a bad server fails its requests instead of the benchmark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class StreamError(Exception):
    """A failed response: an HTTP error status, malformed SSE, an error event, no usage chunk."""


@dataclass(frozen=True)
class RequestOutcome:
    """One request. Times are seconds from sending it; `error` is None when it succeeded."""

    index: int
    error: str | None = None
    latency: float = 0.0  # to the end of the stream, or to the failure
    ttft: float | None = None  # None when no chunk carried text
    chunk_gaps: tuple[float, ...] = ()
    text_chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_steps: int | None = None  # None when the server does not report usage.dspark
    finish_reason: str | None = None
    text: str = ""  # the completion, so that a sweep can compare the outputs of its policies

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


@dataclass
class StreamTracker:
    """Accumulates one streamed response; times are seconds since the request was sent."""

    first_text: float | None = None
    last_text: float | None = None
    end: float | None = None  # when `data: [DONE]` arrived
    gaps: list[float] = field(default_factory=list)
    text_chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    texts: list[str] = field(default_factory=list)

    def on_event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.end = now
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"malformed SSE data: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"malformed SSE data: {data[:80]!r}")
        if "error" in chunk:  # a server may fail a request after the 200 status went out
            raise StreamError(f"error event: {error_message(chunk)}")
        if chunk.get("usage") is not None:  # some servers send "usage": null on every chunk
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamError(f"chunk without a choices list: {data[:80]!r}")
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamError(f"malformed choice: {choice!r:.80}")
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if choice.get("text"):
                self._on_text(now)
                self.texts.append(str(choice["text"]))

    def _on_text(self, now: float) -> None:
        if self.first_text is None:
            self.first_text = now
        else:
            self.gaps.append(now - self.last_text)
        self.last_text = now
        self.text_chunks += 1

    def outcome(self, index: int) -> RequestOutcome:
        if self.end is None:
            raise StreamError("stream ended before `data: [DONE]`")
        if self.usage is None:
            raise StreamError("no usage chunk (does the server honour stream_options.include_usage?)")
        completion = _int_field(self.usage, "completion_tokens")
        prompt = _int_field(self.usage, "prompt_tokens")
        dspark = self.usage.get("dspark")
        reports_steps = isinstance(dspark, dict) and "decode_steps" in dspark
        steps = _int_field(dspark, "decode_steps") if reports_steps else None
        return RequestOutcome(index=index, latency=self.end, ttft=self.first_text,
                              chunk_gaps=tuple(self.gaps), text_chunks=self.text_chunks,
                              prompt_tokens=prompt, completion_tokens=completion, decode_steps=steps,
                              finish_reason=self.finish_reason, text="".join(self.texts))


def _int_field(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StreamError(f"usage.{key} is not a count: {value!r}")
    return value


def error_message(body: Any) -> str:
    """The `error.message` of an OpenAI error body, else the body itself (shortened)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:200]


class SseParser:
    """Incremental SSE parsing: `data:` lines accumulate until the blank line that ends an event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The event's data when `line` completes one, else None. Comments and other fields are ignored."""
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data
