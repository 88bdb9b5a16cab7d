"""DP attention end to end on the CPU (gloo over 127.0.0.1): the embedded pair recompiled with
`parallelism: {tp, dp, dp_attention: true}`, every DP rank scheduling, drafting and planning its own requests
and agreeing each step on the rows they all run.

- Greedy output equals one-process target-only decoding under `torchrun` with 4 processes (tp 4, dp 2: two
  attention ranks per DP rank, the second following its engine) and with 2 (tp 2, dp 2) and one DP rank
  idle (a single request), static and compact, with the check mode on.
- In-process ranks record every verify step each engine runs: all run the same tier, which is the largest
  any needed; an idle engine runs padding requests alone; graph-tier alignment fills each engine's rows up to
  the global tier; a DP rank whose planner fails makes every DP rank run the uniform step.
- The check mode fails every DP rank loudly when one lays out another tier.
- `dspark serve` starts the ranks; concurrent requests, streamed or not, greedy or seeded and sampled, spread
  over the DP ranks and come back as one process serves them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dspark.compiler import build
from dspark.runtime.engine.step_sync import GlobalVerify
from dspark.runtime.layout import tier_for

from .gloo_ranks import as_rank, free_port, spawn_ranks
from .parallel_builds import (
    NEW_TOKENS,
    PROMPTS,
    REPO,
    compile_parallel,
    http_json,
    prompt_args,
    reference,
    run,
    torchrun,
    wait_healthy,
)

DP_ATTENTION = {"dp_attention": True}
TIERS = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # specs/tiny_cpu_compact_tiers.yaml's


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "compact"])
def test_dp_attention_under_torchrun_decodes_as_one_process(mode: str, tmp_path: Path) -> None:
    """4 processes: 2 DP ranks of 2 attention ranks, each engine leading a follower (2 processes, one
    attention rank per DP rank, run in the tests below)."""
    name = compile_parallel(f"tiny_cpu_{mode}", tmp_path, tp=4, dp=2, **DP_ATTENTION)
    assert torchrun(name, 4, tmp_path, free_port()) == reference(f"tiny_cpu_{mode}")


@pytest.mark.slow
def test_a_recording_run_records_every_dp_ranks_steps(tmp_path: Path) -> None:
    """`run --record` under DP attention: the other DP rank's calibration rows and step records come back
    to rank 0's recording, its slots numbered after DP rank 0's (32 slots each)."""
    name = compile_parallel("tiny_cpu_cap_accept", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    record = tmp_path / "rec"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(free_port())]
    command = ["-m", f"generated.{name}", "run", *prompt_args(PROMPTS), "--max-new-tokens", "16",
               "--record", str(record)]
    result = run(launch + command, tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    steps = [json.loads(line) for line in (record / "steps.jsonl").read_text().splitlines()]
    slots = {r["slot"] for step in steps for r in step["requests"]}
    assert min(slots) < 32 <= max(slots)  # both DP ranks' requests
    info = json.loads((record / "run.json").read_text())
    assert info["recorded_steps"] == len(steps) and info["stats"]["requests"] == len(PROMPTS)
    meta = json.loads((record / "sts" / "meta.json").read_text())
    assert meta["num_samples"] > 0


@pytest.mark.slow
def test_a_dp_attention_build_profiles_its_own_step_costs(tmp_path: Path) -> None:
    """`dspark profile` under torchrun: every DP rank runs each timed step alongside rank 0, and the table
    carries the DP build's fingerprint, so the build recompiles against it without a stale-table error."""
    name = compile_parallel("tiny_cpu_compact", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    out = tmp_path / "tables"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(free_port())]
    profile = ["-m", "dspark.cli.main", "profile", str(tmp_path / "generated" / name), "-o", str(out),
               "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--grid-density", "2",
               "--m-bin", "8", "--no-progress"]
    result = run(launch + profile, tmp_path, DSPARK_TP_CHECK="1")
    assert result.returncode == 0, result.stderr[-8000:]
    spec = tmp_path / f"{name}.yaml"
    data = yaml.safe_load(spec.read_text())
    data["cost_model"] = {"type": "additive", "file": str(out / "additive.json")}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    build(spec, tmp_path / "generated" / name)  # not stale: profiled on this very launch


