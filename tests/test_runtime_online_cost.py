"""The online cost refit (`dspark.runtime.planner.online_cost`): a synthetic stream whose true step cost
differs from the table in shape converges at the knots it visits, knots it never visits keep the table's
values, every refit is a valid monotone table whatever the stream (hostile ones included), the engine swaps
refitted tables in without changing a committed token, and the spec section, the CLI flags, the server's
`GET /v1/dspark/cost-table`, `/metrics` and the step records carry it."""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dspark.formats.cost_tables import cost_table_from_json, cost_table_json
from dspark.formats.step_records import RequestRecord, StepRecord, StepRecordError
from dspark.runtime.config import OnlineCostSettings
from dspark.runtime.planner.cost_models import AdditiveCostTable
from dspark.runtime.planner.online_cost import OnlineCostRefit, hats, plan_cost_model

from .runtime_helpers import REPO, compile_on_and_off, spec_with

MS = 1e-3


def table(context: bool = False) -> AdditiveCostTable:
    """A small table with every term: draft, decode, and (optionally) a context term."""
    fields = dict(bias_seconds=2 * MS, bs_probes=(1, 2, 4, 8, 16),
                  alpha_seconds=(0.0, 0.1 * MS, 0.3 * MS, 0.7 * MS, 1.5 * MS),
                  m_probes=(1, 8, 16, 32, 64, 128),
                  theta_seconds=(0.0, 0.5 * MS, 1 * MS, 2 * MS, 6 * MS, 12 * MS), draft_bs_probes=(1, 4, 16),
                  draft_seconds=(1 * MS, 1.2 * MS, 2 * MS), decode_bs_probes=(1, 4, 16),
                  decode_seconds=(3 * MS, 3.5 * MS, 5 * MS))
    if context:
        scale = (1.5, 2.2)
        fields.update(
            context_len=128, context_lens=(512, 900),
            context_bias_seconds=tuple(fields["bias_seconds"] * s for s in scale),
            context_alpha_seconds=tuple(tuple(a * s for a in fields["alpha_seconds"]) for s in scale),
            context_theta_seconds=tuple(tuple(t * s for t in fields["theta_seconds"]) for s in scale),
            context_draft_seconds=tuple(tuple(d * s for d in fields["draft_seconds"]) for s in scale),
            context_decode_seconds=tuple(tuple(d * s for d in fields["decode_seconds"]) for s in scale))
    return AdditiveCostTable(**fields)


def price(t: AdditiveCostTable, num_reqs: int, rows: int, context: float = 0.0) -> float:
    at = t.at_context(context)
    return at.step_time(num_reqs, rows) + at.draft_time(num_reqs)


def valid(t: AdditiveCostTable) -> None:
    """A table a file can hold (read back through the format), pricing every step above zero."""
    again = cost_table_from_json(cost_table_json(t.to_format()), "the refitted table")
    assert again.model_dump() == t.to_format().model_dump()
    for context in (0.0, 300.0, 2000.0):
        at = t.at_context(context)
        for b in (1, 3, 16, 40):
            assert at.step_time(b, 1) > 0
            assert not at.decode_seconds or at.decode_time(b) > 0


def test_hats_weigh_as_np_interp_does() -> None:
    knots = np.array([1.0, 8.0, 16.0, 64.0])
    x = np.array([-5.0, 1.0, 3.0, 8.0, 40.0, 64.0, 500.0])
    values = np.array([0.3, 1.0, 2.5, 7.0])
    assert np.allclose(hats(x, knots) @ values, np.interp(x, knots, values))
    assert np.allclose(hats(x, np.array([4.0])), 1.0)


def dearer_stream(refit: OnlineCostRefit, compiled: AdditiveCostTable, steps: int, seed: int = 0,
                  context: float = 100.0) -> None:
    """Steps at B 1..4 and up to 8 rows a request whose true cost is 3 ms more than the table's and whose
    rows cost twice what theta says, with 2 % noise, one step in 30 three times as long (a stall), and
    one in 5 a step without speculation (3 ms more than the decode term)."""
    gen = np.random.default_rng(seed)
    for _ in range(steps):
        b = int(gen.integers(1, 5))
        at = compiled.at_context(context)
        noise = float(np.exp(0.02 * gen.standard_normal())) * (3.0 if gen.random() < 1 / 30 else 1.0)
        if gen.random() < 0.2:
            refit.observe_off(b, context, (at.decode_time(b) + 3 * MS) * noise)
            continue
        m = int(gen.integers(b, 8 * b + 1))
        truth = price(compiled, b, m, context) + 3 * MS + float(np.interp(m, at.m_probes, at.theta_seconds))
        refit.observe_drafted(b, m, context, truth * noise)


