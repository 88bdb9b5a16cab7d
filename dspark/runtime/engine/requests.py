"""A request as the engine tracks it, and the error for one it cannot serve."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.runtime.kv_cache import SlotHandle
from dspark.runtime.sampling import SamplingParams


class RequestError(ValueError):
    """A request that this deployment cannot serve (says which limit and what to change).

    `field` names the request field to change, where there is one: "prompt" when the prompt alone
    breaks a limit (empty, or too long for even one new token), "max_new_tokens" when fewer new
    tokens would fit (the message then gives the largest that does). `code` is
    "context_length_exceeded" for a request over the context length or the KV pool."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


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
    seed: int | None = None  # what `generator` was seeded with (another DP rank's engine rebuilds it)
    probe_nll: float = 0.0  # summed over the prompt's probed tokens (`ExtendSteps.prompt_probe`), nats
    probed: int = 0

    @property
    def prompt_surprise(self) -> float | None:
        """The mean negative log-likelihood of the prompt's probed tokens (None: none probed)."""
        return self.probe_nll / self.probed if self.probed else None


def reserved_tokens(r: Request, num_draft_tokens: int) -> int:
    """KV slots a request holds from admission to its end: prompt, every new token and one step's rows."""
    return len(r.prompt) + r.max_new_tokens + num_draft_tokens


def validate_request(r: Request, num_draft_tokens: int, max_context_len: int, pool_tokens: int) -> None:
    """Raise `RequestError` naming the limit `r` breaks: an empty prompt, no tokens to generate, more
    than `max_context_len`, or more than the whole KV pool (`pool_tokens`). The messages speak to
    whoever sent the request: they name its fields, never engine internals such as request ids."""
    if not r.prompt:
        raise RequestError("the prompt is empty; send at least one token", "prompt")
    if r.max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be at least 1, got {r.max_new_tokens}", "max_new_tokens")
    # The tighter of the two limits decides, so that the largest max_new_tokens offered really fits.
    if pool_tokens < max_context_len:
        limit = pool_tokens
        name = f"the whole KV pool of {pool_tokens} tokens (serving.max_total_tokens)"
    else:
        limit = max_context_len
        name = f"the context length of {max_context_len} tokens (serving.max_context_len)"
    if reserved_tokens(r, num_draft_tokens) <= limit:
        return
    # A request reserves its prompt, every new token and one verify step's N rows.
    largest = limit - len(r.prompt) - num_draft_tokens
    if largest < 1:
        raise RequestError(
            f"the prompt is {len(r.prompt)} tokens, too long for {name}: with {num_draft_tokens} tokens "
            f"reserved for a verify step and 1 new token, at most {limit - num_draft_tokens - 1} prompt "
            "tokens fit; shorten the prompt", "prompt", "context_length_exceeded")
    raise RequestError(
        f"the prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens}) + {num_draft_tokens} "
        f"tokens reserved for a verify step exceed {name}; lower max_new_tokens to at most {largest}",
        "max_new_tokens", "context_length_exceeded")
