"""A request as the engine tracks it, and the error for one it cannot serve."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.runtime.kv_cache import SlotHandle
from dspark.runtime.sampling import SamplingParams


class RequestError(ValueError):
    """A request that this deployment cannot serve (says which limit and what to change).
    `field` names the request field at fault ("prompt", "max_new_tokens"), where there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(eq=False)  # a request is itself: membership tests must not compare outputs field by field
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    generator: torch.Generator | None = None  # the request's own stream when it has a seed
    handle: SlotHandle | None = None
    output: list[int] = field(default_factory=list)
    seq_len: int = 0  # positions whose target (and draft-context) KV is cached
    prefilled: int = 0  # prompt tokens prefilled so far (chunked prefill)
    root: int = -1  # last committed token; its KV is written by the next forward
    done: bool = False
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens) or "abort"
    decode_steps: int = 0  # decode steps this request took part in


def reserved_tokens(r: Request, num_draft_tokens: int) -> int:
    """KV slots a request holds from admission to its end: prompt, every new token and one step's rows."""
    return len(r.prompt) + r.max_new_tokens + num_draft_tokens


def validate_request(r: Request, num_draft_tokens: int, max_context_len: int, pool_tokens: int) -> None:
    """Raise `RequestError` naming the limit `r` breaks: an empty prompt, no tokens to generate, more
    than `max_context_len`, or more than the whole KV pool (`pool_tokens`)."""
    if not r.prompt:
        raise RequestError(f"request {r.rid}: empty prompt", "prompt")
    if r.max_new_tokens < 1:
        raise RequestError(f"request {r.rid}: max_new_tokens must be >= 1", "max_new_tokens")
    if reserved_tokens(r, num_draft_tokens) > max_context_len:
        raise RequestError(
            f"request {r.rid}: prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) "
            f"+ N ({num_draft_tokens}) exceeds serving.max_context_len ({max_context_len}); "
            "shorten the prompt or raise max_context_len in the spec", "prompt")
    if reserved_tokens(r, num_draft_tokens) > pool_tokens:
        raise RequestError(
            f"request {r.rid}: prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) "
            f"+ N ({num_draft_tokens}) exceeds the whole KV pool ({pool_tokens} tokens, "
            "serving.max_total_tokens); shorten the request or raise max_total_tokens", "prompt")
