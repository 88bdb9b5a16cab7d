"""FP8 block-scaled weights kept quantised on CUDA (`dspark.runtime.families.dsv4.fp8_linear`): the Triton
kernel against its torch reference under the interpreter (every finite e4m3 code decoded as torch decodes it;
partial tiles and partial scale blocks); a kept weight sliced on its scale blocks (and refused off them) and
moved without casting; a release-layout FP8 checkpoint loaded for CUDA keeps its codes and block scales in
place of the float weights and computes what the dequantised model computes; and, where a GPU is present, the
compiled kernel against the reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark.runtime.families.dsv4.fp8_linear import Fp8BlockWeight, fp8_block_linear, fp8_block_linear_torch
from dspark.runtime.families.dsv4.model import DSV4Model
from dspark.runtime.kernels import dispatch
from dspark.runtime.models.checkpoint import load_target

from .dsv4_dspark_common import STAGE_CONFIG, target_release_state
from .dsv4_quant_common import naive_fp8, quantise_fp8
from .interp_runner import interpreter_results

INTERP_CHECKS = ["kernel_matches_reference", "every_code_decodes"]
BLOCK = (8, 8)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    return interpreter_results("dsv4_fp8_interp_checks.py", processes=1)


@pytest.mark.parametrize("check", INTERP_CHECKS)
def test_the_kernel_matches_its_reference_under_the_interpreter(interp_results: dict[str, str], check: str
                                                                ) -> None:
    assert check in interp_results, f"the interpreter checks no longer run {check!r}"
    assert interp_results[check] == "ok", interp_results[check]


def test_a_kept_weight_is_its_dequantised_product_sliced_on_its_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    experts = [quantise_fp8(torch.randn(24, 16, generator=gen), BLOCK, ue8m0=True) for _ in range(3)]
    codes, scales = torch.stack([c for c, _ in experts]), torch.stack([s.float() for _, s in experts])
    weight = Fp8BlockWeight(codes, scales, BLOCK)
    x = torch.randn(5, 16, generator=gen)
    one = weight[1]
    want = x @ naive_fp8(*experts[1], BLOCK).t()
    torch.testing.assert_close(one.linear(x), want, rtol=1e-5, atol=1e-5)
    rows, cols = one[8:24], one[:, 8:16]  # a row-parallel and a column-parallel share, on block boundaries
    torch.testing.assert_close(rows.linear(x), want[:, 8:24], rtol=1e-5, atol=1e-5)
    assert cols.scales.shape == (3, 1) and torch.equal(cols.codes.view(torch.uint8),
                                                       one.codes[:, 8:16].view(torch.uint8))
    with pytest.raises(ValueError, match="not on its 8-wide scale blocks"):
        one[4:12]
    with pytest.raises(ValueError, match="index the expert first"):
        weight.linear(x)
    moved = copy.deepcopy(weight).to(torch.bfloat16)  # a model cast to the serving dtype
    assert moved.codes.dtype == torch.float8_e4m3fn and moved.scales.dtype == torch.float32
    assert torch.equal(moved.scales, weight.scales)


def _fp8_checkpoint(path: Path) -> DSV4Model:
    from dspark.formats.dsv4_hf_config import dsv4_geometry

    config = {k: v for k, v in STAGE_CONFIG.items() if not k.startswith("dspark_")}
    config.update(num_nextn_predict_layers=0, compress_ratios=config["compress_ratios"][:4],
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"})
    model = DSV4Model(dsv4_geometry(config), seed=6)
    state = {}
    for name, tensor in target_release_state(model).items():
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if name.endswith(".weight") and tensor.dim() == 2 and leaf in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            codes, scale = quantise_fp8(tensor, BLOCK, ue8m0=True)
            state[name], state[name.removesuffix(".weight") + ".scale"] = codes, scale
        else:
            state[name] = tensor
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return model


def test_an_fp8_checkpoint_stays_fp8_for_cuda_and_computes_the_dequantised_model(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path / "fp8")
    cuda = load_target(str(tmp_path / "fp8"), backend="cuda").model  # built here; the engine moves it
    cpu = load_target(str(tmp_path / "fp8"), backend="cpu").model
    layer = cuda.layers[2]
    assert isinstance(layer.wq_a, Fp8BlockWeight) and layer.wq_a.codes.dtype == torch.float8_e4m3fn
    assert layer.wq_a.block == BLOCK and not any(isinstance(m, Fp8BlockWeight) for m in cpu.modules())
    torch.testing.assert_close(layer.wq_a.linear(torch.eye(layer.wq_a.shape[1])), cpu.layers[2].wq_a.t())
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    torch.testing.assert_close(cuda.forward_full(tokens), cpu.forward_full(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.HAS_TRITON), reason="needs a CUDA GPU")
def test_the_compiled_kernel_matches_the_reference_on_the_gpu() -> None:
    gen = torch.Generator().manual_seed(1)
    codes, scales = quantise_fp8(torch.randn(300, 520, generator=gen), (128, 128), ue8m0=True)
    x = torch.randn(37, 520, generator=gen)
    want = fp8_block_linear_torch(x, codes, scales, (128, 128))
    got = fp8_block_linear(x.cuda(), codes.cuda(), scales.float().cuda(), (128, 128))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    got16 = fp8_block_linear(x.cuda().bfloat16(), codes.cuda(), scales.float().cuda(), (128, 128))
    torch.testing.assert_close(got16.float().cpu(), want, rtol=2e-2, atol=5e-2)
