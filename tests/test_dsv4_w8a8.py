"""Ascend W8A8_DYNAMIC weights kept quantised (`dspark.runtime.families.dsv4.w8a8`): the CPU models of
`npu_dynamic_quant` and `npu_quant_matmul` against naive integer arithmetic (and their input dtypes checked as
the operators check them); a kept weight's product row by row, the same bits alone and in a batch, sliced as
sharding slices it, moved without casting; a W8A8 checkpoint loaded for Ascend keeps its int8 codes and
channel scales in place of the float weights (a nonzero weight offset refused by name), for the CPU
dequantised; and the Ascend layers on the torch_npu stand-in, multiplying through the two operators, give the
CPU paged forward's logits of the same quantised model over prefill and verify steps."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark.runtime.families.dsv4 import ascend_op_models
from dspark.runtime.families.dsv4.ascend_quant_op_models import (
    reference_dynamic_quant,
    reference_quant_matmul,
)
from dspark.runtime.families.dsv4.cpu_paged import Dsv4PagedCaches, layer_forward, prefill_config
from dspark.runtime.families.dsv4.model import DSV4Model
from dspark.runtime.families.dsv4.verify_metadata import plan_dsv4_verify
from dspark.runtime.families.dsv4.w8a8 import W8A8Weight, bind_kernel, npu_kernel
from dspark.runtime.families.dsv4.weights import Dsv4WeightsError, load_dsv4_weights
from dspark.runtime.models.checkpoint import CheckpointError, load_target

from .dsv4_dspark_common import STAGE_CONFIG, target_release_state
from .dsv4_fake_npu import QUANT_MATMUL, FakeNpu, device_only, install_fake_npu
from .dsv4_layers_common import (
    CFG,
    MAX_LEN,
    MAX_REQ,
    PROMPTS,
    SCRIPT,
    STEP,
    forward,
    plan,
    step_tokens,
    tokens,
)

# the linears a W8A8_DYNAMIC checkpoint quantises: the projections and the FFN (norms, sinks, router,
# compressors' gates and the vocabulary stay float)
QUANTISED = ("wq_a", "wq_b", "wkv", "wo", "wo_a", "wo_b", "w1", "w2", "w3")


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: codes [..., out, in], scales [..., out]."""
    scale = w.abs().amax(-1) / 127.0
    return torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale


def naive_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One linear as the two operators define it, element by element: the token's scale and codes in
    float32 (round half to even), the products in exact integers, dequantised in float32, then bfloat16."""
    f32 = torch.float32
    xb = x.to(torch.bfloat16).to(f32)
    out = torch.empty(x.shape[0], codes.shape[0])
    for i in range(x.shape[0]):
        s = xb[i].abs().max() / torch.tensor(127.0, dtype=f32)
        q = [int(torch.round(v / s)) if s else 0 for v in xb[i]]
        for j in range(codes.shape[0]):
            acc = sum(a * int(b) for a, b in zip(q, codes[j].tolist(), strict=True))
            out[i, j] = torch.tensor(float(acc), dtype=f32) * scale[j].to(f32) * s
    return out.to(torch.bfloat16).float()


def test_the_operator_models_are_the_integer_arithmetic_and_check_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=gen)
    codes, scale = quantise(torch.randn(7, 24, generator=gen))
    q, s = reference_dynamic_quant(x.to(torch.bfloat16))
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    assert int(q.abs().max()) == 127  # each row's largest value maps to +-127
    got = reference_quant_matmul(q, codes.t(), scale, pertoken_scale=s, output_dtype=torch.bfloat16)
    torch.testing.assert_close(got.float(), naive_product(x, codes, scale), rtol=0, atol=0)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        reference_dynamic_quant(x)  # float32: the operator takes half types only
    with pytest.raises(TypeError, match="int8"):
        reference_quant_matmul(q.float(), codes.t(), scale, pertoken_scale=s, output_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pertoken_scale"):
        reference_quant_matmul(q, codes.t(), scale, pertoken_scale=s[:3], output_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        reference_quant_matmul(q, codes.t(), scale, pertoken_scale=s, output_dtype=torch.float32)


def test_a_kept_weight_multiplies_row_by_row_slices_and_moves_as_the_format_says() -> None:
    gen = torch.Generator().manual_seed(1)
    codes, scale = quantise(torch.randn(3, 6, 16, generator=gen))  # three stacked experts
    weight = W8A8Weight(codes, scale)
    x = torch.randn(9, 16, generator=gen)
    expert = weight[1]
    assert isinstance(expert, W8A8Weight) and expert.shape == (6, 16)
    batch = expert.linear(x)
    assert all(torch.equal(expert.linear(x[i:i + 1])[0], batch[i]) for i in range(9))  # row-invariant
    torch.testing.assert_close(batch, naive_product(x, codes[1], scale[1]), rtol=0, atol=0)
    rows, cols = expert[2:5], expert[:, 4:12]  # a row-parallel share keeps its rows' scales, a column one all
    assert torch.equal(rows.scale, scale[1, 2:5]) and torch.equal(cols.scale, scale[1])
    assert torch.equal(cols.codes, codes[1][:, 4:12])
    with pytest.raises(ValueError, match="index the expert first"):
        weight.linear(x)
    moved = copy.deepcopy(weight).to(torch.bfloat16)  # a model cast to the serving dtype
    assert moved.codes.dtype == torch.int8 and moved.scale.dtype == torch.float32
    assert torch.equal(moved.scale, weight.scale)


def _w8a8_checkpoint(path: Path, offset: float = 0.0) -> tuple[Path, DSV4Model]:
    """A DeepSeek-V4 checkpoint in the release's names whose projections and experts are W8A8_DYNAMIC."""
    from dspark.formats.dsv4_hf_config import dsv4_geometry

    config = {k: v for k, v in STAGE_CONFIG.items() if not k.startswith("dspark_")}
    config.update(num_nextn_predict_layers=0, compress_ratios=config["compress_ratios"][:4])
    model = DSV4Model(dsv4_geometry(config), seed=5)
    state = {}
    for name, tensor in target_release_state(model).items():
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if name.endswith(".weight") and tensor.dim() == 2 and leaf in QUANTISED:
            codes, scale = quantise(tensor)
            stem = name.removesuffix(".weight")
            state[name], state[stem + ".weight_scale"] = codes, scale[:, None]
            state[stem + ".weight_offset"] = torch.full((tensor.shape[0], 1), offset)
        else:
            state[name] = tensor
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path, model