def test_a_stream_dearer_in_shape_converges_at_the_visited_knots() -> None:
    compiled = table()
    refit = OnlineCostRefit(compiled, OnlineCostSettings())
    dearer_stream(refit, compiled, 1024)
    assert refit.poll() is not None and refit.refits == 1  # one per refit_every steps, at the poll
    dearer_stream(refit, compiled, 512, seed=1)
    assert refit.poll() is not None
    live = refit.table
    assert refit.last is not None and refit.last.outliers > 0  # the stalls were left out
    for b in (1, 2, 3, 4):
        for m in (b, 2 * b, 4 * b, 8 * b):
            rows = float(np.interp(m, compiled.m_probes, compiled.theta_seconds))
            truth = price(compiled, b, m) + 3 * MS + rows
            assert price(live, b, m) == pytest.approx(truth, rel=0.03), (b, m)
            # the compiled table alone is far off: the refit moved the shape, not only the level
            assert abs(price(compiled, b, m) / truth - 1) > 0.1
        assert live.decode_time(b) == pytest.approx(compiled.decode_time(b) + 3 * MS, rel=0.03)
    valid(live)


def test_knots_the_traffic_never_visits_keep_the_tables_values() -> None:
    compiled = table()
    refit = OnlineCostRefit(compiled, OnlineCostSettings())
    dearer_stream(refit, compiled, 512)
    live = refit.poll()
    assert live is not None and refit.last is not None
    # B = 8 and 16, M = 64 and 128 and the decode term at 16 requests were never seen: no correction there
    assert not refit.last.alpha[3:].any() and not refit.last.theta[4:].any() and refit.last.decode[2] == 0
    k = 1.0 + refit.last.scale
    for m in (8, 32, 100):  # B beyond the traffic: the table's own increments between its knots, scaled
        assert live.step_time(16, m) - live.step_time(8, m) == pytest.approx(
            k * (compiled.step_time(16, m) - compiled.step_time(8, m)), rel=1e-9, abs=1e-12)
    assert live.step_time(2, 128) - live.step_time(2, 64) == pytest.approx(
        k * (compiled.step_time(2, 128) - compiled.step_time(2, 64)), rel=1e-9)
    # the scale and the intercept are the correction every step shares: an unvisited step moves by them alone
    shared = k * compiled.decode_time(16) + refit.last.intercept
    assert live.decode_time(16) == pytest.approx(shared, rel=1e-9)


def test_the_context_shape_is_kept() -> None:
    compiled = table(context=True)
    refit = OnlineCostRefit(compiled, OnlineCostSettings())
    dearer_stream(refit, compiled, 512, context=130.0)
    live = refit.poll()
    assert live is not None and refit.last is not None
    valid(live)
    # every profiled context's fields moved by the same correction: the price difference between two
    # contexts is the compiled table's, scaled as every price is
    k = 1.0 + refit.last.scale
    for b, m in ((1, 4), (3, 20), (4, 32)):
        assert price(live, b, m, 900) - price(live, b, m, 128) == pytest.approx(
            k * (price(compiled, b, m, 900) - price(compiled, b, m, 128)), rel=1e-6)


def test_steps_at_every_context_are_priced_there() -> None:
    compiled = table(context=True)
    refit = OnlineCostRefit(compiled, OnlineCostSettings(window=256, refit_every=256))
    gen = np.random.default_rng(3)
    for _ in range(256):  # the compiled table is right at every context: nothing to correct
        b, context = int(gen.integers(1, 9)), float(gen.uniform(0, 1500))
        m = int(gen.integers(b, 8 * b + 1))
        refit.observe_drafted(b, m, context, price(compiled, b, m, context))
    live = refit.poll()
    assert live is not None and refit.last is not None
    assert abs(refit.last.intercept) < 1e-9 and np.abs(refit.last.theta).max() < 1e-9
    for context in (0, 200, 512, 700, 1500):
        assert price(live, 4, 20, context) == pytest.approx(price(compiled, 4, 20, context), rel=1e-6)


