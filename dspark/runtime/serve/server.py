"""`dspark serve`: an OpenAI-compatible HTTP server over one generated runtime.

One engine thread owns the runtime (`engine_thread.py`); the asyncio side validates requests,
detokenizes what the engine delivers incrementally, cuts it at stop strings and sends it.
`POST /v1/completions` takes a prompt (`openai_protocol.py`); `POST /v1/chat/completions` takes
messages, renders them with the model's chat template (`dspark/runtime/chat_template.py`) and also ends
a reply at the template's end-of-turn token, which is never part of the content (`chat_protocol.py`).

Errors (shapes in `errors.py`, accepted fields in `openai_protocol.py` and `chat_protocol.py`): a
request is validated in full — its JSON, fields, model, messages and chat template, prompt encoding and
context length — before anything is sent, so a refused request, streaming or not, is an ordinary JSON
error response with a 4xx status. Once a stream has begun its status (200) cannot change: if the
request then fails (the engine stopped, a server fault), the stream ends with a
`data: {"error": {...}}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dspark.fingerprint import fingerprint_of_deployment, sampling_policy
from dspark.formats.cost_tables import cost_table_json
from dspark.runtime.chat_template import ChatTemplateError
from dspark.runtime.engine.requests import Request, RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.serve.chat_protocol import (
    ChatChunks,
    ChatCompletionRequest,
    chat_completion_body,
    chat_completion_id,
    parse_chat_request,
)
from dspark.runtime.serve.engine_thread import ENGINE_FAILED, EngineStopped, EngineThread, Stream
from dspark.runtime.serve.errors import SERVER_ERROR, ApiError, install_error_handlers, server_fault
from dspark.runtime.serve.metrics import ServingMetrics
from dspark.runtime.serve.openai_protocol import (
    CompletionChunks,
    CompletionRequest,
    GenerationRequest,
    completion_body,
    completion_id,
    parse_completion_request,
    usage,
)
from dspark.runtime.serve.request_body import body_limit, read_json_object
from dspark.runtime.serve.streaming import Chunks, StopMatcher, sse
from dspark.runtime.tokenizer import TokenizerError

log = logging.getLogger("uvicorn.error")

ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/dspark/calibration, "
          "GET /v1/dspark/cost-table, GET /health and GET /metrics")
# A temperature this small samples the argmax anyway, and in float32 it overflows the scaled logits
# (a NaN distribution): such a request decodes greedily, as vLLM does below the same bound.
GREEDY_BELOW_TEMPERATURE = 1e-5
# top_p rounds to 0 in float32 below ~1e-45 and would then drop every token; any top_p at or below
# the top token's probability (>= 1 / vocabulary size) keeps that token alone, so this bound changes
# nothing for vocabularies up to a million tokens.
MIN_TOP_P = 1e-6
# The engine speaks of max_new_tokens and prompt; each route names them after its own fields.
COMPLETION_FIELDS = {"max_new_tokens": "max_tokens", "prompt": "prompt"}


def engine_stopped() -> ApiError:
    return ApiError(503, "the engine has stopped after an internal failure (see the server log); the "
                         "server must be restarted", kind=SERVER_ERROR, code="engine_stopped")


def request_refused(err: RequestError, fields: dict[str, str] | None = None) -> ApiError:
    """A request the engine cannot serve, in the API's field names (`fields`: engine name -> API name)."""
    fields = COMPLETION_FIELDS if fields is None else fields
    message = str(err)
    if "max_new_tokens" in fields:
        message = message.replace("max_new_tokens", fields["max_new_tokens"])
    return ApiError(400, message, fields.get(err.field or "", err.field), code=err.code)


def first_stop(tokens: list[int], stop_ids: frozenset[int]) -> int | None:
    """Index of the first token of `tokens` in `stop_ids`, or None."""
    return next((i for i, t in enumerate(tokens) if t in stop_ids), None)


@dataclass(frozen=True)
class Event:
    """A piece of a response: new text, the finish reason on the last one, the request's decode steps
    so far, and the output tokens delivered so far (not counting a stop token or anything after it)."""

    text: str
    finish_reason: str | None
    decode_steps: int
    tokens: int