def test_a_w8a8_checkpoint_stays_int8_on_ascend_and_is_dequantised_on_the_cpu(tmp_path: Path) -> None:
    path, model = _w8a8_checkpoint(tmp_path / "w8a8")
    ascend = load_target(str(path), backend="ascend").model
    layer = ascend.layers[1]
    assert isinstance(layer.wq_a, W8A8Weight) and isinstance(layer.ffn.experts.w2, W8A8Weight)
    assert layer.ffn.experts.w2.shape == model.layers[1].ffn.experts.w2.shape  # stacked [E, out, in]
    codes, scale = quantise(model.layers[1].wq_a.detach())
    assert torch.equal(layer.wq_a.codes, codes) and torch.equal(layer.wq_a.scale, scale)
    assert not isinstance(layer.attn_norm, W8A8Weight) and not isinstance(ascend.head, W8A8Weight)
    cpu = load_target(str(path), backend="cpu").model
    assert not any(isinstance(m, W8A8Weight) for m in cpu.modules())
    torch.testing.assert_close(cpu.layers[1].wq_a, codes.float() * scale[:, None])
    tokens_ = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    assert torch.isfinite(ascend.forward_full(tokens_)).all()


def test_a_nonzero_weight_offset_is_refused_where_it_would_stay_quantised(tmp_path: Path) -> None:
    path, model = _w8a8_checkpoint(tmp_path / "offset", offset=1.0)
    with pytest.raises(CheckpointError, match=r"weight_offset cannot stay quantised"):
        load_target(str(path), backend="ascend")
    load_target(str(path), backend="cpu")  # dequantised by its rule, offset included
    with pytest.raises(Dsv4WeightsError, match=r"layers\.0\.attn\.wkv\.weight: a nonzero weight_offset"):
        from safetensors.torch import load_file
        load_dsv4_weights(DSV4Model(model.cfg), load_file(str(path / "model.safetensors")), keep_w8a8=True)


