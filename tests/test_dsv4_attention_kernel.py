"""DSV4 attention kernel (`dspark.runtime.families.dsv4.triton_attention`): the torch reference against the
Ascend operator model (`ascend_op_models.reference_sparse_attn_sharedkv`) on planned verify steps, the Triton
kernel against the reference under the interpreter (in a subprocess: tests/dsv4_kernel_interp_checks.py),
input refusals, and on a GPU the compiled kernel without host sync and inside a replayed CUDA graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dspark.runtime.families.dsv4 import triton_attention as kernel_module
from dspark.runtime.families.dsv4.triton_attention import (
    MAX_HEAD_DIM,
    block_sizes,
    dsv4_attention,
    dsv4_attention_args,
    dsv4_attention_torch,
    launch_dsv4_attention,
)
from dspark.runtime.families.dsv4.verify_metadata import Dsv4PageTables, Dsv4StepConfig, plan_dsv4_verify
from dspark.runtime.kernels import dispatch
from tests.dsv4_kernel_interp_checks import CASE_KINDS, SEEDS, Case, ascend_reference, make_case, rule_topk
from tests.interp_runner import interpreter_results

REPO = Path(__file__).resolve().parents[1]
INTERP_CHECKS = ["kinds_match_reference", "operator_mode", "many_heads_and_wide_head_dim",
                 "negative_positions_write_zeros", "topk_reading_rules", "rows_independent"]
KIND_NAMES = [name for name, _ in CASE_KINDS]
KINDS = dict(CASE_KINDS)
TOL = dict(atol=2e-5, rtol=2e-5)


# -- the torch reference against the Ascend operator model ---------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_reference_matches_operator_model(kind: str, seed: int) -> None:
    # The null page is zero, so the operator's padding rows (which read it) give zeros as ours do.
    case = make_case(1000 + seed, **KINDS[kind])
    got = case.call("torch")
    torch.testing.assert_close(got, ascend_reference(case), **TOL)
    assert (got[case.padding_rows] == 0).all()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_operator_mode_matches_operator_model_on_a_random_null_page(kind: str) -> None:
    """Without the metadata's padding lengths every row reads as the operator reads, null page included."""
    case = make_case(2000, **KINDS[kind], null_zero=False)
    got = dsv4_attention_torch(case.q, case.swa_kv, case.cmp_kv, case.sinks, scale=case.scale,
                               **case.operator_args())
    torch.testing.assert_close(got, ascend_reference(case), **TOL)


