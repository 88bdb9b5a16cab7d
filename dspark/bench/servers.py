"""The servers of `dspark bench --sweep` (`dspark.bench.sweep`): what one runs (a package and the `dspark
serve` flags of a decoding policy) and the subprocess that runs it, started on a free loopback port, ready
when `GET /health` answers, and always stopped (SIGINT, then SIGTERM, then SIGKILL), also when the sweep
is interrupted or killed politely.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

HOST = "127.0.0.1"
READY_PATH = "/health"
POLL_S = 0.25
STOP_GRACE_S = 30.0  # uvicorn finishes in-flight requests on SIGINT; a healthy server is gone in a second
KILL_GRACE_S = 10.0
PORT_ATTEMPTS = 3  # a free port found here may be taken before the server binds it
STDERR_TAIL_LINES = 3


class SweepError(Exception):
    """The sweep could not finish: a server did not come up, died, or failed every request (exit 1)."""


@dataclass(frozen=True)
class SweepPackage:
    """A generated package as the sweep needs it: where it is and how it verifies."""

    path: Path
    name: str
    verify_mode: str  # "static", "cap-accept" or "compact"
    num_draft_tokens: int  # N = gamma + 1

    @property
    def is_static(self) -> bool:
        return self.verify_mode == "static"


@dataclass(frozen=True)
class ServerRun:
    """One server process: the policy it measures, its package and the `dspark serve` flags that make it."""

    policy: str  # "target-only", "static", "fixed-K" or "adaptive"
    package: SweepPackage
    flags: tuple[str, ...] = ()

    def command(self, port: int, python: str = sys.executable) -> list[str]:
        return [python, "-m", "dspark", "serve", str(self.package.path), "--host", HOST, "--port", str(port),
                "--log-level", "warning", *self.flags]


# -- the server -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A `dspark serve` subprocess for one `ServerRun`: started and ready on entry, stopped on exit (also
    on an exception or Ctrl-C); its output goes to a temporary file whose tail explains a failure."""

    def __init__(self, run: ServerRun, timeout_s: float, python: str = sys.executable) -> None:
        self.run = run
        self.timeout_s = timeout_s
        self.python = python
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> ServerProcess:
        try:
            for attempt in range(PORT_ATTEMPTS):
                self._start()
                if self._wait_ready(retry_taken_port=attempt + 1 < PORT_ATTEMPTS):
                    return self
                self.stop()
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable: the last attempt raises")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        self.port = free_port()
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.run.command(self.port, self.python), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def _wait_ready(self, retry_taken_port: bool) -> bool:
        """True once the server answers; False when it lost its port to another process (try another);
        a `SweepError` with the server's last words when it exits or never answers."""
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.output_tail()
                if retry_taken_port and "already in use" in tail:
                    return False
                raise SweepError(f"the {self.run.policy} server ({self.describe()}) exited with status "
                                 f"{code} before it answered on port {self.port}; its output ends: {tail}")
            try:
                if httpx.get(self.url + READY_PATH, timeout=2.0, trust_env=False).status_code == 200:
                    self.ready = True
                    return True
            except httpx.HTTPError:
                pass  # not listening yet: the model is still loading
            if time.monotonic() > deadline:
                raise SweepError(f"the {self.run.policy} server ({self.describe()}) did not answer GET "
                                 f"{READY_PATH} on port {self.port} within {self.timeout_s:g} s; its output "
                                 f"ends: {self.output_tail()}; pass a larger --server-timeout if the model "
                                 "loads slowly")
            time.sleep(POLL_S)

    def describe(self) -> str:
        return " ".join(["dspark serve", str(self.run.package.path), *self.run.flags])

    def check_alive(self) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            raise SweepError(f"the {self.run.policy} server ({self.describe()}) exited with status {code} "
                             f"mid-sweep; its output ends: {self.output_tail()}")

    def output_tail(self) -> str:
        """The server's last non-empty output lines, on one line."""
        if self._log is None:
            return "(no output)"
        self._log.flush()
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().decode("utf-8", "replace").splitlines()]
        tail = [line for line in lines if line][-STDERR_TAIL_LINES:]
        return " | ".join(tail) if tail else "(no output)"

    def stop(self) -> None:
        """SIGINT (uvicorn's graceful shutdown), then SIGTERM, then SIGKILL; always waits for the exit, so
        no process outlives the sweep."""
        proc, self.proc = self.proc, None
        ready, self.ready = self.ready, False
        if proc is not None:
            try:
                if proc.poll() is None:
                    # Before uvicorn installs its handlers SIGINT may be ignored (a process started in the
                    # background inherits that): a server still loading is terminated instead.
                    proc.send_signal(signal.SIGINT if ready else signal.SIGTERM)
                    try:
                        proc.wait(STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        proc.terminate()
                        try:
                            proc.wait(KILL_GRACE_S)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
            except BaseException:  # a second Ctrl-C while waiting: do not leave it running
                proc.kill()
                proc.wait()
                raise
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt while the sweep runs, so that `finally` blocks stop the
    servers when the sweep is killed politely (a terminal closing, `timeout`, a job scheduler)."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    names = [s for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s)]
    try:
        previous = {name: signal.signal(getattr(signal, name), interrupt) for name in names}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