@pytest.mark.slow
def test_the_dp_ranks_switch_speculation_off_together(tmp_path: Path) -> None:
    """A table whose target-only decode step is nearly free: the planner switches speculation off, every DP
    rank with it (one decision from every DP rank's prediction; the check mode compares each step's rows),
    and probes; greedy output stays one process's."""
    name = compile_parallel("tiny_cpu_compact", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    spec = tmp_path / f"{name}.yaml"
    data = yaml.safe_load(spec.read_text())
    table = json.loads((REPO / "specs" / "tables" / "tiny_cpu" / "additive.json").read_text())
    table.pop("fingerprint", None)
    probes = table["bs_probes"]
    cheap = {**table, "type": "additive", "decode_bs_probes": probes,
             "decode_seconds": [1e-6 * (1 + i) for i in range(len(probes))]}
    data["cost_model"] = cheap
    data["verify"] = {**data["verify"], "off": "auto", "off_patience": 2, "probe_every": 4}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    build(spec, tmp_path / "generated" / name)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(free_port())]
    command = ["-m", f"generated.{name}", "run", *prompt_args(PROMPTS), "--max-new-tokens", str(NEW_TOKENS),
               "--json"]
    result = run(launch + command, tmp_path, DSPARK_TP_CHECK="1")
    assert result.returncode == 0, result.stderr[-8000:]
    out = json.loads(result.stdout)
    assert [c["token_ids"] for c in out["completions"]] == reference("tiny_cpu_compact")
    stats = out["stats"]
    assert stats["speculation_off_steps"] > 0 and stats["speculation_switches"] >= 1
    assert stats["mean_predicted_tau_per_step"] is not None  # the drafted steps before, and the probes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static"])
