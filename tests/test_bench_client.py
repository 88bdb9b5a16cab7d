"""`dspark bench` against a real HTTP server: a small FastAPI app served by uvicorn in a background thread.

The app implements the OpenAI completions contract the bench client relies on, with injected delays and
token counts, and records what it saw (request bodies, arrival times, requests in flight). Timing checks are
lower bounds and orderings only: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from dspark import corpus as prompt_sets
from dspark.bench.client import (
    BenchConfig,
    BenchResult,
    RequestOutcome,
    StreamError,
    arrival_offsets,
    benchmark,
    format_result,
    percentile,
    summarize,
)
from dspark.bench.stream import SseParser, StreamTracker
from dspark.cli.bench import add_bench_parser, run_bench

MODEL = "fake-model"
OTHER_MODEL = "other-model"
SLACK_S = 0.005  # asyncio timers may fire this much early on a coarse clock; never later is not assumed


@dataclass
class Behaviour:
    first_delay: float = 0.0  # after the empty opening chunk, before the first text chunk
    chunk_delay: float = 0.0  # between text chunks
    tokens_per_chunk: int = 2  # tokens committed per "decode step", one chunk per step
    report_steps: bool = True  # usage.dspark.decode_steps


@dataclass
class FakeServer:
    url: str = ""
    behaviour: Behaviour = field(default_factory=Behaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each completion request
    models_at: list[float] = field(default_factory=list)  # ... and of each /v1/models request
    in_flight: int = 0
    peak: int = 0

    def reset(self, **behaviour: Any) -> FakeServer:
        self.behaviour = Behaviour(**behaviour)
        self.bodies.clear()
        self.arrivals.clear()
        self.models_at.clear()
        self.in_flight = self.peak = 0
        return self

    def enter(self, body: dict[str, Any]) -> None:
        self.arrivals.append(time.monotonic())
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        b, prompt, max_tokens = self.behaviour, body["prompt"], body["max_tokens"]
        try:
            yield _sse(_chunk(""))  # an opening chunk without text must not count as the first token
            await asyncio.sleep(b.first_delay)
            if prompt == "garbage":
                yield "data: {not json\n\n"
                return
            sent = steps = 0
            while sent < max_tokens:
                if steps:
                    await asyncio.sleep(b.chunk_delay)
                n = min(b.tokens_per_chunk, max_tokens - sent)
                sent, steps = sent + n, steps + 1
                yield _sse(_chunk("x" * n, "length" if sent == max_tokens else None))
                if prompt == "drop":
                    raise RuntimeError("connection dropped on purpose")  # uvicorn closes it mid-body
        finally:
            # Out of flight before the last events: the server's count never exceeds the client's.
            self.leave()
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": sent,
                                 "total_tokens": len(prompt) + sent}
        if b.report_steps:
            usage["dspark"] = {"decode_steps": steps}
        yield _sse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL, "choices": [],
                    "usage": usage})
        yield "data: [DONE]\n\n"


def _chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(server: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        server.models_at.append(time.monotonic())
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "test"}
                                           for m in (MODEL, OTHER_MODEL)]}

    @app.get("/html/v1/models")
    async def html_page() -> HTMLResponse:  # something that is not an OpenAI server, at a base URL
        return HTMLResponse("<html><body>hello</body></html>")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        server.enter(body)
        if body["prompt"].startswith("error:"):
            server.leave()
            error = {"message": body["prompt"][len("error:"):].strip(), "type": "invalid_request_error",
                     "param": "prompt", "code": None}
            return JSONResponse({"error": error}, status_code=400)
        return StreamingResponse(server.stream(body), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def live_server() -> Iterator[FakeServer]:
    fake = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the bound socket goes to uvicorn: no race for a free port
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(build_app(fake), log_level="critical", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    yield fake
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def server(live_server: FakeServer) -> FakeServer:
    return live_server.reset()


def _run(server: FakeServer, prompts: list[str], **config: Any) -> BenchResult:
    config.setdefault("num_prompts", len(prompts))
    return benchmark(BenchConfig(url=server.url, progress=False, **config), prompts)


# -- against the server --------------------------------------------------------------------------
def test_counts_tokens_steps_and_request_body(server: FakeServer) -> None:
    server.reset(tokens_per_chunk=3)
    prompts = ["def f(", "class A:", "import os\n"]
    r = _run(server, prompts, num_prompts=4, max_tokens=10)
    assert (r.completed, r.failed, r.errors) == (4, 0, ())
    assert r.model == MODEL  # from /v1/models
    assert r.total_completion_tokens == 40
    assert r.total_prompt_tokens == sum(len(p) for p in prompts) + len(prompts[0])  # the pool cycles
    assert r.total_decode_steps == 16  # 3 + 3 + 3 + 1 tokens per request
    assert r.mean_accepted_tokens_per_step == pytest.approx(40 / 16)
    assert r.mean_tokens_per_chunk == pytest.approx(40 / 16)
    assert r.finish_reasons == {"length": 4}
    assert r.output_throughput == pytest.approx(40 / r.duration_s)
    assert r.total_token_throughput == pytest.approx((40 + r.total_prompt_tokens) / r.duration_s)
    assert r.request_throughput == pytest.approx(4 / r.duration_s)
    assert sorted(b["prompt"] for b in server.bodies) == sorted(prompts + prompts[:1])
    body = server.bodies[0]
    assert body["model"] == MODEL and body["max_tokens"] == 10 and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body


def test_latencies_follow_the_injected_delays(server: FakeServer) -> None:
    first, gap = 0.15, 0.05
    server.reset(first_delay=first, chunk_delay=gap, tokens_per_chunk=2)
    r = _run(server, ["p"] * 4, max_tokens=8)  # 4 chunks: the first after `first`, then 3 gaps
    assert r.completed == 4
    assert r.ttft is not None and r.tpot is not None and r.e2e_latency is not None and r.chunk_gap is not None
    assert r.ttft.count == 4 and r.tpot.count == 4 and r.e2e_latency.count == 4 and r.chunk_gap.count == 12
    for stats in (r.ttft, r.tpot, r.e2e_latency, r.chunk_gap):
        assert 0 < stats.p50_ms <= stats.p99_ms
    # Lower bounds: a response can be late but never early.
    ms = 1e3
    assert r.ttft.p50_ms >= (first - SLACK_S) * ms
    assert r.chunk_gap.p50_ms >= (gap - SLACK_S) * ms
    assert r.e2e_latency.p50_ms >= (first + 3 * gap - SLACK_S) * ms
    assert r.tpot.p50_ms >= (3 * gap - SLACK_S) / 7 * ms  # (end − first token) / (8 − 1)
    assert r.ttft.mean_ms < r.e2e_latency.mean_ms
    assert r.duration_s >= first + 3 * gap - SLACK_S


def test_concurrency_is_never_exceeded(server: FakeServer) -> None:
    server.reset(chunk_delay=0.03, tokens_per_chunk=1)
    r = _run(server, ["p"] * 12, max_tokens=4, concurrency=3)
    assert r.completed == 12
    assert server.peak <= 3 and r.peak_in_flight <= 3
    assert server.peak >= 2  # the limit was actually reached (not a sequential client)
    server.reset(chunk_delay=0.03, tokens_per_chunk=1)
    r = _run(server, ["p"] * 8, max_tokens=4)  # unlimited: all at once
    assert r.completed == 8 and server.peak > 3 and r.concurrency is None


def test_request_rate_spaces_arrivals(server: FakeServer) -> None:
    rate, n, seed = 10.0, 5, 1
    expected = arrival_offsets(n, rate, seed)
    assert expected[-1] > 0.2  # the schedule is spread out: the check below means something
    _run(server, ["p"] * n, request_rate=rate, seed=seed, max_tokens=2)
    # Requests start after /v1/models answered, and none may leave before its scheduled time.
    (start,) = server.models_at
    observed = sorted(t - start for t in server.arrivals)
    assert all(o >= e - SLACK_S for o, e in zip(observed, expected, strict=True)), (observed, expected)


def test_failures_are_counted_and_reported(server: FakeServer) -> None:
    prompts = ["ok", "error: prompt too long", "drop", "garbage", "ok"]
    r = _run(server, prompts, concurrency=2, max_tokens=4)
    assert (r.completed, r.failed) == (2, 3)
    assert r.total_completion_tokens == 8  # only successful requests count
    assert r.errors[0] == "request 1: HTTP 400: prompt too long"
    assert r.errors[1].startswith("request 2: ")  # the dropped connection, named by httpx's error type
    assert "Error" in r.errors[1]
    assert r.errors[2].startswith("request 3: malformed SSE data")
    text = format_result(r)
    assert "failed requests" in text and "prompt too long" in text and "malformed SSE" in text


def test_run_bench_json_cli(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(["alpha\nbeta", "gamma"]))
    args = _parse(["--url", server.url + "/v1/", "--num-prompts", "3", "--max-tokens", "5", "--concurrency",
                   "2", "--json", "--no-progress", "--ignore-eos", "--prompts-file", str(prompts_file)])
    assert run_bench(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 3 and out["failed"] == 0 and out["errors"] == []
    assert out["model"] == MODEL and out["url"] == server.url and out["request_rate"] is None
    assert out["total_completion_tokens"] == 15
    assert out["mean_accepted_tokens_per_step"] == pytest.approx(15 / 9)  # 2 + 2 + 1 per request
    assert set(out["ttft"]) == {"count", "mean_ms", "p50_ms", "p99_ms"}
    assert sorted(b["prompt"] for b in server.bodies) == ["alpha\nbeta", "alpha\nbeta", "gamma"]
    assert all(b["ignore_eos"] is True for b in server.bodies)


def test_run_bench_text_with_held_out_prompts(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.reset(report_steps=False)
    assert run_bench(_parse(["--url", server.url, "--num-prompts", "2", "--max-tokens", "3",
                             "--model", OTHER_MODEL, "--no-progress"])) == 0
    out = capsys.readouterr().out
    assert "successful requests" in out and "TTFT" in out and "inter-chunk gap" in out
    assert "n/a (no usage.dspark.decode_steps)" in out
    assert len(server.models_at) == 1 and {b["model"] for b in server.bodies} == {OTHER_MODEL}
    assert sorted(b["prompt"] for b in server.bodies) == sorted(prompt_sets.held_out_prompts(2))


def test_every_request_failing_exits_nonzero(server: FakeServer, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("error: nope\n\nerror: nope again\n")
    assert run_bench(_parse(["--url", server.url, "--num-prompts", "2", "--no-progress",
                             "--prompts-file", str(prompts_file)])) == 1
    captured = capsys.readouterr()
    assert "HTTP 400: nope" in captured.out and "all 2 requests failed" in captured.err


def test_unreachable_server_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("x\n")
    for model in ([], ["--model", "m"]):  # a named model does not skip the check
        assert run_bench(_parse(["--url", url, "--num-prompts", "1", "--no-progress",
                                 "--prompts-file", str(prompts_file), *model])) == 1
        captured = capsys.readouterr()
        assert captured.err.startswith(f"dspark bench: error: cannot reach a server at {url} (")
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err and not captured.out


@pytest.mark.parametrize(("path", "says"), [("/nothing", "answered HTTP 404"),
                                            ("/html", "did not return a model list")])
def test_a_url_that_is_not_an_openai_server_exits_nonzero(server: FakeServer, path: str, says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse(["--url", server.url + path, "--num-prompts", "1", "--no-progress"])) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dspark bench: error: {server.url + path} does not look like an "
                          "OpenAI-compatible server") and says in err
    assert not server.bodies  # nothing was sent


def test_a_model_the_server_does_not_list_exits_nonzero(server: FakeServer,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse(["--url", server.url, "--model", "gpt-4", "--no-progress"])) == 1
    err = capsys.readouterr().err
    assert f"'gpt-4' is not served at {server.url}; it serves '{MODEL}', '{OTHER_MODEL}'" in err
    assert not server.bodies


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert run_bench(_parse(["--url", "http://x", "--prompts-file", str(bad)])) == 2
    assert run_bench(_parse(["--url", "http://x", "--concurrency", "0"])) == 2
    assert run_bench(_parse(["--url", "http://x", "--request-rate", "0"])) == 2
    assert run_bench(_parse(["--url", "localhost:8000"])) == 2
    assert run_bench(_parse(["--url", "http://x", "--prompts-file", str(tmp_path / "missing.json")])) == 2
    err = capsys.readouterr().err
    assert err.count("dspark bench: error:") == 5 and "Traceback" not in err
    assert "--url must be an http:// or https:// URL" in err and "missing.json not found" in err


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dspark")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


# -- pieces ---------------------------------------------------------------------------------------
def test_arrival_offsets_are_seeded_poisson() -> None:
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    a = arrival_offsets(2000, 50.0, 7)
    assert a == arrival_offsets(2000, 50.0, 7) and a != arrival_offsets(2000, 50.0, 8)
    assert a[0] == 0.0 and a == sorted(a)
    assert a[-1] / (len(a) - 1) == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 1/rate


def test_sse_parser_and_tracker() -> None:
    parser = SseParser()
    lines = [": comment", "event: x", 'data: {"choices": [{"text": "a"}],', 'data:  "usage": null}', "", "",
             "data:[DONE]", ""]
    events = [e for line in lines if (e := parser.feed(line)) is not None]
    assert events == ['{"choices": [{"text": "a"}],\n "usage": null}', "[DONE]"]
    tracker = StreamTracker()
    tracker.on_event(events[0], 0.5)
    with pytest.raises(StreamError, match="before `data: \\[DONE\\]`"):
        tracker.outcome(0)
    tracker.on_event("[DONE]", 0.7)
    with pytest.raises(StreamError, match="no usage chunk"):
        tracker.outcome(0)
    tracker.on_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}), 0.6)
    outcome = tracker.outcome(0)
    assert (outcome.ttft, outcome.latency) == (0.5, 0.7)
    assert (outcome.completion_tokens, outcome.decode_steps) == (1, None)
    assert outcome.tpot is None  # one token: no time per output token
    with pytest.raises(StreamError, match="error event: boom"):
        StreamTracker().on_event(json.dumps({"error": {"message": "boom"}}), 0.0)


def test_summary_of_outcomes() -> None:
    outcomes = [RequestOutcome(0, latency=1.0, ttft=0.2, chunk_gaps=(0.1, 0.3), text_chunks=3,
                               prompt_tokens=2, completion_tokens=9, decode_steps=3, finish_reason="stop"),
                RequestOutcome(1, error="HTTP 400: no"),
                RequestOutcome(2, latency=2.0, ttft=0.4, text_chunks=1, completion_tokens=1, decode_steps=1)]
    r = summarize(BenchConfig(url="http://h/v1"), "m", outcomes, 4.0, 2)
    assert (r.completed, r.failed, r.errors, r.url) == (2, 1, ("request 1: HTTP 400: no",), "http://h")
    assert r.mean_accepted_tokens_per_step == pytest.approx(10 / 4)
    assert r.tpot is not None and r.tpot.count == 1 and r.tpot.mean_ms == pytest.approx(100.0)
    assert r.ttft is not None
    assert r.ttft.p50_ms == pytest.approx(300.0) and r.ttft.p99_ms == pytest.approx(398.0)
    assert r.finish_reasons == {"stop": 1, "none": 1}
    assert r.output_throughput == pytest.approx(2.5) and r.request_throughput == pytest.approx(0.5)
    assert json.loads(json.dumps(r.to_json()))["request_rate"] is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0


def test_prompt_sets(tmp_path: Path) -> None:
    train, held = prompt_sets.corpus_files()
    assert held and not set(train) & set(held)
    prompts = prompt_sets.held_out_prompts(3, 50, phase=10)
    assert len(prompts) == 3 and all(len(p) == 50 for p in prompts)
    assert not set(prompts) & set(prompt_sets.held_out_prompts(3, 50, phase=70))
    lines = tmp_path / "p.txt"
    lines.write_text("a\n\n  \nb\n")
    assert prompt_sets.load_prompts_file(lines) == ["a", "b"]
    bad = tmp_path / "p.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON list of strings"):
        prompt_sets.load_prompts_file(bad)
