"""The draft step in captured graphs: one graph per batch-size tier, beside the verify graphs.

Eagerly, a draft step of the tiny pair on a GPU is several hundred small kernel launches (the block's
layers, then the Markov head's `gamma` sequential slots, each an embedding, a product and an argmax),
which cost more than the verify step they feed. Captured, a step is one replay.

A tier's graph is captured on padding requests (prefix 0, token 0, an all-null page table: their block
K/V land in the null page, which no request reads) and replays whatever step was copied into the static
inputs: each request's root, its first block position and its page-table row. The paged block's metadata
is derived from those inside the graph (`PagedDraftBlock.plan` reads no host value on the Triton path).

Only the greedy proposal is captured: a sampling draft draws from per-request generators and a recording
run keeps the confidence head's inputs, and both run eagerly (`accepts` says which steps replay).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Sequence

import torch

from dspark.runtime.attention.triton_paged import TritonPagedAttention
from dspark.runtime.engine.forward import PagedDraftBlock
from dspark.runtime.models.dspark_block_draft import BlockProposal, DSparkBlockDraft
from dspark.runtime.runners.graphs import GraphApi

# drafts, confidence logits, logits, hidden: what a replay writes
Proposal = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


class GraphDraftRunner:
    def __init__(self, draft: DSparkBlockDraft, attn: TritonPagedAttention, batch_tiers: Sequence[int],
                 pages_per_request: int, gamma: int, page_size: int, graphs: GraphApi) -> None:
        if not batch_tiers or list(batch_tiers) != sorted(set(batch_tiers)) or batch_tiers[0] < 1:
            raise ValueError(f"draft batch tiers must be increasing positive sizes, got {list(batch_tiers)}")
        self.draft, self.attn = draft, attn
        self.tiers = tuple(batch_tiers)
        self.gamma, self.page_size = draft.resolve_gamma(gamma), page_size
        device = draft.lm_head.weight.device
        largest = self.tiers[-1]
        # the static inputs every tier's graph reads a prefix of (host-side steps are copied in)
        self.roots = torch.zeros(largest, dtype=torch.long, device=device)
        self.prefix = torch.zeros(largest, dtype=torch.long, device=device)
        self.page_table = torch.zeros(largest, pages_per_request, dtype=torch.int32, device=device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, Proposal] = {}
        for tier in reversed(self.tiers):  # largest first: the CUDA graphs of smaller tiers share its pool
            self.graphs[tier], self.outputs[tier] = graphs.capture(self._forward(tier),
                                                                   contextlib.nullcontext())

    def _forward(self, tier: int) -> Callable[[], Proposal]:
        roots, prefix, table = self.roots[:tier], self.prefix[:tier], self.page_table[:tier]

        def forward() -> Proposal:
            block = PagedDraftBlock.plan(self.attn, None, prefix, self.gamma, table, self.page_size)
            p = self.draft.propose_paged(roots, prefix, block, None, gamma=self.gamma)
            assert p.drafts is not None
            return p.drafts, p.conf_logits, p.logits, p.hidden

        return forward

    def accepts(self, num_requests: int, gamma: int, greedy: bool, keep_conf_inputs: bool) -> bool:
        """Whether a step of these requests replays a graph (else it runs eagerly)."""
        return greedy and not keep_conf_inputs and gamma == self.gamma and num_requests <= self.tiers[-1]

    def propose(self, roots: torch.Tensor, prefix: torch.Tensor, page_table: torch.Tensor) -> BlockProposal:
        """The greedy proposal of `B` requests (roots and first block positions `[B]`, page-table rows
        `[B, pages]`, on the device): the smallest tier holding them replays, its padding rows zeroed."""
        num = roots.shape[0]
        tier = self.tiers[bisect.bisect_left(self.tiers, num)]
        self.roots[:num].copy_(roots)
        self.prefix[:num].copy_(prefix)
        self.page_table[:num].copy_(page_table)
        if num < tier:
            self.roots[num:tier].zero_()
            self.prefix[num:tier].zero_()
            self.page_table[num:tier].zero_()
        self.graphs[tier].replay()  # type: ignore[attr-defined]
        drafts, conf, logits, hidden = self.outputs[tier]
        # drafts and confidences outlive the step (the lagged planner keeps them); the logits and hidden
        # states are the graph's memory, read within the step only (the next replay overwrites them)
        return BlockProposal(drafts=drafts[:num].clone(),
                             conf_logits=None if conf is None else conf[:num].clone(),
                             logits=logits[:num], hidden=hidden[:num])
