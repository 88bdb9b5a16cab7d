"""`dspark bench`: load a running OpenAI-compatible completions server and report latency and throughput.

Sends `--num-prompts` streaming `POST /v1/completions` requests, at most `--concurrency` in flight, arriving
as a seeded Poisson process at `--request-rate` per second (default: all at once). Per request it measures
TTFT (send to the first non-empty text chunk), TPOT ((end − first token) / (completion tokens − 1)), the
end-to-end latency and the gaps between text chunks; token counts come from the final usage chunk
(`stream_options.include_usage`). A dspark server also reports `usage.dspark.decode_steps`, from which the
mean accepted tokens per step (accepted drafts + the bonus token) follows.

Before any request it asks the server for `/v1/models`: an address where nothing listens, or where something
other than an OpenAI-compatible server answers, or a `--model` the server does not list, is a
`BenchSetupError` naming the URL rather than a run of failed requests. httpx and tqdm are imported only when
a benchmark runs, so that the other subcommands do not pay for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dspark.bench.stream import RequestOutcome, SseParser, StreamError, StreamTracker, error_message

if TYPE_CHECKING:
    import httpx

__all__ = [
    "BenchConfig", "BenchResult", "BenchSetupError", "LatencyStats", "RequestOutcome", "StreamError",
    "arrival_offsets", "benchmark", "benchmark_outcomes", "format_result", "probe_server", "summarize",
]

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
MAX_REPORTED_ERRORS = 5
CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 30.0  # /v1/models needs no decode step: a server that is up answers it at once
# A request queued behind a full batch may wait long for its first byte: only a stuck server should
# time out, never a busy one.
READ_TIMEOUT_S = 600.0


class BenchSetupError(Exception):
    """The benchmark could not start (server unreachable, not an OpenAI server, no such model)."""


@dataclass(frozen=True)
class BenchConfig:
    url: str
    model: str | None = None  # None: the first id from /v1/models
    num_prompts: int = 64
    concurrency: int | None = None  # None: unlimited
    request_rate: float = math.inf
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not self.request_rate > 0:  # also rejects NaN
            raise ValueError(f"--request-rate must be positive, got {self.request_rate}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be non-negative, got {self.temperature}")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--url must be an http:// or https:// URL such as http://127.0.0.1:8000, "
                             f"got {self.url!r}")

    @property
    def base_url(self) -> str:
        """The server root: a trailing `/` or `/v1` (as OpenAI clients take it) is dropped."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats | None:
        if not seconds:
            return None
        ms = sorted(s * 1e3 for s in seconds)
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


@dataclass(frozen=True)
class BenchResult:
    model: str
    url: str
    num_prompts: int
    concurrency: int | None
    request_rate: float
    max_tokens: int
    temperature: float
    completed: int
    failed: int
    errors: tuple[str, ...]  # the first MAX_REPORTED_ERRORS, by request index
    duration_s: float
    request_throughput: float  # successful requests per second
    output_throughput: float  # completion tokens per second
    total_token_throughput: float  # prompt + completion tokens per second
    total_prompt_tokens: int
    total_completion_tokens: int
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    e2e_latency: LatencyStats | None
    chunk_gap: LatencyStats | None
    mean_tokens_per_chunk: float | None
    total_decode_steps: int | None
    mean_accepted_tokens_per_step: float | None  # None when the server reports no decode_steps
    peak_in_flight: int
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["errors"] = list(self.errors)
        # JSON has no infinity: null means "all at once".
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), of an already sorted sequence."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `count` requests: a Poisson process at `rate` per second whose
    first request leaves at once, or all at once when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def select_prompts(pool: Sequence[str], count: int) -> list[str]:
    """`count` prompts, cycling through `pool` when it is shorter."""
    if not pool:
        raise ValueError("no prompts to send")
    return [pool[i % len(pool)] for i in range(count)]


# -- one request --------------------------------------------------------------------------------


def _describe(err: BaseException) -> str:
    # httpx timeouts and some protocol errors have an empty message: the type is the information.
    text = str(err)
    if isinstance(err, StreamError):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


