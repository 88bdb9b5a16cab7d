"""OpenAI `/v1/completions` request and response shapes, and the error body every 4xx uses.

Requests are validated strictly (unknown fields and wrong types are errors naming the field):
a client that sends a parameter this server would silently ignore gets told instead. Fields of
the OpenAI API that this server does not implement are accepted only at their no-op values.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="send a last chunk with the usage counts")


class CompletionRequest(BaseModel):
    """`POST /v1/completions`. `prompt` is text, or token ids of the served tokenizer."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model name (`GET /v1/models`)")
    prompt: str | list[StrictInt] = Field(description="prompt text or token ids")
    max_tokens: StrictInt | None = Field(None, description="new tokens at most (default: the spec's)")
    temperature: Number | None = Field(None, description="0 = greedy (default: the spec's)")
    top_p: Number | None = Field(None, description="nucleus mass in (0, 1] (default: the spec's)")
    top_k: StrictInt | None = Field(None, description="top-k, 0 = off (default: the spec's)")
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings, not included")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, description="the request samples from its own generator, "
                                                     "seeded with this (best effort, as OpenAI's)")
    ignore_eos: StrictBool = Field(False, description="extension: keep generating past EOS")
    user: str | None = None
    # OpenAI fields accepted only at their defaults: this server has no such feature.
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    logit_bias: None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("max_tokens must be >= 1")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 100:
            raise ValueError("temperature must be in [0, 100]")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be at most 4 non-empty strings")
        return stops

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, decode_steps: int) -> dict[str, Any]:
    """OpenAI usage plus `dspark.decode_steps` (completion_tokens / decode_steps = tokens per step)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "dspark": {"decode_steps": decode_steps}}


def completion_body(cid: str, model: str, text: str, finish_reason: str | None,
                    usage_body: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage_body is not None:
        body["usage"] = usage_body
    return body


def usage_chunk(cid: str, model: str, usage_body: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_body}
