"""The `dsv4` family as a serving target: `DSV4Model`'s layers run over paged caches by an attention backend.

The engine sees a target through `dspark.runtime.models.families.ServingTarget`: a forward over a step's
packed rows that also returns the residual streams the DSpark draft reads, and row-invariant logits. Here the
per-layer work that touches caches (writing the window's raw K=V, the compressor rows and the entries closed
by the step's boundary rows, then attending) belongs to the backend (`Dsv4LayerBackend`): the CPU one
(`dspark.runtime.families.dsv4.cpu_attention.Dsv4PagedAttention`) runs the paged reference of
`dspark.runtime.families.dsv4.cpu_paged`; everything else of a layer is the model's own (`DSV4Layer`), so
every backend runs the same weights and math.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.families.dsv4.model import DSV4Layer, DSV4Model
from dspark.runtime.families.dsv4.verify_metadata import Dsv4VerifyMetadata


class Dsv4LayerBackend(Protocol):
    """Runs one DSV4 layer of a planned step over the caches it owns."""

    max_extend_rows: int  # rows one request may append in an extend step (its ring bounds it)

    def forward_layer(self, layer_id: int, layer: DSV4Layer, h: Tensor, tokens: Tensor,
                      meta: Dsv4VerifyMetadata) -> Tensor:
        """The residual h of the rows' tokens [T] (hash-routed experts read them) -> the layer's: the step's
        cache writes, then attention, the output projection and the FFN."""
        ...


class Dsv4ForCausalLM(nn.Module):
    """A `DSV4Model` with the interface the engine serves (`ServingTarget`)."""

    def __init__(self, cfg: Dsv4Geometry) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DSV4Model(cfg)
        # The engine reads the model's dtype and device off its LM head; this one is the model's own head
        # (under tensor parallelism the vocab-parallel head of this rank's rows, `shard_dsv4_target`).
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.head

    @property
    def local_num_heads(self) -> int:
        """The query heads this rank's layers hold: all of them, or under tensor parallelism n_heads / tp
        (`sharding.shard_dsv4_target`). An attention backend sized from the
        target runs on these."""
        return self.model.layers[0].local_heads

    @torch.no_grad()
    def init_dummy_(self, seed: int) -> None:
        """Seeded random weights scaled so activations stay O(1) and the indexer's top-k has real choices."""
        self.model.init_random_(seed)

    @torch.no_grad()
    def forward_paged_states(self, input_ids: Tensor, positions: Tensor, attn: Dsv4LayerBackend,
                             meta: Dsv4VerifyMetadata, capture: Sequence[int] = ()
                             ) -> tuple[Tensor, Tensor | None]:
        """The step's rows' last residual ([T, dim], or [T, hc_mult, dim] streams: `compute_logits` takes
        either), and the residual after `capture` layers as a DSpark draft reads it ([T, len(capture) *
        dim]: `DSV4Model.draft_features`; 0: the embeddings; None without `capture`). The rows' positions
        are the metadata's, which `positions` repeats."""
        bad = [n for n in capture if not 0 <= n <= self.cfg.n_layers]
        if bad:
            raise ValueError(f"cannot capture the residual stream after {bad} layers of a "
                             f"{self.cfg.n_layers}-layer model (0 is the embeddings)")
        h = self.model.embed_tokens(input_ids)
        kept = {0: self.model.draft_features(h)} if 0 in capture else {}
        for i, layer in enumerate(self.model.layers):
            h = attn.forward_layer(i, layer, h, input_ids, meta)
            if i + 1 in capture:
                kept[i + 1] = self.model.draft_features(h)
        return h, torch.cat([kept[n] for n in capture], dim=-1) if capture else None

    @torch.no_grad()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[T, vocab] logits of the rows' last residual: the streams' collapse, final RMSNorm and the head,
        row-invariant."""
        return self.model.lm_head(hidden)

    @torch.no_grad()
    def greedy_continue(self, prompts: Tensor, steps: int) -> Tensor:
        """[b, P + steps]: the prompts followed by their greedy continuations, one request at a time
        through the reference's incremental state (what paged serving must reproduce)."""
        out = []
        for prompt in prompts:
            result = self.model.prefill(prompt)
            seq = prompt.tolist()
            for _ in range(steps):
                token = int(result.logits[-1].argmax())
                seq.append(token)
                result = self.model.step(result.state, [token])
            out.append(seq)
        return torch.tensor(out, dtype=torch.long)
