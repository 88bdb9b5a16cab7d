"""`dspark bench --sweep` and the two `dspark serve` flags it runs its baselines with.

- Mistakes on the command line: one `dspark bench: error: ...` line naming the flag, exit 2, no traceback,
  before any server starts; a server that never comes up: its output's tail, exit 1, nothing left running.
- The table, JSON and PNG of synthetic results.
- `--target-only` and `--fixed-verify-len K` serve the same greedy completions as target-only decoding.
- One small real sweep on the embedded CPU packages: every point, tok/s > 0, every policy's texts equal to
  target-only's (speculation is lossless).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from dspark.bench import servers as servers_module
from dspark.bench import sweep as sweep_module
from dspark.bench.client import BenchConfig, RequestOutcome, summarize
from dspark.bench.sweep import (
    Load,
    RequestRecord,
    ServerProcess,
    ServerRun,
    SweepConfig,
    SweepError,
    SweepPackage,
    SweepPoint,
    SweepResult,
    SweepUsageError,
    machine_info,
    plan_runs,
    run_sweep,
)
from dspark.bench.sweep_output import format_table, write_outputs
from dspark.cli.main import main
from dspark.runtime.engine.requests import RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import GeneratedPackage, load_package
from dspark.runtime.serve.server import CompletionServer

from .runtime_helpers import REPO
from .server_helpers import serving_in_process

COMPACT = REPO / "generated" / "tiny_cpu_compact"
STATIC = REPO / "generated" / "tiny_cpu_static"
COMPACT_PKG = SweepPackage(COMPACT, "tiny_cpu_compact", "compact", 8)
STATIC_PKG = SweepPackage(STATIC, "tiny_cpu_static", "static", 8)


# -- argument errors ------------------------------------------------------------------------------------
def _bench_fails(argv: list[str], capsys: pytest.CaptureFixture[str], status: int, *says: str) -> str:
    assert main(["bench", *argv]) == status
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("dspark bench: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not captured.out
    for text in says:
        assert text in err, err
    return err


SWEEP = ["--sweep", str(COMPACT), str(STATIC)]


@pytest.mark.parametrize(("argv", "says"), [
    ([*SWEEP, "--policies", "target-only,speculative"], ("--policies", "unknown policy 'speculative'",
                                                          "target-only, static, fixed, adaptive")),
    ([*SWEEP, "--policies", ","], ("--policies needs at least one",)),
    ([*SWEEP, "--concurrency-list", "1,x"], ("--concurrency-list must be comma-separated positive integers",
                                             "'1,x'")),
    ([*SWEEP, "--concurrency-list", "0,4"], ("--concurrency-list", "'0,4'")),
    ([*SWEEP, "--concurrency-list", ""], ("--concurrency-list",)),
    ([*SWEEP, "--concurrency-list", "2.5"], ("--concurrency-list",)),
    ([*SWEEP, "--request-rates", "0"], ("--request-rates must be comma-separated positive",)),
    ([*SWEEP, "--request-rates", "inf"], ("--request-rates",)),
    ([*SWEEP, "--request-rates", "nan"], ("--request-rates",)),
    ([*SWEEP, "--fixed-k", "1,9"], ("--fixed-k", "k = 9 is outside 1..8", "tiny_cpu_compact")),
    ([*SWEEP, "--fixed-k", "0"], ("--fixed-k must be comma-separated positive integers",)),
    ([*SWEEP, "--policies", "adaptive", "--fixed-k", "2"], ("--fixed-k", "add fixed to --policies")),
    ([*SWEEP, "--concurrency", "4"], ("--concurrency is for --url", "--concurrency-list")),
    ([*SWEEP, "--request-rate", "2"], ("--request-rate is for --url", "--request-rates")),
    ([*SWEEP, "--model", "x"], ("--model is for --url",)),
    ([*SWEEP, "--temperature", "0.8"], ("--temperature", "greedily")),
    ([*SWEEP, "--num-prompts", "0"], ("--num-prompts must be at least 1",)),
    ([*SWEEP, "--max-tokens", "0"], ("--max-tokens must be at least 1",)),
    ([*SWEEP, "--server-timeout", "0"], ("--server-timeout must be a positive",)),
    (["--sweep", str(COMPACT), str(COMPACT)], ("--sweep takes at most one static package and one compact",)),
    (["--sweep", str(COMPACT), "--policies", "static"], ("--policies static needs a static package",
                                                         "add one to --sweep")),
    (["--sweep", str(STATIC), "--policies", "adaptive"], ("--policies adaptive needs a compact or "
                                                          "cap-accept package",)),
    (["--url", "http://127.0.0.1:1", "--concurrency-list", "1,2"], ("--concurrency-list belongs to a sweep",
                                                                    "--sweep PACKAGE")),
    (["--url", "http://127.0.0.1:1", "--policies", "adaptive"], ("--policies belongs to a sweep",)),
])
def test_bad_sweep_arguments_are_one_line_and_status_2(argv: list[str], says: Sequence[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _bench_fails(argv, capsys, 2, *says)


def test_a_path_that_is_not_a_generated_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bench_fails(["--sweep", str(tmp_path / "missing")], capsys, 2, "--sweep", "no such directory")
    _bench_fails(["--sweep", str(COMPACT), str(tmp_path)], capsys, 2, "--sweep",
                 "is not a generated dspark package", "dspark-compile build")
    (tmp_path / "file.txt").write_text("x")
    _bench_fails(["--sweep", str(tmp_path / "file.txt")], capsys, 2, "--sweep", "is a file")


def test_out_must_be_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("x")
    _bench_fails([*SWEEP, "--out", str(tmp_path / "taken")], capsys, 2, "--out", "is a file")


def test_a_sweep_failure_is_one_line_and_status_1(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def fails(*_: object, **__: object) -> SweepResult:
        raise SweepError("the adaptive server (dspark serve x) exited with status 3 before it answered on "
                         "port 1; its output ends: boom")

    monkeypatch.setattr("dspark.cli.bench.run_sweep", fails)
    _bench_fails([*SWEEP, "--no-progress"], capsys, 1, "exited with status 3", "boom")


# -- which servers run ---------------------------------------------------------------------------------
def test_the_default_policies_are_every_one_the_packages_allow() -> None:
    runs, notes = plan_runs([COMPACT_PKG, STATIC_PKG])
    assert [r.policy for r in runs] == ["target-only", "static", *(f"fixed-{k}" for k in range(1, 9)),
                                        "adaptive"]
    assert not notes
    by_policy = {r.policy: r for r in runs}
    assert by_policy["target-only"].package == COMPACT_PKG and by_policy["target-only"].flags == (
        "--target-only",)
    assert by_policy["static"].package == STATIC_PKG and by_policy["static"].flags == ()
    assert by_policy["fixed-3"].flags == ("--fixed-verify-len", "3")
    assert by_policy["adaptive"].package == COMPACT_PKG and by_policy["adaptive"].flags == ()
    command = by_policy["fixed-3"].command(4321, "python")
    assert command[:4] == ["python", "-m", "dspark", "serve"] and command[-2:] == ["--fixed-verify-len", "3"]
    assert "--port" in command and "4321" in command


def test_a_missing_package_skips_its_policies_with_a_note() -> None:
    runs, notes = plan_runs([COMPACT_PKG], fixed_k=[8, 1, 8])
    assert [r.policy for r in runs] == ["target-only", "fixed-1", "fixed-8", "adaptive"]
    assert notes == ["static: skipped, no static package given to --sweep"]
    runs, notes = plan_runs([STATIC_PKG])
    assert [(r.policy, r.package) for r in runs] == [("target-only", STATIC_PKG), ("static", STATIC_PKG)]
    assert len(notes) == 2 and all("no compact or cap-accept package" in n for n in notes)
    with pytest.raises(SweepUsageError, match="no policy left"):
        SweepConfig(packages=(STATIC_PKG,), runs=())


def test_requests_per_load_are_at_least_two_per_slot() -> None:
    runs, _ = plan_runs([COMPACT_PKG], ["adaptive"])
    config = SweepConfig((COMPACT_PKG,), tuple(runs), (1, 16, 64), (2.0,), num_prompts=64)
    assert [config.requests_at(load) for load in config.loads] == [64, 64, 128, 64]
    assert config.pool_size == 128
    assert [load.label for load in config.loads] == ["c=1", "c=16", "c=64", "2 req/s"]


# -- table, JSON and PNG of synthetic results ------------------------------------------------------------
def _point(policy: str, load: Load, tok_s: float, texts: Sequence[str] = ("ab", "cd"), tokens: int = 10,
           steps: int | None = 5, failed: int = 0) -> SweepPoint:
    outcomes = [RequestOutcome(index=i, latency=0.1 + 0.01 * i, ttft=0.02, chunk_gaps=(0.01,), text_chunks=2,
                               prompt_tokens=3, completion_tokens=tokens, decode_steps=steps,
                               finish_reason="length", text=text) for i, text in enumerate(texts)]
    outcomes += [RequestOutcome(index=len(texts) + i, error="HTTP 500: boom", latency=0.1)
                 for i in range(failed)]
    duration = tokens * len(texts) / tok_s
    concurrency = int(load.value) if load.kind == "concurrency" else None
    config = BenchConfig(url="http://127.0.0.1:1", num_prompts=len(outcomes), concurrency=concurrency,
                         request_rate=load.value if load.kind == "rate" else math.inf, max_tokens=tokens,
                         ignore_eos=True)
    result = summarize(config, "tiny_cpu_compact", outcomes, duration, concurrency or len(outcomes))
    return SweepPoint(policy, "tiny_cpu_compact", load, result,
                      tuple(RequestRecord.of(o, len(texts)) for o in outcomes))


C1, C8, RATE = Load("concurrency", 1), Load("concurrency", 8), Load("rate", 4.0)


def _synthetic(points: Sequence[SweepPoint], notes: tuple[str, ...] = ()) -> SweepResult:
    runs, _ = plan_runs([COMPACT_PKG, STATIC_PKG], fixed_k=[1, 8])
    config = SweepConfig((COMPACT_PKG, STATIC_PKG), tuple(runs), (1, 8), (4.0,), num_prompts=2, max_tokens=10,
                         notes=notes, command="dspark bench --sweep a b")
    return SweepResult(config, ("p0", "p1"), tuple(points), "2025-01-01T00:00:00+00:00",
                       "2025-01-01T00:01:00+00:00", machine_info())


def test_the_table_has_a_row_per_load_a_group_per_policy_and_the_ratio() -> None:
    result = _synthetic([
        _point("target-only", C1, 100), _point("target-only", C8, 400), _point("target-only", RATE, 300),
        _point("fixed-1", C1, 80), _point("fixed-1", C8, 500), _point("fixed-8", C1, 200),
        _point("fixed-8", C8, 450), _point("adaptive", C1, 300), _point("adaptive", C8, 600),
    ], notes=("static: skipped, no static package given to --sweep",))
    assert result.ratio(C1) == pytest.approx(300 / 200)
    assert result.ratio(C8) == pytest.approx(600 / 500)
    assert result.ratio(RATE) is None  # no adaptive point at that load
    table = format_table(result)
    lines = table.splitlines()
    header = next(line for line in lines if "target-only" in line and "|" in line)
    for title in ("target-only", "fixed k=1", "fixed k=8", "adaptive", "adaptive /"):
        assert title in header
    assert header.index("target-only") < header.index("fixed k=1") < header.index("adaptive")
    rows = {line.split("|")[0].strip(): line for line in lines if line.startswith(("c=", "4 req/s"))}
    assert list(rows) == ["c=1", "c=8", "4 req/s"]
    assert rows["c=1"].rstrip().endswith("1.50x") and rows["c=8"].rstrip().endswith("1.20x")
    assert rows["4 req/s"].rstrip().endswith("-")
    cells = [c.split() for c in rows["c=1"].split("|")[1:-1]]
    assert len(cells) == 4 and all(len(c) == 5 for c in cells)
    assert cells[0][0] == "100.0" and cells[0][4] == "2.00"  # tok/s, tokens per decode step (10 / 5)
    assert cells[0][3] == "20.00"  # TTFT p50 in ms
    assert "note: static: skipped" in table
    assert "greedy outputs identical to target-only's: 4 of 4 policies" in table


def test_differing_outputs_and_failed_requests_are_called_out() -> None:
    result = _synthetic([_point("target-only", C1, 100), _point("adaptive", C1, 120, texts=("ab", "XX"),
                                                                failed=1)])
    checks = {c.policy: c for c in result.lossless()}
    assert checks["target-only"].identical and checks["target-only"].compared == 2
    assert checks["adaptive"].mismatched == 1 and checks["adaptive"].compared == 2
    assert "prompt 1" in (checks["adaptive"].first_mismatch or "")
    table = format_table(result)
    assert "1 of 2 policies -- DIFFER: adaptive 1/2" in table
    assert "WARNING: 1 requests failed" in table
    assert result.failed_requests == 1


def test_the_json_and_png_hold_every_point(tmp_path: Path) -> None:
    points = [_point(p, load, 100 + i) for i, (p, load) in enumerate(
        (p, load) for p in ("target-only", "fixed-1", "fixed-8", "adaptive") for load in (C1, C8, RATE))]
    result = _synthetic(points)
    table = format_table(result)
    written = write_outputs(result, tmp_path / "out", table)
    assert [p.name for p in written] == ["sweep.json", "sweep.txt", "sweep.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sweep.json", "sweep.png", "sweep.txt"]
    assert (tmp_path / "out" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "sweep.txt").read_text() == table + "\n"
    data = json.loads((tmp_path / "out" / "sweep.json").read_text())
    for key in ("command", "argv", "started", "finished", "machine", "packages", "servers", "settings",
                "prompts", "ratios", "lossless", "points"):
        assert key in data, key
    assert data["command"] == "dspark bench --sweep a b"
    assert data["machine"]["cpu_count"] == os.cpu_count() and data["machine"]["platform"]
    assert [p["name"] for p in data["packages"]] == ["tiny_cpu_compact", "tiny_cpu_static"]
    assert len(data["points"]) == 12
    point = data["points"][0]
    assert point["policy"] == "target-only" and point["load"] == {"kind": "concurrency", "value": 1,
                                                                  "label": "c=1"}
    assert point["output_throughput"] == pytest.approx(100)
    assert point["tpot"]["p50_ms"] > 0 and point["mean_accepted_tokens_per_step"] == 2.0
    assert point["requests"][1]["text"] == "cd" and point["requests"][1]["prompt_index"] == 1
    assert data["points"][2]["request_rate"] == 4.0 and data["points"][2]["load"]["label"] == "4 req/s"
    assert all(check["identical"] for check in data["lossless"])


# -- the server process ----------------------------------------------------------------------------------
def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable that takes the place of the interpreter in `python -m dspark serve ... --port P`."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\nimport os, sys, signal, time\n"
                    "port = int(sys.argv[sys.argv.index('--port') + 1])\n" + body)
    path.chmod(0o755)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


RUN = ServerRun("adaptive", COMPACT_PKG)


def test_a_server_that_exits_is_reported_with_its_output(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "print('loading the checkpoint', file=sys.stderr)\n"
                                    "print('ValueError: no such checkpoint', file=sys.stderr)\nsys.exit(3)\n")
    config = SweepConfig((COMPACT_PKG,), (RUN,), (1,), server_timeout_s=30)
    with pytest.raises(SweepError) as info:
        run_sweep(config, ["x"], python=python)
    message = str(info.value)
    assert "the adaptive server (dspark serve" in message and "exited with status 3" in message
    assert "loading the checkpoint | ValueError: no such checkpoint" in message and "\n" not in message


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    python = _fake_python(tmp_path, f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                    "print('still loading', file=sys.stderr, flush=True)\ntime.sleep(120)\n")
    config = SweepConfig((COMPACT_PKG,), (RUN,), (1,), server_timeout_s=1)
    with pytest.raises(SweepError, match=r"did not answer GET /health on port \d+ within 1 s; its output "
                                         r"ends: still loading; pass a larger --server-timeout"):
        run_sweep(config, ["x"], python=python)
    assert not _alive(int(pid_file.read_text()))


HEALTHY = ("from http.server import BaseHTTPRequestHandler, HTTPServer\n"
           "class H(BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
           "    def log_message(self, *a): pass\n")


@pytest.mark.parametrize("ignores_sigint", [False, True])
def test_the_server_is_stopped_on_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         ignores_sigint: bool) -> None:
    body = HEALTHY + ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if ignores_sigint else "")
    python = _fake_python(tmp_path, body + "HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    monkeypatch.setattr(servers_module, "STOP_GRACE_S", 0.5)  # a server deaf to SIGINT gets SIGTERM soon
    pid = 0
    with pytest.raises(KeyboardInterrupt), ServerProcess(RUN, 30, python) as server:
        assert server.proc is not None
        pid = server.proc.pid
        assert httpx.get(server.url + "/health", timeout=5, trust_env=False).status_code == 200
        raise KeyboardInterrupt
    assert pid and not _alive(pid)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are installed from the main thread only")
def test_sigterm_becomes_an_interrupt_while_the_sweep_runs() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sweep_module.termination_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes
            pass
    assert signal.getsignal(signal.SIGTERM) == previous


# -- dspark serve --target-only / --fixed-verify-len ------------------------------------------------------
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def compact() -> GeneratedPackage:
    return load_package(COMPACT)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["import os\nimport sys\n\ndef main(", "class Parser:\n    def __init__(self, text):\n"]


@pytest.fixture(scope="module")
def reference(compact: GeneratedPackage, prompts: list[str]) -> list[str]:
    runtime = Runtime(compact)
    ids = [compact.tokenizer.encode(p) for p in prompts]
    outputs, _ = runtime.generate(ids, MAX_TOKENS, target_only=True)
    return [compact.tokenizer.decode(o) for o in outputs]


def _served(runtime: Runtime, prompts: list[str]) -> list[dict[str, object]]:
    with serving_in_process(CompletionServer(runtime)) as (_, url):
        with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
            bodies = [client.post("/v1/completions", json={
                "model": runtime.deployment.name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}).json() for p in prompts]
    return bodies


def _texts(bodies: list[dict[str, object]]) -> list[str]:
    return [body["choices"][0]["text"] for body in bodies]  # type: ignore[index]


def _steps(body: dict[str, object]) -> int:
    return body["usage"]["dspark"]["decode_steps"]  # type: ignore[index]


def test_a_target_only_server_decodes_without_speculation(compact: GeneratedPackage, prompts: list[str],
                                                          reference: list[str]) -> None:
    runtime = Runtime(compact)
    runtime.target_only = True  # what `dspark serve --target-only` sets after building the runtime
    bodies = _served(runtime, prompts)
    assert _texts(bodies) == reference
    # one token per decode step, after the first from the prefill
    assert all(_steps(b) == MAX_TOKENS - 1 for b in bodies)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_fixed_verify_len_server_is_lossless_and_verifies_k_rows(
        compact: GeneratedPackage, prompts: list[str], reference: list[str], k: int) -> None:
    runtime = Runtime(compact, fixed_verify_len=k)
    schedule = runtime.plan.schedule  # type: ignore[attr-defined]
    assert schedule.floor == schedule.cap == k
    bodies = _served(runtime, prompts)
    assert _texts(bodies) == reference
    # at most k tokens per step (k - 1 accepted drafts and the bonus token)
    assert all(_steps(b) >= math.ceil((MAX_TOKENS - 1) / k) for b in bodies)
    if k == 1:
        assert all(_steps(b) == MAX_TOKENS - 1 for b in bodies)


def test_the_runtime_refuses_a_fixed_verify_len_that_cannot_apply(compact: GeneratedPackage) -> None:
    with pytest.raises(RequestError, match="needs a cap-accept or compact deployment"):
        Runtime(load_package(STATIC), fixed_verify_len=2)
    for k in (0, 9):
        with pytest.raises(RequestError, match=rf"must be in 1..N = 8, got {k}"):
            Runtime(compact, fixed_verify_len=k)


def test_dspark_serve_refuses_a_fixed_verify_len_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in (([str(STATIC), "--fixed-verify-len", "2"], "--fixed-verify-len needs a cap-accept or "
                                                                  "compact build; tiny_cpu_static"),
                       ([str(COMPACT), "--fixed-verify-len", "9"], "--fixed-verify-len must be in 1..8")):
        assert main(["serve", *argv, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dspark: error: ") and err.count("\n") == 1 and says in err, err
    with pytest.raises(SystemExit):  # argparse: the two baselines exclude each other
        main(["serve", str(COMPACT), "--target-only", "--fixed-verify-len", "2"])
    assert "not allowed with argument" in capsys.readouterr().err


# -- a real sweep -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_small_real_sweep_is_complete_and_lossless(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    max_tokens = 12
    status = main(["bench", "--sweep", str(COMPACT), "--concurrency-list", "1,4", "--policies",
                   "target-only,fixed,adaptive", "--fixed-k", "1,8", "--num-prompts", "4", "--max-tokens",
                   str(max_tokens), "--out", str(tmp_path), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "greedy outputs identical to target-only's: 4 of 4 policies" in captured.out
    assert "note:" not in captured.out  # static was not asked for: nothing skipped
    assert (tmp_path / "sweep.txt").read_text() == captured.out
    assert (tmp_path / "sweep.png").stat().st_size > 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    points = {(p["policy"], p["load"]["label"]): p for p in data["points"]}
    assert sorted(points) == sorted((policy, load) for policy in ("target-only", "fixed-1", "fixed-8",
                                                                  "adaptive") for load in ("c=1", "c=4"))
    reference: dict[int, str] = {}
    for p in data["points"]:
        if p["policy"] == "target-only":
            reference.update({r["prompt_index"]: r["text"] for r in p["requests"]})
    assert len(reference) == 8  # c=4 sends 2 per slot: 8 distinct prompts
    for (policy, load), p in points.items():
        assert p["output_throughput"] > 0 and p["failed"] == 0 and p["completed"] == len(p["requests"])
        assert len(p["requests"]) == {"c=1": 4, "c=4": 8}[load]
        assert p["peak_in_flight"] <= int(load.removeprefix("c="))
        for r in p["requests"]:
            assert r["completion_tokens"] == max_tokens, (policy, load, r)  # ignore_eos: a fixed length
            assert r["text"] == reference[r["prompt_index"]], (policy, load, r["prompt_index"])
        per_step = p["mean_accepted_tokens_per_step"]
        if policy in ("target-only", "fixed-1"):  # one token per decode step after the prefill's
            assert per_step == pytest.approx(max_tokens / (max_tokens - 1))
    assert all(check["identical"] for check in data["lossless"])
    assert data["servers"][0] == {"policy": "target-only", "package": "tiny_cpu_compact",
                                  "serve_flags": ["--target-only"]}


def test_help_names_the_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in ("--sweep", "--concurrency-list", "--request-rates", "--policies", "--fixed-k", "--out",
                 "--rounds"):
        assert flag in text


def test_rounds_interleave_every_policy_with_every_server_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []  # ("warm" or "point", policy), in the order they ran
    warm, point = sweep_module._warm, sweep_module._point

    def recorded_warm(server: sweep_module.ServerProcess, *args: object) -> None:
        calls.append(("warm", server.run.policy))
        warm(server, *args)  # type: ignore[arg-type]

    def recorded_point(server: sweep_module.ServerProcess, *args: object) -> SweepPoint:
        calls.append(("point", server.run.policy))
        return point(server, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sweep_module, "_warm", recorded_warm)
    monkeypatch.setattr(sweep_module, "_point", recorded_point)
    status = main(["bench", "--sweep", str(COMPACT), "--concurrency-list", "1,2", "--policies",
                   "target-only,fixed,adaptive", "--fixed-k", "8", "--num-prompts", "2", "--max-tokens", "6",
                   "--rounds", "2", "--out", str(tmp_path), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "2 rounds, every server up" in captured.out
    assert "greedy outputs identical to target-only's: 3 of 3 policies" in captured.out
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["settings"]["rounds"] == 2 and "--rounds 2" in data["command"]
    order = [(p["round"], p["load"]["label"], p["policy"]) for p in data["points"]]
    policies = ["target-only", "fixed-8", "adaptive"]
    expected = []
    for round_index in range(2):
        cycle = policies if round_index % 2 == 0 else policies[::-1]
        for load_index, load in enumerate(("c=1", "c=2")):
            shift = (round_index + load_index) % 3
            expected += [(round_index, load, p) for p in cycle[shift:] + cycle[:shift]]
    # every (policy, load) once a round, the order rotated, and backwards in the odd rounds
    assert order == expected
    assert order[:2] == [(0, "c=1", "target-only"), (0, "c=1", "fixed-8")]
    assert order[6:8] == [(1, "c=1", "fixed-8"), (1, "c=1", "target-only")]  # now fixed-8 goes first
    # every timed point right after a warm-up burst of its own server, never after another server's run
    assert calls == [c for p in order for c in (("warm", p[2]), ("point", p[2]))]


def test_a_point_of_several_rounds_is_its_median_round() -> None:
    def point(policy: str, tok_s: float, round_index: int) -> SweepPoint:
        return dataclasses.replace(_point(policy, C1, tok_s), round=round_index)

    points = [point("fixed-8", 100.0, 0), point("adaptive", 90.0, 0), point("fixed-8", 300.0, 1),
              point("adaptive", 120.0, 1), point("fixed-8", 110.0, 2), point("adaptive", 105.0, 2)]
    result = _synthetic(points)
    assert result.point("fixed-8", C1).output_throughput == pytest.approx(110.0)  # type: ignore[union-attr]
    assert result.point("adaptive", C1).output_throughput == pytest.approx(105.0)  # type: ignore[union-attr]
    # the ratio pairs the two policies round by round: 0.9, 0.4, 0.9545 -> 0.9
    assert result.ratio(C1) == pytest.approx(0.9)
    assert result.ratio_interval(C1) is None  # three rounds: too few for an interval
    assert [p["round"] for p in result.to_json()["points"]] == [0, 0, 1, 1, 2, 2]


def _rounds(rows: Sequence[tuple[str, Sequence[float]]], load: Load = C1) -> list[SweepPoint]:
    return [dataclasses.replace(_point(policy, load, tok_s), round=r)
            for policy, values in rows for r, tok_s in enumerate(values)]


def test_the_paired_ratio_is_unmoved_by_a_machine_that_drifts_between_rounds() -> None:
    speed = [1.0, 0.6, 1.3, 0.8, 1.1]  # the whole machine slower or faster from one round to the next
    result = _synthetic(_rounds([("fixed-8", [200 * s for s in speed]),
                                 ("target-only", [100 * s for s in speed]),
                                 ("adaptive", [196 * s for s in speed])]))
    assert result.best_base(C1) == "fixed-8"
    assert result.ratio(C1) == pytest.approx(0.98)
    lo, hi = result.ratio_interval(C1)  # type: ignore[misc]
    assert lo == pytest.approx(0.98) and hi == pytest.approx(0.98)  # the drift cancels in every round


def test_the_interval_covers_the_ratio_and_is_reproducible() -> None:
    result = _synthetic(_rounds([("fixed-8", [200, 210, 190, 205, 195, 200]),
                                 ("adaptive", [180, 230, 185, 200, 210, 190])]))
    interval = result.ratio_interval(C1)
    assert interval is not None
    lo, hi = interval
    ratio = result.ratio(C1)
    assert ratio is not None and lo < ratio < hi and lo < 1 < hi
    assert result.ratio_interval(C1) == interval  # a fixed seed: the table is reproducible from the points
    data = result.to_json()
    assert tuple(data["ratio_intervals"]["c=1"]) == interval
    assert data["best_bases"]["c=1"] == "fixed-8" and "twin_ratios" not in data
    row = next(line for line in format_table(result).splitlines() if line.startswith("c=1"))
    assert row.endswith(f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}]")


def test_a_twin_is_a_second_adaptive_server_and_never_a_baseline() -> None:
    runs, _ = plan_runs([COMPACT_PKG], ["fixed", "adaptive"], fixed_k=[8], twin=True)
    assert [(r.policy, r.package, r.flags) for r in runs][-2:] == [("adaptive", COMPACT_PKG, ()),
                                                                   ("adaptive-twin", COMPACT_PKG, ())]
    with pytest.raises(SweepUsageError, match="--twin .* needs the adaptive policy"):
        plan_runs([COMPACT_PKG], ["fixed"], fixed_k=[8], twin=True)
    # the twin is faster than every baseline here, yet the best base stays fixed-8
    result = _synthetic(_rounds([("fixed-8", [200, 200, 200, 200]), ("adaptive", [190, 194, 198, 202]),
                                 ("adaptive-twin", [250, 250, 250, 250])]))
    assert result.best_base(C1) == "fixed-8"
    assert result.ratio(C1) == pytest.approx(0.98)
    assert result.ratio(C1, "adaptive-twin") == pytest.approx(1.25)
    assert result.to_json()["twin_ratios"]["c=1"] == pytest.approx(1.25)
    table = format_table(result)
    header = next(line for line in table.splitlines() if "adaptive /" in line)
    assert "twin /" in header and header.index("adaptive /") < header.index("twin /")
    row = next(line for line in table.splitlines() if line.startswith("c=1"))
    assert row.split("|")[-1].strip().startswith("1.25x [")
    assert "twin = a second adaptive server" in table


def test_twin_is_a_sweep_flag(capsys: pytest.CaptureFixture[str]) -> None:
    _bench_fails(["--url", "http://127.0.0.1:1", "--twin"], capsys, 2, "--twin belongs to a sweep")
    _bench_fails(["--sweep", str(STATIC), "--twin"], capsys, 2, "--twin", "needs the adaptive policy")


def test_rounds_below_one_are_refused() -> None:
    runs, _ = plan_runs([COMPACT_PKG], ["adaptive"])
    with pytest.raises(SweepUsageError, match="--rounds must be >= 1"):
        SweepConfig((COMPACT_PKG,), tuple(runs), rounds=0)
