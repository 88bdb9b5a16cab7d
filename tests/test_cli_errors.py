"""`dspark run`, `serve` and `profile` (and a generated package's entry point) with the mistakes a new
user makes: each is one `dspark: error: ...` line saying what to do, exit status 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.cli.main import main
from dspark.cli.package_entry import main as package_main

from .runtime_helpers import REPO

STATIC = REPO / "generated" / "tiny_cpu_static"


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *says: str) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("dspark: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not captured.out
    for text in says:
        assert text in err, err
    return err


@pytest.mark.parametrize("command", [["run", "--prompt", "x"], ["serve", "--port", "0"],
                                     ["profile", "-o", "tables"]])
def test_a_path_that_is_not_a_generated_package(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               command: list[str]) -> None:
    name, *rest = command
    _fails([name, str(tmp_path / "missing"), *rest], capsys, "no such directory", "dspark-compile build")
    (tmp_path / "file.txt").write_text("x")
    _fails([name, str(tmp_path / "file.txt"), *rest], capsys, "is a file")
    _fails([name, str(tmp_path), *rest], capsys, "is not a generated dspark package")


def test_prompts_files_that_cannot_be_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(path: Path) -> list[str]:
        return ["run", str(STATIC), "--prompts-file", str(path)]

    _fails(run(tmp_path / "missing.json"), capsys, "missing.json not found")
    (tmp_path / "numbers.json").write_text("[1, 2]")
    _fails(run(tmp_path / "numbers.json"), capsys, "expected a JSON list of strings", '"def main("')
    (tmp_path / "object.json").write_text('{"prompts": ["a"]}')
    _fails(run(tmp_path / "object.json"), capsys, "expected a JSON list of strings")
    (tmp_path / "broken.json").write_text('["a", ')
    _fails(run(tmp_path / "broken.json"), capsys, "broken.json is not valid JSON")
    (tmp_path / "empty.txt").write_text("\n  \n")
    _fails(run(tmp_path / "empty.txt"), capsys, "holds no prompts")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    _fails(run(tmp_path / "latin1.txt"), capsys, "not UTF-8")
    _fails(run(tmp_path), capsys, "is a directory")


@pytest.mark.parametrize(("options", "says"), [
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be a positive integer, got -5"),
    (["--budget-fraction", "1.5"], "--budget-fraction must be between 0 and 1, got 1.5"),
    (["--budget-fraction", "-0.1"], "--budget-fraction must be between 0 and 1"),
    (["--budget-fraction", "0.5"], "--budget-fraction needs a cap-accept or compact build"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or more"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be 0 (off) or more"),
    (["--record-steps", "0"], "--record-steps must be a positive integer"),
    (["--record-features"], "--record-features needs --record DIR"),
    (["--target-only", "--compare-target-only"], "leave out --target-only"),
])
def test_out_of_range_run_options(capsys: pytest.CaptureFixture[str], options: list[str], says: str) -> None:
    _fails(["run", str(STATIC), "--prompt", "x", *options], capsys, says)


def test_serving_on_a_port_in_use_fails_before_loading_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _fails(["serve", str(STATIC), "--port", str(port)], capsys, f"127.0.0.1:{port}",
               "already in use", "--port")
    _fails(["serve", str(STATIC), "--port", "70000"], capsys, "--port must be between 0 and 65535")
    _fails(["serve", str(STATIC), "--host", "no-such-host.invalid"], capsys, "--host")


@pytest.mark.parametrize(("options", "says"), [
    (["--repeats", "0"], "--repeats must be a positive integer"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--batch-sizes", "1,0"], "every --batch-sizes value must be a positive integer"),
    (["--m-bin", "0"], "--m-bin must be a positive integer"),
])
def test_out_of_range_profile_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str],
                                      says: str) -> None:
    _fails(["profile", str(STATIC), "-o", str(tmp_path / "t"), *options], capsys, says)
    assert not (tmp_path / "t").exists()


def test_the_package_entry_point_reports_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    assert package_main(STATIC, ["run", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m generated.tiny_cpu_static: error: --max-new-tokens must be a positive "
                   "integer, got 0\n")


def test_the_installed_command_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", str(tmp_path), "--prompt", "x"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("dspark: error: ")
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("argv", [[], ["run"], ["serve"], ["bench"], ["profile"], ["train-tiny"]])
def test_help_texts_speak_to_users(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    texts = [capsys.readouterr().out]
    for command in ([], ["run"], ["serve"]):
        with pytest.raises(SystemExit):
            package_main(STATIC, [*command, "--help"])
        texts.append(capsys.readouterr().out)
    for text in texts:
        assert text.startswith("usage: ")
        # no internal module names or notes meant for developers
        for internal in ("dspark/", ".py", "DESIGN", "the lead", "TODO", "runtime."):
            assert internal not in text, (internal, text)
