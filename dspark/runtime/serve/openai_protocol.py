"""OpenAI `POST /v1/completions`: what this server accepts, and its response shapes.

Requests are validated strictly, so that a client is told rather than silently served something else.
For each field of OpenAI's completions API:

- honoured: `model`, `prompt`, `max_tokens`, `temperature`, `top_p`, `stop` (up to 4 strings),
  `stream`, `stream_options.include_usage` (with `stream` only, as OpenAI), `seed`; and two
  extensions, `top_k` and `ignore_eos`.
- accepted and ignored: `user`, the caller's id of its end user for abuse monitoring; it never
  changes a completion.
- accepted only at their no-op values and refused (400 naming the field) otherwise: `n` (1),
  `best_of` (1), `echo` (false), `logprobs` (null), `suffix` (null or ""), `presence_penalty` and
  `frequency_penalty` (0), `logit_bias` (null or {}). This server has none of these features.
- `prompt` is one string or one list of token ids. A list holding a single string or a single
  token-id list is that prompt; longer lists (batched prompts) are refused.
- any other field is refused as unknown.

Omitted, `max_tokens` is the deployment's `serving.max_new_tokens` (not OpenAI's 16), and
`temperature`, `top_p` and `top_k` are its `serving.generation`. The server decodes a `temperature`
below 1e-5 greedily (so small a temperature picks the most likely token anyway) and raises a `top_p`
below 1e-6 to 1e-6 (either keeps the most likely token alone): in float32 they would overflow.

`parse_completion_request` turns a decoded JSON object into a `CompletionRequest` or an `ApiError`
whose message names the field in plain words (never pydantic's wording). `GenerationRequest` holds the
fields the chat route (`chat_protocol.py`) shares with this one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from dspark.runtime.serve.errors import ApiError

MAX_STOP_STRINGS = 4
# Any k over the vocabulary keeps every token; far larger ones would overflow the engine's int64 tensors.
MAX_TOP_K = 2**31 - 1
REFUSED = "refused"  # the pydantic error type of a field this server refuses in its own words


def refuse(message: str) -> PydanticCustomError:
    # No context: the message is used verbatim (it must not carry client text, which could hold braces).
    return PydanticCustomError(REFUSED, message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="send a last chunk with the usage counts")


class GenerationRequest(BaseModel):
    """What `POST /v1/completions` and `POST /v1/chat/completions` share: the model, sampling, stop strings,
    streaming, the seed, the extensions, and the OpenAI features this server lacks that both routes name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model name (`GET /v1/models`)")
    temperature: float | None = Field(None, description="0 = greedy (default: the spec's)")
    top_p: float | None = Field(None, description="nucleus mass in (0, 1] (default: the spec's)")
    top_k: int | None = Field(None, description="extension: top-k, 0 = off (default: the spec's)")
    stop: list[str] | None = Field(None, description="up to 4 stop strings, not included in the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, description="the request samples from its own generator, seeded "
                                               "with this (best effort, as OpenAI's)")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    user: str | None = Field(None, description="accepted and ignored")
    # OpenAI features this server lacks: accepted at their no-op values only (see the module docstring).
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 100:  # also refuses NaN
            raise refuse("`temperature` must be between 0 (greedy) and 100")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise refuse("`top_p` must be greater than 0 and at most 1")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_K:
            raise refuse(f"`top_k` must be between 0 (off) and {MAX_TOP_K}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < 2**63:
            raise refuse("`seed` must be between 0 and 2**63 - 1")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise refuse("`stop` must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise refuse(f"`stop` holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are supported")
        if any(not s for s in stops):
            raise refuse("`stop` strings must not be empty")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: Any, info: ValidationInfo) -> None:
        return _only_one(value, str(info.field_name))

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: Any, info: ValidationInfo) -> None:
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value == 0):
            return None
        raise refuse(f"`{info.field_name}` is not supported: only 0 (no penalty) is accepted")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Any) -> None:
        if value is not None and value != {}:
            raise refuse("`logit_bias` is not supported")
        return None

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`. `prompt` is text, or token ids of the served tokenizer."""

    prompt: str | list[int] = Field(description="prompt text or token ids")
    max_tokens: int | None = Field(None, description="new tokens at most (default: the spec's)")
    # OpenAI features this server lacks: accepted at their no-op values only (see the module docstring).
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a batch of one is that prompt
        if isinstance(value, str):
            if not value:
                raise refuse("`prompt` must not be empty")
            return value
        if not isinstance(value, list):
            raise refuse("`prompt` must be a string or a list of token ids")
        if not value:
            raise refuse("`prompt` must not be empty")
        if all(isinstance(v, str | list) for v in value):
            raise refuse("`prompt` must be a single string; batched prompts are not supported, "
                          "send one request per prompt")
        if not all(_is_int(v) for v in value):
            raise refuse("`prompt` as a list must hold token ids (integers), e.g. [1, 450, 4996]")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        return positive_token_count(value, "max_tokens")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: Any, info: ValidationInfo) -> None:
        return _only_one(value, str(info.field_name))

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: Any) -> None:
        if value is not None and value is not False:
            raise refuse("`echo` is not supported: the completion never repeats the prompt")
        return None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> None:
        if value is not None:
            raise refuse("`logprobs` is not supported")
        return None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: Any) -> None:
        if value not in (None, ""):
            raise refuse("`suffix` is not supported: this server completes text after the prompt only")
        return None


RequestT = TypeVar("RequestT", bound=GenerationRequest)


def positive_token_count(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise refuse(f"`{name}` must be at least 1")
    return value


def _only_one(value: Any, name: str) -> None:
    """`n` / `best_of`: this server returns one choice per request."""
    if value is None or (_is_int(value) and value == 1):
        return None
    if _is_int(value) and value > 1:
        raise refuse(f"`{name}` > 1 is not supported: this server returns one completion per request; "
                      "send several requests instead")
    raise refuse(f"`{name}` must be 1 (this server returns one completion per request)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_completion_request(payload: dict[str, Any]) -> CompletionRequest:
    """The request, or an `ApiError` (400) naming the first field at fault."""
    return parse_request(CompletionRequest, payload)


def parse_request(model: type[RequestT], payload: dict[str, Any]) -> RequestT:
    """`payload` as a `model` request, or an `ApiError` (400) naming the first field at fault."""
    try:
        req = model.model_validate(payload)
    except ValidationError as err:
        raise validation_error(err, model) from None
    if req.stream_options is not None and not req.stream:  # as OpenAI: an option that would do nothing
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")
    return req


# What a pydantic error type says about a field, in the API's words.
TYPE_MESSAGES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer",
    "int_from_float": "must be an integer", "float_type": "must be a number",
    "float_parsing": "must be a number", "string_type": "must be a string",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "model_type": "must be an object", "dict_type": "must be an object",
    "model_attributes_type": "must be an object", "list_type": "must be a list",
    "missing": "is required",
}


def validation_error(err: ValidationError, model: type[BaseModel] = CompletionRequest) -> ApiError:
    """The 400 for a request to `model` that failed validation: its first error, the field named as sent."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) if loc else None
    kind = first.get("type")
    if kind == REFUSED:
        return ApiError(400, str(first["msg"]), param)
    if kind == "extra_forbidden":
        known = StreamOptions.model_fields if len(loc) > 1 else model.model_fields
        return ApiError(400, f"unknown parameter `{param}`; this server accepts "
                             f"{', '.join(known)}", param)
    if kind == "value_error":  # a ValueError from a validator: its own message
        return ApiError(400, f"`{param}`: {first.get('ctx', {}).get('error', first['msg'])}", param)
    said = TYPE_MESSAGES.get(str(kind))
    if said is None:
        return ApiError(400, f"`{param}` is invalid: {first['msg']}", param)
    if kind == "missing":
        return ApiError(400, f"`{param}` {said}", param)
    return ApiError(400, f"`{param}` {said}, got {_json_type(first.get('input'))}", param)


def _json_type(value: Any) -> str:
    """The JSON type of a value, which is what a client sent (its text may be long or private)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


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


class CompletionChunks:
    """The `text_completion` chunks of one streamed response: text and finish reason travel together."""

    def __init__(self, cid: str, model: str) -> None:
        self.cid, self.model = cid, model

    def opening(self) -> list[dict[str, Any]]:
        return []

    def event(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        if not text and finish_reason is None:
            return []
        return [completion_body(self.cid, self.model, text, finish_reason, None)]

    def usage(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return usage_chunk(self.cid, self.model, usage_body)