def random_table(gen: np.random.Generator) -> AdditiveCostTable:
    def probes(count: int, top: int) -> tuple[int, ...]:
        return tuple(sorted({1, *(int(v) for v in gen.integers(2, top, size=count - 1))}))

    def rising(count: int, scale: float) -> tuple[float, ...]:
        start = float(gen.choice([0.0, gen.exponential(scale)]))
        return tuple(float(v) for v in start + np.cumsum(np.r_[0.0, gen.exponential(scale, size=count - 1)]))

    bs, ms = probes(int(gen.integers(1, 6)), 64), probes(int(gen.integers(1, 10)), 512)
    ds = probes(int(gen.integers(1, 5)), 64)
    fields = dict(bias_seconds=float(gen.exponential(2 * MS)) + 0.1 * MS, bs_probes=bs,
                  alpha_seconds=rising(len(bs), MS), m_probes=ms, theta_seconds=rising(len(ms), MS),
                  draft_bs_probes=ds, draft_seconds=rising(len(ds), MS), decode_bs_probes=ds,
                  decode_seconds=tuple(v + MS for v in rising(len(ds), MS)))
    if gen.random() < 0.5:
        scale = 1.0 + float(gen.exponential())
        fields.update(context_len=100, context_lens=(800,),
                      context_bias_seconds=(fields["bias_seconds"] * scale,),
                      context_alpha_seconds=(tuple(a * scale for a in fields["alpha_seconds"]),),
                      context_theta_seconds=(tuple(t * scale for t in fields["theta_seconds"]),),
                      context_draft_seconds=(tuple(d * scale for d in fields["draft_seconds"]),),
                      context_decode_seconds=(tuple(d * scale for d in fields["decode_seconds"]),))
    return AdditiveCostTable(**fields)


@pytest.mark.parametrize("seed", range(24))
def test_every_refit_is_a_valid_monotone_table(seed: int) -> None:
    """Random tables under random traffic: cheaper or dearer than the table, in any shape, heavy tails."""
    gen = np.random.default_rng(seed)
    compiled = random_table(gen)
    refit = OnlineCostRefit(compiled, OnlineCostSettings(window=128, refit_every=32,
                                                         ridge=float(gen.choice([0.01, 4.0, 100.0]))))
    level, per_row = float(gen.uniform(-5, 5)) * MS, float(gen.uniform(-0.5, 2.0))
    top_b = int(gen.integers(1, 80))
    for _ in range(256):
        b, context = int(gen.integers(1, top_b + 1)), float(gen.uniform(0, 2000))
        m = int(gen.integers(b, 8 * b + 1))
        seconds = price(compiled, b, m, context) * (1 + per_row * m / 64) + level
        seconds *= float(np.exp(gen.standard_t(2) * 0.1))
        if gen.random() < 0.2:
            refit.observe_off(b, context, max(seconds, 1e-7))
        else:
            refit.observe_drafted(b, m, context, max(seconds, 1e-7))
        live = refit.poll()
        if live is not None:
            valid(live)  # constructing it checked monotonicity, signs and every context's table
    assert refit.refits == 8 and refit.rejected == 0


@pytest.mark.parametrize("stream", ["not measured", "one shape", "nearly nothing", "an hour", "alternating",
                                    "off steps only"])
def test_hostile_streams_never_produce_an_invalid_table(stream: str) -> None:
    compiled = table(context=True)
    refit = OnlineCostRefit(compiled, OnlineCostSettings(window=64, refit_every=16))
    for i in range(64):
        if stream == "not measured":
            for bad in (math.nan, math.inf, -math.inf, 0.0, -1.0):
                refit.observe_drafted(4, 16, 100.0, bad)
                refit.observe_off(4, 100.0, bad)
            refit.observe_drafted(0, 0, 100.0, 0.01)  # no request
            refit.observe_drafted(4, 2, 100.0, 0.01)  # fewer rows than requests: not a step
            refit.observe_drafted(4, 16, math.nan, 0.01)  # no context
        elif stream == "one shape":
            refit.observe_drafted(4, 16, 300.0, 0.1)
        elif stream == "nearly nothing":
            refit.observe_drafted(1 + i % 8, 1 + i, 50.0 * i, 1e-12)
        elif stream == "an hour":
            refit.observe_drafted(1 + i % 8, 1 + i, 50.0 * i, 3600.0)
        elif stream == "alternating":
            refit.observe_drafted(1 + i % 8, 1 + i, 50.0 * i, 1e-9 if i % 2 else 1e3)
        else:
            refit.observe_off(1 + i % 16, 50.0 * i, 0.02)
        refit.poll()
    if stream == "not measured":
        assert refit.samples == 0 and refit.refits == 0 and refit.table is compiled
        assert refit.ignored == 64 * 13
        return
    assert refit.refits == 4 and refit.rejected == 0
    valid(refit.table)
    if stream == "one shape":  # a fixed excess where every step has one shape: that step is priced right
        assert price(refit.table, 4, 16, 300.0) == pytest.approx(0.1, rel=0.01)
    if stream == "nearly nothing":  # the floor: never below a hundredth of the compiled smallest step
        assert refit.table.step_time(1, 1) >= 0.01 * compiled.step_time(1, 1) * (1 - 1e-9)


