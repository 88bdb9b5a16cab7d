"""Triton kernels vs their torch references, run under the Triton interpreter on CPU tensors.

`TRITON_INTERPRET` is read when `triton.jit` decorates a kernel, i.e. when the kernel modules are
first imported, so these checks run in a fresh process (tests/test_runtime_kernels.py starts it)
rather than in a pytest process that may already have imported the kernels. The interpreter
neither computes bf16 correctly nor checks bounds, so the cases are fp32/int64 and every kernel
also writes into oversized buffers prefilled with a sentinel: an unmasked load or store shows up
as a changed sentinel or a sentinel copied into the result.

Prints one JSON object: check name -> "ok" or the failure's traceback.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from collections.abc import Callable
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from dspark.runtime.kernels.accept import (
    greedy_accept,  # noqa: E402
    launch_greedy_accept,  # noqa: E402
)
from dspark.runtime.kernels.dispatch import next_pow2  # noqa: E402
from dspark.runtime.kernels.paged_attention import (  # noqa: E402
    MIN_DOT,
    block_sizes,
    launch_paged_attention,
    paged_attention,
)
from dspark.runtime.kernels.rms_norm import launch_rms_norm, rms_norm, rms_norm_torch  # noqa: E402
from dspark.runtime.kernels.scatter import (  # noqa: E402
    launch_pack_rows,
    launch_scatter_rows,
    pack_rows,
    scatter_rows,
)
from dspark.runtime.kernels.verify_rows import VerifyRows, build_verify_rows, launch_verify_rows  # noqa: E402
from tests.interp_runner import run_checks  # noqa: E402

SENTINEL = -777
CASES = 30


def _lens_case(rng: random.Random, case: int) -> tuple[int, torch.Tensor]:
    """(N, verify_lens int32): B in 1..12 (case 0 always a single request), gamma in 1..8,
    lengths anywhere in [1, N]."""
    num_reqs, n = (1 if case == 0 else rng.randint(1, 12)), rng.randint(1, 8) + 1
    return n, torch.tensor([rng.randint(1, n) for _ in range(num_reqs)], dtype=torch.int32)


def _equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{name}: got {got.dtype} {got.tolist()}, want {want.dtype} {want.tolist()}")


def check_layout_worked_example() -> None:
    vl = torch.tensor([2, 1, 4], dtype=torch.int32)
    rows = build_verify_rows(vl, torch.zeros(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32),
                             16, 7, num_draft_tokens=5, impl="triton")
    _equal("qo_indptr", rows.qo_indptr, torch.tensor([0, 2, 3, 7], dtype=torch.int32))
    _equal("src_index", rows.src_index, torch.tensor([0, 1, 5, 10, 11, 12, 13]))


def check_layout_random() -> None:
    rng = random.Random(1)
    for case in range(CASES):
        n, vl = _lens_case(rng, case)
        num_reqs, total = vl.shape[0], int(vl.sum())
        page_size = rng.randint(1, 16)
        prefix = torch.tensor([rng.randint(0, 40) for _ in range(num_reqs)], dtype=torch.int32)
        pages = -(-(40 + n) // page_size)
        # A column slice of a wider table, so the kernel must honour the table's row stride.
        wide = torch.randperm(num_reqs * (pages + 3), dtype=torch.int32).view(num_reqs, pages + 3)
        table = wide[:, :pages]
        want = build_verify_rows(vl, prefix, table, page_size, total, num_draft_tokens=n, impl="torch")
        got = build_verify_rows(vl, prefix, table, page_size, total, num_draft_tokens=n, impl="triton")
        for field in ("qo_indptr", "row_req", "positions", "out_cache_loc", "src_index"):
            _equal(field, getattr(got, field), getattr(want, field))

        # The row buffers are longer than the step by a whole request's worth, and the kernel is told
        # it may use them all: only its per-request masks keep the tail untouched.
        extra = n + 1
        buf = VerifyRows(*(torch.full((len_ + extra,), SENTINEL, dtype=dt) for len_, dt in (
            (num_reqs + 1, torch.int32), (total, torch.int64), (total, torch.int64), (total, torch.int64),
            (total, torch.int64))))
        launch_verify_rows(vl, prefix, table, page_size, total + extra, n, buf)
        _equal("qo_indptr in buffer", buf.qo_indptr[:num_reqs + 1], want.qo_indptr)
        _equal("qo_indptr tail", buf.qo_indptr[num_reqs + 1:],
               torch.full((extra,), SENTINEL, dtype=torch.int32))
        for field in ("row_req", "positions", "out_cache_loc", "src_index"):
            _equal(f"{field} in buffer", getattr(buf, field)[:total], getattr(want, field))
            _equal(f"{field} tail", getattr(buf, field)[total:], torch.full((extra,), SENTINEL))


AcceptCase = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _accept_case(rng: random.Random, case: int) -> AcceptCase:
    """Wide drafts/target (3 extra columns that all match) and verify_lens, seq_lens.

    Drafts copy the target and then get a mismatch at a random position (or none), and the tiny
    vocabulary makes later chance matches common, so every stopping rule is exercised.
    """
    n, vl = _lens_case(rng, case)
    num_reqs, gamma = vl.shape[0], n - 1
    target = torch.tensor([[rng.randint(0, 3) for _ in range(n + 3)] for _ in range(num_reqs)])
    drafts = target[:, :gamma + 3].clone()
    for r in range(num_reqs):
        miss = rng.randint(0, gamma)
        if miss < gamma:
            drafts[r, miss] = 4 + rng.randint(0, 3)  # outside the target's vocabulary: a sure mismatch
    seq = torch.tensor([rng.randint(0, 100) for _ in range(num_reqs)], dtype=torch.int32)
    return drafts, target, vl, seq


def check_accept_cap_example() -> None:
    drafts = torch.tensor([[1, 2, 3]] * 3)
    target = torch.tensor([[1, 2, 3, 4]] * 3)
    acc = greedy_accept(drafts, target, torch.tensor([2, 1, 4]), impl="triton")
    _equal("correct_len", acc.correct_len, torch.tensor([1, 0, 3]))
    _equal("bonus", acc.bonus, torch.tensor([2, 1, 4]))


def check_accept_random() -> None:
    rng = random.Random(2)
    for case in range(CASES):
        wide_drafts, wide_target, vl, seq = _accept_case(rng, case)
        num_reqs, gamma = vl.shape[0], wide_target.shape[1] - 4
        drafts, target = wide_drafts[:, :gamma], wide_target[:, :gamma + 1]
        seq_lens = seq if case % 2 else None
        want = greedy_accept(drafts, target, vl, seq_lens, impl="torch")
        got = greedy_accept(drafts, target, vl, seq_lens, impl="triton")
        for field in ("correct_len", "commit_len", "bonus"):
            _equal(field, getattr(got, field), getattr(want, field))
        if seq_lens is None:
            assert got.new_seq_lens is None
        else:
            _equal("new_seq_lens", got.new_seq_lens, want.new_seq_lens)

        extra = 3
        outs = [torch.full((num_reqs + extra,), SENTINEL) for _ in range(3)]
        new_seq = torch.full((num_reqs + extra,), SENTINEL, dtype=torch.int32)
        launch_greedy_accept(drafts, target, vl, seq, *outs, new_seq)
        for name, buf, ref in zip(("correct_len", "commit_len", "bonus"), outs,
                                  (want.correct_len, want.commit_len, want.bonus), strict=True):
            _equal(f"{name} in buffer", buf[:num_reqs], ref)
            _equal(f"{name} tail", buf[num_reqs:], torch.full((extra,), SENTINEL))
        _equal("new_seq_lens in buffer", new_seq[:num_reqs], (seq + want.commit_len).int())
        _equal("new_seq_lens tail", new_seq[num_reqs:], torch.full((extra,), SENTINEL, dtype=torch.int32))


def _rows_case(rng: random.Random, case: int) -> tuple[int, int, torch.Tensor]:
    """(fixed rows B*N, width H, src_index of a random ragged layout)."""
    n, vl = _lens_case(rng, case)
    rows = build_verify_rows(vl, torch.zeros_like(vl), torch.zeros(vl.shape[0], 1, dtype=torch.int32),
                             64, int(vl.sum()), num_draft_tokens=n, impl="torch")
    return vl.shape[0] * n, rng.choice([1, 5, 16, 37]), rows.src_index


# The pack/scatter checks launch with BLOCK_H = 16 (so H = 5 or 37 ends in a partial block) on
# buffers with PAD sentinel columns and rows beyond the real ones: an unmasked load or store then
# stays inside the buffer, where the interpreter cannot corrupt memory and the check can see it.
BLOCK_H = 16
PAD = BLOCK_H


def check_pack_random() -> None:
    rng = random.Random(3)
    for case in range(CASES):
        num_fixed, width, src_index = _rows_case(rng, case)
        total = src_index.shape[0]
        wide = torch.full((num_fixed, width + PAD), float(SENTINEL))
        wide[:, :width] = torch.randn(num_fixed, width)
        fixed = wide[:, :width]
        want = pack_rows(fixed, src_index, impl="torch")
        _equal("pack", pack_rows(fixed, src_index, impl="triton"), want)

        out = torch.full((total + 2, width + PAD), float(SENTINEL))
        launch_pack_rows(fixed, src_index, out[:, :width], block_h=BLOCK_H)
        _equal("pack in buffer", out[:total, :width], want)
        _equal("pack padding", out[:, width:], torch.full((total + 2, PAD), float(SENTINEL)))
        _equal("pack extra rows", out[total:, :width], torch.full((2, width), float(SENTINEL)))

        ids = torch.randint(0, 1000, (num_fixed,))
        _equal("pack ids", pack_rows(ids, src_index, impl="triton"), pack_rows(ids, src_index, impl="torch"))
        cube = torch.randn(num_fixed, 2, 3)
        _equal("pack 3-D", pack_rows(cube, src_index, impl="triton"),
               pack_rows(cube, src_index, impl="torch"))


def check_scatter_random() -> None:
    rng = random.Random(4)
    for case in range(CASES):
        num_fixed, width, src_index = _rows_case(rng, case)
        total = src_index.shape[0]
        wide = torch.full((total, width + PAD), float(SENTINEL))
        wide[:, :width] = torch.randn(total, width)
        packed = wide[:, :width]
        want = scatter_rows(packed, src_index, num_fixed, fill=float("-inf"), impl="torch")
        _equal("scatter", scatter_rows(packed, src_index, num_fixed, fill=float("-inf"), impl="triton"), want)

        out = torch.full((num_fixed + 2, width + PAD), float(SENTINEL))
        launch_scatter_rows(packed, src_index, out[:, :width], block_h=BLOCK_H)
        unplanned = torch.ones(num_fixed + 2, dtype=torch.bool)
        unplanned[src_index] = False
        _equal("scatter planned rows", out[src_index, :width], packed)
        _equal("scatter unplanned rows", out[unplanned],
               torch.full((int(unplanned.sum()), width + PAD), float(SENTINEL)))
        _equal("scatter padding", out[:, width:], torch.full((num_fixed + 2, PAD), float(SENTINEL)))

        ids = torch.randint(0, 1000, (total,))
        _equal("scatter ids", scatter_rows(ids, src_index, num_fixed, fill=-1, impl="triton"),
               scatter_rows(ids, src_index, num_fixed, fill=-1, impl="torch"))


AttnInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                   torch.Tensor]
ATTN_CASES = 20
# Sentinel rows / dims around every attention buffer: at least the smallest BLOCK_M, so the rows an
# unmasked store of the last slot's last block would write stay inside the buffer, where they show.
ATTN_PAD = MIN_DOT


def _padded(shape: tuple[int, int, int], rows_pad: int, heads_pad: int, dims_pad: int,
            fill: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded buffer, the `[:shape]` view of it holding `fill` or random values).

    The padding is sentinel-sized noise, not one constant: a constant in the padded dims of q and k
    would shift every key's score alike and leave the softmax unchanged.
    """
    big = SENTINEL * (1 + torch.rand(shape[0] + rows_pad, shape[1] + heads_pad, shape[2] + dims_pad))
    view = big[:shape[0], :shape[1], :shape[2]]
    view.copy_(torch.randn(shape) if fill is None else fill)
    return big, view