def test_an_idle_dp_rank_takes_part_in_every_step(mode: str, tmp_path: Path) -> None:
    """One request: DP rank 0 decodes it, DP rank 1 runs every forward on padding alone. (Compact with an
    idle DP rank: `test_every_dp_rank_runs_the_global_tier`, where DP rank 0 goes idle mid-run.)"""
    name = compile_parallel(f"tiny_cpu_{mode}", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    one = PROMPTS[:1]
    assert torchrun(name, 2, tmp_path, free_port(), one) == reference(f"tiny_cpu_{mode}", one)


@pytest.mark.slow
def test_the_prompt_probe_runs_on_every_dp_rank_with_online_calibration(tmp_path: Path) -> None:
    """With online calibration the prefill projects its prompt-probe rows apart, padded to the most any DP
    rank has: one request leaves DP rank 1 none of its own (the check mode compares the rows every rank ran),
    and greedy output stays one process's target-only decoding."""
    name = compile_parallel("tiny_cpu_compact", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    one = PROMPTS[:1]
    got = torchrun(name, 2, tmp_path, free_port(), one, "--online-calibration")
    assert got == reference("tiny_cpu_compact", one)


# -- in-process ranks: what every engine ran ------------------------------------------------------------
MAX_NEW = (8, 40, 16)  # DP rank 0 gets requests 0 and 2, DP rank 1 request 1: DP rank 0 goes idle first


def _engine_rank(rank: int, size: int, port: int, package_dir: str, prompts: list[list[int]], fault: str,
                 out_dir: str) -> None:
    as_rank(rank, size, port, check=fault == "tier")
    from dspark.runtime.distributed import dp_sync
    from dspark.runtime.distributed.lockstep import RankDisagreement
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.package import load_package
    from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
    from dspark.runtime.runners.eager import EagerVerifyRunner

    steps: list[dict[str, Any]] = []
    run_states = EagerVerifyRunner.run_states

    def recorded(self: Any, layout: Any, input_ids: torch.Tensor) -> Any:
        n = layout.num_requests
        steps.append({"tier": layout.tier, "requests": n, "rows": layout.total_rows,
                      "run_lens": layout.rows_per_slot[:n].tolist()})
        return run_states(self, layout, input_ids)

    EagerVerifyRunner.run_states = recorded  # type: ignore[method-assign]
    if fault == "plan" and rank == 1:  # DP rank 1's planner fails on its third step
        plan_step, calls = AdaptiveVerifyPlan.plan_step, []

        def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise ValueError("the floor alone needs more rows than the largest tier")
            return plan_step(self, *args, **kwargs)

        AdaptiveVerifyPlan.plan_step = failing  # type: ignore[method-assign]
    if fault == "tier" and rank == 1:  # DP rank 1 computes the global tier wrongly
        def wrong(*args: Any, **kwargs: Any) -> GlobalVerify:
            agreed = global_verify(*args, **kwargs)
            return GlobalVerify(agreed.tier + 8, agreed.logit_rows, agreed.uniform_rows)

        global_verify = dp_sync.global_verify
        dp_sync.global_verify = wrong  # type: ignore[assignment]
    result: dict[str, Any] = {"steps": steps}
    package = load_package(package_dir)
    try:
        if not follows(package):
            runtime = Runtime(package)
            try:
                requests = [runtime.new_request(p, n) for p, n in zip(prompts, MAX_NEW, strict=True)]
                for r in requests:
                    runtime.enqueue(r)
                while runtime.has_work:
                    runtime.step()
                result["outputs"] = [r.output for r in requests]
            finally:
                runtime.close()
    except RankDisagreement as err:
        result["disagreement"] = str(err)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if "disagreement" in result:
        os._exit(0)  # the process group is mid-step: leave without tearing it down


@pytest.fixture(scope="module")
def tiers_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """specs/tiny_cpu_compact_tiers.yaml (compact, tier-aligned, 12 tiers) with tp 2, dp 2, DP attention."""
    root = tmp_path_factory.mktemp("dp_tiers")
    return root / "generated" / compile_parallel("tiny_cpu_compact_tiers", root, tp=2, dp=2, **DP_ATTENTION)


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' ids, and each one's greedy target-only continuation as one process decodes it."""
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    runtime = Runtime(load_package(REPO / "generated" / "tiny_cpu_compact_tiers"))
    ids = [runtime.package.tokenizer.encode(p) for p in PROMPTS]
    outputs, _ = runtime.generate(ids, max(MAX_NEW), target_only=True)
    return ids, [out[:n] for out, n in zip(outputs, MAX_NEW, strict=True)]


def _run_ranks(package: Path, prompts: list[list[int]], fault: str, out_dir: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_engine_rank, 2, (str(package), prompts, fault), out_dir, 300, "DP attention ranks")


@pytest.mark.slow
def test_every_dp_rank_runs_the_global_tier(tiers_build: Path, prompts_and_reference: Any,
                                            tmp_path: Path) -> None:
    prompts, want = prompts_and_reference
    ranks = _run_ranks(tiers_build, prompts, "", tmp_path)
    assert ranks[0]["outputs"] == want
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert len(steps0) == len(steps1) > 0  # every verify step is run by both engines
    idle = differ = 0
    for a, b in zip(steps0, steps1, strict=True):
        assert a["tier"] == b["tier"]  # the tier agreement
        busy = [s for s in (a, b) if s["requests"]]
        # the global tier is the largest any DP rank needed (alignment fills a DP rank's rows within it)
        assert a["tier"] == max(tier_for(s["rows"], TIERS) for s in busy)
        # graph-tier alignment: each busy DP rank's rows fill the global tier, up to B x cap (cap 8)
        assert all(s["rows"] == min(a["tier"], 8 * s["requests"]) for s in busy), (a, b)
        idle += len(busy) == 1
        for s in (a, b):
            if not s["requests"]:
                assert s["rows"] == 0  # padding requests alone
        differ += a["rows"] != b["rows"]
    assert idle and differ  # the agreement was not trivial: rows differed and DP rank 0 went idle


@pytest.mark.slow
def test_a_dp_rank_that_cannot_plan_makes_every_rank_run_the_uniform_step(
        tiers_build: Path, prompts_and_reference: Any, tmp_path: Path) -> None:
    prompts, want = prompts_and_reference
    ranks = _run_ranks(tiers_build, prompts, "plan", tmp_path)
    assert ranks[0]["outputs"] == want  # still lossless
    uniform = [i for i, (a, b) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"], strict=True))
               if {n for s in (a, b) for n in s["run_lens"]} == {8}]
    # DP rank 1's third verify step: every request of both DP ranks runs the uniform rows, here N = 8
    assert 2 in uniform
    step = ranks[0]["steps"][2], ranks[1]["steps"][2]
    assert step[0]["tier"] == step[1]["tier"] == tier_for(8 * max(s["requests"] for s in step), TIERS)


@pytest.mark.slow
def test_the_check_mode_fails_every_dp_rank_on_another_tier(tiers_build: Path, prompts_and_reference: Any,
                                                             tmp_path: Path) -> None:
    prompts, _ = prompts_and_reference
    ranks = _run_ranks(tiers_build, prompts, "tier", tmp_path)
    for rank in ranks:
        assert rank["disagreement"] == ("DP ranks disagree on the verify step (tier, logit rows): ranks "
                                        "[0] vs [1] computed different results")


# -- serving ----------------------------------------------------------------------------------------------
def _streamed_text(url: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def _one_process(prompt: str, max_tokens: int, temperature: float, seed: int | None) -> str:
    """What the one-process static build serves for one request (greedy: target-only; sampled: from the
    request's own generator, which a static step draws from the same way whatever the batch)."""
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package
    from dspark.runtime.sampling import SamplingParams

    runtime = Runtime(load_package(REPO / "generated" / "tiny_cpu_static"))
    tokenizer = runtime.package.tokenizer
    r = runtime.new_request(tokenizer.encode(prompt), max_tokens, SamplingParams(temperature), seed=seed)
    runtime.enqueue(r)
    runtime.target_only = temperature == 0
    while runtime.has_work:
        runtime.step()
    return tokenizer.decode(r.output)


@pytest.mark.slow
def test_dspark_serve_spreads_concurrent_requests_over_the_dp_ranks(tmp_path: Path) -> None:
    name = compile_parallel("tiny_cpu_static", tmp_path, tp=2, dp=2, **DP_ATTENTION)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "DSPARK_TP_CHECK": "1"}
    command = [sys.executable, "-m", "dspark.cli.main", "serve", str(tmp_path / "generated" / name),
               "--port", str(port)]
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    bodies = [{"model": name, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0},
              {"model": name, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0},
              {"model": name, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.8, "seed": 5}]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        with ThreadPoolExecutor(3) as pool:  # together: the engine spreads them over both DP ranks
            answers = [pool.submit(http_json, f"{url}/v1/completions", bodies[0]),
                       pool.submit(_streamed_text, f"{url}/v1/completions", bodies[1]),
                       pool.submit(http_json, f"{url}/v1/completions", bodies[2])]
            greedy, streamed, sampled = (a.result() for a in answers)
        assert greedy[0] == 200 and sampled[0] == 200
        texts = [greedy[1]["choices"][0]["text"], streamed, sampled[1]["choices"][0]["text"]]
        assert texts == [_one_process(b["prompt"], b["max_tokens"], b["temperature"], b.get("seed"))
                         for b in bodies]
        os.killpg(server.pid, signal.SIGINT)
        server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
