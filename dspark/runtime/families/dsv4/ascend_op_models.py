"""CPU reference models of the Ascend operators a DSV4 verify step calls, to check metadata without an NPU.

These are oracles, not fast paths: plain torch, fp32 math, a loop per row. They take the argument names and
layouts of the operators' documentation and of the peers' call sites, so that metadata built for the NPU
(`dspark.runtime.families.dsv4.verify_metadata`, or a later generated Ascend builder) can be run through them
on any CPU. Nothing here imports torch_npu. Only the TND query layout and paged (PA_ND / PA_BSND) caches the
DSV4 verify path uses are modelled; other layouts are refused with NotImplementedError.

`reference_sparse_attn_sharedkv` -- `npu_sparse_attn_sharedkv` (SAS)
--------------------------------------------------------------------
Sources: the operator README (`csrc/attention/sparse_attn_sharedkv/README.md` in vllm-project/vllm-ascend;
`experimental/attention/sparse_attn_sharedkv/README.md` in the ops-transformer mirrors, e.g.
yuanfang-chen/ops-transformer, gitcode Ascend/ops-transformer), its CPU golden
(`.../sparse_attn_sharedkv/tests/pytest/sparse_attn_sharedkv_golden.py` there), vllm-ascend's kernel and
tiling sources for `ori_sparse_indices` (`csrc/attention/sparse_attn_sharedkv/op_kernel/...`), and the call
sites (vllm-ascend `vllm_ascend/attention/dsa_v1.py` `_forward_attention`; sgl-project/sglang
`python/sglang/srt/hardware_backend/npu/attention/ascend_dsv4_backend.py` `_forward_dense`,
`_forward_compressed`).
Modelled:
* O = softmax(Q K~^T * softmax_scale) K~ with K~ = V~ (shared KV: the value is the key), one softmax over
  the union of the raw window and the compressed entries; KV_N heads with query head h on kv head h // G.
* `sinks` [N1] fp32: a per-query-head logit that joins the softmax denominator only (exp(sink - max)
  added to the row sum, no value) -- the golden's `sinks_softmax`.
* Request b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]; row i of q_len sits at position
  p = seqused_kv[b] - q_len + i (right-down alignment). Rows with p < 0 output 0 (golden).
* Raw window, `ori_mask_mode=4` (band): positions max(0, p - ori_win_left) .. min(p + ori_win_right, kv-1)
  (ori_win_left = -1: from 0), read through `ori_block_table[b, pos // block_size]`.
* `ori_sparse_indices` [T, KV_N, K1]: physical slots (page * block_size + offset) read straight from
  `ori_kv`, no block table and no band mask, up to the first negative entry and at most min(K1, kv) of them
  -- vllm-ascend's SWA kernel (`GetOriSparseActualSeqLen`, `DataCopyPABySlots`); it passes
  `dspark_swa_indices` this way for layers without compression only. Its compressed-attention kernel
  ignores the argument, so giving it with `cmp_kv` is refused here rather than silently dropped.
* Compressed entries, `cmp_mask_mode=3`: row p sees entries 0 .. floor((p + 1) / cmp_ratio) - 1, entry e at
  `cmp_block_table[b, e // cmp_block_size]`. Without `cmp_sparse_indices` (C128) all of them; with it (C4)
  the logical entry ids of row t: the first min(K2, visible) ids, stopping at the first -1, ids >= visible
  skipped (golden `gather_cmp_kv`), duplicates kept.
* `cmp_ratio`=1 means no compressed part (vllm-ascend passes max(compress_ratio, 1), SGLang omits it).
Left out: `softmax_lse` (documented as invalid output), the bf16 re-rounding of probabilities the golden
does, `metadata` (the AI-CPU tiling plan; no effect on the math), `cu_seqlens_ori_kv`/`cu_seqlens_cmp_kv`
(ineffective with PA_ND), BSND/TND kv layouts, ori_mask_mode != 4, cmp_mask_mode != 3, and the hardware
shape limits (N1 = 64, D = 512, K1/K2 multiples of 128, block sizes multiples of 16) so small geometries work.
`seqused_q` is documented as ineffective for TND; if given, rows of slot b past seqused_q[b] output 0.
A row with no key at all outputs 0.

`reference_lightning_indexer` -- `npu_lightning_indexer` / `npu_[vllm_]quant_lightning_indexer` (QLI)
---------------------------------------------------------------------------------------------------
Sources: the READMEs in vllm-ascend (`csrc/attention/lightning_indexer/README.md`,
`csrc/attention/vllm_quant_lightning_indexer/README.md`), MindSpore's `mindspore.ops.lightning_indexer` page,
the golden `experimental/attention/quant_lightning_indexer/tests/pytest/quant_lightning_indexer_golden.py`
(ops-transformer mirrors) and the call sites (vllm-ascend `vllm_ascend/models/deepseek_v4/indexer.py`
`select_topk`; SGLang's `li_quant_metadata` kwargs above).
Modelled: per row t and kv head n2, score_j = sum_{h in group(n2)} weights[t, h] * ReLU(q[t, h] . k_j) over
the request's compressed entries j < floor(actual_seq_lengths_key[b] / cmp_ratio) (key paged through
`block_table`), masked under `sparse_mode=3` to j < floor((kv - q_len + i + 1) / cmp_ratio); the indices of
the top `sparse_count` scores, in descending score order, ties to the smaller index (the golden's stable
sort), then -1. `actual_seq_lengths_query` holds cumulative row ends (TND). Indices are logical entry ids, the
form SAS's `cmp_sparse_indices` takes. `sparse_values` (not returned by the device yet) comes back as the
selected scores, -inf where the index is -1. `reference_quant_lightning_indexer` models the quantised
variant at quant mode 0 (per token and head): it takes only an int8 query and int8 keys with float16 dequant
scales, as the device does, and scores sum_h w_h * ReLU((q_h . k_j) * scale_q * scale_k) with the integer
dot products exact. Left out: fp8 inputs, other quant modes, fp16 intermediate rounding, `metadata`,
pre_tokens/next_tokens other than the default, BSND layouts.

`reference_compressor_write` -- the compressor's write of the compressed caches
----------------------------------------------------------------------------------
The indexing follows `verify_metadata` (itself from vllm-ascend `compressor_metadata` and SGLang's
`positions_cmp_padding_c{r}` / `c{r}_loc`): boundary row m (position p, (p + 1) % r == 0) writes entry
(p + 1) // r - 1, pooled from positions p - r + 1 .. p of its request, into slot `cmp_slot_mapping[m]` (vLLM
form: pad -1, skipped) or `cmp_loc[m]` (Ascend form: pad 0, a null-page slot, written). The math is a
stand-in: the entry is the per-feature softmax(score)-weighted sum of the block's rows (SGLang's unfused
path `(kv * score.softmax(dim=rows)).sum(rows)`), or their mean without scores; the real compressor's
overlapping 2r window for C4 (coff = 2), `ape`, RMSNorm, RoPE at `cmp_positions`, Hadamard rotation, state
cache and quantisation are left out. Padding rows write zeros (the device writes whatever its pad rows
compute; only the null page receives it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.runtime.families.dsv4.verify_metadata import INDEXER_RATIO, Dsv4VerifyMetadata

BAND = 4  # ori_mask_mode: band around the row's position
RIGHT_DOWN_CAUSAL = 3  # cmp_mask_mode / sparse_mode
DEFAULT_MASK = 0  # sparse_mode: every entry of the request
NO_LIMIT = (1 << 63) - 1  # pre_tokens / next_tokens default
CMP_RATIOS = (1, 4, 128)  # SAS cmp_ratio (1: raw window only)

Reads = dict[str, list[list[int]]]


class AscendOpArgumentError(ValueError):
    """An operator argument the documented operator would reject (or that would read outside a cache)."""


# ----------------------------------------------------------------------------------------------------------
# argument checks


def _tensor(name: str, a: object, *, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        raise AscendOpArgumentError(f"{name} must be a torch tensor, got {type(a).__name__}")
    if a.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise AscendOpArgumentError(f"{name} must be {names}, got {str(a.dtype).removeprefix('torch.')}")
    if a.ndim != ndim:
        raise AscendOpArgumentError(f"{name} must have {ndim} dims, got shape {list(a.shape)}")
    return a


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT32 = (torch.int32,)
_INT8 = (torch.int8,)
_FP16 = (torch.float16,)


def _cu_seqlens(name: str, cu: object, rows: int) -> list[int]:
    """Cumulative row offsets [B + 1], starting at 0, non-decreasing, ending within the `rows` query rows."""
    cu_list = _tensor(name, cu, dtypes=_INT32, ndim=1).tolist()
    if not cu_list or cu_list[0] != 0:
        raise AscendOpArgumentError(f"{name} must start with 0 (B + 1 cumulative offsets), got {cu_list}")
    if any(b < a for a, b in zip(cu_list, cu_list[1:], strict=False)) or cu_list[-1] > rows:
        raise AscendOpArgumentError(f"{name} must be non-decreasing and end at most at T={rows}, "
                                    f"got {cu_list}")
    return cu_list


def _lengths(name: str, a: object, batch: int) -> list[int]:
    values = _tensor(name, a, dtypes=_INT32, ndim=1)
    if values.shape[0] != batch:
        raise AscendOpArgumentError(f"{name} must have B={batch} entries, got {values.shape[0]}")
    out = values.tolist()
    if any(v < 0 for v in out):
        raise AscendOpArgumentError(f"{name} must be >= 0, got {out}")
    return out


def _table(name: str, table: object, batch: int) -> torch.Tensor:
    t = _tensor(name, table, dtypes=_INT32, ndim=2)
    if t.shape[0] != batch:
        raise AscendOpArgumentError(f"{name} must have B={batch} rows, got {list(t.shape)}")
    return t


def _paged_slot(name: str, table: torch.Tensor, b: int, index: int, block_size: int, num_blocks: int) -> int:
    """Physical slot of logical index `index` of request b, refusing a read outside the cache."""
    col = index // block_size
    if col >= table.shape[1]:
        raise AscendOpArgumentError(f"{name}[{b}] has {table.shape[1]} columns; index {index} needs "
                                    f"column {col}")
    page = int(table[b, col])
    if not 0 <= page < num_blocks:
        raise AscendOpArgumentError(f"{name}[{b}, {col}] = {page} is outside the cache's {num_blocks} blocks")
    return page * block_size + index % block_size


def _sparse_indices(name: str, a: object, rows: int, kv_heads: int) -> torch.Tensor:
    t = _tensor(name, a, dtypes=_INT32, ndim=3)
    if t.shape[0] != rows or t.shape[1] != kv_heads or t.shape[2] < 1:
        raise AscendOpArgumentError(f"{name} must be [T={rows}, KV_N={kv_heads}, K >= 1], "
                                    f"got {list(t.shape)}")
    return t


def _queries_and_cache(q_name: str, q: torch.Tensor, kv_name: str, kv: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checked `[T, N1, D]` queries and the paged cache they read, and N1 / KV heads (the GQA group)."""
    q = _tensor(q_name, q, dtypes=_FLOATS, ndim=3)
    heads, head_dim = q.shape[1], q.shape[2]
    kv = _paged_cache(kv_name, kv, head_dim, q.dtype)
    kv_heads = kv.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise AscendOpArgumentError(f"{q_name} heads N1={heads} must be a multiple of {kv_name} heads "
                                    f"{kv_heads}")
    return q, kv, heads // kv_heads


