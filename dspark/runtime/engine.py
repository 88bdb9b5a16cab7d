"""The batched decode loop of a generated runtime: prefill, then draft → plan → verify → accept.

Everything deployment-specific comes from the generated package: the attention metadata
builders and backend (`attn_metadata`), the verify runner (`graph_runner`) and the verify plan
(`planner_config`). This module is the same for every deployment.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.runtime.accept import greedy_accept
from dspark.runtime.attn_metadata import cache_slots, prefix_slots
from dspark.runtime.checkpoint import load_draft, load_target
from dspark.runtime.kernels import build_verify_rows, pack_rows, scatter_rows
from dspark.runtime.kv_cache import PagedKVCache, RequestSlots, SlotHandle
from dspark.runtime.layout import RaggedVerifyLayout
from dspark.runtime.package import GeneratedPackage
from dspark.runtime.plan import StepPlan
from dspark.runtime.planner import LaggedSurvival
from dspark.runtime.recording import RunRecorder
from dspark.runtime.sampling import SamplingParams, rejection_accept, sample, warp


class RequestError(ValueError):
    """A request that this deployment cannot serve (says which limit and what to change)."""


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    handle: SlotHandle | None = None
    output: list[int] = field(default_factory=list)
    seq_len: int = 0  # positions whose target (and draft-context) KV is cached
    root: int = -1  # last committed token; its KV is written by the next forward
    done: bool = False


@dataclass
class RunStats:
    """Counts of one `generate` call. Acceptance is measured on verified drafts, never inferred."""

    gamma: int
    requests: int = 0
    steps: int = 0
    request_steps: int = 0
    generated_tokens: int = 0
    committed_tokens: int = 0
    verify_rows: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    padding_rows: int = 0  # rows added to reach the step's graph tier
    planned_rows: int = 0  # sum of verify_lens (in cap-accept fewer rows than run)
    predicted_tau: float = 0.0  # sum over planned steps of the planner's tau
    planned_committed: int = 0  # committed tokens of those same steps
    drafts_verified: list[int] = field(default_factory=list)
    drafts_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafts_verified = [0] * self.gamma
        self.drafts_accepted = [0] * self.gamma

    def record_step(self, correct: list[int], verify_lens: list[int], layout: RaggedVerifyLayout,
                    step: StepPlan) -> None:
        for c, vl in zip(correct, verify_lens, strict=True):
            for k in range(vl - 1):
                self.drafts_verified[k] += 1
                self.drafts_accepted[k] += int(k < c)
        committed = sum(correct) + len(correct)
        self.steps += 1
        self.request_steps += len(correct)
        self.committed_tokens += committed
        self.verify_rows += layout.total_rows
        self.padding_rows += layout.num_padding_rows
        self.planned_rows += sum(verify_lens)
        tau = step.tau
        if tau is not None:
            self.predicted_tau += tau
            self.planned_committed += committed

    @property
    def wall_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def to_json(self) -> dict[str, Any]:
        per_request_step = self.request_steps or 1
        return {
            "requests": self.requests,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "wall_seconds": round(self.wall_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "tokens_per_second": round(self.generated_tokens / max(self.wall_seconds, 1e-9), 2),
            "mean_commit_len": round(self.committed_tokens / per_request_step, 4),
            "mean_accepted_drafts": round(sum(self.drafts_accepted) / per_request_step, 4),
            "verify_rows": self.verify_rows,
            "padding_rows": self.padding_rows,
            "planned_rows": self.planned_rows,
            "mean_predicted_tau_per_step": (round(self.predicted_tau / self.steps, 4)
                                            if self.planned_committed else None),
            "mean_committed_per_planned_step": (round(self.planned_committed / self.steps, 4)
                                                if self.planned_committed else None),
            "drafts_verified_by_position": self.drafts_verified,
            "drafts_accepted_by_position": self.drafts_accepted,
            "acceptance_by_position": [round(a / v, 4) if v else None
                                       for a, v in zip(self.drafts_accepted, self.drafts_verified,
                                                       strict=True)],
        }


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
        """Greedy completions of `prompts` (token ids), speculative unless `target_only`."""
        reqs = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
        for r in reqs:
            self._validate(r)
        stats = RunStats(gamma=self.plan.gamma, requests=len(reqs))
        waiting: deque[Request] = deque(reqs)
        running: list[Request] = []
        while waiting or running:
            admitted = self._admit(waiting, running)
            if admitted:
                t0 = time.perf_counter()
                self._prefill(admitted, target_only, stats)
                stats.prefill_seconds += time.perf_counter() - t0
                running.extend(admitted)
            self._retire(running)
            if not running:
                continue
            t0 = time.perf_counter()
            if target_only:
                self._target_step(running, stats)
            else:
                self._speculative_step(running, stats)
            stats.decode_seconds += time.perf_counter() - t0
            self._retire(running)
        stats.generated_tokens = sum(len(r.output) for r in reqs)
        return [r.output for r in reqs], stats

    # -- admission ---------------------------------------------------------------------
    def _reserve_tokens(self, r: Request) -> int:
        return len(r.prompt) + r.max_new_tokens + self.plan.num_draft_tokens

    def _validate(self, r: Request) -> None:
        cap = self.deployment.serving.max_context_len
        if not r.prompt:
            raise RequestError(f"request {r.rid}: empty prompt")
        if r.max_new_tokens < 1:
            raise RequestError(f"request {r.rid}: max_new_tokens must be >= 1")
        if self._reserve_tokens(r) > cap:
            raise RequestError(
                f"request {r.rid}: prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                f"+ N ({self.plan.num_draft_tokens}) exceeds serving.max_context_len ({cap}); "
                "shorten the prompt or raise max_context_len in the spec")

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

    def _retire(self, running: list[Request]) -> None:
        for r in [r for r in running if r.done]:
            self.slots.release(r.handle.slot)
            running.remove(r)

    def _commit(self, r: Request, tokens: list[int]) -> None:
        eos = self.package.tokenizer.eos_id
        for t in tokens:
            if t == eos:
                r.done = True
                return
            r.output.append(t)
            if len(r.output) >= r.max_new_tokens:
                r.done = True
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

    def _prefill(self, reqs: list[Request], target_only: bool, stats: RunStats) -> None:
        page_table = self._page_table(reqs)
        lens = self._tensor([len(r.prompt) for r in reqs], torch.int32)
        meta = self.metadata.build_extend_metadata(torch.zeros_like(lens), lens, page_table)
        ids = self._tensor([t for r in reqs for t in r.prompt])
        hidden = self.target.forward_paged(ids, meta.positions, self.attn, meta)
        last = torch.cumsum(lens.long(), 0) - 1
        first = self.pick_token(self.target.compute_logits(hidden[last])).tolist()
        if not target_only:
            row_req = torch.repeat_interleave(torch.arange(len(reqs), device=self.device), lens.long())
            self._append_draft_context(hidden, meta.positions, row_req, page_table)
        for r, tok in zip(reqs, first, strict=True):
            r.seq_len = len(r.prompt)
            r.root = tok
            self._commit(r, [tok])

    def _target_step(self, running: list[Request], stats: RunStats) -> None:
        page_table = self._page_table(running)
        prefix = self._tensor([r.seq_len for r in running], torch.int32)
        meta = self.metadata.build_extend_metadata(prefix, torch.ones_like(prefix), page_table)
        ids = self._tensor([r.root for r in running])
        hidden = self.target.forward_paged(ids, meta.positions, self.attn, meta)
        nxt = self.pick_token(self.target.compute_logits(hidden)).tolist()
        for r, tok in zip(running, nxt, strict=True):
            r.seq_len += 1
            r.root = tok
            self._commit(r, [tok])
        stats.steps += 1
        stats.request_steps += len(running)
        stats.committed_tokens += len(running)
        stats.verify_rows += len(running)

    def pick_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from `logits [..., V]` under the run's policy (argmax when greedy)."""
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

        drafts, conf_logits, draft_logits = self.draft.propose(
            roots, prefix.long(), self.draft_context(page_table, prefix), prefix.long(),
            None if self.sampling.greedy else self.pick_token)
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
        if self.sampling.greedy:
            pred = logits.argmax(-1)
            if self.compact:  # back to the fixed stride accept reads; unplanned rows are never read
                pred = scatter_rows(pred, rows.src_index, num_reqs * n, fill=-1)
            acc = greedy_accept(drafts, pred.view(num_reqs, n), verify_lens)
        else:
            p_probs = warp(logits, self.sampling)
            if self.compact:
                p_probs = scatter_rows(p_probs, rows.src_index, num_reqs * n)
            verdict = rejection_accept(drafts, warp(draft_logits, self.sampling),
                                       p_probs.view(num_reqs, n, -1), verify_lens, self.generator)
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
        if self.recorder is not None and conf_logits is not None:
            # The uncapped greedy match: its labels are exact wherever every row ran.
            raw = (greedy_accept(drafts, pred.view(num_reqs, n), torch.full_like(verify_lens, n)).correct_len
                   if self.sampling.greedy else verdict.raw_correct_len)
            self.recorder.sts.add(conf_logits, raw, run_lens == n)
            self.recorder.steps.append(self._step_record(
                handles, step, layout, lens, correct, raw.tolist(), conf_logits, seconds))

    def _step_record(self, handles: list[SlotHandle], step: StepPlan, layout: RaggedVerifyLayout,
                     lens: list[int], correct: list[int], raw: list[int], conf_logits: torch.Tensor,
                     seconds: float) -> dict[str, Any]:
        decision = step.decision
        survival = step.survival.tolist() if step.survival is not None else [None] * len(lens)
        confidence = conf_logits.float().tolist()
        return {
            "num_reqs": len(lens), "lag": self.plan.lag_steps, "mode": self.deployment.verify_mode,
            "budget": decision.budget if decision else None, "aligned_budget": step.aligned_budget,
            "decision_tau": decision.tau if decision else None,
            "planned_rows": sum(lens), "rows": layout.total_rows, "tier": layout.graph_num_tokens,
            "padding_rows": layout.num_padding_rows, "tau": step.tau,
            "committed": sum(correct) + len(correct),
            "predicted_step_seconds": decision.predicted_step_seconds if decision else None,
            "step_seconds": seconds,
            "requests": [{"slot": h.slot, "generation": h.generation, "verify_len": vl, "correct_len": c,
                          "raw_correct_len": rc, "commit_len": c + 1, "confidence": z, "survival": s}
                         for h, vl, c, rc, z, s in zip(handles, lens, correct, raw, confidence, survival,
                                                       strict=True)],
        }
