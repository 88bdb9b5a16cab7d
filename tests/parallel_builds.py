"""The embedded pair's builds recompiled with another `parallelism`, and running them as processes."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from dspark.compiler import build

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The quick brown fox", "Once upon a time", "def main():")
NEW_TOKENS = 24
TIMEOUT = 300  # a hung collective fails the test instead of the suite


def compile_parallel(spec: str, root: Path, **parallelism: Any) -> str:
    """specs/<spec>.yaml with `parallelism`, compiled to root/generated/<name> (importable with root on the
    path); returns the name."""
    spec_path = REPO / "specs" / f"{spec}.yaml"
    data = yaml.safe_load(spec_path.read_text())
    for section in ("cost_model", "calibration"):  # their table files, where the spec names them
        if isinstance(data.get(section), dict) and "file" in data[section]:
            data[section]["file"] = str(spec_path.parent / data[section]["file"])
    suffix = "".join(f"_{k.replace('_', '')}{int(v)}" for k, v in parallelism.items())
    name = data["name"] = f"{spec}{suffix}"
    data["parallelism"] = parallelism
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (root / "generated").mkdir(exist_ok=True)
    (root / "generated" / "__init__.py").touch()
    # the tables were profiled on the one-process build, whose fingerprint they carry
    build(path, root / "generated" / name, allow_stale_tables=True)
    return name


def run(args: list[str], cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    # PYTHONFAULTHANDLER: a rank that aborts in native code prints where each of its threads was
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1", **env_vars}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def completions(result: subprocess.CompletedProcess[str]) -> list[list[int]]:
    assert result.returncode == 0, result.stderr[-8000:]
    return [c["token_ids"] for c in json.loads(result.stdout)["completions"]]


def prompt_args(prompts: tuple[str, ...] = PROMPTS) -> list[str]:
    return [arg for p in prompts for arg in ("--prompt", p)]


@functools.cache
def _reference(build_name: str, prompts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    result = run([sys.executable, "-m", f"generated.{build_name}", "run", *prompt_args(prompts),
                  "--max-new-tokens", str(NEW_TOKENS), "--target-only", "--json"], REPO)
    return tuple(map(tuple, completions(result)))


def reference(build_name: str, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """One process's greedy target-only decoding of `prompts` with the repository's `build_name` (run once
    per session: the repository's builds do not change under the tests)."""
    return [list(c) for c in _reference(build_name, prompts)]


def torchrun(name: str, processes: int, cwd: Path, port: int, prompts: tuple[str, ...] = PROMPTS,
             *extra: str) -> list[list[int]]:
    """`torchrun --nproc-per-node processes -m generated.<name> run …` greedy, with the check mode on (every
    step's results compared across the ranks that must agree)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    command = ["-m", f"generated.{name}", "run", *prompt_args(prompts), "--max-new-tokens", str(NEW_TOKENS),
               "--json", *extra]
    return completions(run(launch + command, cwd, DSPARK_TP_CHECK="1"))


def http_json(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_healthy(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:  # the leader listens once every rank has loaded and joined
        try:
            if http_json(f"{url}/health")[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.5)
