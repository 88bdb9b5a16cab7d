"""Prometheus metrics of a serving runtime (`GET /metrics`).

Counters are cumulative so that rates and ratios come out of PromQL over any window, e.g. the
planner's tau bias is `rate(dspark_committed_tokens_total{planned="true"}) /
rate(dspark_predicted_tau_total) - 1` and the mean commit_len is
`rate(dspark_committed_tokens_total) / rate(dspark_request_steps_total)`; gauges describe the last
step and the pool as they are now. One registry per server, so tests can run several.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from dspark.runtime.engine.runtime import Runtime

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServingMetrics:
    def __init__(self, runtime: Runtime) -> None:
        r = self.registry = CollectorRegistry()
        labels = {"deployment": runtime.deployment.name, "verify_mode": runtime.deployment.verify_mode}
        names, values = list(labels), list(labels.values())

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*values)

        self.requests_received = counter("dspark_requests_received", "requests accepted").labels(*values)
        finished = counter("dspark_requests_finished", "requests finished, by reason", ("reason",))
        self.requests_finished = _Bound(finished, values)
        self.prompt_tokens = counter("dspark_prompt_tokens", "prompt tokens of finished requests") \
            .labels(*values)
        self.generation_tokens = counter("dspark_generation_tokens", "tokens generated").labels(*values)
        self.steps = counter("dspark_decode_steps", "decode steps").labels(*values)
        self.request_steps = counter("dspark_request_steps", "request-steps (requests per step, summed)") \
            .labels(*values)
        committed = counter("dspark_committed_tokens", "tokens committed by decode steps; planned="
                            "true counts only steps with a predicted tau", ("planned",))
        self.committed = committed.labels(*values, "false")
        self.committed_planned = committed.labels(*values, "true")
        self.predicted_tau = counter("dspark_predicted_tau", "the planner's predicted committed tokens, "
                                     "summed over planned steps").labels(*values)
        self.verify_rows = counter("dspark_verify_rows", "verify rows run (tier padding included)") \
            .labels(*values)
        self.planned_rows = counter("dspark_planned_rows", "rows the planner chose (sum of verify_lens)") \
            .labels(*values)
        self.padding_rows = counter("dspark_padding_rows", "rows added to reach a graph tier").labels(*values)
        self.step_seconds = Histogram("dspark_step_seconds", "decode step wall time", names,
                                      buckets=STEP_BUCKETS, registry=r).labels(*values)
        self.budget = gauge("dspark_budget_rows", "the last step's verify budget (rows)")
        self.tier = gauge("dspark_tier_rows",
                          "the last step's graph tier (rows; the row count without tiers)")
        self.batch = gauge("dspark_batch_requests", "requests in the last decode step")
        self.mean_commit_len = gauge("dspark_mean_commit_len", "committed tokens per request-step, "
                                     "since start")
        self.tau_bias = gauge("dspark_tau_bias_ratio", "mean(actual - tau) / mean(actual) over planned "
                              "steps, since start")
        # the planner's off state: whether it speculates now, and the steps and seconds spent in each state
        self.speculating = gauge("dspark_speculating", "1 while decode steps speculate, 0 while the planner "
                                 "has switched speculation off (or the server decodes target-only)")
        self.speculating.set(1)
        state_steps = counter("dspark_state_decode_steps", "decode steps by speculation state: on (drafted "
                              "and verified) or off (target-only)", ("state",))
        state_seconds = counter("dspark_state_decode_seconds", "decode step seconds by speculation state",
                                ("state",))
        self.state_steps = {state: state_steps.labels(*values, state) for state in ("on", "off")}
        self.state_seconds = {state: state_seconds.labels(*values, state) for state in ("on", "off")}
        self.switches = counter("dspark_speculation_switches", "times the planner switched speculation "
                                "off or on again").labels(*values)
        self.step_offset = gauge("dspark_step_offset_seconds", "seconds the planner adds to every step "
                                 "price: the fixed part of recent decode steps' excess over the table")
        self.queue_depth = gauge("dspark_queue_depth", "requests waiting for a slot or KV pages")
        self.running = gauge("dspark_running_requests", "requests holding a slot")
        self.free_pages = gauge("dspark_kv_free_pages", "free KV pages")
        self.total_pages = gauge("dspark_kv_pages", "KV pages in the pool (the null page excluded)")
        self.free_slots = gauge("dspark_free_slots", "free request slots")
        # online calibration (`dspark serve --online-calibration`): read from the calibrator when scraped
        self.online = runtime.speculative.online
        if self.online is not None:
            self.calibration_samples = gauge("dspark_calibration_samples", "request-steps labelled for "
                                             "online calibration since start")
            self.calibration_refits = gauge("dspark_calibration_refits",
                                            "online calibration refits swapped in")
            self.calibration_drift = gauge("dspark_calibration_drift", "1 while the recent steps' "
                                           "calibration or traffic has drifted beyond noise, else 0")
            self.calibration_shift = gauge("dspark_calibration_traffic_shift_z", "the recent steps' mean "
                                           "confidence logit against the window's other requests', in "
                                           "standard errors")
            self.calibration_step_seconds = gauge("dspark_calibration_step_seconds", "wall seconds online "
                                                  "calibration has spent on the step path since start")
            self.calibration_background_seconds = gauge("dspark_calibration_background_cpu_seconds", "CPU "
                                                        "seconds of online calibration's finished checks "
                                                        "and refits since start")
            self.calibration_prompt_shift = gauge("dspark_calibration_prompt_shift_z", "the newest "
                                                  "prompts' surprise to the target against the prompts' "
                                                  "before them, in standard errors")
            by_position = [*names, "position"]
            self.calibration_temperature = Gauge("dspark_calibration_temperature", "the STS temperature in "
                                                 "use, by draft position", by_position, registry=r)
            self.calibration_ece = Gauge("dspark_calibration_window_ece", "cumulative ECE of the window "
                                         "with the temperatures in use, by draft position", by_position,
                                         registry=r)
            self._labels = values
        # online cost refit (`dspark serve --online-cost`): read from the refit when scraped
        self.cost_refit = runtime.speculative.cost_refit
        if self.cost_refit is not None:
            self.cost_samples = gauge("dspark_cost_refit_samples", "decode steps measured for the online "
                                      "cost refit since start")
            self.cost_refits = gauge("dspark_cost_refits", "refitted cost tables swapped in")
            self.cost_rejected = gauge("dspark_cost_refits_rejected", "refitted cost tables that failed "
                                       "validation (the table in use stayed)")
            self.cost_intercept = gauge("dspark_cost_refit_intercept_seconds", "the last refit's correction "
                                        "every step's price shares (the bias's)")
        self._committed = 0
        self._request_steps = 0
        self._tau = 0.0
        self._planned_committed = 0
        self._speculating = True
        self.observe_pool(runtime)

    def observe_pool(self, runtime: Runtime) -> None:
        pool = runtime.pool_stats()
        self.queue_depth.set(pool["waiting"])
        self.running.set(pool["running"])
        self.free_pages.set(pool["free_pages"])
        self.total_pages.set(pool["total_pages"])
        self.free_slots.set(pool["free_slots"])

    def observe_step(self, runtime: Runtime) -> None:
        step = runtime.last_step
        if step is not None:
            self.steps.inc()
            self.request_steps.inc(step.num_reqs)
            self.committed.inc(step.committed)
            self.verify_rows.inc(step.rows)
            self.planned_rows.inc(step.planned_rows)
            self.padding_rows.inc(step.padding_rows)
            self.step_seconds.observe(step.seconds)
            state = "on" if step.speculating else "off"
            self.state_steps[state].inc()
            self.state_seconds[state].inc(step.seconds)
            self.batch.set(step.num_reqs)
            self.tier.set(step.tier)
            self._committed += step.committed
            self._request_steps += step.num_reqs
            self.mean_commit_len.set(self._committed / self._request_steps)
            if step.budget is not None:
                self.budget.set(step.budget)
            if step.tau is not None:
                self.predicted_tau.inc(step.tau)
                self.committed_planned.inc(step.committed)
                self._tau += step.tau
                self._planned_committed += step.committed
                self.tau_bias.set((self._planned_committed - self._tau) / max(self._planned_committed, 1))
        self.step_offset.set(runtime.speculative.offset.seconds)
        speculating = not runtime.target_only and (runtime.switch is None or runtime.switch.speculating)
        if self._speculating != speculating:
            self._speculating = speculating
            self.speculating.set(int(speculating))
            if runtime.switch is not None and not runtime.target_only:
                self.switches.inc()
        self.observe_pool(runtime)

    def render(self) -> tuple[bytes, str]:
        if self.online is not None:
            state = self.online.state()
            self.calibration_samples.set(state["samples"])
            self.calibration_refits.set(state["refits"])
            self.calibration_step_seconds.set(self.online.step_seconds)
            self.calibration_background_seconds.set(self.online.background_seconds)
            self.calibration_drift.set(int(state["drift"]))
            for gauge, z in ((self.calibration_shift, state["shift_z"]),
                             (self.calibration_prompt_shift, state["prompt_z"])):
                gauge.set(float("nan") if z is None else z)
            for k, (t, e) in enumerate(zip(state["temperatures"], state["window_ece"], strict=True)):
                self.calibration_temperature.labels(*self._labels, str(k)).set(t)
                self.calibration_ece.labels(*self._labels, str(k)).set(float("nan") if e is None else e)
        if self.cost_refit is not None:
            cost = self.cost_refit.state()
            self.cost_samples.set(cost["samples"])
            self.cost_refits.set(cost["refits"])
            self.cost_rejected.set(cost["rejected"])
            intercept = cost["intercept_seconds"]
            self.cost_intercept.set(float("nan") if intercept is None else intercept)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Bound:
    """A labelled counter with the deployment labels filled in: `.labels(reason).inc()`."""

    def __init__(self, counter: Counter, values: list[str]) -> None:
        self._counter = counter
        self._values = values

    def labels(self, *extra: str) -> Counter:
        return self._counter.labels(*self._values, *extra)
