"""`dspark serve`: an OpenAI-compatible HTTP server over one generated runtime.

One engine thread owns the runtime (`engine_thread.py`); the asyncio side validates requests,
detokenizes what the engine delivers incrementally, cuts it at stop strings and sends it.

Errors (shapes in `errors.py`, accepted fields in `openai_protocol.py`): a request is validated in
full — its JSON, fields, model, prompt encoding and context length — before anything is sent, so a
refused request, streaming or not, is an ordinary JSON error response with a 4xx status. Once a
stream has begun its status (200) cannot change: if the request then fails (the engine stopped, a
server fault), the stream ends with a `data: {"error": {...}}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dspark.runtime.engine.requests import Request, RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.serve.engine_thread import ENGINE_FAILED, EngineStopped, EngineThread, Stream
from dspark.runtime.serve.errors import SERVER_ERROR, ApiError, install_error_handlers, server_fault
from dspark.runtime.serve.metrics import ServingMetrics
from dspark.runtime.serve.openai_protocol import (
    CompletionRequest,
    completion_body,
    completion_id,
    parse_completion_request,
    usage,
    usage_chunk,
)
from dspark.runtime.serve.request_body import body_limit, read_json_object
from dspark.runtime.serve.streaming import StopMatcher, sse
from dspark.runtime.tokenizer import TokenizerError

log = logging.getLogger("uvicorn.error")

ROUTES = "POST /v1/completions, GET /v1/models, GET /health and GET /metrics"
# A temperature this small samples the argmax anyway, and in float32 it overflows the scaled logits
# (a NaN distribution): such a request decodes greedily, as vLLM does below the same bound.
GREEDY_BELOW_TEMPERATURE = 1e-5
# top_p rounds to 0 in float32 below ~1e-45 and would then drop every token; any top_p at or below
# the top token's probability (>= 1 / vocabulary size) keeps that token alone, so this bound changes
# nothing for vocabularies up to a million tokens.
MIN_TOP_P = 1e-6
# The engine speaks of max_new_tokens; this API's field is max_tokens.
API_FIELDS = {"max_new_tokens": "max_tokens"}


def engine_stopped() -> ApiError:
    return ApiError(503, "the engine has stopped after an internal failure (see the server log); the "
                         "server must be restarted", kind=SERVER_ERROR, code="engine_stopped")


def request_refused(err: RequestError) -> ApiError:
    """A request the engine cannot serve, in the API's field names."""
    message = str(err)
    for engine_name, api_name in API_FIELDS.items():
        message = message.replace(engine_name, api_name)
    return ApiError(400, message, API_FIELDS.get(err.field or "", err.field), code=err.code)


class CompletionServer:
    """The FastAPI app and what it needs: runtime, engine thread, tokenizer, metrics."""

    def __init__(self, runtime: Runtime, model_name: str | None = None) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.package.tokenizer
        self.model_name = model_name or runtime.deployment.name
        self.max_body_bytes = body_limit(runtime.deployment.serving.max_context_len)
        self.metrics = ServingMetrics(runtime)
        self.engine = EngineThread(runtime, self.metrics)
        self.started = time.time()
        self.app = self._build_app()

    # -- request handling ---------------------------------------------------------------
    def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            try:
                return self.tokenizer.encode(req.prompt)
            except TokenizerError as err:
                raise ApiError(400, f"`prompt`: {err}", "prompt") from None
        # An id the model has no embedding for would fail inside the engine's step, not here.
        vocab = min(self.tokenizer.vocab_size, self.runtime.deployment.model.geometry.vocab_size)
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"`prompt` holds token ids outside the vocabulary [0, {vocab}): "
                                f"{bad[:5]}", "prompt")
        return list(req.prompt)

    def _sampling(self, req: CompletionRequest) -> SamplingParams:
        s = self.runtime.deployment.serving
        temperature = s.temperature if req.temperature is None else req.temperature
        top_p = s.top_p if req.top_p is None else req.top_p
        return SamplingParams(0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
                              max(top_p, MIN_TOP_P), s.top_k if req.top_k is None else req.top_k)

    def _make_request(self, req: CompletionRequest) -> Request:
        if req.model != self.model_name:
            raise ApiError(404, f"model `{req.model}` is not served here; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "model", code="model_not_found")
        prompt = self._prompt_ids(req)
        max_new = req.max_tokens or self.runtime.deployment.serving.max_new_tokens
        try:
            return self.runtime.new_request(prompt, max_new, self._sampling(req), ignore_eos=req.ignore_eos,
                                            seed=req.seed)
        except RequestError as err:
            raise request_refused(err) from None

    def _submit(self, req: CompletionRequest) -> tuple[Request, Stream]:
        request = self._make_request(req)
        stream = Stream(asyncio.get_running_loop())
        try:
            self.engine.submit(request, stream)
        except EngineStopped:
            raise engine_stopped() from None
        return request, stream

    async def _events(self, request: Request, stream: Stream, stops: list[str]
                      ) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text delta, finish_reason, decode_steps) as the engine delivers; aborts on early exit."""
        decoder = self.tokenizer.incremental_decoder()
        matcher = StopMatcher(stops)
        finished = False
        try:
            while True:
                delivery = await stream.events.get()
                if delivery.finish_reason == ENGINE_FAILED:
                    finished = True  # the engine is gone: nothing to abort
                    raise engine_stopped()
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
        request, stream = self._submit(req)
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
        request, stream = self._submit(req)  # refusals happen here, before the 200 goes out
        cid = completion_id()
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def body() -> AsyncIterator[bytes]:
            steps = 0
            events = self._events(request, stream, req.stop_strings())
            try:
                async for text, reason, decode_steps in events:
                    steps = decode_steps
                    if text or reason is not None:
                        yield sse(completion_body(cid, self.model_name, text, reason, None))
            except ApiError as err:
                yield sse(err.body())
                yield sse("[DONE]")
                return
            except Exception:  # a fault after the 200: say so in the stream, keep the connection
                log.exception("server fault while streaming request %s", cid)
                yield sse(server_fault().body())
                yield sse("[DONE]")
                return
            finally:
                await events.aclose()
            if include_usage:
                yield sse(usage_chunk(cid, self.model_name,
                                      usage(len(request.prompt), len(request.output), steps)))
            yield sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # -- app ----------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        # No generated API docs: the completions route reads its body itself, so they would be empty.
        app = FastAPI(title="dspark", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
        install_error_handlers(app, ROUTES)

        @app.post("/v1/completions", response_model=None)
        async def completions(http: HttpRequest) -> JSONResponse | StreamingResponse:
            req = parse_completion_request(await read_json_object(http, self.max_body_bytes))
            if not self.engine.alive:
                raise engine_stopped()
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


def serve(runtime: Runtime, sock: socket.socket, host: str, port: int, model_name: str | None = None,
          log_level: str = "info") -> None:
    """Serve on `sock`, already bound to host:port (which only name it in the log), until interrupted."""
    import uvicorn

    server = CompletionServer(runtime, model_name)
    port = sock.getsockname()[1]  # the port the system chose for --port 0
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level)
    # uvicorn names the address only when it binds the socket itself; this one was bound earlier.
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d (press CTRL+C to quit)", server.model_name, shown, port)
    uvicorn.Server(config).run(sockets=[sock])
