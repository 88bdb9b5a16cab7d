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
