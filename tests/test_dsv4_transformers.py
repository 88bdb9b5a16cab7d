"""DeepSeek-V4's whole architecture against an independent reference: transformers' `DeepseekV4ForCausalLM` at
tiny random geometry (hash-routed and top-k experts, the shared expert, the SwiGLU clamp, hyper-connections,
the grouped output projection, YaRN on the compressed layers; sliding, C4 and C128-kind layers), saved with
`save_pretrained` as sharded safetensors and loaded by dspark from its `config.json`.

The logits of the reference model, of its incremental steps and of the paged static and compact verify steps
equal transformers' within float32 tolerance; the checkpoint in the release's names and in transformers'
module names loads to the same model; a served package of the checkpoint decodes greedily as transformers'
`generate(do_sample=False)`, and speculative output equals target-only output in every verify mode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, name) for name in ("DeepseekV4Config", "DeepseekV4ForCausalLM")):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 (DeepseekV4Config, "
                "DeepseekV4ForCausalLM)", allow_module_level=True)

from dspark.cli.compile import main as compile_main  # noqa: E402
from dspark.formats.dsv4_config import Dsv4Geometry  # noqa: E402
from dspark.formats.dsv4_hf_config import dsv4_geometry  # noqa: E402
from dspark.runtime.engine.runtime import Runtime  # noqa: E402
from dspark.runtime.families.dsv4.cpu_paged import Dsv4PagedCaches, prefill, run_step  # noqa: E402
from dspark.runtime.families.dsv4.model import DSV4Model  # noqa: E402
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig  # noqa: E402
from dspark.runtime.families.dsv4.weights import Dsv4WeightsError, load_dsv4_weights  # noqa: E402
from dspark.runtime.models.checkpoint import CheckpointError, load_target  # noqa: E402
from dspark.runtime.package import load_package  # noqa: E402
from dspark.runtime.tokenizer import BYTE_TOKENIZER_FILE, EOS_ID, VOCAB_SIZE  # noqa: E402

from .dsv4_quant_common import naive_fp4, naive_fp8, naive_w8a8, quantise_fp4, quantise_fp8  # noqa: E402

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]
SEQ = 44  # past YaRN's original 16 positions, five C8 blocks, ten C4 blocks
TOL = 2e-5


def hf_config() -> transformers.DeepseekV4Config:
    # 16 index heads: with two, relu(q . k) is often 0 for every head and top-k breaks exact ties arbitrarily
    return transformers.DeepseekV4Config(
        vocab_size=VOCAB_SIZE, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=6,
        layer_types=LAYER_TYPES, compress_rates={"compressed_sparse_attention": 4,
                                                 "heavily_compressed_attention": 8},
        num_hash_layers=1, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=6, o_groups=2, o_lora_rank=8,
        index_n_heads=16, index_head_dim=16, index_topk=3, qk_rope_head_dim=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=256, swiglu_limit=0.5, routed_scaling_factor=1.5, eos_token_id=EOS_ID,
        bos_token_id=None)


@pytest.fixture(scope="module")
def hf_model() -> transformers.DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in model.named_parameters():  # transformers zeroes sinks and biases: make each count
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.rand(VOCAB_SIZE, 6, generator=gen).argsort(-1)[:, :2])
            else:
                gate.e_score_correction_bias.copy_(torch.randn(6, generator=gen))
    return model


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dsv4") / "target"
    hf_model.save_pretrained(path, max_shard_size="40KB")  # several shards behind an index
    (path / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "byte"}))
    return path


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def reference_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0]


def config_of(checkpoint: Path) -> Dsv4Geometry:
    return dsv4_geometry(json.loads((checkpoint / "config.json").read_text()))


def ours(checkpoint: Path) -> DSV4Model:
    return load_target(str(checkpoint)).model  # type: ignore[attr-defined,return-value]


def test_the_checkpoint_reads_as_the_whole_architecture(checkpoint: Path) -> None:
    assert len(list(checkpoint.glob("*.safetensors"))) > 1
    assert (checkpoint / "model.safetensors.index.json").is_file()
    g = config_of(checkpoint)
    assert (g.ffn, g.n_routed_experts, g.n_activated_experts, g.n_hash_layers) == ("moe", 6, 2, 1)
    assert (g.hc_mult, g.hc_sinkhorn_iters, g.o_groups, g.o_lora_rank) == (3, 5, 2, 8)
    assert (g.rope_factor, g.rope_original_max_position, g.swiglu_limit) == (4.0, 16, 0.5)
    assert (g.compress_ratios, g.rope_dim, g.route_scale) == ((0, 4, 8, 4), 8, 1.5)


def test_prefill_and_incremental_logits_equal_transformers(hf_model, checkpoint: Path) -> None:
    model, ids = ours(checkpoint), tokens(SEQ, 2)
    want = reference_logits(hf_model, ids)
    torch.testing.assert_close(model.forward_full(ids), want, rtol=TOL, atol=TOL)
    result = model.prefill(ids[:20])
    steps = [result.logits]
    for start, n in ((20, 1), (21, 5), (26, 7), (33, 11)):  # verify-sized steps, all rows accepted
        result = model.step(result.state, ids[start:start + n])
        steps.append(result.logits)
    torch.testing.assert_close(torch.cat(steps), want, rtol=TOL, atol=TOL)


def test_paged_static_and_compact_verify_steps_equal_transformers(hf_model, checkpoint: Path) -> None:
    """Three requests prefilled in chunks, then verify steps of 8 rows each (static) and of ragged rows
    (compact), rejected rows rolled back by running the accepted prefix again: every real row's logits are
    transformers' on its request's sequence."""
    model = ours(checkpoint)
    seqs = [tokens(SEQ, 10 + i) for i in range(3)]
    wants = [reference_logits(hf_model, s) for s in seqs]
    config = Dsv4StepConfig(num_draft_tokens=8, window=6, compress_ratios=(4, 8), swa_page_size=8,
                            swa_ring_size=32, cmp_page_sizes={4: 8, 8: 8}, index_topk=3,
                            padding_request_rows=8)
    caches = Dsv4PagedCaches.allocate(model.cfg, config, 3, 64)
    lens = [12, 5, 9]
    got = prefill(model, caches, [0, 1, 2], [s[:n].tolist() for s, n in zip(seqs, lens, strict=True)])
    for i, (n, logits) in enumerate(zip(lens, got, strict=True)):
        torch.testing.assert_close(logits, wants[i][:n], rtol=TOL, atol=TOL)
    steps = [[8, 8, 8], [3, 7, 1], [8, 2, 5], [6, 8, 4]]  # static, then compact
    for rows in steps:
        _, got = run_step(model, caches, [0, 1, 2], lens, [s[p:p + r].tolist() for s, p, r in
                                                           zip(seqs, lens, rows, strict=True)])
        for i, (p, r) in enumerate(zip(lens, rows, strict=True)):
            torch.testing.assert_close(got[i], wants[i][p:p + r], rtol=TOL, atol=TOL)
        # half the rows accepted (the rest are overwritten by the next step, as a rejected suffix is)
        lens = [p + max(1, r // 2) for p, r in zip(lens, rows, strict=True)]


def _release_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained wrote, renamed to DeepSeek's release: no `model.` prefix, the
    attention's kv_norm as `attn.kv_norm` (save_pretrained writes `attn.norm`)."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        out[re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", name)] = tensor
    return out


def _saved(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for shard in checkpoint.glob("*.safetensors"):
        state.update(load_file(str(shard)))
    return state


def test_the_release_names_and_transformers_module_names_load_the_same_model(hf_model, checkpoint: Path,
                                                                          tmp_path: Path) -> None:
    want = ours(checkpoint).state_dict()
    cfg = config_of(checkpoint)
    release = _release_names(_saved(checkpoint))
    assert "embed.weight" in release and "layers.0.ffn.experts.5.w3.weight" in release
    for state in (release, hf_model.state_dict()):  # module names: packed experts, self_attn.*, mlp.*
        model = DSV4Model(cfg)
        load_dsv4_weights(model, state)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, want[name]), name
    # the release checkpoint on disk, with an index over two shards, loads by load_target too
    path = tmp_path / "release"
    path.mkdir()
    names = sorted(release)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: release[n].contiguous() for n in part}, str(path / file))
    index = {"weight_map": {n: file for file, part in halves.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text((checkpoint / "config.json").read_text())
    loaded = load_target(str(path)).model.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(loaded[n], t) for n, t in want.items())


LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight")
EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [8, 8],
              "activation_scheme": "dynamic", "expert_dtype": "fp4"}


def _write(path: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir()
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _fp8_fp4(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The release's formats: FP8 attention and shared-expert linears in 8 x 8 blocks, FP4 routed experts;
    and the float weights they dequantise to by the naive rules."""
    quantised, dequantised = dict(state), dict(state)
    for name, w in state.items():
        stem = name.removesuffix(".weight")
        if LINEAR.fullmatch(name):
            q, scale = quantise_fp8(w, (8, 8), ue8m0=True)
            dequantised[name] = naive_fp8(q, scale, (8, 8))
        elif EXPERT.fullmatch(name):
            q, scale = quantise_fp4(w)
            dequantised[name] = naive_fp4(q, scale)
        else:
            continue
        quantised[name], quantised[stem + ".scale"] = q, scale
    return quantised, dequantised