def quantised_copy(m: DSV4Model) -> DSV4Model:
    """`m` with every QUANTISED linear replaced by its W8A8 codes and scales."""
    out = copy.deepcopy(m)
    for name, param in list(out.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        if leaf in QUANTISED and param.dim() >= 2:
            module = out.get_submodule(owner)
            delattr(module, leaf)
            setattr(module, leaf, W8A8Weight(*quantise(param.detach())))
    return out


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    monkeypatch.setattr(ascend_op_models, "CMP_RATIOS", (*ascend_op_models.CMP_RATIOS, CFG.hca_ratio))
    return install_fake_npu(monkeypatch)


def test_the_ascend_layers_multiply_through_the_operators_as_the_cpu_model_does(npu: FakeNpu) -> None:
    import sys

    from .dsv4_layers_common import geometry, model
    from .test_dsv4_ascend_layers import QUANT, ascend

    cpu_model = quantised_copy(model(QUANT))
    npu_model = copy.deepcopy(cpu_model)
    assert bind_kernel(npu_model, npu_kernel(sys.modules["torch_npu"])) > 0

    def cpu_logits(caches: Dsv4PagedCaches, toks: torch.Tensor, meta) -> torch.Tensor:
        h = cpu_model.embed_tokens(toks)
        for layer, lc in zip(cpu_model.layers, caches.layers, strict=True):
            h = layer_forward(layer, lc, h, toks, meta, None)
        return cpu_model.lm_head(h)

    cpu = Dsv4PagedCaches.allocate(geometry(QUANT), STEP, MAX_REQ, MAX_LEN, seed=3)
    layers = ascend(cpu.clone())
    chunk = prefill_config(CFG, STEP)
    seqs = [tokens(n, seed=40 + i) for i, n in enumerate(PROMPTS)]
    with torch.no_grad():
        done = [0] * MAX_REQ
        while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
            rows = [s[d:d + chunk.num_draft_tokens] for d, s in zip(done, seqs, strict=True)]
            live = [r for r in range(MAX_REQ) if rows[r]]
            meta = plan_dsv4_verify([len(rows[r]) for r in live], [done[r] for r in live], chunk,
                                    cpu.page_tables(live))
            toks = torch.tensor([t for r in live for t in rows[r]])
            want = cpu_logits(cpu, toks, meta)
            got = forward(layers, toks, device_only(meta), npu_model, index_quant=QUANT)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for r in live:
                done[r] += len(rows[r])
        tier, script = SCRIPT[0]
        meta = plan(cpu, [n for n, _ in script], list(PROMPTS), tier=tier,
                    num_slots=None if tier is None else 8)
        toks = step_tokens(meta, seed=7)
        want = cpu_logits(cpu, toks, meta)[: meta.total_rows]
        got = forward(layers, toks, device_only(meta), npu_model, index_quant=QUANT)[: meta.total_rows]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sum(name == QUANT_MATMUL for name, _ in npu.calls) > 0


def test_tensor_and_expert_parallelism_slice_kept_weights_as_they_slice_floats() -> None:
    import dataclasses

    from dspark.runtime.families.dsv4.expert_parallel import shard_dsv4_experts
    from dspark.runtime.families.dsv4.sharding import shard_dsv4_target
    from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM

    from .test_dsv4_tensor_parallel import GEOMETRY, place

    geometry = dataclasses.replace(GEOMETRY, ffn="moe", n_routed_experts=4, n_activated_experts=2, o_groups=2,
                                   o_lora_rank=8)

    def quantised_target() -> Dsv4ForCausalLM:
        target = Dsv4ForCausalLM(geometry)
        target.model = quantised_copy(target.model)
        return target

    target = quantised_target()
    whole = copy.deepcopy(target.model)
    shard_dsv4_target(target, place(1, 2))
    for mine, full in zip(target.model.layers, whole.layers, strict=True):
        rows, cols = full.wq_b.shape[0] // 2, full.wo_b.shape[1] // 2
        assert isinstance(mine.wq_b, W8A8Weight) and isinstance(mine.wo_b, W8A8Weight)
        assert torch.equal(mine.wq_b.codes, full.wq_b.codes[rows:])
        assert torch.equal(mine.wq_b.scale, full.wq_b.scale[rows:])
        assert torch.equal(mine.wo_a.codes, full.wo_a.codes[full.wo_a.shape[0] // 2:])
        assert torch.equal(mine.wo_b.codes, full.wo_b.codes[:, cols:]) and torch.equal(mine.wo_b.scale,
                                                                                        full.wo_b.scale)
    target = quantised_target()
    whole = copy.deepcopy(target.model)
    shard_dsv4_experts(target, place(1, 2), rows_replicated=True)  # type: ignore[arg-type]
    for mine, full in zip(target.model.layers, whole.layers, strict=True):
        assert isinstance(mine.ffn.experts.w1, W8A8Weight) and mine.ffn.experts.w1.shape[0] == 2
        assert torch.equal(mine.ffn.experts.w2.codes, full.ffn.experts.w2.codes[2:])
        assert torch.equal(mine.ffn.experts.w2.scale, full.ffn.experts.w2.scale[2:])
