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

import json
import os
import random
import sys
import traceback
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from dspark.runtime.kernels.accept import (
    greedy_accept,  # noqa: E402
    launch_greedy_accept,  # noqa: E402
)
from dspark.runtime.kernels.scatter import (  # noqa: E402
    launch_pack_rows,
    launch_scatter_rows,
    pack_rows,
    scatter_rows,
)
from dspark.runtime.kernels.verify_rows import VerifyRows, build_verify_rows, launch_verify_rows  # noqa: E402

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


CHECKS: dict[str, Callable[[], None]] = {
    "layout_worked_example": check_layout_worked_example,
    "layout_random": check_layout_random,
    "accept_cap_example": check_accept_cap_example,
    "accept_random": check_accept_random,
    "pack_random": check_pack_random,
    "scatter_random": check_scatter_random,
}


def main() -> int:
    results: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
