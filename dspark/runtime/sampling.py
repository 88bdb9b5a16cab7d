"""Sampling: the warped distributions of draft and target, and rejection-sampling verification.

Speculative sampling keeps the target's distribution exactly: draft k, drawn from the draft's
warped distribution q_k, is accepted with probability min(1, p_k(x) / q_k(x)); at the first
rejection the committed token is drawn from the residual norm(max(0, p_k - q_k)); a request that
stops without a rejection (every draft accepted, or its verify_len cap reached) draws its last
token from p at that row. Each committed token is then distributed as the target's warped
next-token distribution given the prefix, whatever the draft proposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark.runtime.kernels.accept import AcceptResult

# Below this temperature a request decodes greedily: dividing logits by it overflows float32, and
# the distribution is a one-hot at the argmax to within float precision anyway (vLLM does the same).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 (or below `MIN_TEMPERATURE`) means greedy; top_k 0 and top_p 1 switch those
    filters off. No value a request can carry makes a distribution NaN."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def policy(self) -> str:
        """The policy name calibrations and fingerprints use (`dspark.fingerprint.sampling_policy`)."""
        from dspark.fingerprint import sampling_policy

        return sampling_policy(0.0 if self.greedy else self.temperature, self.top_p, self.top_k)


def _scaled(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """`logits / temperature` in float32, shifted so each row's largest logit is 0: however small
    the temperature, the row keeps a finite maximum and softmax cannot produce NaN."""
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / temperature


def _past_top_p(sorted_probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which of the descending probabilities fall outside the smallest prefix whose mass reaches
    top_p (the token that crosses it stays); the most likely token always stays."""
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    drop[..., 0] = False
    return drop


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities `[..., V]` after temperature, top-k and top-p (float32)."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scaled = _scaled(logits, params.temperature)
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(_past_top_p(sorted_probs, params.top_p), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass(frozen=True)
class RowGenerators:
    """One random stream per request of a batch: a request with a `seed` draws only from its own
    generator, so what it samples does not depend on which other requests share its steps; the
    rest draw from the runtime's generator."""

    rows: tuple[torch.Generator | None, ...]
    default: torch.Generator | None

    def rand(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Uniforms in [0, 1) of `shape`, whose leading dimension is the request."""
        if shape[0] != len(self.rows):
            raise ValueError(f"{len(self.rows)} generators for {shape[0]} requests")
        return torch.stack([torch.rand(shape[1:], generator=g or self.default, device=device)
                            for g in self.rows])


Generator = torch.Generator | RowGenerators | None


def uniform(shape: tuple[int, ...], generator: Generator, device: torch.device) -> torch.Tensor:
    if isinstance(generator, RowGenerators):
        return generator.rand(shape, device)
    return torch.rand(shape, generator=generator, device=device)


def sample(probs: torch.Tensor, generator: Generator) -> torch.Tensor:
    """One token per row of `probs [..., V]` (int64 `[...]`); per-request generators sample by
    inverting each row's CDF at a uniform from that request's stream."""
    if isinstance(generator, RowGenerators):
        cdf = probs.float().cumsum(-1)
        u = generator.rand(tuple(probs.shape[:-1]), probs.device) * cdf[..., -1]
        # right=True: a zero-probability token (a flat CDF step) can never be chosen.
        index = torch.searchsorted(cdf, u.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
        return index.clamp_max(probs.shape[-1] - 1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@dataclass(frozen=True)
class SamplingAccept:
    result: AcceptResult
    raw_correct_len: torch.Tensor  # int64 [B]: acceptances ignoring the verify_len cap (labels)
    accept_prob: torch.Tensor  # float32 [B, gamma]: min(1, p/q) of each draft, the chance it was accepted


def rejection_accept(drafts: torch.Tensor, q_probs: torch.Tensor, p_probs: torch.Tensor,
                     verify_lens: torch.Tensor, generator: Generator) -> SamplingAccept:
    """Verify sampled `drafts [B, gamma]` (drawn from `q_probs [B, gamma, V]`) against the
    target's warped `p_probs [B, N, V]`; acceptance is capped by `verify_lens` as in greedy mode."""
    num_reqs, gamma = drafts.shape
    device = drafts.device
    q = q_probs.gather(-1, drafts[..., None]).squeeze(-1)
    p = p_probs[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform((num_reqs, gamma), generator, device)
    accepted = u * q < p  # u < p / q without dividing by a possibly tiny q
    raw = accepted.long().cumprod(-1).sum(-1)
    cap = verify_lens.long() - 1
    correct = torch.minimum(raw, cap)
    rows = torch.arange(num_reqs, device=device)
    p_stop = p_probs[rows, correct]  # [B, V]: p at the row after the accepted prefix
    # Stopped by a rejection among the verified drafts; a draft at or past the cap was never
    # verified (not planned), so stopping there draws from p, not from the residual.
    rejected = raw < cap
    q_stop = q_probs[rows, correct.clamp(max=gamma - 1)]
    residual = (p_stop - q_stop).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection has residual mass > 0 unless p <= q everywhere, i.e. p == q (then nothing is
    # ever rejected); guard the division anyway.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_stop)
    stop_dist = torch.where(rejected[:, None], residual, p_stop)
    bonus = sample(stop_dist, generator)
    # q > 0 at a draft sampled from q; the clamp only guards a degenerate distribution.
    accept_prob = (p / q.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0).float()
    return SamplingAccept(AcceptResult(correct, correct + 1, bonus), raw, accept_prob)


@dataclass(frozen=True)
class BatchSampling:
    """The sampling parameters of each request in a batch (a server mixes policies in one step).

    Greedy requests get one-hot distributions at their argmax, so one rejection-sampling pass
    serves the whole batch: with one-hot p and q a draft is accepted exactly when it equals the
    target's argmax, and the committed token is that argmax — greedy verification, unchanged.
    """

    params: tuple[SamplingParams, ...]

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def _columns(self, device: torch.device,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        greedy = torch.tensor([p.greedy for p in self.params], device=device)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in self.params],
                                   dtype=torch.float32, device=device)
        top_p = torch.tensor([p.top_p for p in self.params], dtype=torch.float32, device=device)
        # top_k past the vocabulary keeps everything (and must not overflow an int64 column).
        top_k = torch.tensor([min(p.top_k, vocab) for p in self.params], dtype=torch.long, device=device)
        return greedy, temperature, top_p, top_k


def warp_rows(logits: torch.Tensor, batch: BatchSampling) -> torch.Tensor:
    """Probabilities `[B, ..., V]` with request b's parameters applied to `logits[b]` (float32);
    greedy requests get a one-hot distribution at the argmax."""
    num_reqs, vocab = logits.shape[0], logits.shape[-1]
    if len(batch.params) != num_reqs:
        raise ValueError(f"{len(batch.params)} sampling parameter sets for {num_reqs} requests")
    greedy, temperature, top_p, top_k = batch._columns(logits.device, vocab)
    shape = (num_reqs,) + (1,) * (logits.dim() - 1)
    scaled = _scaled(logits, temperature.view(shape))
    # The sort over the vocabulary is the expensive part: only a request that filters needs it.
    filters = [p for p in batch.params if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if not filters:
        probs = torch.softmax(scaled, dim=-1)
    else:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        # top-k: keep ranks < k (0 = all); ties at the k-th value are kept, as in `warp`.
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_logits.gather(-1, (k - 1).view(shape).expand(*sorted_logits.shape[:-1], 1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs = probs.gather(-1, order)
        sorted_probs = sorted_probs.masked_fill(_past_top_p(sorted_probs, top_p.view(shape)), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if not any(p.greedy for p in batch.params):
        return probs
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(probs.dtype)
    return torch.where(greedy.view(shape), one_hot, probs)


def pick_rows(logits: torch.Tensor, batch: BatchSampling, generator: Generator) -> torch.Tensor:
    """One token per request row of `logits [B, ..., V]` under that request's parameters."""
    if batch.all_greedy:
        return logits.argmax(-1)
    return sample(warp_rows(logits, batch), generator)
