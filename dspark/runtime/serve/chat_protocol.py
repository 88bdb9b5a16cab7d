"""OpenAI `POST /v1/chat/completions`: what this server accepts, and its response shapes.

The prompt is the conversation rendered by the model's chat template (`dspark/runtime/chat_template.py`);
sampling, stop strings, streaming, `seed` and the extensions are as on the completions route
(`openai_protocol.py`, `GenerationRequest`). For each field of OpenAI's chat API:

- honoured: `model`, `messages`, `max_completion_tokens` and its deprecated name `max_tokens` (either, or
  both when equal), `temperature`, `top_p`, `stop`, `stream`, `stream_options.include_usage`, `seed`;
  and the extensions `top_k`, `ignore_eos` (which also ignores the template's end-of-turn token) and
  `chat_template_kwargs` (an object of extra template variables, e.g. `{"enable_thinking": false}` for
  Qwen3, as vLLM and SGLang take it; it may not replace `messages`, `add_generation_prompt`, `tools`,
  `documents` or the special tokens).
- `messages`: a non-empty list of `{"role": "system" | "user" | "assistant", "content": ..., "name": ...}`.
  `content` is a string, or a list of text parts (`{"type": "text", "text": ...}`) joined with newlines
  (vLLM's rule); `name` is optional and passed to the template. Keys whose value is null are dropped
  first, as Hugging Face does (the OpenAI SDK sends an assistant message it returned with
  `"tool_calls": null`, `"refusal": null` and the like).
- accepted and ignored: `user`; `parallel_tool_calls` (no tools, so nothing to parallelize).
- accepted only at their no-op values and refused (400 naming the field) otherwise: `n` (1), `logprobs`
  (false), `top_logprobs` (null), `presence_penalty` and `frequency_penalty` (0), `logit_bias` (null or
  {}), `tools` (null or []), `tool_choice` (null or "none"), `functions` (null), `function_call` (null or
  "none"), `response_format` (null or `{"type": "text"}`), `modalities` (null or ["text"]), `audio`
  (null). Messages with the roles `tool`, `function` or `developer`, `tool_calls`, and content parts other
  than text (images, audio, files) are refused likewise, naming the message.
- any other field is refused as unknown.

Responses: `chat.completion` with one choice `{"index": 0, "message": {"role": "assistant", "content"},
"logprobs": null, "finish_reason"}` and `usage`; streamed, `chat.completion.chunk`s: the role first
(`{"role": "assistant", "content": ""}`), then content deltas, then an empty delta with the
`finish_reason`; with `stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
with no choices carries the usage, as OpenAI's do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from dspark.runtime.chat_template import RESERVED_VARIABLES
from dspark.runtime.serve.errors import ApiError
from dspark.runtime.serve.openai_protocol import (
    GenerationRequest,
    parse_request,
    positive_token_count,
    refuse,
)

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")
NO_TOOLS = "this server has no tool calling"


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`. `messages` is checked message by message by `parse_chat_request`."""

    messages: list[Any] = Field(description="the conversation: system, user and assistant messages")
    max_completion_tokens: int | None = Field(None, description="new tokens at most (default: the spec's)")
    max_tokens: int | None = Field(None, description="deprecated name of max_completion_tokens")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension: extra variables for the chat template, e.g. enable_thinking")
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored (no tools)")
    # OpenAI features this server lacks: accepted at their no-op values only (see the module docstring).
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None

    @field_validator("max_completion_tokens", "max_tokens")
    @classmethod
    def _token_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return positive_token_count(value, str(info.field_name))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RESERVED_VARIABLES & set(value or {}))
        if taken:
            raise refuse(f"`chat_template_kwargs` may not set {', '.join(taken)}: the server sets "
                         "these from the request and the model")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> None:
        if value is not None and value is not False:
            raise refuse("`logprobs` is not supported")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: Any) -> None:
        if value is not None:
            raise refuse("`top_logprobs` is not supported")
        return None

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None and value != []:
            raise refuse(f"`{info.field_name}` is not supported: {NO_TOOLS}")
        return None

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None and value != "none":
            raise refuse(f"`{info.field_name}` is not supported: {NO_TOOLS}; only \"none\" is accepted")
        return None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> None:
        if value is not None and value != {"type": "text"}:
            raise refuse("`response_format` is not supported: this server produces free text only "
                         "(no JSON mode or schema); only {\"type\": \"text\"} is accepted")
        return None

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, value: Any) -> None:
        if value is not None and value != ["text"]:
            raise refuse("`modalities` is not supported: this server produces text only")
        return None

    @field_validator("audio")
    @classmethod
    def _audio(cls, value: Any) -> None:
        if value is not None:
            raise refuse("`audio` is not supported: this server produces text only")
        return None

    def token_limit(self) -> tuple[int | None, str]:
        """(the requested new-token limit or None, the field it was given in)."""
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError(400, "`max_tokens` and `max_completion_tokens` differ; send one of them "
                                    "(`max_tokens` is the deprecated name)", "max_completion_tokens")
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def parse_chat_request(payload: dict[str, Any]) -> tuple[ChatCompletionRequest, list[dict[str, str]]]:
    """The request and its messages ready for the template, or an `ApiError` (400) naming the field."""
    req = parse_request(ChatCompletionRequest, payload)
    req.token_limit()  # refuses two different limits before anything else is done
    return req, parse_messages(req.messages)


