"""The batched decode loop of a generated runtime: prefill, then draft → plan → verify → accept.

Everything deployment-specific comes from the generated package: the attention metadata
builders and backend (`attn_metadata`), the verify runner (`graph_runner`) and the verify plan
(`planner_config`). This module is the same for every deployment.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from dspark.measure.recording import RunRecorder
from dspark.runtime.attention.metadata import cache_slots, prefix_slots
from dspark.runtime.engine.requests import Request, RequestError, reserved_tokens, validate_request
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_record import step_record
from dspark.runtime.kernels import build_verify_rows, pack_rows, scatter_rows
from dspark.runtime.kernels.accept import greedy_accept
from dspark.runtime.kv_cache import PagedKVCache, RequestSlots
from dspark.runtime.layout import RaggedVerifyLayout
from dspark.runtime.models.checkpoint import load_draft, load_target
from dspark.runtime.package import GeneratedPackage
from dspark.runtime.planner.survival import LaggedSurvival
from dspark.runtime.sampling import (
    BatchSampling,
    Generator,
    RowGenerators,
    SamplingParams,
    pick_rows,
    rejection_accept,
    sample,
    warp,
    warp_rows,
)

DEVICES = {"cpu": "cpu", "cuda": "cuda", "ascend": "npu"}


def backend_device(backend: str) -> torch.device:
    """The torch device a backend runs on; a clear error where that device is absent."""
    name = DEVICES[backend]
    if name == "cuda" and not torch.cuda.is_available():
        raise RequestError("this deployment was compiled for CUDA but no GPU is visible; compile "
                           "a spec with backend.kind: cpu to dry-run it here")
    return torch.device(name)


class Runtime:
    def __init__(self, package: GeneratedPackage, forced_budget_fraction: float | None = None,
                 recorder: RunRecorder | None = None, sampling: SamplingParams | None = None,
                 seed: int = 0) -> None:
        dep = package.deployment
        self.package = package
        self.deployment = dep
        self.plan = package.plan
        if forced_budget_fraction is not None:
            if dep.verify_mode == "static":
                raise RequestError("a forced budget fraction needs a cap-accept or compact deployment; "
                                   "static mode has no planner")
            # An experiment override: verify this share of the candidate drafts every step.
            self.plan = self.plan.with_overrides(forced_budget_fraction=forced_budget_fraction)
        self.metadata = package.attn_metadata
        self.device = backend_device(dep.backend)
        self.target = load_target(dep.model.checkpoint, dep.model.dtype, package.directory).to(self.device)
        self.draft = load_draft(dep.draft.checkpoint, dep.model.dtype, package.directory).to(self.device)
        self._check_models()
        s = dep.serving
        self.page_size = s.page_size
        num_pages = s.max_total_tokens // s.page_size + 1  # + the null page
        self.slots = RequestSlots(s.max_running_requests, s.pages_per_request, num_pages, s.page_size)
        dtype = self.target.lm_head.weight.dtype
        tc, dc = self.target.cfg, self.draft.cfg
        self.kv = PagedKVCache(tc.num_layers, num_pages, s.page_size, tc.num_kv_heads, tc.head_dim,
                               dtype, self.device)
        self.draft_kv = PagedKVCache(dc.num_layers, num_pages, s.page_size, dc.num_kv_heads,
                                     dc.head_dim, dtype, self.device)
        self.attn = self.metadata.AttentionBackend(self.kv, s.page_size, tc.num_heads, tc.head_dim ** -0.5)
        self.verify_runner = package.graph_runner.VerifyRunner(self.target, self.attn)
        self.tiers: tuple[int, ...] = tuple(package.graph_runner.TOKEN_TIERS)
        self.compact = dep.verify_mode == "compact"
        self.recorder = recorder  # calibration shards and step records (`dspark run --record`)
        s = dep.serving
        self.sampling = sampling or SamplingParams(s.temperature, s.top_p, s.top_k)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # The lagged-confidence history is per runtime: a plan is shared, immutable config.
        self.history = (LaggedSurvival(self.plan.lag_steps, self.plan.gamma)
                        if self.plan.lag_steps else None)
        # The scheduler: requests wait for a slot and their KV pages, then run until they finish.
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully prefilled yet
        self.running: list[Request] = []
        self.stats = RunStats(gamma=self.plan.gamma)
        self.last_step: StepInfo | None = None
        self.target_only = False
        self._rids = itertools.count()

    def _check_models(self) -> None:
        geo = self.deployment.model.geometry
        tc, dc = self.target.cfg, self.draft.cfg
        got = (tc.vocab_size, tc.hidden_size, tc.num_layers, tc.num_heads, tc.num_kv_heads, tc.head_dim)
        want = (geo.vocab_size, geo.hidden_size, geo.num_layers, geo.num_heads, geo.num_kv_heads,
                geo.head_dim)
        if got != want:
            raise RequestError(f"target checkpoint geometry {got} differs from the compiled {want}; "
                               "recompile the spec against this checkpoint")
        if dc.gamma != self.plan.gamma or dc.target_hidden_size != tc.hidden_size:
            raise RequestError(f"draft checkpoint (gamma {dc.gamma}, target hidden "
                               f"{dc.target_hidden_size}) does not fit this deployment (gamma "
                               f"{self.plan.gamma}, hidden {tc.hidden_size}); recompile")

    # -- public ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 target_only: bool = False) -> tuple[list[list[int]], RunStats]:
        """Completions of `prompts` (token ids) under the run's sampling policy, speculative unless
        `target_only`; a batch run of the same scheduler the server drives step by step."""
        if self.has_work:
            raise RequestError("generate needs an idle runtime; requests are still queued or running")
        reqs = [self.new_request(p, max_new_tokens) for p in prompts]
        self.stats = RunStats(gamma=self.plan.gamma, requests=len(reqs))
        self.target_only = target_only
        try:
            for r in reqs:
                self.enqueue(r)
            while self.has_work:
                self.step()
        finally:
            self.target_only = False
        self.stats.generated_tokens = sum(len(r.output) for r in reqs)
        return [r.output for r in reqs], self.stats

    def new_request(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    ignore_eos: bool = False, seed: int | None = None) -> Request:
        """A validated request (not queued yet); raises RequestError naming the limit it breaks.
        With a `seed` the request samples from its own generator. Reads only configuration, so any
        thread may call it."""
        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        r = Request(next(self._rids), list(prompt), max_new_tokens, sampling or self.sampling, ignore_eos,
                    generator)
        self._validate(r)
        return r

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Drop a queued or running request and free its slot and pages at once."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running or request in self.prefilling:
            (self.running if request in self.running else self.prefilling).remove(request)
            self.slots.release(request.handle.slot)
        else:
            return
        request.done = True
        request.finish_reason = request.finish_reason or "abort"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def pool_stats(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running) + len(self.prefilling),
                "free_slots": self.slots.num_free_slots, "free_pages": self.slots.num_free_pages,
                "total_pages": self.slots.num_pages - 1}

    def step(self) -> list[Request]:
        """One scheduler iteration: admit and prefill what fits, one decode step for the running
        batch, retire what finished. Returns the requests that got tokens or finished."""
        stats = self.stats
        touched: list[Request] = []
        self.prefilling.extend(self._admit(self.waiting, self.running + self.prefilling))
        if self.prefilling:
            t0 = time.perf_counter()
            ready = self._prefill_chunk(self.target_only)
            stats.prefill_seconds += time.perf_counter() - t0
            self.running.extend(ready)
            touched.extend(ready)
        finished = self._retire(self.running)
        if self.running:
            t0 = time.perf_counter()
            decoding = list(self.running)
            if self.target_only:
                self._target_step(decoding, stats)
            else:
                self._speculative_step(decoding, stats)
            stats.decode_seconds += time.perf_counter() - t0
            for r in decoding:
                r.decode_steps += 1
            touched.extend(r for r in decoding if r not in touched)
            finished += self._retire(self.running)
        touched.extend(r for r in finished if r not in touched)
        return touched

    # -- admission ---------------------------------------------------------------------
    def _reserve_tokens(self, r: Request) -> int:
        return reserved_tokens(r, self.plan.num_draft_tokens)

    def _validate(self, r: Request) -> None:
        pool = (self.slots.num_pages - 1) * self.page_size
        validate_request(r, self.plan.num_draft_tokens, self.deployment.serving.max_context_len, pool)

    def _admit(self, waiting: deque[Request], running: list[Request]) -> list[Request]:
        admitted: list[Request] = []
        page = self.page_size
        while waiting and self.slots.num_free_slots:
            need = -(-self._reserve_tokens(waiting[0]) // page)
            if need > self.slots.num_free_pages:
                if not running and not admitted:
                    raise RequestError("the KV pool cannot hold even one request; raise "
                                       "serving.max_total_tokens")
                break
            r = waiting.popleft()
            r.handle = self.slots.admit()
            self.slots.reserve(r.handle.slot, self._reserve_tokens(r))
            admitted.append(r)
        return admitted

    def _retire(self, running: list[Request]) -> list[Request]:
        done = [r for r in running if r.done]
        for r in done:
            self.slots.release(r.handle.slot)
            running.remove(r)
        return done

    def _commit(self, r: Request, tokens: list[int]) -> None:
        eos = self.package.tokenizer.eos_ids
        for t in tokens:
            if t in eos and not r.ignore_eos:
                r.done, r.finish_reason = True, "stop"
                return
            r.output.append(t)
            if len(r.output) >= r.max_new_tokens:
                r.done, r.finish_reason = True, "length"
                return

    # -- forward passes ----------------------------------------------------------------
    def _page_table(self, running: list[Request]) -> torch.Tensor:
        return self.slots.page_table[[r.handle.slot for r in running]].to(self.device)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _append_draft_context(self, hidden: torch.Tensor, positions: torch.Tensor,
                              row_req: torch.Tensor, page_table: torch.Tensor) -> None:
        loc = cache_slots(page_table, row_req, positions, self.page_size)
        for layer, (k, v) in enumerate(self.draft.context_kv(hidden, positions)):
            self.draft_kv.write(layer, loc, k, v)

    def _prefill_chunk(self, target_only: bool) -> list[Request]:
        """Prefill up to `chunked_prefill_tokens` prompt tokens of the admitted requests, in
        admission order; returns those whose prompt is now complete, with their first token."""
        budget = self.deployment.serving.chunked_prefill_tokens
        batch: list[Request] = []
        takes: list[int] = []
        for r in self.prefilling:
            if budget == 0:
                break
            take = min(len(r.prompt) - r.prefilled, budget)
            batch.append(r)
            takes.append(take)
            budget -= take
        page_table = self._page_table(batch)
        prefix = self._tensor([r.prefilled for r in batch], torch.int32)
        lens = self._tensor(takes, torch.int32)
        meta = self.metadata.build_extend_metadata(prefix, lens, page_table)
        chunks = [r.prompt[r.prefilled:r.prefilled + k] for r, k in zip(batch, takes, strict=True)]
        ids = self._tensor([t for chunk in chunks for t in chunk])
        hidden = self.target.forward_paged(ids, meta.positions, self.attn, meta)
        if not target_only:
            row_req = torch.repeat_interleave(torch.arange(len(batch), device=self.device), lens.long())
            self._append_draft_context(hidden, meta.positions, row_req, page_table)
        for r, k in zip(batch, takes, strict=True):
            r.prefilled += k
        complete = [i for i, r in enumerate(batch) if r.prefilled == len(r.prompt)]
        if not complete:
            return []
        last = (torch.cumsum(lens.long(), 0) - 1)[complete]
        ready = [batch[i] for i in complete]
        logits = self.target.compute_logits(hidden[last])
        first = pick_rows(logits, self._batch(ready), self._generators(ready)).tolist()
        for r, tok in zip(ready, first, strict=True):
            self.prefilling.remove(r)
            r.seq_len = len(r.prompt)
            r.root = tok
            self._commit(r, [tok])
        return ready

    def _target_step(self, running: list[Request], stats: RunStats) -> None:
        t0 = time.perf_counter()
        page_table = self._page_table(running)
        prefix = self._tensor([r.seq_len for r in running], torch.int32)
        meta = self.metadata.build_extend_metadata(prefix, torch.ones_like(prefix), page_table)
        ids = self._tensor([r.root for r in running])
        hidden = self.target.forward_paged(ids, meta.positions, self.attn, meta)
        logits = self.target.compute_logits(hidden)
        nxt = pick_rows(logits, self._batch(running), self._generators(running)).tolist()
        for r, tok in zip(running, nxt, strict=True):
            r.seq_len += 1
            r.root = tok
            self._commit(r, [tok])
        stats.steps += 1
        stats.request_steps += len(running)
        stats.committed_tokens += len(running)
        stats.verify_rows += len(running)
        self.last_step = StepInfo(len(running), len(running), len(running), len(running), 0, len(running),
                                  None, None, time.perf_counter() - t0)

    @staticmethod
    def _batch(requests: list[Request]) -> BatchSampling:
        return BatchSampling(tuple(r.sampling for r in requests))

    def _generators(self, requests: list[Request]) -> Generator:
        """The runtime's generator, or one stream per request when any request has a seed."""
        if all(r.generator is None for r in requests):
            return self.generator
        return RowGenerators(tuple(r.generator for r in requests), self.generator)

    def pick_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from `logits [..., V]` under the runtime's default policy (argmax when
        greedy); the profiler's draft steps use it."""
        if self.sampling.greedy:
            return logits.argmax(-1)
        return sample(warp(logits, self.sampling), self.generator)

    def draft_context(self, page_table: torch.Tensor,
                      prefix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's cached context K/V over the requests' first `max(prefix)` slots."""
        cap = -(-int(prefix.max()) // self.page_size) * self.page_size
        slots = prefix_slots(page_table, self.page_size, cap)
        return [(self.draft_kv.k[i][slots], self.draft_kv.v[i][slots])
                for i in range(self.draft.cfg.num_layers)]

    def _speculative_step(self, running: list[Request], stats: RunStats) -> None:
        start = time.perf_counter()
        n = self.plan.num_draft_tokens
        num_reqs = len(running)
        page_table = self._page_table(running)
        prefix = self._tensor([r.seq_len for r in running], torch.int32)
        roots = self._tensor([r.root for r in running])

        batch = self._batch(running)
        greedy = batch.all_greedy
        generator = self._generators(running)
        proposal = self.draft.propose(
            roots, prefix.long(), self.draft_context(page_table, prefix), prefix.long(),
            None if greedy else lambda lg: pick_rows(lg, batch, generator),
            keep_conf_inputs=self.recorder is not None and self.recorder.sts.features)
        drafts, conf_logits, draft_logits = proposal.drafts, proposal.conf_logits, proposal.logits
        assert drafts is not None
        step = self.plan.plan_step(conf_logits, [r.handle.slot for r in running],
                                   [r.handle.generation for r in running], self.history)
        verify_lens = step.verify_lens.to(self.device)
        # cap-accept runs every row and caps only acceptance; compact runs the planned rows.
        run_lens = verify_lens if self.compact else torch.full_like(verify_lens, n)
        layout = RaggedVerifyLayout.from_verify_lens(run_lens, self.tiers)
        rows = build_verify_rows(run_lens, prefix, page_table, self.page_size, layout.total_rows,
                                 num_draft_tokens=n)
        ids = torch.cat((roots[:, None], drafts), dim=1).reshape(-1)  # fixed stride: N per request
        if self.compact:
            ids = pack_rows(ids, rows.src_index)
        hidden = self.verify_runner.run(ids, prefix, page_table, layout)
        logits = self.target.compute_logits(hidden)
        if greedy:
            pred = logits.argmax(-1)
            if self.compact:  # back to the fixed stride accept reads; unplanned rows are never read
                pred = scatter_rows(pred, rows.src_index, num_reqs * n, fill=-1)
            acc = greedy_accept(drafts, pred.view(num_reqs, n), verify_lens)
        else:
            if self.compact:  # unplanned rows stay zero logits; rejection sampling never reads them
                logits = scatter_rows(logits, rows.src_index, num_reqs * n)
            p_probs = warp_rows(logits.view(num_reqs, n, -1), batch)
            verdict = rejection_accept(drafts, warp_rows(draft_logits, batch), p_probs, verify_lens,
                                       generator)
            acc = verdict.result

        # The root and the accepted drafts become draft context; the other rows are discarded.
        offset = rows.positions - prefix.long()[rows.row_req]
        keep = offset <= acc.correct_len[rows.row_req]
        self._append_draft_context(hidden[keep], rows.positions[keep], rows.row_req[keep], page_table)

        correct = acc.correct_len.tolist()
        bonus = acc.bonus.tolist()
        draft_rows = drafts.tolist()
        handles = [r.handle for r in running]
        for r, c, b, d in zip(running, correct, bonus, draft_rows, strict=True):
            r.seq_len += c + 1
            r.root = b
            self._commit(r, d[:c] + [b])
        lens = verify_lens.tolist()
        stats.record_step(correct, lens, layout, step)
        seconds = time.perf_counter() - start  # the step's wall time, before any recording work
        decision = step.decision
        self.last_step = StepInfo(num_reqs, sum(correct) + num_reqs, layout.total_rows, sum(lens),
                                  layout.num_padding_rows, layout.graph_num_tokens,
                                  decision.budget if decision else None, step.tau, seconds)
        if self.recorder is not None and conf_logits is not None:
            # The uncapped greedy match: its labels are exact wherever every row ran.
            raw = (greedy_accept(drafts, pred.view(num_reqs, n), torch.full_like(verify_lens, n)).correct_len
                   if greedy else verdict.raw_correct_len)
            # Labels are the acceptance event of the recorder's policy; other requests' are not.
            same_policy = torch.tensor([r.sampling == self.sampling for r in running], device=raw.device)
            self.recorder.sts.add(conf_logits, raw, (run_lens == n) & same_policy, proposal.conf_inputs)
            self.recorder.steps.append(step_record(
                handles, step, layout, lens, correct, raw.tolist(), conf_logits, seconds,
                self.plan.lag_steps, self.deployment.verify_mode))
