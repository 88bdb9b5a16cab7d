"""Forward passes that append rows after a request's cache: prefill chunks, and target-only decoding
(the lossless reference)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dspark.runtime.attention.metadata import AttentionMetadata
from dspark.runtime.engine.forward import EngineModels, batch_sampling
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import PrefillChunk, commit_tokens
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.layout import ExtendLayout, plan_extend
from dspark.runtime.sampling import pick_rows

ExtendMetadataBuilder = Callable[[ExtendLayout], AttentionMetadata]


class ExtendSteps:
    def __init__(self, models: EngineModels, build_metadata: ExtendMetadataBuilder,
                 eos_ids: frozenset[int]) -> None:
        self.models = models
        self.build_metadata = build_metadata
        self.eos_ids = eos_ids

    def _forward(self, requests: list[Request], prefix: list[int], extend: list[int], ids: list[int],
                 capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]:
        m = self.models
        layout = plan_extend(prefix, extend, m.host_page_table(requests), m.page_size, m.device,
                             [r.handle.slot for r in requests])
        hidden, states = m.target.forward_paged_states(m.tensor(ids), layout.positions, m.attn,
                                                       self.build_metadata(layout), capture)
        return hidden, states, layout

    def prefill(self, chunks: list[PrefillChunk], with_draft: bool) -> list[Request]:
        """Prefill the chunks; returns the requests whose prompt is now complete, each with its
        first token committed. With `with_draft` the prompt also becomes draft context."""
        batch = [c.request for c in chunks]
        ids = [t for c in chunks for t in c.request.prompt[c.request.prefilled:c.request.prefilled + c.take]]
        hidden, states, layout = self._forward(batch, [r.prefilled for r in batch], [c.take for c in chunks],
                                               ids, self.models.capture if with_draft else ())
        if with_draft:
            assert states is not None
            self.models.append_draft_context(states, layout.positions, layout.row_req, layout.page_table)
        for c in chunks:
            c.request.prefilled += c.take
        complete = [i for i, r in enumerate(batch) if r.prefilled == len(r.prompt)]
        if not complete:
            return []
        ready = [batch[i] for i in complete]
        last = [layout.host_qo_indptr[i + 1] - 1 for i in complete]
        logits = self.models.target.compute_logits(hidden[last])
        first = pick_rows(logits, batch_sampling(ready), self.models.generators(ready)).tolist()
        for r, token in zip(ready, first, strict=True):
            r.seq_len = len(r.prompt)
            r.root = token
            commit_tokens(r, [token], self.eos_ids)
        return ready

    def decode(self, running: list[Request], stats: RunStats) -> StepInfo:
        """One target-only decode step: each request's root is run and the next token picked."""
        start = time.perf_counter()
        num_reqs = len(running)
        hidden, _, _ = self._forward(running, [r.seq_len for r in running], [1] * num_reqs,
                                     [r.root for r in running])
        logits = self.models.target.compute_logits(hidden)
        nxt = pick_rows(logits, batch_sampling(running), self.models.generators(running)).tolist()
        for r, token in zip(running, nxt, strict=True):
            r.seq_len += 1
            r.root = token
            commit_tokens(r, [token], self.eos_ids)
        stats.steps += 1
        stats.request_steps += num_reqs
        stats.committed_tokens += num_reqs
        stats.verify_rows += num_reqs
        return StepInfo(num_reqs, num_reqs, num_reqs, num_reqs, 0, num_reqs, None, None,
                        time.perf_counter() - start)
