"""`dspark run --record`: calibration shards and the step ring agree with what the run did, and
`dspark report` reads what was recorded."""

from __future__ import annotations

import json
from typing import Any

import torch

from dspark.cli.main import main
from dspark.corpus import held_out_text
from dspark.formats.run_info import read_run_info
from dspark.formats.step_records import read_steps
from dspark.measure.recording import RunRecorder
from dspark.report.inputs import load_inputs
from dspark.report.markdown import write_report
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import compile_variant
from .test_runtime_modes import COSTLY_ROWS


def _prompts(tokenizer) -> list[list[int]]:
    """Varied held-out prompts: different lengths, starting mid-line, one of a single byte."""
    texts = held_out_text(200_000)
    prompts = [texts[i][(97 * i) % 400:][: 5 + 23 * i] for i in range(7)] + ["x"]
    return [tokenizer.encode(p) for p in prompts]


def _run_info(pkg, stats) -> dict[str, Any]:
    """What `dspark run` passes to `RunRecorder.close` (`dspark.formats.run_info`)."""
    dep = pkg.deployment
    return {"deployment": dep.name, "verify_mode": dep.verify_mode, "backend": dep.backend,
            "device": dep.device, "gamma": pkg.plan.gamma, "lag_steps": pkg.plan.lag_steps,
            "policy": "greedy", "tiers": [], "target_only": False, "fingerprint": None,
            "stats": None if stats is None else stats.to_json()}


def _shards(directory):
    data = [torch.load(p, weights_only=True) for p in sorted(directory.glob("shard-*.pt"))]
    return torch.cat([d["logits"] for d in data]), torch.cat([d["prefix_mask"] for d in data])


def _steps(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cap_accept_records_every_request_with_labels_from_the_uncapped_match(tmp_path) -> None:
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS,
                                        "serving": {"max_running_requests": 4}}, "rec_cap"))
    recorder = RunRecorder(tmp_path / "run", pkg.plan.gamma, "greedy", record_steps=1000, shard_size=16)
    runtime = Runtime(pkg, recorder=recorder)
    _, stats = runtime.generate(_prompts(pkg.tokenizer), 32)
    recorder.close(_run_info(pkg, stats))

    logits, mask = _shards(tmp_path / "run" / "sts")
    steps = _steps(tmp_path / "run" / "steps.jsonl")
    requests = [r for s in steps for r in s["requests"]]
    assert logits.shape == mask.shape == (stats.request_steps, pkg.plan.gamma)
    assert len(list((tmp_path / "run" / "sts").glob("shard-*.pt"))) == -(-stats.request_steps // 16)
    # rows in step order: the label is the uncapped greedy prefix, which may exceed the cap
    raw = torch.tensor([r["raw_correct_len"] for r in requests])
    assert torch.equal(mask.sum(1), raw)
    assert torch.equal(mask, torch.arange(pkg.plan.gamma)[None, :] < raw[:, None])  # prefixes
    assert torch.allclose(logits, torch.tensor([r["confidence"] for r in requests]))
    assert all(r["correct_len"] == min(r["raw_correct_len"], r["verify_len"] - 1) for r in requests)
    assert any(r["raw_correct_len"] > r["correct_len"] for r in requests)  # the cap did bite
    assert len(steps) == stats.steps and sum(s["committed"] for s in steps) == stats.committed_tokens
    assert all(s["tau"] is not None and s["budget"] is not None for s in steps)
    meta = json.loads((tmp_path / "run" / "sts" / "meta.json").read_text())
    assert meta["num_samples"] == stats.request_steps and meta["skipped_requests"] == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["format"] == "dspark-run" and run["total_steps"] == stats.steps
    assert read_steps(tmp_path / "run" / "steps.jsonl", pkg.plan.gamma)[-1].step == stats.steps - 1
    # Greedy, a draft's acceptance probability is whether it matches: the match's leading run is raw.
    accept = torch.tensor([r["accept_prob"] for r in requests])
    assert set(accept.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(accept.cumprod(1).sum(1).long(), raw)


def test_compact_records_only_fully_verified_requests_and_says_why(tmp_path) -> None:
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"verify": {"mode": "compact"}, "cost_model": COSTLY_ROWS,
                                        "serving": {"max_running_requests": 4}}, "rec_compact"))
    recorder = RunRecorder(tmp_path / "run", pkg.plan.gamma, "greedy", record_steps=3)
    runtime = Runtime(pkg, recorder=recorder)
    _, stats = runtime.generate(_prompts(pkg.tokenizer), 32)
    recorder.close(_run_info(pkg, None))
    meta = json.loads((tmp_path / "run" / "sts" / "meta.json").read_text())
    assert meta["skipped_requests"] > 0 and "cap-accept" in meta["skip_reason"]
    assert meta["num_samples"] + meta["skipped_requests"] == stats.request_steps
    steps = _steps(tmp_path / "run" / "steps.jsonl")
    assert len(steps) == 3 and steps[-1]["step"] == stats.steps - 1  # a bounded ring: the last 3