async def send_request(client: httpx.AsyncClient, payload: dict[str, Any], index: int) -> RequestOutcome:
    """Send one streaming completion and time it. Never raises (but for cancellation): a failure of any
    kind becomes an outcome with `error` set, so that one bad request cannot end the run."""
    sent = time.perf_counter()
    tracker = StreamTracker()
    parser = SseParser()
    try:
        async with client.stream("POST", COMPLETIONS_PATH, json=payload) as response:
            if response.status_code >= 400:
                await response.aread()
                try:
                    body: Any = response.json()
                except ValueError:
                    body = response.text
                raise StreamError(f"HTTP {response.status_code}: {error_message(body)}")
            async for line in response.aiter_lines():
                data = parser.feed(line)
                if data is not None:
                    tracker.on_event(data, time.perf_counter() - sent)
        data = parser.flush()  # a last event without its closing blank line
        if data is not None:
            tracker.on_event(data, time.perf_counter() - sent)
        return tracker.outcome(index)
    except Exception as err:
        return RequestOutcome(index=index, error=_describe(err), latency=time.perf_counter() - sent)


# -- the run ------------------------------------------------------------------------------------
class _InFlight:
    """Counts requests between send and end, to report (and test) the peak against --concurrency."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            self.now -= 1


def _payload(config: BenchConfig, model: str, prompt: str) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": config.max_tokens,
        "temperature": config.temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:  # an extension: left out otherwise, so that strict servers accept the request
        payload["ignore_eos"] = True
    return payload


async def probe_server(client: httpx.AsyncClient, base_url: str, requested: str | None) -> str:
    """The model to request: `requested`, or the first the server lists. Raises `BenchSetupError` when
    nothing answers at `base_url`, when what answers is not an OpenAI-compatible server, or when it does
    not serve `requested`."""
    import httpx

    url = base_url + MODELS_PATH
    try:
        response = await client.get(MODELS_PATH, timeout=PROBE_TIMEOUT_S)
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        raise BenchSetupError(f"cannot reach a server at {base_url} ({_describe(err)}); check that the "
                              "server is running and the URL is right") from None
    except httpx.HTTPError as err:
        raise BenchSetupError(f"the server at {base_url} did not answer GET {url} "
                              f"({_describe(err)})") from None
    not_openai = f"{base_url} does not look like an OpenAI-compatible server: GET {url}"
    if response.status_code != 200:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise BenchSetupError(f"{not_openai} answered HTTP {response.status_code} ({kind}); pass the "
                              "server's base URL, e.g. http://127.0.0.1:8000")
    try:
        served = [str(model["id"]) for model in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchSetupError(f"{not_openai} did not return a model list") from None
    if requested is None:
        if not served:
            raise BenchSetupError(f"the server at {base_url} lists no model; pass --model")
        return served[0]
    if requested not in served:
        raise BenchSetupError(f"model {requested!r} is not served at {base_url}; it serves "
                              f"{', '.join(map(repr, served)) or 'no model'}")
    return requested


async def run_requests(client: httpx.AsyncClient, config: BenchConfig, model: str, prompts: Sequence[str]
                       ) -> tuple[list[RequestOutcome], float, int]:
    """(outcomes by request index, wall seconds from the first send to the last end, peak in flight)."""
    from tqdm import tqdm

    limit: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(config.concurrency) if config.concurrency else contextlib.nullcontext())
    in_flight = _InFlight()
    # disable=None lets tqdm turn itself off when stderr is not a terminal (CI logs, pipes).
    bar = tqdm(total=len(prompts), desc="bench", unit="req", disable=None if config.progress else True)

    async def one(index: int) -> RequestOutcome:
        async with limit:
            with in_flight.track():
                outcome = await send_request(client, _payload(config, model, prompts[index]), index)
        bar.update()
        return outcome

    start = time.perf_counter()
    tasks = []
    for index, offset in enumerate(arrival_offsets(len(prompts), config.request_rate, config.seed)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(outcomes), duration, in_flight.peak


async def benchmark_async(config: BenchConfig, prompts: Sequence[str]) -> BenchResult:
    return (await benchmark_outcomes_async(config, prompts))[0]


async def benchmark_outcomes_async(config: BenchConfig, prompts: Sequence[str]
                                   ) -> tuple[BenchResult, list[RequestOutcome]]:
    """The summary and every request's outcome (request i sent prompt i modulo the pool)."""
    import httpx

    prompts = select_prompts(prompts, config.num_prompts)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, write=CONNECT_TIMEOUT_S,
                            pool=None)
    # trust_env=False: a proxy from the environment would be measured along with the server.
    async with httpx.AsyncClient(base_url=config.base_url, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        model = await probe_server(client, config.base_url, config.model)
        outcomes, duration, peak = await run_requests(client, config, model, prompts)
    return summarize(config, model, outcomes, duration, peak), outcomes


def benchmark(config: BenchConfig, prompts: Sequence[str]) -> BenchResult:
    """Run the benchmark (its own event loop) and summarize it. Raises BenchSetupError before any request."""
    return asyncio.run(benchmark_async(config, prompts))


def benchmark_outcomes(config: BenchConfig, prompts: Sequence[str]
                       ) -> tuple[BenchResult, list[RequestOutcome]]:
    """`benchmark`, and every request's outcome too (its text, timings and counts)."""
    return asyncio.run(benchmark_outcomes_async(config, prompts))


def summarize(config: BenchConfig, model: str, outcomes: Sequence[RequestOutcome], duration: float,
              peak_in_flight: int) -> BenchResult:
    ok = [o for o in outcomes if o.ok]
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.index)
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    completion_tokens = sum(o.completion_tokens for o in ok)
    chunks = sum(o.text_chunks for o in ok)
    stepped = [o for o in ok if o.decode_steps is not None]
    steps = sum(o.decode_steps or 0 for o in stepped)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return BenchResult(
        model=model, url=config.base_url, num_prompts=len(outcomes), concurrency=config.concurrency,
        request_rate=config.request_rate, max_tokens=config.max_tokens, temperature=config.temperature,
        completed=len(ok), failed=len(failed),
        errors=tuple(f"request {o.index}: {o.error}" for o in failed[:MAX_REPORTED_ERRORS]),
        duration_s=duration, request_throughput=len(ok) * per_s, output_throughput=completion_tokens * per_s,
        total_token_throughput=(prompt_tokens + completion_tokens) * per_s,
        total_prompt_tokens=prompt_tokens, total_completion_tokens=completion_tokens,
        ttft=LatencyStats.of([o.ttft for o in ok if o.ttft is not None]),
        tpot=LatencyStats.of([t for o in ok if (t := o.tpot) is not None]),
        e2e_latency=LatencyStats.of([o.latency for o in ok]),
        chunk_gap=LatencyStats.of([g for o in ok for g in o.chunk_gaps]),
        mean_tokens_per_chunk=completion_tokens / chunks if chunks else None,
        total_decode_steps=steps if stepped else None,
        # Only requests that report their steps count, so that a mixed answer cannot skew the ratio.
        mean_accepted_tokens_per_step=sum(o.completion_tokens for o in stepped) / steps if steps else None,
        peak_in_flight=peak_in_flight,
        finish_reasons=dict(Counter(o.finish_reason or "none" for o in ok)),
    )