def test_a_refit_is_deterministic_and_cheap() -> None:
    compiled = table(context=True)
    fits = []
    for _ in range(2):
        refit = OnlineCostRefit(compiled, OnlineCostSettings(refit_every=512))
        dearer_stream(refit, compiled, 512, seed=5, context=400.0)
        fits.append(refit.poll())
    assert fits[0] is not None and fits[0] == fits[1]
    # What a refit costs between steps: a window of 512 steps, 64 of them new (the steady state).
    refit = OnlineCostRefit(compiled, OnlineCostSettings())
    dearer_stream(refit, compiled, 512, context=400.0)
    refit.poll()
    seconds = []
    for seed in range(8):
        dearer_stream(refit, compiled, 64, seed=10 + seed, context=400.0)
        start = time.perf_counter()
        refit.poll()
        seconds.append(time.perf_counter() - start)
    assert refit.refits == 9
    assert min(seconds) < 0.01, seconds  # about 0.4 ms on a 2-core CPU; loose for loaded CI machines
    start = time.perf_counter()
    for _ in range(1000):
        refit.observe_drafted(3, 17, 400.0, 0.01)
    assert (time.perf_counter() - start) / 1000 < 50e-6  # a few microseconds on the step path


def test_the_plan_embeds_the_refitted_table() -> None:
    from dspark.runtime.planner.cost_models import cost_model_from_dict

    live = table(context=True)
    assert cost_model_from_dict(plan_cost_model(live), "PLAN.cost_model") == live


# -- the engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", ["tiny_cpu_cap_accept", "tiny_cpu_compact"])
def test_refitted_tables_never_change_what_is_committed(build: str) -> None:
    from dspark.corpus import held_out_prompts
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    package = load_package(REPO / "generated" / build)
    prompts = [package.tokenizer.encode(p) for p in held_out_prompts(6)]
    runtime = Runtime(package, online_cost=OnlineCostSettings(window=64, refit_every=4))
    refit = runtime.speculative.cost_refit
    assert refit is not None and refit.table == package.plan.table
    want, _ = runtime.generate(prompts, 48, target_only=True)
    got, stats = runtime.generate(prompts, 48)
    assert got == want  # lossless with the tables swapped while it ran
    assert refit.refits >= 2 and refit.samples == stats.steps and refit.rejected == 0
    assert runtime.speculative.plan.table == refit.table  # the last refit is the one planning
    if runtime.switch is not None:
        assert runtime.switch.table is runtime.speculative.plan.table  # the off state weighs the same table
    # the step offset restarted at the last swap: it has seen only the steps since
    assert runtime.speculative.offset.samples <= 4


def test_online_cost_needs_an_additive_table() -> None:
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    with pytest.raises(RequestError, match="additive cost table's knots, but this deployment plans with no "
                                           "cost model"):
        Runtime(load_package(REPO / "generated" / "tiny_cpu_static"), online_cost=OnlineCostSettings())


def test_the_flags_override_the_spec() -> None:
    from types import SimpleNamespace

    from dspark.cli.common import online_cost_of

    spec = OnlineCostSettings(window=128, refit_every=16)
    on, off = (SimpleNamespace(deployment=SimpleNamespace(online_cost=c)) for c in (spec, None))
    assert online_cost_of(on, None) == spec and online_cost_of(on, False) is None
    assert online_cost_of(on, True) == spec
    assert online_cost_of(off, None) is None and online_cost_of(off, True) == OnlineCostSettings()
    with pytest.raises(ValueError, match="refit_every 64 exceeds window 32"):
        OnlineCostSettings(window=32)
    with pytest.raises(ValueError, match="ridge must be a finite number > 0"):
        OnlineCostSettings(ridge=0.0)