def _w8a8(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Ascend W8A8_DYNAMIC: every linear int8 with per-channel scales and offsets."""
    quantised, dequantised = dict(state), dict(state)
    gen = torch.Generator().manual_seed(5)
    for name, w in state.items():
        if not (LINEAR.fullmatch(name) or EXPERT.fullmatch(name)):
            continue
        stem = name.removesuffix(".weight")
        scale = w.abs().amax(1, keepdim=True) / 100
        offset = torch.randint(-10, 10, (w.shape[0], 1), generator=gen).float()
        q = (torch.round(w / scale) + offset).clamp(-128, 127).to(torch.int8)
        quantised[name] = q
        quantised[stem + ".weight_scale"], quantised[stem + ".weight_offset"] = scale, offset
        dequantised[name] = naive_w8a8(q, scale, offset)
    return quantised, dequantised


@pytest.mark.parametrize("fmt", ["fp8_fp4", "w8a8"])
def test_each_weight_format_loads_to_the_model_of_its_dequantised_weights(checkpoint: Path, tmp_path: Path,
                                                                         fmt: str) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    quantised, dequantised = (_fp8_fp4 if fmt == "fp8_fp4" else _w8a8)(_release_names(_saved(checkpoint)))
    assert any(t.dtype in (torch.int8, torch.float8_e4m3fn) for t in quantised.values())
    want = load_target(str(_write(tmp_path / "float", dequantised, config))).model.state_dict()
    if fmt == "fp8_fp4":
        config = {**config, "quantization_config": FP8_CONFIG}
    got = load_target(str(_write(tmp_path / fmt, quantised, config))).model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in want.items())


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.pop("layers.2.attn.wo_b.weight"), "missing tensors.*layers.2.wo_b"),
    (lambda s: s.pop("layers.1.ffn.experts.4.w2.weight"), r"layer 1: experts .* of ffn\.experts\.E\.w2"),
    (lambda s: s.__setitem__("layers.0.attn.extra.weight", torch.zeros(1)),
     "no place for: layers.0.attn.extra"),
    (lambda s: s.__setitem__("layers.0.attn.wq_a.scale", torch.zeros(1)), "float32 weight with quantisation"),
    (lambda s: s.__setitem__("head.weight", torch.zeros(3, 3)), r"head: shape \[3, 3\]"),
    (lambda s: s["layers.0.ffn.gate.tid2eid"].__setitem__((0, 1), int(s["layers.0.ffn.gate.tid2eid"][0, 0])),
     "distinct experts"),
])
def test_a_mismatched_missing_or_extra_tensor_is_refused_by_name(checkpoint: Path, edit, message) -> None:
    state = {n: t.clone() for n, t in _release_names(_saved(checkpoint)).items()}
    edit(state)
    cfg = config_of(checkpoint)
    with pytest.raises(Dsv4WeightsError, match=message):
        load_dsv4_weights(DSV4Model(cfg), state)


def test_load_target_names_the_checkpoint_in_its_error(checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    state = _release_names(_saved(checkpoint))
    state.pop("norm.weight")
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"{path}: missing tensors.*final_norm"):
        load_target(str(path))


MODES = ("static", "cap-accept", "compact")
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def packages(checkpoint: Path, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint compiled in each verify mode (geometry read from its config.json, a dummy draft)."""
    root = tmp_path_factory.mktemp("packages")
    out = {}
    for mode in MODES:
        spec = {"name": f"dsv4_hf_{mode.replace('-', '_')}",
                "model": {"family": "dsv4", "checkpoint": str(checkpoint)},
                "draft": {"checkpoint": str(root / "no-draft"), "load_format": "dummy", "num_layers": 1,
                          "gamma": 4},
                "backend": {"kind": "cpu", "device": "generic"},
                "verify": {"mode": mode, "allow_no_cost_model": True} if mode != "static" else {"mode": mode},
                "serving": {"max_context_len": 128, "max_total_tokens": 1024}}
        path = root / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        assert compile_main(["build", str(path), "-o", str(root / mode)]) == 0
        out[mode] = root / mode
    return out


def _cut(seq: list[int]) -> list[int]:
    return seq[: seq.index(EOS_ID)] if EOS_ID in seq else seq


def test_served_greedy_decoding_is_transformers_generate_and_speculation_is_lossless(hf_model,
                                                                                    packages) -> None:
    prompts = [tokens(n, 30 + n).tolist() for n in (9, 23, 4)]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        want.append(_cut(out[0, len(prompt):].tolist()))
    for mode, package in packages.items():
        runtime = Runtime(load_package(package))
        target_only, _ = runtime.generate(prompts, NEW_TOKENS, target_only=True)
        assert target_only == want, mode
        speculative, stats = runtime.generate(prompts, NEW_TOKENS)
        assert speculative == want and stats.steps > 0, mode
