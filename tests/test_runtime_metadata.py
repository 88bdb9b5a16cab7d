"""Generated attention metadata: the CPU/CUDA varlen form and the Ascend TND form.

The Ascend builder is checked by running a CPU model of `npu_fused_infer_attention_score`'s
documented TND semantics on its output and comparing with the CPU reference backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.runtime.backends.ascend import reference_fused_infer_attention_tnd
from dspark.runtime.backends.torch_paged import TorchPagedAttention
from dspark.runtime.kv_cache import PagedKVCache

from .runtime_helpers import compile_variant, import_file

GEOMETRY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_layers": 1,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
PAGE = 8
GAMMA = 3
N = GAMMA + 1


@pytest.fixture(scope="module")
def builders(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("meta")
    common = {"model": {"checkpoint": str(tmp / "absent"), "geometry": GEOMETRY},
              "draft": {"checkpoint": str(tmp / "absent_draft"), "gamma": GAMMA},
              "graph": {"enabled": False},
              "serving": {"page_size": PAGE, "max_context_len": 64, "max_running_requests": 4}}
    cpu = compile_variant(tmp, "tiny_cpu_static.yaml",
                          {**common, "backend": {"kind": "cpu", "device": "generic"}}, "meta_cpu")
    asc = compile_variant(tmp, "ascend_910c_static.yaml",
                          {**common, "backend": {"kind": "ascend", "device": "910c"},
                           "model": {**common["model"], "dtype": "float32"},
                           "parallelism": {"tp": 1}}, "meta_ascend")
    return (import_file(Path(cpu) / "attn_metadata.py", "meta_cpu_attn"),
            import_file(Path(asc) / "attn_metadata.py", "meta_ascend_attn"))


def _tables() -> torch.Tensor:
    return torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0],
                         [8, 9, 10, 11, 12, 0, 0, 0]], dtype=torch.int32)


def test_static_verify_metadata_is_fixed_width(builders) -> None:
    cpu, asc = builders
    prefix = torch.tensor([5, 0, 17], dtype=torch.int32)
    m = cpu.build_verify_metadata(prefix, _tables())
    assert m.qo_indptr.tolist() == [0, N, 2 * N, 3 * N]
    assert m.kv_lens.tolist() == [5 + N, N, 17 + N]
    assert m.positions.tolist() == [5, 6, 7, 8, 0, 1, 2, 3, 17, 18, 19, 20]
    # position 17 of request 2 lives in its third page (id 10), offset 1
    assert m.out_cache_loc[8].item() == 10 * PAGE + 1
    a = asc.build_verify_metadata(prefix, _tables())
    assert a.actual_seq_lengths_q.tolist() == [N, 2 * N, 3 * N]
    assert a.actual_seq_lengths_kv.tolist() == [5 + N, N, 17 + N]
    assert torch.equal(a.slot_mapping, m.out_cache_loc)
    assert torch.equal(a.block_table, _tables())


def test_extend_metadata_is_ragged(builders) -> None:
    cpu, asc = builders
    prefix = torch.tensor([0, 3, 9], dtype=torch.int32)
    ext = torch.tensor([4, 1, 2], dtype=torch.int32)
    m = cpu.build_extend_metadata(prefix, ext, _tables())
    assert m.qo_indptr.tolist() == [0, 4, 5, 7]
    assert m.positions.tolist() == [0, 1, 2, 3, 3, 9, 10]
    assert m.kv_lens.tolist() == [4, 4, 11]
    a = asc.build_extend_metadata(prefix, ext, _tables())
    assert a.actual_seq_lengths_q.tolist() == [4, 5, 7]  # cumulative ends, not lengths
    assert a.actual_seq_lengths_kv.tolist() == [4, 4, 11]


@pytest.mark.parametrize("prefix", [[0, 0, 0], [5, 1, 20], [13, 7, 2]])
def test_ascend_metadata_through_reference_operator_matches_cpu_backend(builders, prefix) -> None:
    cpu, asc = builders
    torch.manual_seed(sum(prefix))
    heads, kv_heads, dim = GEOMETRY["num_heads"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
    cpu_cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
    asc_cache = PagedKVCache(1, 16, PAGE, kv_heads, dim, torch.float32)
    cpu_attn = TorchPagedAttention(cpu_cache, PAGE, heads, dim ** -0.5)
    table = _tables()

    def ascend_attend(q, k, v, meta):
        asc_cache.write(0, meta.slot_mapping, k, v)
        return reference_fused_infer_attention_tnd(
            q, asc_cache.k[0].view(-1, PAGE, kv_heads * dim), asc_cache.v[0].view(-1, PAGE, kv_heads * dim),
            actual_seq_lengths=meta.actual_seq_lengths_q, actual_seq_lengths_kv=meta.actual_seq_lengths_kv,
            block_table=meta.block_table, block_size=meta.block_size, num_heads=heads,
            num_key_value_heads=kv_heads, scale=dim ** -0.5)

    pre = torch.tensor(prefix, dtype=torch.int32)
    if pre.sum() > 0:  # prefill the prefixes through both paths
        zero = torch.zeros_like(pre)
        keep = pre > 0
        mc = cpu.build_extend_metadata(zero[keep], pre[keep], table[keep])
        ma = asc.build_extend_metadata(zero[keep], pre[keep], table[keep])
        t = int(pre.sum())
        q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
        torch.testing.assert_close(ascend_attend(q, k, v, ma), cpu_attn.attend(0, q, k, v, mc),
                                   rtol=1e-5, atol=1e-5)
    mc = cpu.build_verify_metadata(pre, table)
    ma = asc.build_verify_metadata(pre, table)
    t = mc.total_rows
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    torch.testing.assert_close(ascend_attend(q, k, v, ma), cpu_attn.attend(0, q, k, v, mc),
                               rtol=1e-5, atol=1e-5)