def _paged_cache(name: str, a: object, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    t = _tensor(name, a, dtypes=_FLOATS, ndim=4)
    if t.shape[3] != head_dim or t.dtype != dtype:
        want, got = str(dtype).removeprefix("torch."), str(t.dtype).removeprefix("torch.")
        raise AscendOpArgumentError(f"{name} must be {want} [blocks, block_size, KV_N, D={head_dim}], "
                                    f"got {got} {list(t.shape)}")
    return t


def _sink_softmax_out(logits: torch.Tensor, keys: torch.Tensor, sink: float | None) -> torch.Tensor:
    """softmax over [logits, sink] (the sink has no value) applied to `keys`; 0 without any key."""
    if logits.numel() == 0:
        return torch.zeros(keys.shape[-1], dtype=torch.float32)
    top = logits.max()
    if sink is not None:
        top = torch.maximum(top, torch.tensor(sink, dtype=torch.float32))
    weights = torch.exp(logits - top)
    total = weights.sum()
    if sink is not None:
        total = total + torch.exp(torch.tensor(sink, dtype=torch.float32) - top)
    return (weights / total) @ keys


# ----------------------------------------------------------------------------------------------------------
# npu_sparse_attn_sharedkv


def reference_sparse_attn_sharedkv(
    q: torch.Tensor, *, ori_kv: torch.Tensor, cmp_kv: torch.Tensor | None = None,
    ori_sparse_indices: torch.Tensor | None = None, cmp_sparse_indices: torch.Tensor | None = None,
    ori_block_table: torch.Tensor | None = None, cmp_block_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor, seqused_q: torch.Tensor | None = None, seqused_kv: torch.Tensor,
    sinks: torch.Tensor | None = None, softmax_scale: float | None = None, cmp_ratio: int = 1,
    ori_mask_mode: int = BAND, cmp_mask_mode: int = RIGHT_DOWN_CAUSAL, ori_win_left: int = 127,
    ori_win_right: int = 0, layout_q: str = "TND", layout_kv: str = "PA_ND", reads: Reads | None = None,
) -> torch.Tensor:
    """CPU model of `npu_sparse_attn_sharedkv` (TND query, PA_ND caches); returns attention_out [T, N1, D].

    `reads`, when given a dict, receives per query row the physical slots read: reads["ori"][t] and
    reads["cmp"][t] (sorted, union over kv heads), so tests can check which pages a row touched.
    """
    if layout_q != "TND" or layout_kv != "PA_ND":
        raise NotImplementedError(f"only layout_q='TND' with layout_kv='PA_ND' is modelled, "
                                  f"got {layout_q!r}, {layout_kv!r}")
    if ori_mask_mode != BAND or cmp_mask_mode != RIGHT_DOWN_CAUSAL:
        raise NotImplementedError(f"only ori_mask_mode=4 and cmp_mask_mode=3 are modelled (the only values "
                                  f"the operator accepts), got {ori_mask_mode}, {cmp_mask_mode}")
    q, ori_kv, group = _queries_and_cache("q", q, "ori_kv", ori_kv)
    rows, heads, head_dim = q.shape
    kv_heads = ori_kv.shape[2]
    cu = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, rows)
    batch = len(cu) - 1
    kv_lens = _lengths("seqused_kv", seqused_kv, batch)
    q_used = _lengths("seqused_q", seqused_q, batch) if seqused_q is not None else None
    if cmp_ratio not in CMP_RATIOS:
        raise AscendOpArgumentError(f"cmp_ratio must be one of {CMP_RATIOS}, got {cmp_ratio}")
    if (cmp_kv is None) != (cmp_ratio == 1):
        state = "missing" if cmp_kv is None else "given"
        raise AscendOpArgumentError(f"cmp_kv must be given exactly when cmp_ratio > 1 (got "
                                    f"cmp_ratio={cmp_ratio}, cmp_kv {state})")
    if cmp_kv is None and (cmp_block_table is not None or cmp_sparse_indices is not None):
        raise AscendOpArgumentError("cmp_block_table / cmp_sparse_indices need cmp_kv")
    if ori_win_left < -1 or ori_win_right < 0:
        raise AscendOpArgumentError(f"ori_win_left must be >= -1 and ori_win_right >= 0, got {ori_win_left}, "
                                    f"{ori_win_right}")
    if sinks is not None:
        sinks = _tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1)
        if sinks.shape[0] != heads:
            raise AscendOpArgumentError(f"sinks must be float32 [N1={heads}], got {list(sinks.shape)}")
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)

    ori_sparse = None
    ori_table = None
    if ori_sparse_indices is not None:
        if cmp_kv is not None:
            raise AscendOpArgumentError("ori_sparse_indices is only honoured without cmp_kv (the compressed "
                                        "kernels ignore it); pass ori_block_table instead")
        ori_sparse = _sparse_indices("ori_sparse_indices", ori_sparse_indices, rows, kv_heads)
    elif ori_block_table is None:
        raise AscendOpArgumentError("ori_block_table (or ori_sparse_indices) is required with PA_ND ori_kv")
    else:
        ori_table = _table("ori_block_table", ori_block_table, batch)
    ori_blocks, ori_bs = ori_kv.shape[0], ori_kv.shape[1]
    ori_flat = ori_kv.reshape(-1, kv_heads, head_dim).float()

    cmp_flat = cmp_table = cmp_sparse = None
    cmp_blocks = cmp_bs = 0
    if cmp_kv is not None:
        cmp_kv = _paged_cache("cmp_kv", cmp_kv, head_dim, q.dtype)
        if cmp_kv.shape[2] != kv_heads:
            raise AscendOpArgumentError(f"cmp_kv must have KV_N={kv_heads} heads, got {cmp_kv.shape[2]}")
        if cmp_block_table is None:
            raise AscendOpArgumentError("cmp_block_table is required with PA_ND cmp_kv")
        cmp_table = _table("cmp_block_table", cmp_block_table, batch)
        cmp_blocks, cmp_bs = cmp_kv.shape[0], cmp_kv.shape[1]
        cmp_flat = cmp_kv.reshape(-1, kv_heads, head_dim).float()
        if cmp_sparse_indices is not None:
            cmp_sparse = _sparse_indices("cmp_sparse_indices", cmp_sparse_indices, rows, kv_heads)

    out = torch.zeros(rows, heads, head_dim, dtype=torch.float32)
    if reads is not None:
        reads["ori"] = [[] for _ in range(rows)]
        reads["cmp"] = [[] for _ in range(rows)]
    qf = q.float()
    for b in range(batch):
        start, q_len, kv = cu[b], cu[b + 1] - cu[b], kv_lens[b]
        computed = q_len if q_used is None else min(q_len, q_used[b])
        for i in range(computed):
            t, p = start + i, kv - q_len + i
            if p < 0:  # a row before the request's first key: no key, output 0 (golden)
                continue
            row_ori: set[int] = set()
            row_cmp: set[int] = set()
            for n2 in range(kv_heads):
                if ori_sparse is not None:
                    slots = []
                    for s in ori_sparse[t, n2, : min(ori_sparse.shape[2], kv)].tolist():
                        if s < 0:
                            break
                        if s >= ori_flat.shape[0]:
                            raise AscendOpArgumentError(f"ori_sparse_indices[{t}, {n2}] slot {s} is outside "
                                                        f"ori_kv's {ori_flat.shape[0]} slots")
                        slots.append(s)
                else:
                    assert ori_table is not None
                    lo = 0 if ori_win_left == -1 else max(p - ori_win_left, 0)
                    hi = min(p + ori_win_right, kv - 1)
                    slots = [_paged_slot("ori_block_table", ori_table, b, pos, ori_bs, ori_blocks)
                             for pos in range(lo, hi + 1)]
                keys = ori_flat[slots, n2]
                row_ori.update(slots)
                if cmp_flat is not None:
                    assert cmp_table is not None
                    visible = (p + 1) // cmp_ratio
                    if cmp_sparse is None:
                        entries = list(range(visible))
                    else:
                        entries = []
                        for e in cmp_sparse[t, n2, : min(cmp_sparse.shape[2], visible)].tolist():
                            if e < 0:
                                break
                            if e < visible:  # ids past the row's visible entries are skipped, not read
                                entries.append(e)
                    cslots = [_paged_slot("cmp_block_table", cmp_table, b, e, cmp_bs, cmp_blocks)
                              for e in entries]
                    keys = torch.cat([keys, cmp_flat[cslots, n2]])
                    row_cmp.update(cslots)
                for h in range(n2 * group, (n2 + 1) * group):
                    logits = (keys @ qf[t, h]) * scale
                    sink = None if sinks is None else float(sinks[h])
                    out[t, h] = _sink_softmax_out(logits, keys, sink)
            if reads is not None:
                reads["ori"][t] = sorted(row_ori)
                reads["cmp"][t] = sorted(row_cmp)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# npu_lightning_indexer