def _attn_case(rng: random.Random, case: int) -> tuple[AttnInputs, int, int, float]:
    """A ragged step: (q, k_cache, v_cache, qo_indptr, kv_lens, positions, page_table), page_size,
    max rows per slot, scale. q and the caches are views into sentinel-padded buffers (extra heads,
    dims and rows), the page table a column slice of a wider one whose extra columns name a page of
    sentinels: an unmasked or misindexed read changes the result.

    Slots are real requests (1..40 rows after a prefix of up to ~100 positions; case 1 is an extend
    of 70 rows, more than any BLOCK_M), 0-row slots anywhere, and a padding request on the null page.
    Every few cases one slot's kv_len is below its last position + 1 (both implementations clip
    the keys to it).
    """
    group, head_dim = rng.choice([1, 2, 3, 4]), rng.choice([16, 24, 32, 64])  # 3: a group padded to 4
    num_kv, page_size = rng.choice([1, 2]), rng.choice([1, 4, 16])
    kinds = ["real"] * rng.randint(1, 4) + ["empty"] * rng.randint(0, 2) + ["pad"] * rng.randint(0, 1)
    rng.shuffle(kinds)
    rows, prefix = [], []
    for kind in kinds:
        rows.append(0 if kind == "empty" else rng.randint(1, 4 if kind == "pad" else rng.choice([4, 9, 40])))
        prefix.append(rng.randint(0, 100) if kind == "real" else 0)
    if case == 1:
        rows[kinds.index("real")] = 70
    pages_per = max(-(-(p + r) // page_size) for p, r in zip(prefix, rows, strict=True))
    num_pages = 2 + len(kinds) * pages_per  # page 0 null, the last one holds only sentinels
    pool = list(range(1, num_pages - 1))
    rng.shuffle(pool)
    table = torch.full((len(kinds), pages_per + 3), num_pages - 1, dtype=torch.int32)
    for r, kind in enumerate(kinds):
        held = -(-(prefix[r] + rows[r]) // page_size) if kind == "real" else 0
        table[r, :pages_per] = 0
        table[r, :held] = torch.tensor([pool.pop() for _ in range(held)], dtype=torch.int32)
    kv = [max(p + r, 1) for p, r in zip(prefix, rows, strict=True)]
    if case % 4 == 3:
        r = rng.choice([i for i, n in enumerate(rows) if n])
        kv[r] = rng.randint(1, kv[r])
    total = sum(rows)
    num_slots = num_pages * page_size
    _, k_cache = _padded((num_slots, num_kv, head_dim), 0, 1, ATTN_PAD)
    _, v_cache = _padded((num_slots, num_kv, head_dim), 0, 1, ATTN_PAD)
    for cache in (k_cache, v_cache):
        cache[(num_pages - 1) * page_size:] = float(SENTINEL)
    _, q = _padded((total, group * num_kv, head_dim), ATTN_PAD, 1, ATTN_PAD)
    qo = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32)
    positions = torch.cat([torch.arange(p, p + r) for p, r in zip(prefix, rows, strict=True)]).long()
    inputs = (q, k_cache, v_cache, qo, torch.tensor(kv, dtype=torch.int32), positions, table[:, :pages_per])
    return inputs, page_size, max(rows), rng.choice([1.0, 0.125, 0.3])


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    same_kind = got.shape == want.shape and got.dtype == want.dtype
    if not same_kind or not torch.allclose(got, want, atol=tol, rtol=tol):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}, "
                             f"max error {err}")