def parse_messages(messages: list[Any]) -> list[dict[str, str]]:
    if not messages:
        raise ApiError(400, "`messages` must hold at least one message", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise ApiError(400, f"`{where}` must be an object with `role` and `content`", where)
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role is None:
        raise ApiError(400, f"`{where}.role` is required", f"{where}.role")
    if role in ("tool", "function"):
        raise ApiError(400, f"`{where}.role` {role!r} is not supported: {NO_TOOLS}", f"{where}.role")
    if role == "developer":
        raise ApiError(400, f"`{where}.role` \"developer\" is not supported; send the instructions as a "
                            "\"system\" message", f"{where}.role")
    if role not in ROLES:
        shown = repr(role) if isinstance(role, str) else "a non-string"
        raise ApiError(400, f"`{where}.role` must be one of {', '.join(ROLES)}, not {shown}", f"{where}.role")
    for key in message:
        if key in ("tool_calls", "function_call"):
            raise ApiError(400, f"`{where}.{key}` is not supported: {NO_TOOLS}", f"{where}.{key}")
        if key not in MESSAGE_KEYS:
            raise ApiError(400, f"unknown field `{where}.{key}`; a message has {', '.join(MESSAGE_KEYS)}",
                           f"{where}.{key}")
    out = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
    if "name" in message:
        if not isinstance(message["name"], str):
            raise ApiError(400, f"`{where}.name` must be a string", f"{where}.name")
        out["name"] = message["name"]
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        raise ApiError(400, f"`{where}` is required", where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"`{where}` must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"`{at}` must be an object with a `type`, e.g. "
                                '{"type": "text", "text": "..."}', at)
        if part["type"] != "text":
            raise ApiError(400, f"`{at}`: content parts of type {part['type']!r} are not supported: this "
                                "model reads text only", at)
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"`{at}.text` must be a string", f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_completion_body(cid: str, model: str, text: str, finish_reason: str | None,
                         usage_body: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_body}


class ChatChunks:
    """The `chat.completion.chunk`s of one streamed response."""

    def __init__(self, cid: str, model: str, include_usage: bool) -> None:
        self.cid, self.model, self.include_usage = cid, model, include_usage
        self.created = int(time.time())  # OpenAI's chunks of one response share it

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def opening(self) -> list[dict[str, Any]]:
        return [self._choice({"role": "assistant", "content": ""}, None)]

    def event(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        out = [self._choice({"content": text}, None)] if text else []
        if finish_reason is not None:
            out.append(self._choice({}, finish_reason))
        return out

    def usage(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_body}