def reference_lightning_indexer(
    query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, *, actual_seq_lengths_query: torch.Tensor,
    actual_seq_lengths_key: torch.Tensor, block_table: torch.Tensor, layout_query: str = "TND",
    layout_key: str = "PA_BSND", sparse_count: int = 2048, sparse_mode: int = RIGHT_DOWN_CAUSAL,
    pre_tokens: int = NO_LIMIT, next_tokens: int = NO_LIMIT, cmp_ratio: int = 1, reads: Reads | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU model of the lightning indexer (TND query, PA_BSND key): (sparse_indices [T, N2, sparse_count]
    int32 padded with -1, sparse_values [T, N2, sparse_count] float32 padded with -inf).

    `reads`, when given a dict, receives reads["key"][t]: the key slots row t scored.
    """
    query, key, group = _queries_and_cache("query", query, "key", key)
    qf, key_flat = query.float(), key.reshape(-1, key.shape[2], key.shape[3]).float()

    def score(t: int, heads: slice, slots: list[int], n2: int, w: torch.Tensor) -> torch.Tensor:
        return w @ torch.relu(qf[t, heads] @ key_flat[slots, n2].T)

    return _indexer_top(query.shape, key.shape, group, weights, score, actual_seq_lengths_query,
                        actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_count,
                        sparse_mode, pre_tokens, next_tokens, cmp_ratio, reads)


def reference_quant_lightning_indexer(
    query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, *, query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor, query_quant_mode: int = 0, key_quant_mode: int = 0,
    actual_seq_lengths_query: torch.Tensor, actual_seq_lengths_key: torch.Tensor, block_table: torch.Tensor,
    layout_query: str = "TND", layout_key: str = "PA_BSND", sparse_count: int = 2048,
    sparse_mode: int = RIGHT_DOWN_CAUSAL, pre_tokens: int = NO_LIMIT, next_tokens: int = NO_LIMIT,
    cmp_ratio: int = 1, reads: Reads | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU model of the quantised lightning indexer (quant mode 0): an int8 query [T, N1, D] with float16
    dequant scales [T, N1] (per token and head) and int8 keys [blocks, block_size, N2, D] with float16 scales
    [blocks, block_size, N2]; score_j = sum_h w_h * ReLU((q_h . k_j) * scale_q,h * scale_k,j), the integer
    dot products exact. The rest as `reference_lightning_indexer`."""
    if query_quant_mode != 0 or key_quant_mode != 0:
        raise NotImplementedError("only quant mode 0 (per token and head) is modelled")
    query = _tensor("query", query, dtypes=_INT8, ndim=3)
    key = _tensor("key", key, dtypes=_INT8, ndim=4)
    rows, heads, head_dim = query.shape
    if key.shape[3] != head_dim or key.shape[2] < 1 or heads % key.shape[2]:
        raise AscendOpArgumentError(f"key must be int8 [blocks, block_size, KV_N, D={head_dim}] with KV_N "
                                    f"dividing N1={heads}, got {list(key.shape)}")
    q_scale = _tensor("query_dequant_scale", query_dequant_scale, dtypes=_FP16, ndim=2)
    if tuple(q_scale.shape) != (rows, heads):
        raise AscendOpArgumentError(f"query_dequant_scale must be [T={rows}, N1={heads}], got "
                                    f"{list(q_scale.shape)}")
    k_scale = _tensor("key_dequant_scale", key_dequant_scale, dtypes=_FP16, ndim=key_dequant_scale.ndim)
    if k_scale.ndim not in (2, 3) or tuple(k_scale.shape[:2]) != tuple(key.shape[:2]) or (
            k_scale.ndim == 3 and k_scale.shape[2] != key.shape[2]):
        raise AscendOpArgumentError(f"key_dequant_scale must be [blocks, block_size(, KV_N)] of the key's "
                                    f"{list(key.shape[:3])}, got {list(k_scale.shape)}")
    group = heads // key.shape[2]
    q_codes, qs = query.to(torch.float32), q_scale.to(torch.float32)
    k_codes = key.reshape(-1, key.shape[2], head_dim).to(torch.float32)
    ks = k_scale.reshape(-1, k_scale.shape[2] if k_scale.ndim == 3 else 1).to(torch.float32)

    def score(t: int, hs: slice, slots: list[int], n2: int, w: torch.Tensor) -> torch.Tensor:
        dots = (q_codes[t, hs].unsqueeze(1) * k_codes[slots, n2]).sum(-1)  # [G, n], exact integers
        scaled = dots * qs[t, hs][:, None] * ks[slots, min(n2, ks.shape[1] - 1)][None, :]
        return (scaled.relu() * w[:, None]).sum(0)

    return _indexer_top(query.shape, key.shape, group, weights, score, actual_seq_lengths_query,
                        actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_count,
                        sparse_mode, pre_tokens, next_tokens, cmp_ratio, reads)


def _indexer_top(query_shape: torch.Size, key_shape: torch.Size, group: int, weights: torch.Tensor,
                 score: Callable[[int, slice, list[int], int, torch.Tensor], torch.Tensor],
                 actual_seq_lengths_query: torch.Tensor, actual_seq_lengths_key: torch.Tensor,
                 block_table: torch.Tensor, layout_query: str, layout_key: str, sparse_count: int,
                 sparse_mode: int, pre_tokens: int, next_tokens: int, cmp_ratio: int, reads: Reads | None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both indexers' masking and top-k around their `score(t, heads, key slots, n2, weights)`."""
    if layout_query != "TND" or layout_key != "PA_BSND":
        raise NotImplementedError(f"only layout_query='TND' with layout_key='PA_BSND' is modelled, got "
                                  f"{layout_query!r}, {layout_key!r}")
    if sparse_mode not in (DEFAULT_MASK, RIGHT_DOWN_CAUSAL):
        raise AscendOpArgumentError(f"sparse_mode must be 0 or 3, got {sparse_mode}")
    if pre_tokens != NO_LIMIT or next_tokens != NO_LIMIT:
        raise NotImplementedError("only the default pre_tokens / next_tokens (2**63 - 1) are modelled")
    if sparse_count < 1:
        raise AscendOpArgumentError(f"sparse_count must be >= 1, got {sparse_count}")
    if cmp_ratio < 1:
        raise AscendOpArgumentError(f"cmp_ratio must be >= 1, got {cmp_ratio}")
    rows, heads = query_shape[0], query_shape[1]
    blocks, bs, kv_heads = key_shape[0], key_shape[1], key_shape[2]
    weights = _tensor("weights", weights, dtypes=_FLOATS, ndim=2)
    if tuple(weights.shape) != (rows, heads):
        raise AscendOpArgumentError(f"weights must be [T={rows}, N1={heads}], got {list(weights.shape)}")
    ends = _tensor("actual_seq_lengths_query", actual_seq_lengths_query, dtypes=_INT32, ndim=1).tolist()
    cu = _cu_seqlens("actual_seq_lengths_query (as [0, *ends])",
                     torch.tensor([0, *ends], dtype=torch.int32), rows)
    batch = len(ends)
    kv_lens = _lengths("actual_seq_lengths_key", actual_seq_lengths_key, batch)
    table = _table("block_table", block_table, batch)
    wf = weights.float()

    indices = torch.full((rows, kv_heads, sparse_count), -1, dtype=torch.int32)
    values = torch.full((rows, kv_heads, sparse_count), float("-inf"), dtype=torch.float32)
    if reads is not None:
        reads["key"] = [[] for _ in range(rows)]
    for b in range(batch):
        start, q_len, kv = cu[b], cu[b + 1] - cu[b], kv_lens[b]
        entries = kv // cmp_ratio
        for i in range(q_len):
            t = start + i
            visible = entries
            if sparse_mode == RIGHT_DOWN_CAUSAL:
                visible = min(entries, max(0, (kv - q_len + i + 1) // cmp_ratio))
            if visible == 0:
                continue
            slots = [_paged_slot("block_table", table, b, j, bs, blocks) for j in range(visible)]
            if reads is not None:
                reads["key"][t] = sorted(slots)
            for n2 in range(kv_heads):
                hs = slice(n2 * group, (n2 + 1) * group)
                scores = score(t, hs, slots, n2, wf[t, hs])
                # Stable descending sort: equal scores keep index order, the golden's tie rule.
                order = torch.sort(scores, descending=True, stable=True).indices[:sparse_count]
                indices[t, n2, : order.numel()] = order.to(torch.int32)
                values[t, n2, : order.numel()] = scores[order]
    return indices, values


# ----------------------------------------------------------------------------------------------------------
# compressor write (indexing model plus a pooling stand-in)


def reference_compressor_write(
    cmp_kv: torch.Tensor, kv_history: torch.Tensor, *, cmp_ratio: int, boundary_rows: torch.Tensor,
    cmp_positions: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, row_slot: torch.Tensor,
    score_history: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed cache after one step's compressor writes, and the M written entries [M, D].

    `cmp_kv` [blocks, block_size, 1, D] (or [blocks, block_size, D]) is not modified: a copy is returned.
    `kv_history` / `score_history` [B, S, D] hold each slot's per-position compressor inputs. `slots` is
    either the vLLM form (`cmp_slot_mapping`, pad -1: skipped) or the Ascend form (`cmp_loc`, pad 0: written).
    """
    if cmp_ratio < 1:
        raise AscendOpArgumentError(f"cmp_ratio must be >= 1, got {cmp_ratio}")
    if not isinstance(cmp_kv, torch.Tensor) or cmp_kv.ndim not in (3, 4):
        raise AscendOpArgumentError("cmp_kv must be a tensor [blocks, block_size, (1,) D]")
    cmp_kv = _tensor("cmp_kv", cmp_kv, dtypes=_FLOATS, ndim=cmp_kv.ndim)
    kv_history = _tensor("kv_history", kv_history, dtypes=_FLOATS, ndim=3)
    head_dim = kv_history.shape[2]
    if cmp_kv.shape[-1] != head_dim or (cmp_kv.ndim == 4 and cmp_kv.shape[2] != 1):
        raise AscendOpArgumentError(f"cmp_kv must be [blocks, block_size, (1,) D={head_dim}], got "
                                    f"{list(cmp_kv.shape)}")
    if score_history is not None:
        score_history = _tensor("score_history", score_history, dtypes=_FLOATS, ndim=3)
        if score_history.shape != kv_history.shape:
            raise AscendOpArgumentError(f"score_history must match kv_history {list(kv_history.shape)}, got "
                                        f"{list(score_history.shape)}")
    rows_t = _tensor("boundary_rows", boundary_rows, dtypes=_INT32, ndim=1)
    m = rows_t.shape[0]
    cmp_pos = _tensor("cmp_positions", cmp_positions, dtypes=(torch.int64,), ndim=1)
    slots_t = _tensor("slots", slots, dtypes=(torch.int32, torch.int64), ndim=1)
    if cmp_pos.shape[0] != m or slots_t.shape[0] != m:
        raise AscendOpArgumentError(f"boundary_rows, cmp_positions and slots must all have M={m} entries")
    pos = _tensor("positions", positions, dtypes=(torch.int64,), ndim=1)
    rslot = _tensor("row_slot", row_slot, dtypes=_INT32, ndim=1)
    if rslot.shape[0] != pos.shape[0]:
        raise AscendOpArgumentError("positions and row_slot must have one entry per row")

    flat = cmp_kv.reshape(-1, head_dim).clone()
    entries = torch.zeros(m, head_dim, dtype=torch.float32)
    for k, (row, slot) in enumerate(zip(rows_t.tolist(), slots_t.tolist(), strict=True)):
        if row >= 0:
            if row >= pos.shape[0]:
                raise AscendOpArgumentError(f"boundary_rows[{k}] = {row} is not a row of the step")
            b, p = int(rslot[row]), int(pos[row])
            if (p + 1) % cmp_ratio or int(cmp_pos[k]) != p - cmp_ratio + 1:
                raise AscendOpArgumentError(f"boundary_rows[{k}] (position {p}) does not close a block of "
                                            f"{cmp_ratio} at cmp_positions[{k}] = {int(cmp_pos[k])}")
            if b >= kv_history.shape[0] or p >= kv_history.shape[1]:
                raise AscendOpArgumentError(f"kv_history has no position {p} of slot {b}")
            block = kv_history[b, p - cmp_ratio + 1 : p + 1].float()
            if score_history is None:
                entries[k] = block.mean(0)
            else:
                gate = score_history[b, p - cmp_ratio + 1 : p + 1].float().softmax(0)
                entries[k] = (block * gate).sum(0)
        if slot < 0:  # vLLM PAD_SLOT_ID: the cache writer skips it
            continue
        if slot >= flat.shape[0]:
            raise AscendOpArgumentError(f"slots[{k}] = {slot} is outside the cache's {flat.shape[0]} slots")
        flat[slot] = entries[k].to(flat.dtype)
    return flat.view(cmp_kv.shape), entries


# ----------------------------------------------------------------------------------------------------------
# running a planned step


@dataclass(frozen=True)
class Dsv4ReferenceOutputs:
    """One layer of a verify step run through the references."""

    attention_out: torch.Tensor  # [T, N1, D]
    topk_indices: torch.Tensor | None  # [T, 1, index_topk] for C4 layers
    topk_values: torch.Tensor | None


def run_dsv4_layer_reference(
    meta: Dsv4VerifyMetadata, *, compress_ratio: int, q: torch.Tensor, ori_kv: torch.Tensor,
    softmax_scale: float, sinks: torch.Tensor | None = None, cmp_kv: torch.Tensor | None = None,
    index_query: torch.Tensor | None = None, index_key: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None, use_swa_indices: bool = False, reads: Reads | None = None,
) -> Dsv4ReferenceOutputs:
    """Run one DSV4 attention layer of a planned step with the arguments the peers pass, from `meta.device`.

    compress_ratio 0 (window only), 4 (indexer top-k, then SAS with `cmp_sparse_indices`) or 128 (SAS over
    every visible entry). `use_swa_indices` passes `swa_indices` as `ori_sparse_indices` (vllm-ascend's
    DSpark path, window-only layers) instead of `ori_block_table` with the band window.
    """
    if compress_ratio not in (0, *meta.compressed):
        raise AscendOpArgumentError(f"compress_ratio must be 0 or one of the step's ratios "
                                    f"{tuple(meta.compressed)}, got {compress_ratio}")
    dev = meta.device
    kwargs: dict = dict(ori_kv=ori_kv, cu_seqlens_q=dev.cu_seqlens_q.cpu(), seqused_kv=dev.seqused_kv.cpu(),
                        sinks=sinks, softmax_scale=softmax_scale, ori_win_left=meta.ori_win_left,
                        ori_win_right=meta.ori_win_right, reads=reads)
    if use_swa_indices:
        kwargs["ori_sparse_indices"] = dev.swa_indices.cpu().unsqueeze(1)
    else:
        kwargs["ori_block_table"] = dev.ori_block_table.cpu()
    topk = values = None
    if compress_ratio:
        plan = meta.compressed[compress_ratio].device
        kwargs.update(cmp_kv=cmp_kv, cmp_ratio=compress_ratio, cmp_block_table=plan.cmp_block_table.cpu())
        if compress_ratio == INDEXER_RATIO:
            if index_query is None or index_key is None or index_weights is None:
                raise AscendOpArgumentError("a C4 layer needs index_query, index_key and index_weights")
            topk, values = reference_lightning_indexer(
                index_query, index_key, index_weights,
                actual_seq_lengths_query=dev.actual_seq_lengths_q.cpu(),
                actual_seq_lengths_key=dev.seqused_kv.cpu(), block_table=plan.cmp_block_table.cpu(),
                sparse_count=meta.config.index_topk, sparse_mode=RIGHT_DOWN_CAUSAL, cmp_ratio=INDEXER_RATIO)
            kwargs["cmp_sparse_indices"] = topk
    out = reference_sparse_attn_sharedkv(q, **kwargs)
    return Dsv4ReferenceOutputs(attention_out=out, topk_indices=topk, topk_values=values)


def compressor_write_from_metadata(
    meta: Dsv4VerifyMetadata, ratio: int, cmp_kv: torch.Tensor, kv_history: torch.Tensor, *,
    score_history: torch.Tensor | None = None, ascend_loc: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_compressor_write` with a planned step's boundary rows, through `cmp_loc` (Ascend form, pads
    written to the null page) or `cmp_slot_mapping` (vLLM form, pads skipped)."""
    if ratio not in meta.compressed:
        raise AscendOpArgumentError(f"the step has no compress ratio {ratio}; "
                                    f"it has {tuple(meta.compressed)}")
    plan = meta.compressed[ratio].device
    slots = plan.cmp_loc if ascend_loc else plan.cmp_slot_mapping
    return reference_compressor_write(
        cmp_kv, kv_history, cmp_ratio=ratio, boundary_rows=plan.boundary_rows.cpu(),
        cmp_positions=plan.cmp_positions.cpu(), slots=slots.cpu(), positions=meta.device.positions.cpu(),
        row_slot=meta.device.row_slot.cpu(), score_history=score_history)


__all__ = [
    "AscendOpArgumentError",
    "Dsv4ReferenceOutputs",
    "compressor_write_from_metadata",
    "reference_compressor_write",
    "reference_lightning_indexer",
    "reference_sparse_attn_sharedkv",
    "run_dsv4_layer_reference",
]
