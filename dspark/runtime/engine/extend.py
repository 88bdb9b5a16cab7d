"""Forward passes that append rows after a request's cache: prefill chunks, and target-only decoding
(the lossless reference).

With `prompt_probe` (online calibration's traffic check, `planner.traffic.prompt_shift`) the prefill also
scores how surprising each prompt is to the target: the mean negative log-likelihood of its last
`prompt_probe` tokens, from the logits of the rows that predict them, in a projection of their own (the rows
that pick the first tokens are projected as they are without it, so no committed token can change).

The engines that run a step together run each of them with the same rows and logit rows (`sync`: under
DP attention the most of any DP rank's, `DPStepSync.agree_extend`): fewer are padded, and a DP rank with
nothing to run pads an empty step, so that the forward's collectives meet their partners."""

from __future__ import annotations

import time

import torch

from dspark.runtime.engine.forward import EngineModels, batch_sampling
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import PrefillChunk, commit_tokens
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_forward import ExtendForward, LogitsForward, StepForwards
from dspark.runtime.engine.step_sync import StepSync
from dspark.runtime.layout import ExtendLayout
from dspark.runtime.sampling import pick_rows


class ExtendSteps:
    def __init__(self, models: EngineModels, forward: StepForwards, eos_ids: frozenset[int],
                 sync: StepSync) -> None:
        self.models = models
        self.forward = forward
        self.eos_ids = eos_ids
        self.sync = sync
        self.prompt_probe = 0  # a prompt's last tokens the prefill scores (0: none)

    def _forward(self, requests: list[Request], prefix: list[int], extend: list[int], ids: list[int],
                 rows: int, capture: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]:
        """Run the requests' rows, padded to `rows`."""
        m = self.models
        self.sync.check("extend rows", rows)
        return self.forward.extend(ExtendForward(
            tuple(prefix), tuple(extend), m.host_page_table(requests), tuple(r.handle.slot for r in requests),
            rows - sum(extend), m.tensor(ids), capture))

    def prefill(self, chunks: list[PrefillChunk], with_draft: bool) -> list[Request]:
        """Prefill the chunks; returns the requests whose prompt is now complete, each with its
        first token committed. With `with_draft` the prompt also becomes draft context."""
        batch = [c.request for c in chunks]
        complete = [i for i, c in enumerate(chunks) if c.request.prefilled + c.take == len(c.request.prompt)]
        real = sum(c.take for c in chunks)
        probes = probe_rows(chunks, self.prompt_probe)
        rows, logit_rows, probe_pad = self.sync.agree_extend(real, len(complete), len(probes))
        if not rows:
            return []
        ids = [t for c in chunks for t in c.request.prompt[c.request.prefilled:c.request.prefilled + c.take]]
        _, states, layout = self._forward(batch, [r.prefilled for r in batch], [c.take for c in chunks],
                                          ids, rows, self.models.capture if with_draft else ())
        if with_draft and real:
            assert states is not None
            self.models.append_draft_context(states[:real], layout.positions[:real], layout.row_req[:real],
                                             layout.page_table)
        for c in chunks:
            c.request.prefilled += c.take
        if probe_pad:
            self._score_probes(chunks, probes, layout, probe_pad)
        if not logit_rows:
            return []
        last = tuple(layout.host_qo_indptr[i + 1] - 1 for i in complete)  # each complete prompt's last row
        logits = self.forward.logits(LogitsForward(last, logit_rows))
        ready = [batch[i] for i in complete]
        if not ready:
            return []
        first = pick_rows(logits, batch_sampling(ready), self.models.generators(ready)).tolist()
        for r, token in zip(ready, first, strict=True):
            r.seq_len = len(r.prompt)
            r.root = token
            commit_tokens(r, [token], self.eos_ids)
        return ready

    def _score_probes(self, chunks: list[PrefillChunk], probes: list[tuple[int, int, int]],
                      layout: ExtendLayout, pad_to: int) -> None:
        """Add each probed row's negative log-likelihood of the prompt token it predicts to its request."""
        rows = tuple(layout.host_qo_indptr[chunk] + offset for chunk, offset, _ in probes)
        self.sync.check("prompt probe rows", pad_to)
        logits = self.forward.logits(LogitsForward(rows, pad_to)).float()
        if not probes:
            return
        targets = torch.tensor([token for _, _, token in probes], device=logits.device)
        nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None]).squeeze(1)
        for (chunk, _, _), value in zip(probes, nll.tolist(), strict=True):
            chunks[chunk].request.probe_nll += value
            chunks[chunk].request.probed += 1

    def decode(self, running: list[Request], stats: RunStats, with_draft: bool = False) -> StepInfo | None:
        """One target-only decode step: each request's root is run and the next token picked. With
        `with_draft` (speculation switched off for a while) the root also becomes draft context, so a
        later step can draft again. None when no request ran (a DP rank without requests, padding the
        step of the others)."""
        start = time.perf_counter()
        num_reqs = len(running)
        rows, _, _ = self.sync.agree_extend(num_reqs, num_reqs, 0)
        if not rows:
            return None
        _, states, layout = self._forward(running, [r.seq_len for r in running], [1] * num_reqs,
                                          [r.root for r in running], rows,
                                          self.models.capture if with_draft else ())
        if with_draft and num_reqs:
            assert states is not None
            self.models.append_draft_context(states[:num_reqs], layout.positions[:num_reqs],
                                             layout.row_req[:num_reqs], layout.page_table)
        # every row the step ran (padded to the DP ranks' most), the requests' first
        logits = self.forward.logits(LogitsForward(None))[:num_reqs]
        if not running:
            return None
        nxt = pick_rows(logits, batch_sampling(running), self.models.generators(running)).tolist()
        for r, token in zip(running, nxt, strict=True):
            r.seq_len += 1
            r.root = token
            commit_tokens(r, [token], self.eos_ids)
        stats.record_decode_step(num_reqs, speculating_off=with_draft)
        return StepInfo(num_reqs=num_reqs, committed=num_reqs, rows=num_reqs, planned_rows=num_reqs,
                        padding_rows=0, tier=num_reqs, budget=None, tau=None,
                        seconds=time.perf_counter() - start, speculating=False)


def probe_rows(chunks: list[PrefillChunk], probe: int) -> list[tuple[int, int, int]]:
    """(chunk, row in the chunk, the prompt token the row predicts) for every row of `chunks` that predicts
    one of its prompt's last `probe` tokens (the prompt's own last row predicts a new token: never probed)."""
    out = []
    for i, c in enumerate(chunks):
        prompt, done = c.request.prompt, c.request.prefilled
        for position in range(max(done, len(prompt) - 1 - probe), min(done + c.take, len(prompt) - 1)):
            out.append((i, position - done, prompt[position + 1]))
    return out