@dataclass(frozen=True)
class Generation:
    """A submitted request and how its output ends: stop strings, and stop token ids beyond EOS."""

    request: Request
    stream: Stream
    stops: list[str]
    stop_ids: frozenset[int] = frozenset()


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

    def _chat_prompt(self, req: ChatCompletionRequest, messages: list[dict[str, str]]
                     ) -> tuple[list[int], frozenset[int]]:
        """The conversation's prompt ids through the model's chat template, and the reply's stop ids."""
        try:
            chat = self.tokenizer.chat_format()
            text = chat.template.render(messages, add_generation_prompt=True,
                                        variables=req.chat_template_kwargs)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), "messages", code="chat_template_error") from None
        try:
            ids = self.tokenizer.encode(text, add_bos=chat.add_bos)
        except TokenizerError as err:
            raise ApiError(400, f"`messages`: {err}", "messages") from None
        return ids, frozenset() if req.ignore_eos else chat.stop_ids

    def _sampling(self, req: GenerationRequest) -> SamplingParams:
        s = self.runtime.deployment.serving
        temperature = s.temperature if req.temperature is None else req.temperature
        top_p = s.top_p if req.top_p is None else req.top_p
        return SamplingParams(0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
                              max(top_p, MIN_TOP_P), s.top_k if req.top_k is None else req.top_k)

    def _check_model(self, req: GenerationRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(404, f"model `{req.model}` is not served here; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "model", code="model_not_found")

    def _new_request(self, req: GenerationRequest, prompt: list[int], max_tokens: int | None,
                     fields: dict[str, str]) -> Request:
        max_new = max_tokens or self.runtime.deployment.serving.max_new_tokens
        try:
            return self.runtime.new_request(prompt, max_new, self._sampling(req), ignore_eos=req.ignore_eos,
                                            seed=req.seed)
        except RequestError as err:
            raise request_refused(err, fields) from None

    def _submit(self, request: Request, stops: list[str], stop_ids: frozenset[int] = frozenset()
                ) -> Generation:
        stream = Stream(asyncio.get_running_loop())
        try:
            self.engine.submit(request, stream)
        except EngineStopped:
            raise engine_stopped() from None
        return Generation(request, stream, stops, stop_ids)

    def _submit_completion(self, req: CompletionRequest) -> Generation:
        self._check_model(req)
        request = self._new_request(req, self._prompt_ids(req), req.max_tokens, COMPLETION_FIELDS)
        return self._submit(request, req.stop_strings())

    def _submit_chat(self, req: ChatCompletionRequest, messages: list[dict[str, str]]) -> Generation:
        self._check_model(req)
        prompt, stop_ids = self._chat_prompt(req, messages)
        max_tokens, field = req.token_limit()
        request = self._new_request(req, prompt, max_tokens, {"max_new_tokens": field, "prompt": "messages"})
        return self._submit(request, req.stop_strings(), stop_ids)

    async def _events(self, gen: Generation) -> AsyncIterator[Event]:
        """The response's events as the engine delivers; aborts the request on early exit or at a stop."""
        decoder = self.tokenizer.incremental_decoder()
        matcher = StopMatcher(gen.stops)
        finished, delivered = False, 0
        try:
            while True:
                delivery = await gen.stream.events.get()
                if delivery.finish_reason == ENGINE_FAILED:
                    finished = True  # the engine is gone: nothing to abort
                    raise engine_stopped()
                tokens, reason = delivery.tokens, delivery.finish_reason
                cut = first_stop(tokens, gen.stop_ids)
                if cut is not None:  # the template's end of turn: the reply ends before it
                    tokens, reason = tokens[:cut], "stop"
                delivered += len(tokens)
                text = "".join(decoder.step(t) for t in tokens)
                final = reason is not None
                if final:
                    text += decoder.flush()
                out, hit = matcher.feed(text, final)
                if hit or cut is not None:
                    self.engine.abort(gen.request, "stop")  # the engine may have run ahead; stop it now
                    finished = True
                    yield Event(out, "stop", delivery.decode_steps, delivered)
                    return
                if final:
                    finished = True
                    yield Event(out, reason, delivery.decode_steps, delivered)
                    return
                if out:
                    yield Event(out, None, delivery.decode_steps, delivered)
        finally:
            if not finished:  # the client went away (or the handler failed): free the slot now
                self.engine.abort(gen.request)

    async def _collect(self, gen: Generation, http: HttpRequest) -> tuple[str, str | None, dict[str, Any]]:
        """(text, finish_reason, usage) of a whole response."""
        parts: list[str] = []
        events = self._events(gen)
        watcher = asyncio.create_task(self._watch_disconnect(http, gen.request))
        last = Event("", None, 0, 0)
        try:
            async for event in events:
                parts.append(event.text)
                last = event
        finally:
            watcher.cancel()
            await events.aclose()
        return "".join(parts), last.finish_reason, usage(len(gen.request.prompt), last.tokens,
                                                          last.decode_steps)

    async def _complete(self, req: CompletionRequest, http: HttpRequest) -> JSONResponse:
        gen = self._submit_completion(req)
        text, reason, usage_body = await self._collect(gen, http)
        return JSONResponse(completion_body(completion_id(), self.model_name, text, reason, usage_body))

    async def _chat(self, req: ChatCompletionRequest, messages: list[dict[str, str]],
                    http: HttpRequest) -> JSONResponse:
        gen = self._submit_chat(req, messages)
        text, reason, usage_body = await self._collect(gen, http)
        return JSONResponse(chat_completion_body(chat_completion_id(), self.model_name, text, reason,
                                                 usage_body))

    async def _watch_disconnect(self, http: HttpRequest, request: Request) -> None:
        while True:
            if await http.is_disconnected():
                self.engine.abort(request)
                return
            await asyncio.sleep(0.1)

    def _stream(self, gen: Generation, chunks: Chunks, include_usage: bool) -> StreamingResponse:
        """The response as server-sent events; `gen` was submitted already, so refusals came before."""

        async def body() -> AsyncIterator[bytes]:
            last = Event("", None, 0, 0)
            events = self._events(gen)
            try:
                for chunk in chunks.opening():
                    yield sse(chunk)
                async for event in events:
                    last = event
                    for chunk in chunks.event(event.text, event.finish_reason):
                        yield sse(chunk)
            except ApiError as err:
                yield sse(err.body())
                yield sse("[DONE]")
                return
            except Exception:  # a fault after the 200: say so in the stream, keep the connection
                log.exception("server fault while streaming a response to %s", self.model_name)
                yield sse(server_fault().body())
                yield sse("[DONE]")
                return
            finally:
                await events.aclose()
            if include_usage:
                yield sse(chunks.usage(usage(len(gen.request.prompt), last.tokens, last.decode_steps)))
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
            if not req.stream:
                return await self._complete(req, http)
            gen = self._submit_completion(req)  # refusals happen here, before the 200 goes out
            return self._stream(gen, CompletionChunks(completion_id(), self.model_name), _wants_usage(req))

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(http: HttpRequest) -> JSONResponse | StreamingResponse:
            req, messages = parse_chat_request(await read_json_object(http, self.max_body_bytes))
            if not self.engine.alive:
                raise engine_stopped()
            if not req.stream:
                return await self._chat(req, messages, http)
            gen = self._submit_chat(req, messages)
            include_usage = _wants_usage(req)
            return self._stream(gen, ChatChunks(chat_completion_id(), self.model_name, include_usage),
                                include_usage)

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

        @app.get("/v1/dspark/calibration")
        async def calibration() -> JSONResponse:
            online = self.runtime.speculative.online
            if online is None:
                raise ApiError(404, "online calibration is off: start the server with --online-calibration "
                                    "(the compiled temperatures are in the package's planner_config.py)",
                               code="online_calibration_off")
            sampling = self.runtime.sampling
            policy = sampling_policy(sampling.temperature, sampling.top_p, sampling.top_k)
            return JSONResponse(online.calibration_file(f"online: {self.model_name} served traffic", policy))

        @app.get("/v1/dspark/cost-table")
        async def cost_table() -> JSONResponse:
            return JSONResponse(self._cost_table())

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            body, content_type = self.metrics.render()
            return PlainTextResponse(body, media_type=content_type)

        return app

    def _cost_table(self) -> dict[str, Any]:
        """The live additive table as a cost-table file (`dspark profile`'s format, with the deployment's
        fingerprint, so it can be saved and named in a spec), with the online refit's figures beside it."""
        refit = self.runtime.speculative.cost_refit
        if refit is None:
            table = getattr(self.runtime.plan, "table", None)
            if table is not None and table.kind == "additive":
                what = ("start the server with --online-cost to refit it (the compiled table is in the "
                        "package's planner_config.py)")
            else:
                kind = "no cost model" if table is None else f"a {table.kind} cost table"
                what = f"this deployment plans with {kind}, and the refit corrects an additive table's knots"
            raise ApiError(404, f"online cost refit is off: {what}", code="online_cost_off")
        table, state = refit.table, refit.state()
        fingerprint = fingerprint_of_deployment(self.runtime.deployment, self.runtime.tiers).to_json()
        return {**cost_table_json(table.to_format(), fingerprint), **state}

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            self.engine.stop()


def _wants_usage(req: GenerationRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def serve(runtime: Runtime, sock: socket.socket, host: str, port: int, model_name: str | None = None,
          log_level: str = "info") -> bool:
    """Serve on `sock`, already bound to host:port (which only name it in the log), until interrupted or,
    in a multi-process launch, until a rank fails. Returns whether the engine failed."""
    import uvicorn

    server = CompletionServer(runtime, model_name)
    port = sock.getsockname()[1]  # the port the system chose for --port 0
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level)
    # uvicorn names the address only when it binds the socket itself; this one was bound earlier.
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d (press CTRL+C to quit)", server.model_name, shown, port)
    uv = uvicorn.Server(config)
    if runtime.ranks.world.size > 1:
        # A rank that died leaves a process group no step can run on again: once the engine has told the
        # waiting requests (503), shut down rather than serve 503s until someone notices.
        def shut_down() -> None:
            log.error("a rank of the launch failed; the server shuts down (restart the launch)")
            uv.should_exit = True

        server.engine.on_failure = shut_down
    uv.run(sockets=[sock])
    return server.engine.error is not None
