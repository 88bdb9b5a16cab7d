"""DeepSeek-V4's mixture of experts: routed experts picked per token, and one shared expert every token runs.

Routing (transformers' `DeepseekV4TopKRouter` / `DeepseekV4HashRouter`, DeepSeek's V4 `Gate`):
scores = score_func(x @ gate.weight^T) over the experts (`sqrtsoftplus`: sqrt(softplus), `sigmoid`, or
`softmax`); a top-k layer picks the k experts of highest score + gate.bias (the selection bias, which
chooses but does not weigh), a hash layer (the first `n_hash_layers`) takes the token's fixed experts
`tid2eid[token]`; the chosen experts' scores are renormalised to sum to 1 and scaled by `route_scale`
(`routed_scaling_factor`). Each expert and the shared expert is a SwiGLU whose gate and up projections are
clamped by `swiglu_limit` (transformers and vLLM clamp the shared expert too).

Row-invariant: the selection is a stable sort of the row's own scores (ties to the lower expert id), and a
row's routed output adds its experts' contributions slot by slot in ascending expert id, whatever
other rows share the step. Under expert parallelism a rank holds the experts `expert_offset ..` and computes
only their slots; the other slots' outputs come from their experts' ranks (`parallel`), each computed on its
row alone, and are added in the same order, so the result is one process's bit for bit.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.formats.dsv4_config import SCORE_FUNCS
from dspark.runtime.families.dsv4.ops import ordered_sum, row_linear, row_softmax, swiglu, tiled


class ExpertSlots(Protocol):
    """What computes a row's routed output when the experts are over several ranks (expert parallelism)."""

    def routed(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor, static_shapes: bool) -> Tensor:
        """Rows x [L, dim], their experts ids [L, k] (ascending) and weights [L, k] -> [L, dim]."""
        ...


class Gate(nn.Module):
    """The router: weight [E, dim]; bias [E] (top-k layers) or tid2eid [vocab, k] (hash layers)."""

    def __init__(self, n_experts: int, dim: int, topk: int, vocab_size: int, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, topk, dtype=torch.long))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.empty(n_experts))


class Experts(nn.Module):
    """Stacked SwiGLU experts: w1, w3 [E, inter, dim], w2 [E, dim, inter] (the release's experts.E.w*)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))
        self.expert_offset = 0  # the global id of w1[0]: 0 unless expert parallelism keeps a slice


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(inter_dim, dim))
        self.w3 = nn.Parameter(torch.empty(inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(dim, inter_dim))


class MoE(nn.Module):
    def __init__(self, *, dim: int, inter_dim: int, n_experts: int, topk: int, vocab_size: int, hashed: bool,
                 score_func: str, route_scale: float, swiglu_limit: float) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS} (got {score_func!r})")
        self.n_experts, self.topk = n_experts, topk
        self.score_func, self.route_scale, self.swiglu_limit = score_func, route_scale, swiglu_limit
        self.gate = Gate(n_experts, dim, topk, vocab_size, hashed)
        self.experts = Experts(n_experts, dim, inter_dim)
        self.shared_experts = SharedExpert(dim, inter_dim)
        # Expert parallelism (`dspark.runtime.families.dsv4.expert_parallel.shard_dsv4_experts`): what
        # computes the slots of experts held by other ranks. None: every expert is here.
        self.parallel: ExpertSlots | None = None

    def scores(self, x: Tensor) -> Tensor:
        """x [L, dim] -> each expert's score [L, E]."""
        logits = row_linear(x, self.gate.weight)
        if self.score_func == "softmax":
            return row_softmax(logits)
        if self.score_func == "sigmoid":
            return tiled(torch.sigmoid, logits)
        return torch.sqrt(tiled(F.softplus, logits))

    def route(self, x: Tensor, tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """x [L, dim] (normed), tokens [L] (hash layers) -> expert ids [L, k] ascending, weights [L, k]."""
        scores = self.scores(x)
        if self.gate.tid2eid is not None:
            if tokens is None:
                raise ValueError("a hash-routed MoE layer needs the rows' token ids")
            ids = self.gate.tid2eid[tokens]
        else:
            assert self.gate.bias is not None
            ranked = torch.sort(scores + self.gate.bias, dim=-1, descending=True, stable=True).indices
            ids = ranked[:, : self.topk]
        ids = ids.sort(dim=-1).values
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale

    def slot_outputs(self, x: Tensor, ids: Tensor, weights: Tensor, static_shapes: bool = False) -> Tensor:
        """Each routed slot's weighted expert output for rows x [L, dim] -> [L, k, dim], computed for the
        experts this module holds (all, or under expert parallelism its slice; zeros in other slots).
        `static_shapes`: every held expert on every row, each slot taking its own expert's output (no
        shape depends on the routing, so a captured graph replays it); the same bits, E times the work."""
        experts = self.experts
        first, held = experts.expert_offset, experts.w1.shape[0]
        out = x.new_zeros(*ids.shape, x.shape[-1])
        if static_shapes:
            for e in range(first, first + held):
                y = self.expert(x, e - first)  # [L, dim]
                out = torch.where((ids == e)[..., None], y[:, None] * weights[..., None], out)
            return out
        for e in range(first, first + held):
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            if rows.numel():
                out[rows, slot] = self.expert(x[rows], e - first) * weights[rows, slot, None]
        return out

    @staticmethod
    def combine(slots: Tensor) -> Tensor:
        """[L, k, dim] slot outputs -> [L, dim], added slot by slot (ascending expert id)."""
        return ordered_sum(list(slots.unbind(1)))

    def expert(self, x: Tensor, local: int) -> Tensor:
        w = self.experts
        return row_linear(swiglu(row_linear(x, w.w1[local]), row_linear(x, w.w3[local]), self.swiglu_limit),
                          w.w2[local])

    def shared(self, x: Tensor) -> Tensor:
        s = self.shared_experts
        return row_linear(swiglu(row_linear(x, s.w1), row_linear(x, s.w3), self.swiglu_limit), s.w2)

    def forward(self, x: Tensor, tokens: Tensor | None, static_shapes: bool = False) -> Tensor:
        """x [L, dim] (normed), tokens [L] -> [L, dim]: the routed slots (over the ranks under expert
        parallelism, `parallel`) added in ascending expert id, then the shared expert. `static_shapes`: no
        shape depends on the routing (device backends that capture graphs; `slot_outputs`)."""
        ids, weights = self.route(x, tokens)
        if self.parallel is None:
            routed = self.combine(self.slot_outputs(x, ids, weights, static_shapes))
        else:
            routed = self.parallel.routed(self, x, ids, weights, static_shapes)
        return routed + self.shared(x)