@pytest.mark.parametrize("kind", ["window_only", "c4_topk", "c128"])
def test_padding_rows_write_zeros_whatever_the_null_page_holds(kind: str) -> None:
    case = make_case(3000, **KINDS[kind], null_zero=False)
    assert case.padding_rows.any()
    got = case.call("torch")
    assert (got[case.padding_rows] == 0).all()
    real = ~case.padding_rows
    torch.testing.assert_close(got[real], ascend_reference(case)[real], **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_topk_reading_rules_match_operator_model(seed: int) -> None:
    """Stop at the first -1, read only the first min(K, visible) columns, skip ids >= visible, keep
    duplicates: the operator's rules, on a random null page so a wrong read shows."""
    case = make_case(4000 + seed, ratio=4, topk=True, null_zero=False, padding=False)
    topk = rule_topk(case)
    case = dataclasses.replace(case, topk=topk, args={**case.args, "topk": topk})
    torch.testing.assert_close(case.call("torch"), ascend_reference(case), **TOL)


def test_negative_positions_and_rows_without_keys_write_zeros() -> None:
    case = make_case(6000, ratio=128, sinks=False, padding=False)
    positions = case.args["positions"].clone()
    positions[0] = -5
    lens = torch.zeros_like(case.args["window_lens"])
    visible = torch.zeros_like(case.args["cmp_visible"])
    got = case.call("torch", positions=positions)
    assert (got[0] == 0).all() and torch.isfinite(got).all()
    none = case.call("torch", window_lens=lens, cmp_visible=visible)  # no key and no sink
    assert (none == 0).all()


def test_metadata_arguments() -> None:
    case = make_case(7000, ratio=4, topk=True)
    meta = case.meta
    window = dsv4_attention_args(meta, 0)
    assert window["window"] == meta.config.window and window["swa_ring_size"] == meta.config.swa_ring_size
    assert window["window_lens"] is meta.device.swa_window_lens and "cmp_visible" not in window
    c4 = dsv4_attention_args(meta, 4)
    assert c4["cmp_block_table"] is meta.compressed[4].device.cmp_block_table
    assert c4["cmp_visible"] is meta.compressed[4].device.cmp_visible


# -- dispatch and block sizes -----------------------------------------------------------------------------

def test_auto_takes_the_torch_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Triton kernel was launched for CPU tensors")

    monkeypatch.setattr(kernel_module, "launch_dsv4_attention", fail)
    case = make_case(8000, ratio=4, topk=True)
    torch.testing.assert_close(case.call("auto"), case.call("torch"), atol=0, rtol=0)


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_case(8001, ratio=0).call("triton")


@pytest.mark.parametrize("heads,head_dim,want", [(64, 512, (16, 16)), (128, 128, (64, 64)), (4, 24, (16, 64)),
                                                 (16, 256, (16, 32))])
def test_block_sizes_are_fixed_per_model(heads: int, head_dim: int, want: tuple[int, int]) -> None:
    assert block_sizes(heads, head_dim) == want


def test_launch_refuses_blocks_below_the_dot_minimum() -> None:
    case = make_case(8002, ratio=0)
    with pytest.raises(ValueError, match="powers of two"):
        launch_dsv4_attention(case.q, case.swa_kv, None, case.sinks, torch.empty_like(case.q), scale=1.0,
                              block_n=8, **case.args)


# -- refusals ---------------------------------------------------------------------------------------------

def _malformed(case: Case, what: str) -> dict[str, Any]:
    """dsv4_attention's arguments with one thing wrong."""
    call: dict[str, Any] = dict(q=case.q, swa_kv=case.swa_kv, cmp_kv=case.cmp_kv, sinks=case.sinks,
                                scale=case.scale, **case.args)
    t = case.q.shape[0]
    bad: dict[str, Any] = {
        "q_2d": dict(q=case.q[:, 0]),
        "q_int": dict(q=case.q.long()),
        "head_dim_too_wide": dict(q=torch.zeros(t, 1, MAX_HEAD_DIM + 1),
                                  swa_kv=torch.zeros(2, 1, MAX_HEAD_DIM + 1), cmp_kv=None,
                                  cmp_block_table=None, cmp_visible=None, topk=None),
        "swa_kv_dtype": dict(swa_kv=case.swa_kv.double()),
        "swa_kv_head_dim": dict(swa_kv=case.swa_kv[..., :-1]),
        "cmp_kv_4d": dict(cmp_kv=None if case.cmp_kv is None else case.cmp_kv.unsqueeze(2)),
        "sinks_shape": dict(sinks=torch.zeros(case.q.shape[1] + 1)),
        "sinks_dtype": dict(sinks=torch.zeros(case.q.shape[1], dtype=torch.float64)),
        "positions_int32": dict(positions=case.args["positions"].int()),
        "positions_length": dict(positions=case.args["positions"][:-1]),
        "row_slot_int64": dict(row_slot=case.args["row_slot"].long()),
        "ori_table_1d": dict(ori_block_table=case.args["ori_block_table"][0]),
        "window_lens_int64": dict(window_lens=case.args["window_lens"].long()),
        "window_zero": dict(window=0),
        "ring_not_pages": dict(swa_ring_size=case.args["swa_ring_size"] + 1),  # page size 2 here
        "ring_below_window": dict(swa_ring_size=0),
        "cmp_parts_partial": dict(cmp_visible=None),
        "cmp_table_rows": dict(cmp_block_table=case.args["cmp_block_table"][:-1]),
        "cmp_visible_int64": dict(cmp_visible=case.args["cmp_visible"].long()),
        "topk_rows": dict(topk=case.args["topk"][:-1]),
        "topk_int64": dict(topk=case.args["topk"].long()),
        "topk_without_cmp": dict(cmp_kv=None, cmp_block_table=None, cmp_visible=None),
        "scale_nan": dict(scale=float("nan")),
        "impl_unknown": dict(impl="cuda"),
    }[what]
    return {**call, **bad}


@pytest.mark.parametrize("what", [
    "q_2d", "q_int", "head_dim_too_wide", "swa_kv_dtype", "swa_kv_head_dim", "cmp_kv_4d", "sinks_shape",
    "sinks_dtype", "positions_int32", "positions_length", "row_slot_int64", "ori_table_1d",
    "window_lens_int64", "window_zero", "ring_not_pages", "ring_below_window", "cmp_parts_partial",
    "cmp_table_rows", "cmp_visible_int64", "topk_rows", "topk_int64", "topk_without_cmp", "scale_nan",
    "impl_unknown"])
def test_refuses_malformed_inputs(what: str) -> None:
    case = make_case(9002, ratio=4, topk=True, padding=False)  # 4 heads, SWA pages of 2
    assert case.swa_kv.shape[1] == 2
    kwargs = _malformed(case, what)
    q, swa_kv, cmp_kv, sinks = (kwargs.pop(k) for k in ("q", "swa_kv", "cmp_kv", "sinks"))
    with pytest.raises((ValueError, TypeError)):
        dsv4_attention(q, swa_kv, cmp_kv, sinks, **kwargs)


# -- Triton under the interpreter ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    return interpreter_results("dsv4_kernel_interp_checks.py")


@pytest.mark.parametrize("check", INTERP_CHECKS)
def test_triton_kernel_matches_reference_under_interpreter(interp_results: dict[str, str],
                                                           check: str) -> None:
    assert check in interp_results, f"the interpreter checks no longer run {check!r}"
    assert interp_results[check] == "ok", interp_results[check]


# -- CUDA: the compiled kernel (skipped without a GPU) ----------------------------------------------------

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.HAS_TRITON),
                                   reason="needs a CUDA device and Triton")