def check_paged_attention_random() -> None:
    rng = random.Random(5)
    for case in range(ATTN_CASES):
        inputs, page_size, max_rows, scale = _attn_case(rng, case)
        kw = {"page_size": page_size, "scale": scale, "max_rows_per_request": max_rows}
        want = paged_attention(*inputs, **kw, impl="torch")
        _close(f"case {case}", paged_attention(*inputs, **kw, impl="triton"), want)


def check_paged_attention_sentinels() -> None:
    """Smallest blocks (several query blocks and key tiles per slot) into a sentinel-padded output:
    exactly the step's rows, heads and dims are written."""
    rng = random.Random(6)
    for case in range(ATTN_CASES):
        inputs, page_size, max_rows, scale = _attn_case(rng, case)
        q = inputs[0]
        total, num_heads, head_dim = q.shape
        group = num_heads // inputs[1].shape[1]
        kw = {"page_size": page_size, "scale": scale, "max_rows_per_request": max_rows}
        want = paged_attention(*inputs, **kw, impl="torch")
        big = torch.full((total + ATTN_PAD, num_heads + 1, head_dim + ATTN_PAD), float(SENTINEL))
        block_m = max(MIN_DOT // next_pow2(group), 1)
        assert block_m <= block_sizes(group, head_dim)[0]
        launch_paged_attention(*inputs, big[:, :num_heads, :head_dim], **kw, block_m=block_m, block_n=MIN_DOT)
        _close(f"case {case} rows", big[:total, :num_heads, :head_dim], want)
        untouched = torch.ones(big.shape, dtype=torch.bool)
        untouched[:total, :num_heads, :head_dim] = False
        _equal(f"case {case} outside the rows", big[untouched],
               torch.full((int(untouched.sum()),), float(SENTINEL)))


def check_paged_attention_rows_independent() -> None:
    """A request's rows have the same bits alone as beside other requests, and its last row the same
    bits as a one-row (decode-shaped) step: the kernel's tiles do not depend on the step."""
    rng = random.Random(7)
    for case in range(8):
        inputs, page_size, max_rows, scale = _attn_case(rng, case)
        q, k_cache, v_cache, qo, kv, positions, table = inputs
        kw = {"page_size": page_size, "scale": scale}
        full = paged_attention(*inputs, **kw, max_rows_per_request=max_rows, impl="triton")
        for r in range(kv.shape[0]):
            start, end = int(qo[r]), int(qo[r + 1])
            for first in {start, end - 1} if end > start else ():
                alone = paged_attention(q[first:end], k_cache, v_cache,
                                        torch.tensor([0, end - first], dtype=torch.int32), kv[r:r + 1],
                                        positions[first:end], table[r:r + 1], **kw,
                                        max_rows_per_request=end - first, impl="triton")
                _equal(f"case {case} slot {r} rows {first}..{end - 1}", alone, full[first:end])


def check_triton_attention_lossless() -> None:
    """The CUDA attention end to end on the CPU: the embedded compact deployment with the Triton
    kernel (interpreted) as its attention decodes greedily exactly as target-only decoding through
    the same kernel: the kernel's rows do not depend on their neighbours, and the metadata, the
    ragged compact rows and the prefill chunks reach it as the CUDA runtime passes them."""
    import dataclasses
    import functools
    from pathlib import Path

    from dspark.corpus import held_out_text
    from dspark.runtime.attention.triton_paged import TritonPagedAttention
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    pkg = load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_compact")
    triton_attention = functools.partial(TritonPagedAttention, impl="triton")
    pkg = dataclasses.replace(pkg, parts=dataclasses.replace(pkg.parts, attention_backend=triton_attention))
    texts = held_out_text(50_000)
    prompts = [pkg.tokenizer.encode(texts[i][:9 + 17 * i]) for i in range(3)]
    runtime = Runtime(pkg)
    assert isinstance(runtime.models.attn, TritonPagedAttention)
    expected, _ = runtime.generate(prompts, 20, target_only=True)
    outputs, stats = Runtime(pkg).generate(prompts, 20)
    assert sum(stats.drafts_accepted) > 0
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {i}: speculative output differs from target-only"


def check_draft_block_through_the_triton_kernel() -> None:
    """The draft's block attention over its paged cache (`PagedDraftBlock`) through the CUDA kernel: every
    block row sees its request's context and whole block (its mask position is the block's last), as the
    batch-invariant torch attention computes it."""
    from pathlib import Path

    from dspark.runtime.attention.triton_paged import TritonPagedAttention
    from dspark.runtime.engine.forward import PagedDraftBlock
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    runtime = Runtime(load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_compact"))
    m, draft = runtime.models, runtime.draft
    prefix_host = [3, 70, 17, 130]
    handles = [runtime.slots.admit() for _ in prefix_host]
    for h, p in zip(handles, prefix_host, strict=True):
        runtime.slots.reserve(h.slot, p + 16)
    table = runtime.slots.page_table[[h.slot for h in handles]]
    torch.manual_seed(0)
    for layer in range(draft.cfg.num_layers):
        m.draft_kv.k[layer].normal_()
        m.draft_kv.v[layer].normal_()
    roots = torch.randint(draft.cfg.vocab_size, (len(prefix_host),))
    prefix = torch.tensor(prefix_host)
    cfg = draft.cfg
    triton = TritonPagedAttention(m.draft_kv, m.page_size, cfg.num_heads, cfg.head_dim ** -0.5, impl="triton")
    def proposal(attention: Any) -> Any:
        block = PagedDraftBlock.plan(attention, prefix_host, prefix, 7, table, m.page_size)
        return draft.propose_paged(roots, prefix, block, None, gamma=7)

    want, got = proposal(m.draft_attn), proposal(triton)
    _close("draft block hidden", got.hidden, want.hidden, tol=1e-4)


def check_rms_norm_random() -> None:
    """Widths that are not powers of two, strided rows and 3-D inputs, against the reference; each
    row written alone into a sentinel-padded buffer has the bits it has among the others."""
    rng = random.Random(5)
    for case in range(CASES):
        rows, width = rng.randint(1, 9), rng.choice([1, 5, 37, 128, 300, 4096])
        x = torch.randn(rows, width + 3)[:, :width] * rng.choice([1e-3, 1.0, 50.0])  # row stride > width
        weight = torch.randn(width)
        want = rms_norm_torch(x, weight, 1e-6)
        got = rms_norm(x, weight, 1e-6, impl="triton")
        _close(f"rms_norm case {case}", got, want, tol=1e-5)
        big = torch.full((rows + 1, width + 4), float(SENTINEL))
        for r in range(rows):
            launch_rms_norm(x[r:r + 1], weight, big[r:r + 1, :width], 1e-6)
        if not torch.equal(big[:rows, :width], got):
            raise AssertionError(f"rms_norm case {case}: a row alone differs from the row in the batch")
        if not (big[rows:] == SENTINEL).all() or not (big[:, width:] == SENTINEL).all():
            raise AssertionError(f"rms_norm case {case}: wrote outside [rows, width]")
    heads, weight = torch.randn(3, 4, 16), torch.randn(16)  # Qwen3's per-head norms: [T, H, D]
    _close("rms_norm 3-D", rms_norm(heads, weight, 1e-5, impl="triton"), rms_norm_torch(heads, weight, 1e-5),
           tol=1e-5)


CHECKS: dict[str, Callable[[], None]] = {
    "layout_worked_example": check_layout_worked_example,
    "layout_random": check_layout_random,
    "accept_cap_example": check_accept_cap_example,
    "accept_random": check_accept_random,
    "pack_random": check_pack_random,
    "scatter_random": check_scatter_random,
    "paged_attention_random": check_paged_attention_random,
    "paged_attention_sentinels": check_paged_attention_sentinels,
    "paged_attention_rows_independent": check_paged_attention_rows_independent,
    "triton_attention_lossless": check_triton_attention_lossless,
    "draft_block_through_the_triton_kernel": check_draft_block_through_the_triton_kernel,
    "rms_norm_random": check_rms_norm_random,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS))
