"""Tensor parallelism launched with torchrun: the embedded pair's static and compact builds recompiled with
`parallelism.tp: 2`, started as `torchrun --nproc-per-node 2 -m generated.<name> run …` on the CPU (gloo over
127.0.0.1). Rank 0 runs the engine and leads; rank 1 follows its step commands on its shard. The greedy
output equals single-process target-only decoding, token for token; a launch that does not fit the build is
refused with the command that does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark.compiler import build

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The quick brown fox", "Once upon a time", "def main():")
NEW_TOKENS = 24
TIMEOUT = 300  # a hung collective fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_tp(mode: str, tp: int, root: Path) -> str:
    """specs/tiny_cpu_<mode>.yaml with parallelism.tp `tp`, compiled to root/generated/<name>."""
    spec_path = REPO / "specs" / f"tiny_cpu_{mode}.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    for section in ("cost_model", "calibration"):  # their table files, where the spec names them
        if isinstance(spec.get(section), dict) and "file" in spec[section]:
            spec[section]["file"] = str(spec_path.parent / spec[section]["file"])
    name = spec["name"] = f"tiny_cpu_{mode}_tp{tp}"
    spec["parallelism"] = {"tp": tp}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "generated").mkdir(exist_ok=True)
    (root / "generated" / "__init__.py").touch()
    # the tables were profiled on the one-process build, whose fingerprint they carry
    build(path, root / "generated" / name, allow_stale_tables=True)
    return name


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def completions(result: subprocess.CompletedProcess[str]) -> list[list[int]]:
    assert result.returncode == 0, result.stderr[-3000:]
    return [c["token_ids"] for c in json.loads(result.stdout)["completions"]]


def prompt_args() -> list[str]:
    return [arg for p in PROMPTS for arg in ("--prompt", p)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "compact"])
def test_tp2_under_torchrun_decodes_as_one_process(mode: str, tmp_path: Path) -> None:
    reference = completions(run([sys.executable, "-m", f"generated.tiny_cpu_{mode}", "run", *prompt_args(),
                                 "--max-new-tokens", str(NEW_TOKENS), "--target-only", "--json"], REPO))
    name = compile_tp(mode, 2, tmp_path)
    launched = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    "-m", f"generated.{name}", "run", *prompt_args(), "--max-new-tokens", str(NEW_TOKENS),
                    "--json"], tmp_path)
    assert completions(launched) == reference


def test_a_launch_that_does_not_fit_the_build_says_how_to_launch_it(tmp_path: Path) -> None:
    name = compile_tp("static", 2, tmp_path)
    result = run([sys.executable, "-m", f"generated.{name}", "run", "--prompt", "hi"], tmp_path)
    assert result.returncode == 2
    assert (f"{name} is compiled for tp × dp = 2 processes, launched as 1: run `torchrun --nproc-per-node 2 "
            f"-m generated.{name} run|serve …`") in result.stderr
    assert "Traceback" not in result.stderr