def test_cli_record_flag_writes_a_run_directory(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml", {"serving": {"max_running_requests": 2}},
                          "rec_cli")
    out = tmp_path / "rec"
    assert main(["run", str(pkg), "--prompt", "def f(x):", "--prompt", "import os",
                 "--max-new-tokens", "24", "--record", str(out), "--record-steps", "2"]) == 0
    capsys.readouterr()
    run = json.loads((out / "run.json").read_text())
    assert run["verify_mode"] == "static" and run["policy"] == "greedy"
    assert run["recorded_steps"] == 2 and run["stats"]["generated_tokens"] == 48
    assert (out / "sts" / "shard-00000.pt").is_file()


def test_spec_record_steps_turns_recording_on_with_a_default_directory(tmp_path, monkeypatch, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"serving": {"max_running_requests": 2, "record_steps": 5}}, "rec_spec")
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(pkg), "--prompt", "x = ", "--max-new-tokens", "40"]) == 0
    capsys.readouterr()
    (run_dir,) = (tmp_path / "runs").glob("rec_spec-*")
    assert len(_steps(run_dir / "steps.jsonl")) == 5  # the spec's ring size


def test_sampling_runs_record_the_rejection_sampling_event_under_their_policy(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS,
                           "serving": {"max_running_requests": 4}}, "rec_sampled")
    out = tmp_path / "rec"
    assert main(["run", str(pkg), "--prompt", "def f(x):", "--prompt", "import os", "--max-new-tokens", "40",
                 "--temperature", "0.8", "--top-k", "20", "--record", str(out)]) == 0
    capsys.readouterr()
    meta = json.loads((out / "sts" / "meta.json").read_text())
    assert meta["policy"] == "sample:temperature=0.8,top_p=1.0,top_k=20"
    assert meta["fingerprint"]["policy"] == meta["policy"]
    _, mask = _shards(out / "sts")
    raw = torch.tensor([r["raw_correct_len"] for s in _steps(out / "steps.jsonl") for r in s["requests"]])
    assert torch.equal(mask.sum(1), raw)  # labels are the verifier's own acceptance events
    # Every accepted draft had a chance of acceptance, and some had one strictly between 0 and 1.
    accept = torch.tensor([r["accept_prob"] for s in _steps(out / "steps.jsonl") for r in s["requests"]])
    assert ((accept >= 0) & (accept <= 1)).all()
    assert (accept[torch.arange(accept.shape[1])[None, :] < raw[:, None]] > 0).all()
    assert ((accept > 0) & (accept < 1)).any()


def test_a_recording_stopped_with_sigterm_still_writes_its_metadata(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from .runtime_helpers import REPO

    out = tmp_path / "rec"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n"] * 64))
    package = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                              {"verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS}, "rec_sigterm")
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", str(package),
                             "--prompts-file", str(prompts),
                             "--max-new-tokens", "900", "--record", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not (out / "sts").is_dir() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    meta = json.loads((out / "sts" / "meta.json").read_text())
    run = json.loads((out / "run.json").read_text())
    assert meta["num_samples"] == sum(
        torch.load(p, weights_only=True)["logits"].shape[0] for p in (out / "sts").glob("shard-*.pt"))
    assert run["format"] == "dspark-run"


def test_a_static_recording_carries_survival_and_reports(tmp_path) -> None:
    # A static build whose draft has a confidence head records its confidence and survival per request,
    # though no planner ran (so no tau); the report shows what that allows and says what it does not.
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"serving": {"max_running_requests": 4}}, "rec_static"))
    recorder = RunRecorder(tmp_path / "run", pkg.plan.gamma, "greedy", record_steps=1000)
    _, stats = Runtime(pkg, recorder=recorder).generate(_prompts(pkg.tokenizer)[:4], 24)
    recorder.close(_run_info(pkg, stats))
    info = read_run_info(tmp_path / "run")
    steps = read_steps(tmp_path / "run" / "steps.jsonl", info.gamma)
    assert info.verify_mode == "static" and len(steps) == stats.steps
    assert all(s.tau is None and s.mode == "static" for s in steps)
    assert all(r.survival is not None and r.confidence is not None for s in steps for r in s.requests)
    text = write_report(load_inputs([tmp_path / "run"]), tmp_path / "report").read_text()
    assert "## Calibration" in text and "## Predicted tau" not in text
    assert "no planner ran (static verification)" in text and "no survival" not in text
