"""Generated attention metadata, read off a step's layout: the CPU/CUDA varlen form and the Ascend TND form.

The Ascend builder is checked by running a CPU model of `npu_fused_infer_attention_score`'s
documented TND semantics on its output and comparing with the CPU reference backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.runtime.attention.ascend import reference_fused_infer_attention_tnd
from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import StepShape, plan_extend, plan_verify

from .runtime_helpers import compile_variant, import_package_module

GEOMETRY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_layers": 1,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
PAGE = 8
GAMMA = 3
N = GAMMA + 1


MODES = ("static", "cap-accept", "compact")


@pytest.fixture(scope="module")
def mode_builders(tmp_path_factory: pytest.TempPathFactory):
    """`{mode: (cpu attn_metadata module, ascend attn_metadata module)}` for every verify mode."""
    tmp = tmp_path_factory.mktemp("meta")
    common = {"model": {"checkpoint": str(tmp / "absent"), "geometry": GEOMETRY},
              "draft": {"checkpoint": str(tmp / "absent_draft"), "gamma": GAMMA},
              "graph": {"enabled": False, "capture_batch_sizes": []},
              "serving": {"page_size": PAGE, "max_context_len": 64, "max_running_requests": 4}}
    out = {}
    for mode in MODES:
        verify = {"mode": mode, "allow_no_cost_model": True}
        tag = mode.replace("-", "_")
        cpu = compile_variant(tmp, "tiny_cpu_static.yaml",
                              {**common, "verify": verify, "backend": {"kind": "cpu", "device": "generic"}},
                              f"meta_cpu_{tag}")
        asc = compile_variant(tmp, "ascend_910c_static.yaml",
                              {**common, "verify": verify, "backend": {"kind": "ascend", "device": "910c"},
                               "model": {**common["model"], "dtype": "float32"},
                               "parallelism": {"tp": 1}}, f"meta_ascend_{tag}")
        out[mode] = (import_package_module(Path(cpu), "attn_metadata"),
                     import_package_module(Path(asc), "attn_metadata"))
    return out


@pytest.fixture(scope="module")
def builders(mode_builders):
    return mode_builders["static"]


CPU = torch.device("cpu")
SHAPE = StepShape(page_size=PAGE, num_draft_tokens=N)


def _tables() -> torch.Tensor:
    return torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0],
                         [8, 9, 10, 11, 12, 0, 0, 0]], dtype=torch.int32)


def _verify(mode: str, prefix: list[int], lens: list[int], table: torch.Tensor):
    """The layout a step of `mode` runs for planned `lens` (compact runs them, the others all N)."""
    run = tuple(lens) if mode == "compact" else (N,) * len(lens)
    return plan_verify(run, tuple(lens), prefix, table, SHAPE, CPU)


def _extend(prefix: list[int], extend: list[int], table: torch.Tensor):
    return plan_extend(prefix, extend, table, PAGE, CPU)


def test_static_verify_metadata_is_fixed_width(builders) -> None:
    cpu, asc = builders
    layout = _verify("static", [5, 0, 17], [N, N, N], _tables())
    m = cpu.build_verify_metadata(layout)
    assert m.qo_indptr.tolist() == [0, N, 2 * N, 3 * N]
    assert m.kv_lens.tolist() == [5 + N, N, 17 + N]
    assert m.positions.tolist() == [5, 6, 7, 8, 0, 1, 2, 3, 17, 18, 19, 20]
    # position 17 of request 2 lives in its third page (id 10), offset 1
    assert m.out_cache_loc[8].item() == 10 * PAGE + 1
    a = asc.build_verify_metadata(layout)
    assert a.actual_seq_lengths_q.tolist() == [N, 2 * N, 3 * N]
    assert a.host_seq_lengths_q == (N, 2 * N, 3 * N)
    assert a.actual_seq_lengths_kv.tolist() == [5 + N, N, 17 + N] == list(a.host_seq_lengths_kv)
    assert torch.equal(a.slot_mapping, m.out_cache_loc)
    assert torch.equal(a.block_table, _tables())


def test_extend_metadata_is_ragged(builders) -> None:
    cpu, asc = builders
    layout = _extend([0, 3, 9], [4, 1, 2], _tables())
    m = cpu.build_extend_metadata(layout)
    assert m.qo_indptr.tolist() == [0, 4, 5, 7]
    assert m.positions.tolist() == [0, 1, 2, 3, 3, 9, 10]
    assert m.kv_lens.tolist() == [4, 4, 11]
    a = asc.build_extend_metadata(layout)
    assert a.actual_seq_lengths_q.tolist() == [4, 5, 7] == list(a.host_seq_lengths_q)  # cumulative ends
    assert a.actual_seq_lengths_kv.tolist() == [4, 4, 11]


def test_compact_metadata_packs_only_planned_rows(mode_builders) -> None:
    cpu, asc = mode_builders["compact"]
    layout = _verify("compact", [5, 0, 17], [2, 1, 4], _tables())
    m = cpu.build_verify_metadata(layout)
    assert m.total_rows == 7  # not 3 x N = 12
    assert m.qo_indptr.tolist() == [0, 2, 3, 7]  # cu_seqlens_q
    assert m.kv_lens.tolist() == [5 + 2, 0 + 1, 17 + 4]
    assert m.positions.tolist() == [5, 6, 0, 17, 18, 19, 20]
    assert m.out_cache_loc.tolist()[3:] == [10 * PAGE + 1, 10 * PAGE + 2, 10 * PAGE + 3, 10 * PAGE + 4]
    assert m.max_seqlen_q == N  # max_verify_len resolves to N here
    a = asc.build_verify_metadata(layout)
    assert a.actual_seq_lengths_q.tolist() == [2, 3, 7]  # cumulative ends qo_indptr[1:]
    assert a.actual_seq_lengths_kv.tolist() == [7, 1, 21]
    assert torch.equal(a.slot_mapping, m.out_cache_loc)
    assert torch.equal(a.positions, m.positions)


@pytest.mark.parametrize("mode", ["static", "cap-accept"])
def test_fixed_width_modes_ignore_the_plan_in_metadata(mode_builders, mode: str) -> None:
    cpu, asc = mode_builders[mode]
    layout = _verify(mode, [3, 9], [2, 1], _tables()[:2])
    assert cpu.build_verify_metadata(layout).qo_indptr.tolist() == [0, N, 2 * N]
    assert asc.build_verify_metadata(layout).actual_seq_lengths_q.tolist() == [N, 2 * N]
    assert layout.verify_lens.tolist() == [2, 1]  # the plan caps acceptance only


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("prefix", "lens"), [([0, 0, 0], [4, 4, 4]), ([5, 1, 20], [2, 1, 4]),
                                              ([13, 7, 2], [1, 3, 2]), ([0, 9, 0], [3, 1, 1])])
def test_ascend_metadata_through_reference_operator_matches_cpu_backend(mode_builders, mode, prefix,
                                                                       lens) -> None:
    cpu, asc = mode_builders[mode]
    torch.manual_seed(sum(prefix) + 7 * sum(lens))
    heads, kv_heads, dim = GEOMETRY["num_heads"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
    cpu_cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
    asc_cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
    cpu_attn = TorchPagedAttention(cpu_cache, PAGE, heads, dim ** -0.5)
    table = _tables()

    def ascend_attend(q, k, v, meta):
        asc_cache.write(0, meta.slot_mapping, k, v)
        return reference_fused_infer_attention_tnd(
            q, asc_cache.k[0].view(-1, PAGE, kv_heads * dim), asc_cache.v[0].view(-1, PAGE, kv_heads * dim),
            actual_seq_lengths=torch.tensor(meta.host_seq_lengths_q),
            actual_seq_lengths_kv=torch.tensor(meta.host_seq_lengths_kv),
            block_table=meta.block_table, block_size=meta.block_size, num_heads=heads,
            num_key_value_heads=kv_heads, scale=dim ** -0.5)

    keep = [i for i, p in enumerate(prefix) if p > 0]
    if keep:  # prefill the prefixes through both paths
        layout = _extend([0] * len(keep), [prefix[i] for i in keep], table[keep])
        mc, ma = cpu.build_extend_metadata(layout), asc.build_extend_metadata(layout)
        t = sum(prefix)
        q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
        torch.testing.assert_close(ascend_attend(q, k, v, ma), cpu_attn.attend(0, q, k, v, mc),
                                   rtol=1e-5, atol=1e-5)
    layout = _verify(mode, prefix, lens, table)
    mc, ma = cpu.build_verify_metadata(layout), asc.build_verify_metadata(layout)
    t = mc.total_rows
    assert t == (sum(lens) if mode == "compact" else len(lens) * N)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    torch.testing.assert_close(ascend_attend(q, k, v, ma), cpu_attn.attend(0, q, k, v, mc),
                               rtol=1e-5, atol=1e-5)


def test_padded_tier_metadata_through_reference_operator_matches_cpu_backend(mode_builders) -> None:
    """A compact step padded to a tier with padding requests and empty slots (a captured graph's
    shape): the real rows attend exactly as unpadded, on the CPU backend and through the Ascend
    operator's reference semantics."""
    cpu, asc = mode_builders["compact"]
    heads, kv_heads, dim = GEOMETRY["num_heads"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
    torch.manual_seed(5)
    prefix, lens = [5, 1, 20], [2, 1, 4]
    padded = plan_verify(tuple(lens), tuple(lens), prefix, _tables(),
                         StepShape(page_size=PAGE, num_draft_tokens=N, tiers=(16,), padding_request_rows=N,
                                   slots_for_tier=lambda tier: 7), CPU)
    plain = _verify("compact", prefix, lens, _tables())
    assert padded.num_slots == 7 and padded.tier == 16 and padded.host_kv_lens[-1] == 1
    q, k, v = torch.randn(16, heads, dim), torch.randn(16, kv_heads, dim), torch.randn(16, kv_heads, dim)

    def attend(meta, rows):
        cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
        attn = TorchPagedAttention(cache, PAGE, heads, dim ** -0.5)
        return attn.attend(0, q[:rows], k[:rows], v[:rows], meta)

    expected = attend(cpu.build_verify_metadata(plain), 7)
    torch.testing.assert_close(attend(cpu.build_verify_metadata(padded), 16)[:7], expected)
    cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
    meta = asc.build_verify_metadata(padded)
    cache.write(0, meta.slot_mapping, k, v)
    out = reference_fused_infer_attention_tnd(
        q, cache.k[0].view(-1, PAGE, kv_heads * dim), cache.v[0].view(-1, PAGE, kv_heads * dim),
        actual_seq_lengths=torch.tensor(meta.host_seq_lengths_q),
        actual_seq_lengths_kv=torch.tensor(meta.host_seq_lengths_kv), block_table=meta.block_table,
        block_size=PAGE, num_heads=heads, num_key_value_heads=kv_heads, scale=dim ** -0.5)
    torch.testing.assert_close(out[:7], expected, rtol=1e-5, atol=1e-5)


def test_compact_rows_see_what_the_same_rows_see_in_a_full_verify(mode_builders) -> None:
    """A planned row attends to exactly the keys it would see in the full B x N step: the
    unplanned rows come after it, so dropping them changes nothing before them."""
    cpu_static, _ = mode_builders["static"]
    cpu_compact, _ = mode_builders["compact"]
    heads, kv_heads, dim = GEOMETRY["num_heads"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
    torch.manual_seed(3)
    prefix, lens = [6, 2, 11], [3, 1, 2]
    full = cpu_static.build_verify_metadata(_verify("static", prefix, lens, _tables()))
    packed_layout = _verify("compact", prefix, lens, _tables())
    packed = cpu_compact.build_verify_metadata(packed_layout)
    src = packed_layout.src_index
    q = torch.randn(3 * N, heads, dim)
    k, v = torch.randn(3 * N, kv_heads, dim), torch.randn(3 * N, kv_heads, dim)
    out_full = TorchPagedAttention(PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32), PAGE, heads,
                                   dim ** -0.5).attend(0, q, k, v, full)
    out_packed = TorchPagedAttention(PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32), PAGE, heads,
                                     dim ** -0.5).attend(0, q[src], k[src], v[src], packed)
    torch.testing.assert_close(out_packed, out_full[src], rtol=1e-6, atol=1e-6)
