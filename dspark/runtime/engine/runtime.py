"""The runtime of a generated package: models, KV caches, the scheduler, and the step loop.

`Runtime.step()` is one scheduler iteration: admit what fits, prefill a chunk, one decode step for
the running batch (speculative, or target-only for the lossless reference), retire what finished.
`generate()` drives it to completion for a batch of prompts; the server drives it request by
request from its engine thread.

Under DP attention every DP rank runs a `Runtime` over its own requests: rank 0's dispatches the server's
requests and steps every DP rank's engine with its own (`DPDispatch`), the others run rank 0's commands
(`follows` → `serve_engine`); `step_local` is one DP rank's share of a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import torch

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.modes import SpeculationOff
from dspark.runtime.attention.metadata import AttentionBackend
from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.attention.triton_paged import TritonPagedAttention
from dspark.runtime.config import OnlineCostSettings
from dspark.runtime.distributed.dp_engine import DPDispatch, RequestSpec, serve_engine
from dspark.runtime.distributed.dp_sync import DPStepSync
from dspark.runtime.distributed.launch import Launch, Ranks, join, leave
from dspark.runtime.distributed.lockstep import LeaderForward, follow
from dspark.runtime.distributed.sharded_load import read_embeddings
from dspark.runtime.engine.extend import ExtendSteps
from dspark.runtime.engine.families import FamilyRuntime, family_runtime
from dspark.runtime.engine.forward import (
    EngineModels,
    ServingDraft,
    backend_device,
    draft_attention,
    draft_cache,
)
from dspark.runtime.engine.requests import Request, RequestError, validate_request
from dspark.runtime.engine.scheduler import Scheduler
from dspark.runtime.engine.speculative import SpeculativeStep, StepRecorder
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_forward import StepForward, StepForwards
from dspark.runtime.engine.step_sync import LocalSync, StepSync
from dspark.runtime.families.dsv4.target import Dsv4LayerBackend
from dspark.runtime.kv_cache import RequestSlots
from dspark.runtime.models.checkpoint import load_draft_model, target_embeddings
from dspark.runtime.models.dummy import draft_config
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.package import GeneratedPackage, VerifyRunner
from dspark.runtime.planner.cost_models import AdditiveCostTable
from dspark.runtime.planner.online_calibration import OnlineCalibrationSettings, OnlineCalibrator
from dspark.runtime.planner.online_cost import OnlineCostRefit
from dspark.runtime.planner.switch import SpeculationSwitch
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan, VerifyPlan
from dspark.runtime.sampling import SamplingParams


class Runtime:
    def __init__(self, package: GeneratedPackage, forced_budget_fraction: float | None = None,
                 recorder: StepRecorder | None = None, sampling: SamplingParams | None = None,
                 seed: int = 0, ranks: Ranks | None = None, fixed_verify_len: int | None = None,
                 online_calibration: OnlineCalibrationSettings | None = None,
                 online_cost: OnlineCostSettings | None = None) -> None:
        """`ranks`: this process's places when `follows` joined the process group already;
        `fixed_verify_len`: every request verifies exactly this many rows each step (benchmarks);
        `online_calibration`: refit the planner's temperatures from the served steps (a planning mode);
        `online_cost`: refit the additive cost table's knots from the steps' measured seconds."""
        dep = package.deployment
        self.package = package
        self.deployment = dep
        self.plan: VerifyPlan = package.plan
        if forced_budget_fraction is not None:
            if not isinstance(self.plan, AdaptiveVerifyPlan):
                raise RequestError("a forced budget fraction needs a cap-accept or compact deployment; "
                                   "static mode has no planner")
            # An experiment override: verify this share of the candidate drafts every step.
            self.plan = self.plan.with_overrides(forced_budget_fraction=forced_budget_fraction)
        if fixed_verify_len is not None:
            n = self.plan.num_draft_tokens
            if not isinstance(self.plan, AdaptiveVerifyPlan):
                raise RequestError("a fixed verify length needs a cap-accept or compact deployment; "
                                   "static mode always verifies all N rows")
            if not 1 <= fixed_verify_len <= n:
                raise RequestError(f"the fixed verify length must be in 1..N = {n}, got {fixed_verify_len}")
            # A benchmark baseline: floor = cap = K, so the planner's budget cannot vary the rows, and
            # every step speculates (the off state would make it another policy).
            self.plan = self.plan.with_overrides(min_verify_len=fixed_verify_len,
                                                 max_verify_len=fixed_verify_len,
                                                 speculation_off=SpeculationOff.NEVER)
        self.ranks = ranks = ranks or join(dep)
        if not ranks.runs_engine:
            raise RequestError(f"rank {ranks.launch.rank} follows its engine's steps (`follows`), it runs no "
                               "engine of its own")
        self.device = rank_device(dep.backend, ranks.launch)
        s = dep.serving
        num_pages = s.num_pages
        family = family_runtime(dep.model.family)
        target = family.rank_target(package, ranks, self.device)
        draft = load_draft_model(dep, package.directory, self.device, self._draft_shares(family, target))
        self._check_models(family, target, draft)
        attn = family.attention(package, target, self.device)
        if isinstance(attn, TorchPagedAttention) and isinstance(self.plan, AdaptiveVerifyPlan):
            # this backend pays an attention call per class of rows per request: plans keep one class
            self.plan = self.plan.with_overrides(row_classes=attn.row_classes(self.plan.schedule.cap))
        self.slots = RequestSlots(s.max_running_requests, s.pages_per_request, num_pages, s.page_size)
        draft_kv = draft_cache(draft, num_pages, s.page_size, target.lm_head.weight.dtype, self.device)
        parts = package.parts
        self.sampling = sampling or SamplingParams(s.temperature, s.top_p, s.top_k)
        # each DP rank samples its own requests from its own stream
        draft_attn = draft_attention(draft_kv, s.page_size, draft, self.device)
        # the draft's graphs plan its block on the device, which the Triton kernel's metadata allows
        graphs = isinstance(draft_attn, TritonPagedAttention) and parts.draft_runner is not None
        self.models = EngineModels(target, draft, draft_kv, attn, self.slots, self.device,
                                   torch.Generator(device=self.device).manual_seed(seed + ranks.dp_rank),
                                   draft_attn, parts.draft_runner(draft, draft_attn) if graphs else None)
        self.verify_runner: VerifyRunner = parts.verify_runner(target, attn, draft.cfg.layers_before_capture)
        forward = StepForward(target, attn, parts.build_extend_metadata, self.verify_runner, self.device)
        # under tensor parallelism every forward is first a step command to this engine's followers
        self.forward: StepForwards = forward
        if ranks.lockstep.size > 1:
            self.forward = LeaderForward(forward, ranks.lockstep)
        eos = package.tokenizer.eos_ids
        self.scheduler = Scheduler(self.slots, self.plan.num_draft_tokens, s.chunked_prefill_tokens,
                                   family.max_extend_rows(attn))
        # what this engine agrees on with the others that run its steps (DP attention), or with itself
        sync: StepSync = DPStepSync(ranks.engines, self.device) if ranks.dp is not None else LocalSync()
        self.sync = sync
        self.extend = ExtendSteps(self.models, self.forward, eos, sync)
        self.speculative = SpeculativeStep(self.models, self.plan, self.forward, eos, self.sampling, sync)
        self.speculative.recorder = recorder
        if online_calibration is not None:
            if not isinstance(self.plan, AdaptiveVerifyPlan) or not dep.draft.confidence_head:
                raise RequestError("online calibration refits the planner's temperatures: it needs a "
                                   "cap-accept or compact deployment with a confidence head")
            self.speculative.online = OnlineCalibrator(self.plan.gamma, self.plan.temperatures,
                                                       online_calibration,
                                                       survival_map=self.plan.survival_map)
            self.extend.prompt_probe = online_calibration.prompt_probe
        if online_cost is not None:
            table = self.plan.table if isinstance(self.plan, AdaptiveVerifyPlan) else None
            if not isinstance(table, AdditiveCostTable):
                kind = "no cost model" if table is None else f"a {table.kind} cost table"
                raise RequestError(f"the online cost refit corrects an additive cost table's knots, but this "
                                   f"deployment plans with {kind}: run it without --online-cost, or compile "
                                   "it with an additive table (`dspark profile` writes additive.json)")
            self.speculative.cost_refit = OnlineCostRefit(table, online_cost)
        # the planner's off state: whether the next decode step speculates (None: every step does)
        self.switch: SpeculationSwitch | None = self.plan.speculation_switch()
        self.stats = RunStats(gamma=self.plan.gamma)
        self.last_step: StepInfo | None = None
        self.target_only = False
        self._rids = itertools.count()
        self.dispatch = DPDispatch(self) if self.sync.spans_ranks and ranks.engines.rank == 0 else None

    def _draft_shares(self, family: FamilyRuntime, target: ServingTarget
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's whole embeddings and LM head, which a draft without its own copies shares: the
        loaded ones, or under tensor parallelism the checkpoint's, read by this rank alone."""
        model = self.deployment.model
        if not family.shares_draft_embeddings(self.deployment):
            return None
        if self.ranks.world.size == 1:
            return target_embeddings(target)
        return read_embeddings(model.checkpoint, model.dtype, self.package.directory, model.family)

    def _check_models(self, family: FamilyRuntime, target: ServingTarget, draft: ServingDraft) -> None:
        geo = family.computed_config(self.deployment)
        tc, dc = target.cfg, draft.cfg
        # every field that changes the computation, not only the shapes: a config.json edited after
        # compiling (another rope_theta or RoPE scaling, tied embeddings) is refused, not served
        differ = [f"{f.name} {getattr(tc, f.name)!r} (compiled {getattr(geo, f.name)!r})"
                  for f in dataclasses.fields(geo) if getattr(tc, f.name) != getattr(geo, f.name)]
        if differ:
            raise RequestError(f"the target checkpoint's config differs from the compiled one: "
                               f"{', '.join(differ)}; recompile the spec against this checkpoint")
        # the draft's architecture as loaded against what was compiled from its config.json (a
        # draft retrained or swapped after compiling is refused, not served with stale settings; the V4
        # stages' loader compares theirs)
        if isinstance(dc, BlockDraftConfig):
            compiled = draft_config(geo, self.deployment.draft)
            differ = [f"{f.name} {getattr(dc, f.name)!r} (compiled {getattr(compiled, f.name)!r})"
                      for f in dataclasses.fields(dc) if getattr(dc, f.name) != getattr(compiled, f.name)]
            if differ:
                raise RequestError(f"the draft checkpoint does not fit this deployment: {', '.join(differ)}; "
                                   "recompile the spec against this draft")
        if not 1 <= self.plan.gamma <= dc.block_size:
            raise RequestError(f"gamma {self.plan.gamma} is outside 1..block_size {dc.block_size} of the "
                               "draft; recompile")

    def close(self, failed: bool = False) -> None:
        """Release the other DP ranks' engines and this engine's follower ranks, and leave the process
        group (a no-op for one process); `failed`: a collective of this process failed (a rank died)."""
        forward, dispatch = self.forward, self.dispatch
        if dispatch is not None:
            dispatch.stop()
        if isinstance(forward, LeaderForward):
            forward.stop()
        failed = failed or (dispatch is not None and dispatch.broken) or (
            isinstance(forward, LeaderForward) and forward.broken)
        leave(self.ranks, together=not failed)

    # -- what the models are ---------------------------------------------------------------
    @property
    def target(self) -> ServingTarget:
        return self.models.target

    @property
    def draft(self) -> ServingDraft:
        return self.models.draft

    @property
    def attn(self) -> AttentionBackend | Dsv4LayerBackend:
        return self.models.attn

    @property
    def page_size(self) -> int:
        return self.slots.page_size

    @property
    def tiers(self) -> tuple[int, ...]:
        return self.deployment.token_tiers

    @property
    def recorder(self) -> StepRecorder | None:
        """Calibration shards and step records of a recording run (`dspark run --record`)."""
        return self.speculative.recorder

    @recorder.setter
    def recorder(self, recorder: StepRecorder | None) -> None:
        self.speculative.recorder = recorder

    # -- requests ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 target_only: bool = False) -> tuple[list[list[int]], RunStats]:
        """Completions of `prompts` (token ids) under the run's sampling policy, speculative unless
        `target_only`; a batch run of the same scheduler the server drives step by step."""
        if self.has_work:
            raise RequestError("generate needs an idle runtime; requests are still queued or running")
        reqs = [self.new_request(p, max_new_tokens) for p in prompts]
        self.stats = RunStats(gamma=self.plan.gamma, requests=len(reqs))
        self.reset_switch()
        self.target_only = target_only
        if self.dispatch is not None:
            self.dispatch.reset_stats = True
        try:
            for r in reqs:
                self.enqueue(r)
            while self.has_work:
                self.step()
        finally:
            self.target_only = False
        if self.dispatch is not None:
            self.stats = self.dispatch.collect_stats()
        self.stats.generated_tokens = sum(len(r.output) for r in reqs)
        return [r.output for r in reqs], self.stats

    def new_request(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    ignore_eos: bool = False, seed: int | None = None) -> Request:
        """A validated request (not queued yet); raises RequestError naming the limit it breaks.
        With a `seed` the request samples from its own generator. Reads only configuration, so any
        thread may call it."""
        r = Request(next(self._rids), list(prompt), max_new_tokens, sampling or self.sampling, ignore_eos,
                    self._generator(seed), seed=seed)
        pool = (self.slots.num_pages - 1) * self.page_size
        validate_request(r, self.plan.num_draft_tokens, self.deployment.serving.max_context_len, pool)
        return r

    def adopt(self, spec: RequestSpec) -> Request:
        """Another DP rank's engine's copy of a request rank 0 validated (DP attention)."""
        return Request(spec.rid, list(spec.prompt), spec.max_new_tokens, spec.sampling, spec.ignore_eos,
                       self._generator(spec.seed), seed=spec.seed)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """A request's own sampling stream when it has a seed."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def enqueue(self, request: Request) -> None:
        (self.dispatch or self.scheduler).enqueue(request)

    def abort(self, request: Request) -> None:
        """Drop a queued or running request and free its slot and pages at once."""
        (self.dispatch or self.scheduler).abort(request)

    @property
    def has_work(self) -> bool:
        return (self.dispatch or self.scheduler).has_work

    def pool_stats(self) -> dict[str, int]:
        return (self.dispatch or self.scheduler).pool_stats()

    def step(self) -> list[Request]:
        """One scheduler iteration (of every DP rank's engine under DP attention). Returns the requests
        that got tokens or finished."""
        if self.dispatch is None:
            return self.step_local()
        touched = self.dispatch.step()
        self.last_step = self.dispatch.last_step
        return touched

    def start_run(self, target_only: bool, reset_stats: bool) -> None:
        """Another DP rank's engine, told by rank 0's command how the coming steps decode: target-only or
        not, and (a new `generate` run) with fresh counters and off state."""
        if reset_stats:
            self.stats = RunStats(gamma=self.plan.gamma)
            self.reset_switch()
        self.target_only = target_only

    def reset_switch(self) -> None:
        """Start the off state afresh (a new `generate` run: speculating, nothing observed yet), priced by the
        table the steps plan with (an online cost refit's, once one is swapped in)."""
        self.switch = self.speculative.plan.speculation_switch()

    def _swap_cost_table(self, decoding: list[Request]) -> None:
        """Between steps: the online cost refit's new table, when one is ready, into the plan and the off
        state alike (both must weigh one table), with the plan's table at the coming step's context made
        here rather than inside the step's measured time."""
        refit = self.speculative.cost_refit
        table = refit.poll() if refit is not None else None
        if table is None:
            return
        assert refit is not None
        self.speculative.use_cost_table(table, refit.refits)
        live = self.speculative.plan.table  # type: ignore[attr-defined]
        assert isinstance(live, AdditiveCostTable)
        if self.switch is not None:
            self.switch.use_table(live)
        if decoding:
            live.at_context(sum(r.seq_len for r in decoding) / len(decoding))

    def _switched_step(self, switch: SpeculationSwitch, decoding: list[Request], stats: RunStats
                       ) -> tuple[StepInfo | None, bool]:
        """A decode step where the planner may switch speculation off, and whether it drafted: drafted,
        or a target-only step whose roots become draft context, as the switch decides (under DP attention
        one decision for every DP rank); a drafted step's committed tokens are what the switch learns."""
        keys = [(r.handle.slot, r.handle.generation) for r in decoding]
        was = switch.speculating
        offset = self.speculative.offset
        context_len = sum(r.seq_len for r in decoding) / len(decoding) if decoding else None
        speculates = switch.speculates(self.sync.agree_prediction(switch.predict(keys, offset.seconds,
                                                                                 context_len)))
        stats.switches += int(switch.speculating != was)
        if not speculates:
            off = self.extend.decode(decoding, stats, with_draft=True)
            if off is not None:
                offset.observe(switch.decode_seconds(off.num_reqs, context_len), off.seconds)
                if self.speculative.cost_refit is not None and context_len is not None:
                    self.speculative.cost_refit.observe_off(off.num_reqs, context_len, off.seconds)
            return off, False
        self.speculative.probe = switch.probing
        prefix = [r.seq_len for r in decoding]
        step = self.speculative(decoding, stats)
        if step is not None:  # None: a DP rank without requests
            switch.observe(keys, [r.seq_len - p for r, p in zip(decoding, prefix, strict=True)], step.rows)
        return step, True

    def step_local(self) -> list[Request]:
        """One iteration of this engine: admit and prefill what fits, one decode step for the running
        batch, retire what finished. Under DP attention it runs every forward of the step, with
        padding only where it has no rows of its own. Returns the requests that got tokens or finished."""
        sched, stats, dp = self.scheduler, self.stats, self.sync.spans_ranks
        touched: list[Request] = []
        sched.admit()
        if sched.prefilling or dp:
            t0 = time.perf_counter()
            ready = self.extend.prefill(sched.prefill_chunks(), with_draft=not self.target_only)
            stats.prefill_seconds += time.perf_counter() - t0
            online = self.speculative.online
            for r in ready:
                sched.start_decoding(r)
                if online is not None and r.prompt_surprise is not None:
                    online.prompt(r.prompt_surprise)
            touched.extend(ready)
        finished = sched.retire()
        if sched.running or dp:
            decoding = list(sched.running)
            if not self.target_only:
                self._swap_cost_table(decoding)
            t0 = time.perf_counter()
            drafted: bool | None = None  # where the planner may switch speculation off: the state it ran
            if self.target_only:
                self.last_step = self.extend.decode(decoding, stats)
            elif self.switch is None:
                self.last_step = self.speculative(decoding, stats)
            else:
                self.last_step, drafted = self._switched_step(self.switch, decoding, stats)
            seconds = time.perf_counter() - t0
            stats.decode_seconds += seconds
            if drafted:
                stats.on_seconds += seconds
            elif drafted is not None:
                stats.off_seconds += seconds
                self.speculative.note_off_step(seconds)
            for r in decoding:
                r.decode_steps += 1
            touched.extend(r for r in decoding if r not in touched)
            finished += sched.retire()
        touched.extend(r for r in finished if r not in touched)
        return touched


def rank_device(backend: str, launch: Launch) -> torch.device:
    """The device this rank runs on: its local GPU under a multi-process CUDA launch."""
    device = backend_device(backend)
    if device.type == "cuda" and launch.world_size > 1:
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    return device


def follows(package: GeneratedPackage, **options: Any) -> bool:
    """Run this rank's part of a multi-process launch other than rank 0's, and return True once rank 0
    stopped it; on rank 0 (or one process) return False at once.

    Under DP attention the engine rank of another DP rank runs its engine (a `Runtime` with the `options`
    rank 0's has) on rank 0's commands; any other rank follows its engine's step commands on its shard.
    """
    dep = package.deployment
    ranks = join(dep)
    if ranks.launch.is_leader:
        return False
    if ranks.runs_engine:
        runtime = Runtime(package, ranks=ranks, **options)
        failed = True
        try:
            serve_engine(runtime)
            failed = False
        finally:
            runtime.close(failed)
        return True
    together = False
    try:
        device = rank_device(dep.backend, ranks.launch)
        family = family_runtime(dep.model.family)
        target = family.rank_target(package, ranks, device)
        attn = family.attention(package, target, device)
        # the verify runner the engine's rank builds (its graphs, where it captures any, are this rank's)
        capture = dep.draft.layers_before_capture
        runner = package.parts.verify_runner(target, attn, capture)
        follow(StepForward(target, attn, package.parts.build_extend_metadata, runner, device), ranks.lockstep)
        together = True  # released by its engine: every rank is leaving
    finally:
        leave(ranks, together)
    return True
