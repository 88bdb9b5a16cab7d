"""A `CompletionServer` served by uvicorn on a thread of the test process, on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from dspark.runtime.serve.server import CompletionServer


@contextmanager
def serving_in_process(server: CompletionServer) -> Iterator[tuple[uvicorn.Server, str]]:
    """(the uvicorn server, its base URL) while the block runs; stopped and joined after it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="critical", access_log=False))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield uv, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()
