"""The oracle: greedy speculative output equals greedy target-only output, token for token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.corpus import held_out_text
from dspark.runtime.engine.requests import RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import REPO, compile_variant

MAX_NEW = 64


def _prompts(tokenizer) -> list[list[int]]:
    """Varied held-out prompts: different lengths, starting mid-line, one of a single byte."""
    texts = held_out_text(200_000)
    prompts = [texts[i][(97 * i) % 400:][: 5 + 23 * i] for i in range(7)] + ["x"]
    return [tokenizer.encode(p) for p in prompts]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("lossless")
    pkg = load_package(compile_variant(tmp, "tiny_cpu_static.yaml", {}, "ref_pkg"))
    prompts = _prompts(pkg.tokenizer)
    outputs, stats = Runtime(pkg).generate(prompts, MAX_NEW, target_only=True)
    assert stats.steps > 0 and all(outputs)
    return tmp, prompts, outputs


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_static_speculative_equals_target_only(reference, batch: int) -> None:
    tmp, prompts, expected = reference
    pkg_dir = compile_variant(tmp, "tiny_cpu_static.yaml",
                              {"serving": {"max_running_requests": batch}}, f"lossless_b{batch}")
    runtime = Runtime(load_package(pkg_dir))
    outputs, stats = runtime.generate(prompts, MAX_NEW)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {i}: speculative output differs from target-only"
    assert stats.verify_rows == stats.request_steps * runtime.plan.num_draft_tokens
    assert sum(stats.drafts_accepted) > 0  # the draft is doing real work
    assert runtime.slots.num_free_slots == batch  # every slot came back
    assert sum(runtime.slots.generation) == len(prompts)  # reused slots got new generations


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "compact"])
def test_chunked_prefill_is_lossless(reference, mode: str) -> None:
    """Prompts prefilled 13 tokens per step (over all requests, across decode steps of the running
    batch) decode exactly as unchunked target-only decoding."""
    tmp, prompts, expected = reference
    verify = {"mode": mode, "allow_no_cost_model": True} if mode == "compact" else {}
    pkg_dir = compile_variant(tmp, "tiny_cpu_static.yaml",
                              {"verify": verify, "serving": {"max_running_requests": 4,
                                                             "chunked_prefill_tokens": 13}},
                              f"chunked_{mode}")
    runtime = Runtime(load_package(pkg_dir))
    assert max(len(p) for p in prompts) > 13 * 3  # several chunks for the longest prompts
    outputs, _ = runtime.generate(prompts, MAX_NEW)
    assert outputs == expected
    target_only, _ = runtime.generate(prompts, MAX_NEW, target_only=True)
    assert target_only == expected
    assert runtime.slots.num_free_slots == 4 and not runtime.has_work


def test_request_over_context_is_rejected_with_the_limit_named(reference) -> None:
    tmp, _, _ = reference
    runtime = Runtime(load_package(tmp / "pkgs" / "ref_pkg"))
    with pytest.raises(RequestError, match="max_context_len"):
        runtime.generate([[256] + [65] * 1000], 40)


@pytest.mark.slow
def test_cli_json_and_generated_entry_point_agree(tmp_path: Path) -> None:
    pkg = REPO / "generated" / "tiny_cpu_static"
    args = ["--prompt", "def parse(text):\n", "--prompt", "import re\n", "--max-new-tokens", "24",
            "--json"]
    spec = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", str(pkg), *args],
                          capture_output=True, text=True, check=True)
    ref = subprocess.run([sys.executable, "-m", "generated.tiny_cpu_static", "run", "--target-only",
                          *args], capture_output=True, text=True, check=True, cwd=REPO)
    a, b = json.loads(spec.stdout), json.loads(ref.stdout)
    assert [c["token_ids"] for c in a["completions"]] == [c["token_ids"] for c in b["completions"]]
    assert a["stats"]["mean_commit_len"] > 1.0 and b["stats"]["mean_commit_len"] == 1.0
    assert len(a["stats"]["acceptance_by_position"]) == 7
    assert all(len(c["token_ids"]) <= 24 for c in a["completions"])


def test_a_run_compared_with_target_only_prints_both_speeds_and_checks_the_outputs(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`dspark run --compare-target-only` (what `./dev demo` runs): the same prompts decoded target-only
    after the speculative run; greedy outputs compared token for token, sampled ones not."""
    from dspark.cli.main import main

    pkg = str(REPO / "generated" / "tiny_cpu_compact")
    args = ["run", pkg, "--prompt", "def parse(text):\n", "--prompt", "import re\n", "--max-new-tokens", "24",
            "--compare-target-only"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = out["target_only_reference"]
    assert ref["identical"] is True
    assert ref["stats"]["mean_commit_len"] == 1.0 and out["stats"]["mean_commit_len"] > 1.0
    assert ref["stats"]["generated_tokens"] == out["stats"]["generated_tokens"]
    assert ref["speedup"] > 0 and ref["decode_speedup"] > 0
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[tiny_cpu_compact · target-only\] \d+ tokens in .* · outputs identical", lines[-2])
    assert lines[-1].startswith("speculative / target-only: ")
    assert main([*args, "--temperature", "0.8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target_only_reference"]["identical"] is None
