"""`dspark serve`: an OpenAI-compatible HTTP server over one generated runtime.

One engine thread owns the `Runtime` (and so every tensor and the KV pool) and runs its
continuous-batching loop: it takes new requests and aborts from a thread-safe queue between
steps, runs a step, and hands each request's new tokens to the asyncio side, where they are
detokenized incrementally, checked for stop strings and streamed. The HTTP side never touches the
runtime except through that queue, so a slow client cannot stall a decode step, and a client
that goes away only enqueues an abort: its slot and KV pages are freed before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from dspark.runtime.engine.requests import Request, RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.serve.metrics import ServingMetrics
from dspark.runtime.serve.openai_protocol import (
    ApiError,
    CompletionRequest,
    StreamOptions,
    completion_body,
    completion_id,
    usage,
    usage_chunk,
)


@dataclass
class Delivery:
    """What the engine thread hands to a request's stream after a step."""

    tokens: list[int]
    finish_reason: str | None  # "stop" / "length" when the engine finished the request
    decode_steps: int


@dataclass
class Stream:
    """The asyncio side of one request."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens already delivered (engine thread only)

    def push(self, delivery: Delivery) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, delivery)


class EngineThread:
    """Runs the runtime's scheduler loop; everything else talks to it through `submit`/`abort`."""

    def __init__(self, runtime: Runtime, metrics: ServingMetrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[int, tuple[Request, Stream]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: Request, stream: Stream) -> None:
        def add() -> None:
            self.runtime.enqueue(request)
            self._streams[request.rid] = (request, stream)
            self.metrics.requests_received.inc()
        self._commands.put(add)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop a request: "abort" (the client went away) or "stop" (a stop string matched)."""
        def drop() -> None:
            if self._streams.pop(request.rid, None) is not None:
                request.finish_reason = reason
                self.runtime.abort(request)
                self._count_finished(request, reason)
        self._commands.put(drop)

    def _count_finished(self, request: Request, reason: str) -> None:
        self.metrics.requests_finished.labels(reason).inc()
        self.metrics.prompt_tokens.inc(len(request.prompt))

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        command()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.runtime.has_work)
                if not self.runtime.has_work:
                    self.metrics.observe_pool(self.runtime)
                    continue
                touched = self.runtime.step()
                self.metrics.observe_step(self.runtime)
                for r in touched:
                    self._deliver(r)
        except BaseException as err:  # surface a crashed engine to every waiting request
            self.error = err
            for r, stream in self._streams.values():
                stream.push(Delivery([], "error", r.decode_steps))
            raise

    def _deliver(self, r: Request) -> None:
        entry = self._streams.get(r.rid)
        if entry is None:
            return
        stream = entry[1]
        new = r.output[stream.sent:]
        stream.sent = len(r.output)
        reason = r.finish_reason if r.done else None
        if reason is not None:
            del self._streams[r.rid]
            self._count_finished(r, reason)
        if new:
            self.metrics.generation_tokens.inc(len(new))
        if new or reason is not None:
            stream.push(Delivery(new, reason, r.decode_steps))


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a possible stop-string prefix."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        if final or not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _validation_error(err: ValidationError | RequestValidationError) -> ApiError:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # The field, not pydantic's union-member tags ("temperature.float"); nested models keep their path.
    param = loc[0] if loc else None
    if param == "stream_options" and len(loc) > 1 and loc[1] in StreamOptions.model_fields:
        param = f"{param}.{loc[1]}"
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", None)
    where = f"'{param}'" if param else "the request body"
    return ApiError(400, f"{where}: {first.get('msg')}", param)


class CompletionServer:
    """The FastAPI app and what it needs: runtime, engine thread, tokenizer, metrics."""

    def __init__(self, runtime: Runtime, model_name: str | None = None) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.package.tokenizer
        self.model_name = model_name or runtime.deployment.name
        self.metrics = ServingMetrics(runtime)
        self.engine = EngineThread(runtime, self.metrics)
        self.started = time.time()
        self.app = self._build_app()

    # -- request handling ---------------------------------------------------------------
    def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab}): "
                                f"{bad[:5]}", "prompt")
        return list(req.prompt)

    def _sampling(self, req: CompletionRequest) -> SamplingParams:
        s = self.runtime.deployment.serving
        try:
            return SamplingParams(s.temperature if req.temperature is None else float(req.temperature),
                                  s.top_p if req.top_p is None else float(req.top_p),
                                  s.top_k if req.top_k is None else req.top_k)
        except ValueError as err:
            raise ApiError(400, str(err), "temperature") from None

    def _make_request(self, req: CompletionRequest) -> Request:
        if req.model != self.model_name:
            raise ApiError(404, f"model '{req.model}' is not served here; this server serves "
                                f"'{self.model_name}' (GET /v1/models)", "model", "invalid_request_error",
                           "model_not_found")
        prompt = self._prompt_ids(req)
        max_new = req.max_tokens or self.runtime.deployment.serving.max_new_tokens
        try:
            return self.runtime.new_request(prompt, max_new, self._sampling(req), ignore_eos=req.ignore_eos,
                                            seed=req.seed)
        except RequestError as err:
            # The engine speaks of max_new_tokens; this API's field is max_tokens.
            message = str(err).replace("max_new_tokens", "max_tokens")
            param = "max_tokens" if err.field == "max_new_tokens" else err.field
            code = "context_length_exceeded" if "exceeds" in message else None
            raise ApiError(400, message, param, code=code) from None

    async def _events(self, request: Request, stream: Stream, stops: list[str]
                      ) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text delta, finish_reason, decode_steps) as the engine delivers; aborts on early exit."""
        decoder = self.tokenizer.incremental_decoder()
        matcher = StopMatcher(stops)
        finished = False
        try:
            while True:
                delivery = await stream.events.get()
                if delivery.finish_reason == "error":
                    raise ApiError(500, f"the engine stopped: {self.engine.error!r}", kind="server_error")
                text = "".join(decoder.step(t) for t in delivery.tokens)
                final = delivery.finish_reason is not None
                if final:
                    text += decoder.flush()
                out, hit = matcher.feed(text, final)
                if hit:
                    self.engine.abort(request, "stop")  # the engine may have run ahead; stop it now
                    finished = True
                    yield out, "stop", delivery.decode_steps
                    return
                if final:
                    finished = True
                    yield out, delivery.finish_reason, delivery.decode_steps
                    return
                if out:
                    yield out, None, delivery.decode_steps
        finally:
            if not finished:  # the client went away (or the handler failed): free the slot now
                self.engine.abort(request)

    async def _complete(self, req: CompletionRequest, http: HttpRequest) -> JSONResponse:
        request = self._make_request(req)
        stream = Stream(asyncio.get_running_loop())
        self.engine.submit(request, stream)
        cid = completion_id()
        parts: list[str] = []
        events = self._events(request, stream, req.stop_strings())
        watcher = asyncio.create_task(self._watch_disconnect(http, request))
        reason, steps = None, 0
        try:
            async for text, finish, decode_steps in events:
                parts.append(text)
                reason, steps = finish, decode_steps
        finally:
            watcher.cancel()
            await events.aclose()
        return JSONResponse(completion_body(cid, self.model_name, "".join(parts), reason,
                                            usage(len(request.prompt), len(request.output), steps)))

    async def _watch_disconnect(self, http: HttpRequest, request: Request) -> None:
        while True:
            if await http.is_disconnected():
                self.engine.abort(request)
                return
            await asyncio.sleep(0.1)

    async def _stream(self, req: CompletionRequest) -> StreamingResponse:
        request = self._make_request(req)
        stream = Stream(asyncio.get_running_loop())
        self.engine.submit(request, stream)
        cid = completion_id()
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def body() -> AsyncIterator[bytes]:
            steps = 0
            events = self._events(request, stream, req.stop_strings())
            try:
                async for text, reason, decode_steps in events:
                    steps = decode_steps
                    if text or reason is not None:
                        yield _sse(completion_body(cid, self.model_name, text, reason, None))
            except ApiError as err:
                yield _sse(err.body())
            finally:
                await events.aclose()
            if include_usage:
                yield _sse(usage_chunk(cid, self.model_name,
                                       usage(len(request.prompt), len(request.output), steps)))
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # -- app ----------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="dspark", lifespan=self._lifespan)

        @app.exception_handler(ApiError)
        async def api_error(_: HttpRequest, err: ApiError) -> JSONResponse:
            return JSONResponse(err.body(), status_code=err.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: HttpRequest, err: RequestValidationError) -> JSONResponse:
            api = _validation_error(err)
            return JSONResponse(api.body(), status_code=api.status)

        @app.post("/v1/completions", response_model=None)
        async def completions(http: HttpRequest) -> JSONResponse | StreamingResponse:
            raw = await http.body()
            try:
                payload = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ApiError(400, f"the request body is not valid JSON: {err}") from None
            if not isinstance(payload, dict):
                raise ApiError(400, "the request body must be a JSON object")
            try:
                req = CompletionRequest.model_validate(payload)
            except ValidationError as err:
                raise _validation_error(err) from None
            if not self.engine.alive:
                raise ApiError(503, "the engine is not running", kind="server_error")
            return await (self._stream(req) if req.stream else self._complete(req, http))

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "dspark",
                "max_model_len": self.runtime.deployment.serving.max_context_len}]}

        @app.get("/health")
        async def health() -> JSONResponse:
            ok = self.engine.alive
            return JSONResponse({"status": "ok" if ok else "engine stopped", **self.runtime.pool_stats()},
                                status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            body, content_type = self.metrics.render()
            return PlainTextResponse(body, media_type=content_type)

        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            self.engine.stop()


def serve(runtime: Runtime, host: str, port: int, model_name: str | None = None,
          log_level: str = "info") -> None:
    import uvicorn

    server = CompletionServer(runtime, model_name)
    uvicorn.run(server.app, host=host, port=port, log_level=log_level)
