"""The thread that owns the runtime: it runs continuous batching and hands tokens to the asyncio side.

It takes new requests and aborts from a thread-safe queue between steps, runs a step, and pushes each
request's new tokens to that request's `Stream`. The HTTP side never touches the runtime except
through that queue, so a slow client cannot stall a decode step, and a client that goes away only
enqueues an abort: its slot and KV pages are freed before the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.serve.metrics import ServingMetrics

ENGINE_FAILED = "error"  # the finish reason a stream gets when the engine thread died


class EngineStopped(RuntimeError):
    """The engine thread is no longer running (it failed); nothing can be served until a restart."""


@dataclass
class Delivery:
    """What the engine thread hands to a request's stream after a step."""

    tokens: list[int]
    # "stop" / "length" when the engine finished the request, "abort" / "stop" when `abort` did,
    # ENGINE_FAILED when the engine thread died
    finish_reason: str | None
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
        # Orders `submit` against a crash: a stream registered before the crash is told of it, one
        # submitted after is refused; none waits forever.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.error: BaseException | None = None
        # Called (on the engine thread) once the engine has failed and every waiting stream was told.
        self.on_failure: Callable[[], None] | None = None

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
        """Queue a validated request; its tokens arrive on `stream`. Raises `EngineStopped`."""
        with self._lock:
            if self.error is not None or self._stop.is_set():
                raise EngineStopped("the engine is not running")
            self._streams[request.rid] = (request, stream)

        def add() -> None:
            self.runtime.enqueue(request)
            self.metrics.requests_received.inc()
        self._commands.put(add)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop a request: "abort" (the client went away) or "stop" (a stop string matched)."""
        def drop() -> None:
            entry = self._streams.pop(request.rid, None)
            if entry is not None:
                request.finish_reason = reason
                self.runtime.abort(request)
                self._count_finished(request, reason)
                # End the stream: a handler still waiting on it (a client that went away while its
                # non-streamed request ran) would otherwise wait forever.
                entry[1].push(Delivery([], reason, request.decode_steps))
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
            with self._lock:
                self.error = err
                waiting = list(self._streams.values())
                self._streams.clear()
            for r, stream in waiting:
                stream.push(Delivery([], ENGINE_FAILED, r.decode_steps))
            if self.on_failure is not None:
                self.on_failure()
            raise  # the thread's traceback goes to the server log

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