# -- output -------------------------------------------------------------------------------------
def _row(label: str, value: str) -> str:
    return f"  {label:<36}{value}"


def _latency_row(label: str, stats: LatencyStats | None) -> str:
    if stats is None:
        return f"  {label:<20}{'n/a':>10}"
    return f"  {label:<20}{stats.mean_ms:>10.2f}{stats.p50_ms:>10.2f}{stats.p99_ms:>10.2f}"


def format_result(r: BenchResult) -> str:
    """The result as a readable table."""
    rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}"
    concurrency = "unlimited" if r.concurrency is None else str(r.concurrency)
    lines = [
        f"dspark bench: {r.num_prompts} requests to {r.url} (model {r.model}), max_tokens {r.max_tokens}, "
        f"temperature {r.temperature:g}",
        f"  concurrency {concurrency} (peak in flight {r.peak_in_flight}), request rate {rate}/s",
        _row("successful requests", str(r.completed)),
        _row("failed requests", str(r.failed)),
        *(f"    {e}" for e in r.errors),
        _row("duration", f"{r.duration_s:.2f} s"),
        _row("request throughput", f"{r.request_throughput:.2f} req/s"),
        _row("output token throughput", f"{r.output_throughput:.1f} tok/s"),
        _row("total token throughput", f"{r.total_token_throughput:.1f} tok/s"),
        _row("prompt / completion tokens", f"{r.total_prompt_tokens} / {r.total_completion_tokens}"),
        _row("mean accepted tokens per step", "n/a (no usage.dspark.decode_steps)"
             if r.mean_accepted_tokens_per_step is None else f"{r.mean_accepted_tokens_per_step:.2f}"),
        _row("mean tokens per chunk",
             "n/a" if r.mean_tokens_per_chunk is None else f"{r.mean_tokens_per_chunk:.2f}"),
        _row("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(r.finish_reasons.items())) or "-"),
        f"  {'(ms)':<20}{'mean':>10}{'p50':>10}{'p99':>10}",
        _latency_row("TTFT", r.ttft),
        _latency_row("TPOT", r.tpot),
        _latency_row("E2E latency", r.e2e_latency),
        _latency_row("inter-chunk gap", r.chunk_gap),
    ]
    return "\n".join(lines)


