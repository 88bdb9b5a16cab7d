"""A DeepSeek-V4 checkpoint's own DSpark stages as a deployment's draft: a spec whose `draft.checkpoint` is
the target's checkpoint compiles with the stages' settings read from its config.json (`dsv4_stages`), the
engine drafts with them over their windowed context cache, and greedy speculative output equals target-only
output in every verify mode; the stages' settings that do not fit are refused at the spec line, and a
checkpoint edited after compiling is refused when it loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dspark.cli.compile import main as compile_main
from dspark.modes import DSV4_STAGES
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.families.dsv4.dspark_stages import Dsv4DSparkStages
from dspark.runtime.models.checkpoint import CheckpointError
from dspark.runtime.package import load_package

from .dsv4_dspark_common import STAGE_CONFIG, write_stage_checkpoint

MODES = ("static", "cap-accept", "compact")
NEW_TOKENS = 16


def spec(name: str, checkpoint: Path, mode: str, draft: dict[str, Any] | None = None) -> dict[str, Any]:
    verify = {"mode": mode} if mode == "static" else {"mode": mode, "allow_no_cost_model": True}
    return {"name": name, "model": {"family": "dsv4", "checkpoint": str(checkpoint)},
            "draft": draft or {"checkpoint": str(checkpoint)},
            "backend": {"kind": "cpu", "device": "generic"}, "verify": verify,
            "serving": {"max_context_len": 128, "max_total_tokens": 1024, "max_running_requests": 4}}


def build(root: Path, body: dict[str, Any]) -> tuple[int, Path]:
    path = root / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return compile_main(["build", str(path), "-o", str(root / body["name"])]), root / body["name"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_stage_checkpoint(tmp_path_factory.mktemp("dsv4_stages") / "ckpt")


@pytest.fixture(scope="module")
def packages(checkpoint: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packages")
    out = {}
    for mode in MODES:
        code, out[mode] = build(root, spec(f"dsv4_stages_{mode.replace('-', '_')}", checkpoint, mode))
        assert code == 0
    return out


def prompts() -> list[list[int]]:
    # one shorter than the window, two past it (the window slides over the stages' context)
    return [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (4, 13, 27)]


def test_the_target_checkpoint_compiles_as_its_own_draft(packages) -> None:
    draft = load_package(packages["compact"]).deployment.draft
    got = (draft.architecture, draft.num_layers, draft.block_size, draft.mask_token_id,
           draft.target_layer_ids, draft.markov_rank, draft.confidence_head, draft.confidence_with_markov)
    assert got == (DSV4_STAGES, 2, 4, STAGE_CONFIG["dspark_noise_token_id"], (1, 2), 8, True, True)
    text = (packages["compact"] / "deployment.py").read_text()
    assert "architecture='dsv4_stages'" in text


def test_greedy_speculation_with_the_stages_equals_target_only_in_every_mode(packages) -> None:
    want = None
    for mode, package in packages.items():
        runtime = Runtime(load_package(package))
        assert isinstance(runtime.draft, Dsv4DSparkStages)
        # the stages read the target's own tables (the same tensors, not copies)
        target = runtime.target.model  # type: ignore[union-attr]
        assert runtime.draft.embed.data_ptr() == target.embed.data_ptr()
        assert runtime.draft.head.data_ptr() == target.head.data_ptr()
        assert runtime.models.draft_kv.v is runtime.models.draft_kv.k  # one K=V latent, stored once
        target_only, _ = runtime.generate(prompts(), NEW_TOKENS, target_only=True)
        want = want or target_only
        assert target_only == want, mode
        speculative, stats = runtime.generate(prompts(), NEW_TOKENS)
        assert speculative == want and stats.steps > 0, mode
        assert stats.verify_rows > stats.request_steps, mode  # drafts were verified, not only roots


def test_a_dummy_stage_draft_serves_losslessly(checkpoint: Path, tmp_path: Path) -> None:
    draft = {"checkpoint": str(tmp_path / "absent"), "architecture": "dsv4_stages", "load_format": "dummy",
             "num_layers": 1, "block_size": 3, "target_layer_ids": [0, 3], "markov_rank": 4}
    code, package = build(tmp_path, spec("dummy_stages", checkpoint, "compact", draft))
    assert code == 0
    runtime = Runtime(load_package(package))
    assert isinstance(runtime.draft, Dsv4DSparkStages) and runtime.draft.cfg.stages == 1
    target_only, _ = runtime.generate(prompts(), 8, target_only=True)
    assert runtime.generate(prompts(), 8)[0] == target_only


def _config(path: Path, **change: Any) -> Path:
    cfg = {**STAGE_CONFIG, **change}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(("change", "draft", "family", "message"), [
    ({"dspark_target_layer_ids": [1, 4]}, None, "dsv4", r"dspark_target_layer_ids is \[1, 4\]"),
    ({"compress_ratios": [0, 4, 8, 4, 4, 0]}, None, "dsv4", "stages are window-only"),
    ({}, {"architecture": "dspark_block"}, "dsv4", "holds a DeepSeek-V4 checkpoint's DSpark stages"),
    ({}, {"block_size": 6}, "dsv4", "block_size is 6 here but 4"),
])
def test_stages_that_do_not_fit_are_refused_at_the_spec_line(checkpoint: Path, tmp_path: Path, capsys,
                                                              change, draft, family, message) -> None:
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    _config(ckpt, **change)
    body = spec("refused", ckpt, "compact", {"checkpoint": str(ckpt), **(draft or {})})
    code, out = build(tmp_path, body)
    err = capsys.readouterr().err
    assert code != 0 and not out.exists()
    assert "refused.yaml:" in err and "draft" in err
    import re
    assert re.search(message, err), err


def test_stages_draft_only_for_their_own_target(checkpoint: Path, tmp_path: Path, capsys) -> None:
    # another V4 model's stages: the draft checkpoint's geometry differs from the target's
    import shutil
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    _config(other, index_topk=2)
    code, _ = build(tmp_path, spec("other", checkpoint, "compact", {"checkpoint": str(other)}))
    assert code != 0 and "belong to another DeepSeek-V4 model" in capsys.readouterr().err


def test_a_checkpoint_edited_after_compiling_is_refused_when_it_loads(checkpoint: Path,
                                                                      tmp_path: Path) -> None:
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    code, package = build(tmp_path, spec("edited", ckpt, "compact"))
    assert code == 0
    _config(ckpt, dspark_markov_rank=4)
    with pytest.raises(CheckpointError, match=r"markov_rank 4 \(compiled 8\)"):
        Runtime(load_package(package))


def test_a_rank_reads_the_whole_tables_the_stages_share_from_the_checkpoint(checkpoint: Path) -> None:
    # under tensor parallelism the target's tables are split; the one rank that drafts reads them whole
    from dspark.runtime.distributed.sharded_load import read_embeddings
    from dspark.runtime.models.checkpoint import load_target

    target = load_target(str(checkpoint), family="dsv4").model
    embed, head = read_embeddings(str(checkpoint), "float32", None, "dsv4")
    assert torch.equal(embed, target.embed) and torch.equal(head, target.head)  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_draft_with_the_stages_as_one_process_decodes(checkpoint: Path, tmp_path: Path) -> None:
    # under tensor parallelism the target's tables are split; the drafting rank reads them whole
    import sys

    from dspark.compiler import build

    from .gloo_ranks import free_port
    from .parallel_builds import NEW_TOKENS as TOKENS
    from .parallel_builds import completions, prompt_args, run, torchrun

    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / "__init__.py").touch()
    names = {}
    for tp in (1, 2):
        body = spec(f"dsv4_stages_tp{tp}", checkpoint, "compact")
        body["parallelism"] = {"tp": tp}
        path = tmp_path / f"{body['name']}.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        build(path, tmp_path / "generated" / body["name"])
        names[tp] = body["name"]
    want = completions(run([sys.executable, "-m", f"generated.{names[1]}", "run", *prompt_args(),
                            "--max-new-tokens", str(TOKENS), "--target-only", "--json"], tmp_path))
    assert torchrun(names[2], 2, tmp_path, free_port()) == want