# -- the spec, the recording ------------------------------------------------------------------------------


def _spec_with(tmp_path: Path, build: str, section: dict | None, cost_model: dict | None = None) -> Path:
    sections: dict = {"online_cost": section}
    if cost_model is not None:
        sections["cost_model"] = cost_model
    return spec_with(tmp_path, build, f"{build}_online_cost", sections)


def test_the_spec_turns_online_cost_on_and_a_recording_keeps_every_swap(tmp_path: Path) -> None:
    from dspark.cli.main import main as dspark_main
    from dspark.corpus import held_out_prompts
    from dspark.formats.step_records import read_steps
    from dspark.runtime.package import load_package

    pkg = compile_on_and_off(tmp_path, lambda section: _spec_with(tmp_path, "tiny_cpu_compact", section),
                             {"window": 64, "refit_every": 8}, "online_cost", "OnlineCostSettings")
    deployment = load_package(pkg).deployment
    assert deployment.online_cost == OnlineCostSettings(window=64, refit_every=8)

    prompts = [arg for p in held_out_prompts(6) for arg in ("--prompt", p)]
    assert dspark_main(["run", str(tmp_path / "pkg"), *prompts, "--max-new-tokens", "48",
                        "--record", str(tmp_path / "rec")]) == 0
    steps = read_steps(next((tmp_path / "rec").rglob("steps.jsonl")), gamma=7)
    swaps = [s.cost_refit for s in steps if s.cost_refit is not None]
    assert swaps and swaps == sorted(set(swaps)) and swaps[0] >= 1  # each swap once, in order
    assert len(swaps) < len(steps)
    assert dspark_main(["run", str(tmp_path / "pkg"), *prompts, "--max-new-tokens", "16", "--no-online-cost",
                        "--record", str(tmp_path / "plain")]) == 0
    plain = read_steps(next((tmp_path / "plain").rglob("steps.jsonl")), gamma=7)
    assert all(s.cost_refit is None for s in plain)


SPS = {"type": "sps-1d", "sample_batch_tokens": [8, 64], "sample_steps_per_sec": [100.0, 50.0],
       "max_batch_tokens": 256}