def _cuda_case(seed: int, kind: str, dtype: torch.dtype, **kw: Any) -> Case:
    case = make_case(seed, **KINDS[kind], device="cuda", **kw)
    cast = dict(q=case.q.to(dtype), swa_kv=case.swa_kv.to(dtype),
                cmp_kv=None if case.cmp_kv is None else case.cmp_kv.to(dtype))
    return dataclasses.replace(case, **cast)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_cuda_kernel_matches_reference_without_host_sync(kind: str, dtype: torch.dtype) -> None:
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for seed, shape in enumerate([{}, dict(heads=64, head_dim=512, window=128), dict(heads=20, head_dim=40)]):
        case = _cuda_case(10_000 + seed, kind, dtype, **shape)
        case.call("auto")  # compile outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = case.call("auto")
            want = case.call("torch")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert (got[case.padding_rows] == 0).all()


def _graph_steps(device: str) -> tuple[Dsv4StepConfig, list[Any]]:
    """Two steps of one graph shape (tier, slots, table widths) with different requests, prefixes, pages
    and row counts."""
    config = Dsv4StepConfig(num_draft_tokens=4, window=8, compress_ratios=(4, 128), swa_page_size=4,
                            swa_ring_size=12, cmp_page_sizes={4: 4, 128: 1}, index_topk=6)
    rng = np.random.default_rng(0)
    steps = []
    for lens, prefix in (([4, 2, 3], [300, 5, 140]), ([1, 4], [400, 129])):
        r = len(lens)
        tables = Dsv4PageTables(
            swa=rng.permutation(np.arange(1, 1 + 3 * 3, dtype=np.int32))[: r * 3].reshape(r, 3),
            compressed={4: rng.permutation(np.arange(1, 1 + 3 * 30, dtype=np.int32))[: r * 30].reshape(r, 30),
                        128: rng.permutation(np.arange(1, 1 + 3 * 4, dtype=np.int32))[: r * 4].reshape(r, 4)})
        steps.append(plan_dsv4_verify(lens, prefix, config, tables, tier=12, num_slots=6, max_kv_len=410,
                                      device=device))
    return config, steps


def _graph_inputs(meta: Any, ratio: int, gen: torch.Generator, device: str) -> dict[str, Any]:
    args = dsv4_attention_args(meta, ratio)
    if ratio == 4:
        visible = meta.compressed[4].host.cmp_visible
        topk = torch.full((meta.tier, meta.config.index_topk), -1, dtype=torch.int32)
        for t, vis in enumerate(visible.tolist()):
            ids = torch.randperm(vis, generator=gen)[: meta.config.index_topk] if vis else torch.zeros(0)
            topk[t, : ids.numel()] = ids.to(torch.int32)
        args["topk"] = topk.to(device)
    return args


def test_graph_steps_share_their_shapes() -> None:
    """The CUDA graph test's two steps fit one captured graph (checked on the CPU too)."""
    _, (a, b) = _graph_steps("cpu")
    gen = torch.Generator().manual_seed(0)
    for ratio in (0, 4, 128):
        first, second = _graph_inputs(a, ratio, gen, "cpu"), _graph_inputs(b, ratio, gen, "cpu")
        assert first.keys() == second.keys()
        for key, value in first.items():
            if isinstance(value, torch.Tensor):
                assert value.shape == second[key].shape and value.dtype == second[key].dtype, key
            else:
                assert value == second[key], key


@requires_cuda
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_cuda_kernel_replays_in_a_captured_graph_with_new_metadata(ratio: int) -> None:
    config, (first, second) = _graph_steps("cuda")
    gen = torch.Generator().manual_seed(ratio)
    heads, head_dim = 16, 64
    swa_kv = torch.randn(10, config.swa_page_size, head_dim, device="cuda")
    cmp_kv = torch.randn(100, config.cmp_page_sizes[ratio], head_dim, device="cuda") if ratio else None
    sinks = torch.randn(heads, device="cuda")
    q = torch.randn(first.tier, heads, head_dim, device="cuda")
    args = _graph_inputs(first, ratio, gen, "cuda")
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}

    def run() -> torch.Tensor:
        return dsv4_attention(q, swa_kv, cmp_kv, sinks, scale=0.125, **static)

    run()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new = _graph_inputs(second, ratio, gen, "cuda")
    for key, value in new.items():
        if isinstance(value, torch.Tensor):
            static[key].copy_(value)
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = dsv4_attention_torch(q, swa_kv, cmp_kv, sinks, scale=0.125, **new)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
