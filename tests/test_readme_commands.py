"""Every command the README shows runs as shown, on the CPU.

The README promises that each ```sh block runs as it stands from the repository root and stands
alone. This test extracts those blocks and runs them in a scratch copy of the files they read
(specs/, generated/, examples/, benchmarks/), so the working tree is left as it was. A command is
either run or listed in EXCLUDED with the reason, so a new README command is run by default and
fails here if it does not work.

`./dev demo` and `./dev test` are not run as such: `./dev test` is this suite itself, and
`./dev demo` installs into .venv before running two commands, which this test reads out of the `dev`
script and runs (that is what the README says the demo does).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
# What the README's commands read, relative to the repository root.
COPIED = ("specs", "generated", "examples", "benchmarks")
BLOCK_TIMEOUT_S = 300

# Commands shown but not run here (matched against the whole command), with the reason.
EXCLUDED = {
    r"^\./dev demo\b": "its two commands are read out of ./dev and run instead (demo_commands)",
    r"^\./dev test\b": "the test suite itself",
    r"torchrun\b": "several processes under torchrun: tests/test_dp_attention_serving.py and "
                   "tests/test_distributed_serving.py run these launches",
}
# Commands whose success is an exit status other than 0.
EXPECTED_STATUS = {r"dspark-compile diff\b": 1}  # 1: the two packages differ


@dataclass(frozen=True)
class Block:
    line: int             # README line of the opening fence
    commands: list[str]   # logical commands: continuation lines and heredocs joined


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```sh":
            i += 1
            continue
        start, i = i + 1, i + 1
        body: list[str] = []
        while lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        blocks.append(Block(start, split_commands(body)))
        i += 1
    return blocks


def split_commands(body: list[str]) -> list[str]:
    commands: list[str] = []
    j = 0
    while j < len(body):
        if not body[j].strip() or body[j].lstrip().startswith("#"):
            j += 1
            continue
        cmd = [body[j]]
        heredoc = re.search(r"<<-?'?(\w+)'?", body[j])
        while cmd[-1].rstrip().endswith("\\") or heredoc:
            j += 1
            cmd.append(body[j])
            if heredoc and body[j].strip() == heredoc.group(1):
                heredoc = None
        commands.append("\n".join(cmd))
        j += 1
    return commands


def exclusion(command: str) -> str | None:
    return next((why for pattern, why in EXCLUDED.items() if re.search(pattern, command.strip())), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script(commands: list[str]) -> str:
    """One bash script: stop at the first failing command, never leave a background server behind."""
    out = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for command in commands:
        status = next((s for p, s in EXPECTED_STATUS.items() if re.search(p, command)), 0)
        if status:
            out += ["set +e", command, "rc=$?", "set -e",
                    f'[ "$rc" -eq {status} ] || {{ echo "exit status $rc, expected {status}" >&2; exit 1; }}']
        else:
            out.append(command)
    return "\n".join(out) + "\n"


def localised(command: str, port: int) -> str:
    """The README's `.venv/bin/` is the repository's virtual environment; 8000 becomes a free port."""
    command = re.sub(r"(?<![\w/.])\.venv/bin/", f"{VENV_BIN}/", command)
    return command.replace("8000", str(port))


def run_script(text: str, cwd: Path, logs: Path) -> subprocess.CompletedProcess[str]:
    """Run one block in its own process group; whatever it leaves running is killed after it.

    Output goes to files, not pipes, so a leftover background process cannot keep the wait open.
    """
    # One thread per process: two blocks run at once, and every block is mostly process start-up.
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(["bash", "-c", text], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = -1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    note = f"timed out after {BLOCK_TIMEOUT_S} s\n" if status == -1 else ""
    return subprocess.CompletedProcess(proc.args, status, out.read_text(), note + err.read_text())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    for name in COPIED:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def demo_commands() -> list[str]:
    """The commands `./dev demo` runs after installing, as `dspark-compile …` and `dspark …`."""
    text = (REPO / "dev").read_text(encoding="utf-8")
    case = re.search(r"^\s*demo\)\n(.*?)^\s*;;", text, re.S | re.M)
    assert case, "no demo) case in ./dev"
    commands = [c for c in split_commands(case.group(1).splitlines()) if "ensure_venv" not in c]
    plain = [re.sub(r'"\$VENV/bin/([\w-]+)"', r"\1", c).replace('"$@"', "") for c in commands]
    return [" ".join(c.replace("\\\n", " ").split()) for c in plain]


def test_the_readme_says_what_the_demo_runs() -> None:
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    commands = demo_commands()
    assert [c.split()[0] for c in commands] == ["dspark-compile", "dspark"]
    for command in commands:
        assert f"`{command}`" in readme, f"README.md does not show the demo's command {command!r}"


def test_the_readme_blocks_parse_into_commands() -> None:
    blocks = readme_blocks((REPO / "README.md").read_text(encoding="utf-8"))
    commands = [c for b in blocks for c in b.commands]
    assert blocks[0].line == 3  # the README opens with the two commands, right under its title
    assert blocks[0].commands == ["./dev demo    # compile specs/tiny_cpu_compact.yaml, run it on fixed "
                                  "prompts, compare with target-only",
                                  "./dev test    # run the test suite (ruff + pytest, slow tests included)"]
    unused = [p for p in EXCLUDED if not any(re.search(p, c.strip()) for c in commands)]
    assert not unused, f"exclusions that match no README command (remove them): {unused}"
    assert sum(exclusion(c) is None for c in commands) >= 10  # the tour is there, not parsed away
    assert split_commands(["a \\", "  b", "x <<'EOF'", "y \\", "EOF", "# c", "z &"]) == [
        "a \\\n  b", "x <<'EOF'\ny \\\nEOF", "z &"]


def test_a_block_leaves_no_process_behind(tmp_path: Path) -> None:
    """A background process a block forgets to stop neither holds the test up nor outlives it."""
    started = time.monotonic()
    result = run_script("sleep 600 &\necho $! > pid\necho started", tmp_path, tmp_path / "job")
    assert (result.returncode, result.stdout) == (0, "started\n")
    assert time.monotonic() - started < 30
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived its block"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that no longer exists to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_every_readme_command_runs(workspace: Path, tmp_path: Path) -> None:
    blocks = readme_blocks((REPO / "README.md").read_text(encoding="utf-8"))
    demo = script([f"{VENV_BIN}/{c}" for c in demo_commands()])
    jobs: list[tuple[str, str]] = [("./dev demo (its commands)", demo)]
    for block in blocks:
        todo = [c for c in block.commands if exclusion(c) is None]
        if todo:
            port = free_port()
            jobs.append((f"README.md:{block.line}", script([localised(c, port) for c in todo])))
    # The blocks stand alone, so they run side by side, two at a time; those starting the most
    # runtime processes (the slow part: each loads torch and a model) go first.
    order = sorted(range(len(jobs)), key=lambda k: -len(re.findall(r"/dspark |torchrun", jobs[k][1])))
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda k: run_script(jobs[k][1], workspace, tmp_path / f"job{k}"), order)
        done = dict(zip(order, runs, strict=True))
    failures = [f"{name}: exit {done[k].returncode}\n{text}\n--- stdout\n{done[k].stdout[-3000:]}\n"
                f"--- stderr\n{done[k].stderr[-3000:]}"
                for k, (name, text) in enumerate(jobs) if done[k].returncode != 0]
    assert not failures, "\n\n".join(failures)
    assert "acceptance by draft position" in done[0].stdout  # what the README says the demo prints
    assert (workspace / "generated" / "my_deployment" / "manifest.json").is_file()
    assert (workspace / "runs" / "cal" / "sts.json").is_file()
    assert (workspace / "runs" / "report" / "report.md").is_file()