@pytest.mark.parametrize(("build", "section", "cost_model", "where", "message"), [
    ("tiny_cpu_static", {}, None, "online_cost.enabled", "static mode has no planner"),
    ("tiny_cpu_compact", {}, SPS, "online_cost.enabled", "but the spec has a sps-1d cost_model"),
    ("tiny_cpu_compact", {"window": 32}, None, "online_cost.window", "less than refit_every (64)"),
    ("tiny_cpu_compact", {"window": 32, "refit_every": 40}, None, "online_cost.refit_every",
     "more than window (32)"),
    ("tiny_cpu_compact", {"ridge": 0}, None, "online_cost.ridge", "greater than 0"),
])
def test_a_spec_that_cannot_refit_its_costs_is_refused_at_its_line(tmp_path, capsys, build, section,
                                                                    cost_model, where, message) -> None:
    from dspark.cli.compile import main as compile_main

    spec = _spec_with(tmp_path, build, section, cost_model)
    assert compile_main(["build", str(spec), "-o", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert f"{spec.name}:" in err and where in err and message in err, err
    assert not (tmp_path / "pkg").exists()


def test_no_cost_model_is_refused_with_what_to_do(tmp_path, capsys) -> None:
    import yaml

    from dspark.cli.compile import main as compile_main

    spec = _spec_with(tmp_path, "tiny_cpu_compact", {})
    data = yaml.safe_load(spec.read_text())
    del data["cost_model"]
    data["verify"] = {**data["verify"], "allow_no_cost_model": True, "off": "never"}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    assert compile_main(["build", str(spec), "-o", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert "online_cost.enabled" in err and "the spec has no cost_model" in err, err
    assert "additive.json" in err, err


def test_the_step_record_field_round_trips() -> None:
    requests = (RequestRecord(0, 1, 3, 2, 2, 3, None, None),)
    record = StepRecord(num_reqs=1, lag=0, mode="compact", budget=2, aligned_budget=None, decision_tau=2.5,
                        planned_rows=3, rows=3, tier=3, padding_rows=0, tau=2.4, committed=3,
                        predicted_step_seconds=0.01, step_seconds=0.012, requests=requests, step=4,
                        cost_refit=3)
    data = record.to_json()
    assert data["cost_refit"] == 3 and StepRecord.from_json(data, 3, "x") == record
    assert "cost_refit" not in replace(record, cost_refit=None).to_json()
    assert StepRecord.from_json(replace(record, cost_refit=None).to_json(), 3, "x").cost_refit is None
    for bad, message in ((0, "must be >= 1"), (True, "must be int"), (1.5, "must be int")):
        with pytest.raises(StepRecordError, match=f"^f:2: .*cost_refit.*{message}"):
            StepRecord.from_json({**data, "cost_refit": bad}, 3, "f:2")


# -- the server -------------------------------------------------------------------------------------------


def test_the_server_reports_its_live_cost_table() -> None:
    import httpx

    from dspark.corpus import held_out_prompts
    from dspark.fingerprint import fingerprint_of_deployment
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package
    from dspark.runtime.serve.server import CompletionServer

    from .server_helpers import serving_in_process

    package = load_package(REPO / "generated" / "tiny_cpu_compact")
    runtime = Runtime(package, online_cost=OnlineCostSettings(window=64, refit_every=8))
    server = CompletionServer(runtime)
    with serving_in_process(server) as (_, url):
        for prompt in held_out_prompts(4):
            body = {"model": server.model_name, "prompt": prompt, "max_tokens": 32}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        live = httpx.get(f"{url}/v1/dspark/cost-table", timeout=30).json()
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    figures = ("samples", "ignored", "window", "refits", "rejected", "scale", "intercept_seconds",
               "fitted_steps", "outliers")
    assert live["refits"] >= 1 and live["samples"] >= 8 and live["rejected"] == 0
    saved = cost_table_from_json({k: v for k, v in live.items() if k not in figures}, "the live table")
    assert saved.type == "additive"
    assert AdditiveCostTable.from_format(saved) == runtime.speculative.cost_refit.table
    assert saved.fingerprint == fingerprint_of_deployment(package.deployment, runtime.tiers).to_json()
    assert re.search(r"dspark_cost_refits\{[^}]*\} " + re.escape(str(float(live["refits"]))), metrics)
    assert "dspark_cost_refit_samples{" in metrics

    plain = CompletionServer(Runtime(package))
    with serving_in_process(plain) as (_, url):
        off = httpx.get(f"{url}/v1/dspark/cost-table", timeout=30)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert off.status_code == 404 and off.json()["error"]["code"] == "online_cost_off"
    assert "--online-cost" in off.json()["error"]["message"] and "dspark_cost_refits" not in metrics


def test_the_live_cost_table_is_saved_as_a_file_a_spec_can_name(tmp_path: Path) -> None:
    import yaml

    from dspark.cli.serve import save_live_cost_table
    from dspark.compiler.api import build
    from dspark.corpus import held_out_prompts
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package
    from dspark.runtime.planner.cost_models import load_cost_model

    package = load_package(REPO / "generated" / "tiny_cpu_compact")
    runtime = Runtime(package, online_cost=OnlineCostSettings(window=64, refit_every=8))
    runtime.generate([package.tokenizer.encode(p) for p in held_out_prompts(4)], 32)
    refit = runtime.speculative.cost_refit
    assert refit is not None and refit.refits >= 1
    save_live_cost_table(runtime, tmp_path / "live.json")
    assert load_cost_model(tmp_path / "live.json") == refit.table

    # named in the spec, it passes the fingerprint check and becomes the plan's table
    spec = _spec_with(tmp_path, "tiny_cpu_compact", None)
    data = yaml.safe_load(spec.read_text())
    del data["online_cost"]
    data["cost_model"] = {"type": "additive", "file": str(tmp_path / "live.json")}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    build(spec, tmp_path / "pkg")
    assert load_package(tmp_path / "pkg").plan.table == refit.table


def test_saving_the_cost_table_without_the_refit_says_what_to_do(tmp_path: Path, capsys) -> None:
    from dspark.cli.main import main as dspark_main

    assert dspark_main(["serve", str(REPO / "generated" / "tiny_cpu_compact"), "--no-online-cost",
                        "--save-cost-table", str(tmp_path / "t.json")]) == 2
    assert "--save-cost-table needs the online cost refit" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
