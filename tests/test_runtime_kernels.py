"""Verify-step kernels: torch references against plain Python loops, Triton against the references.

The Triton half runs in a subprocess under the Triton interpreter (see kernels_interp_checks.py
for why); this module checks the references, the dispatch and the input validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.runtime.kernels import accept as accept_module
from dspark.runtime.kernels import dispatch, rms_norm, scatter, verify_rows
from dspark.runtime.kernels.accept import greedy_accept
from dspark.runtime.kernels.dispatch import Impl
from dspark.runtime.kernels.scatter import pack_rows, scatter_rows
from dspark.runtime.kernels.verify_rows import build_verify_rows

from .interp_runner import interpreter_results

REPO = Path(__file__).resolve().parents[1]
INTERP_CHECKS = ["layout_worked_example", "layout_random", "accept_cap_example", "accept_random",
                 "pack_random", "scatter_random", "paged_attention_random", "paged_attention_sentinels",
                 "paged_attention_rows_independent", "triton_attention_lossless", "rms_norm_random",
                 "draft_block_through_the_triton_kernel"]


# -- independent oracles: the semantics spelled out one row at a time -------------------------

def loop_verify_rows(lens: list[int], prefix: list[int], table: list[list[int]], page_size: int,
                     n: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"qo_indptr": [0], "row_req": [], "positions": [], "out_cache_loc": [],
                                 "src_index": []}
    for r, length in enumerate(lens):
        for k in range(length):
            pos = prefix[r] + k
            out["row_req"].append(r)
            out["positions"].append(pos)
            out["out_cache_loc"].append(table[r][pos // page_size] * page_size + pos % page_size)
            out["src_index"].append(r * n + k)
        out["qo_indptr"].append(out["qo_indptr"][-1] + length)
    return out


def loop_accept(drafts: list[list[int]], target: list[list[int]], lens: list[int]) -> list[int]:
    correct = []
    for d, t, length in zip(drafts, target, lens, strict=True):
        c = 0
        while c < length - 1 and d[c] == t[c]:
            c += 1
        correct.append(c)
    return correct


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]], int, int]:
    num_reqs, n = draw(st.integers(1, 12)), draw(st.integers(2, 9))
    lens = draw(st.lists(st.integers(1, n), min_size=num_reqs, max_size=num_reqs))
    prefix = draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    page_size = draw(st.integers(1, 16))
    pages = -(-(40 + n) // page_size)
    flat = draw(st.permutations(range(num_reqs * pages)))
    table = [list(flat[r * pages:(r + 1) * pages]) for r in range(num_reqs)]
    return lens, prefix, table, page_size, n


# -- layout --------------------------------------------------------------------------------------

def test_layout_worked_example() -> None:
    rows = build_verify_rows(torch.tensor([2, 1, 4], dtype=torch.int32), torch.tensor([10, 0, 3]),
                             torch.tensor([[5, 6], [7, 8], [1, 2]], dtype=torch.int32), 8, 7,
                             num_draft_tokens=5)
    assert rows.qo_indptr.dtype == torch.int32 and rows.qo_indptr.tolist() == [0, 2, 3, 7]
    assert rows.total_rows == 7
    assert rows.src_index.tolist() == [0, 1, 5, 10, 11, 12, 13]
    assert rows.row_req.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert rows.positions.tolist() == [10, 11, 0, 3, 4, 5, 6]
    # Request 0's positions 10, 11 sit on its second page (6), request 2's 3..6 on its first (1).
    assert rows.out_cache_loc.tolist() == [6 * 8 + 2, 6 * 8 + 3, 7 * 8, 8 + 3, 8 + 4, 8 + 5, 8 + 6]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_layout_reference_matches_loop(case: tuple[list[int], list[int], list[list[int]], int, int]) -> None:
    lens, prefix, table, page_size, n = case
    rows = build_verify_rows(torch.tensor(lens, dtype=torch.int32), torch.tensor(prefix, dtype=torch.int32),
                             torch.tensor(table, dtype=torch.int32), page_size, sum(lens),
                             num_draft_tokens=n, impl="torch")
    want = loop_verify_rows(lens, prefix, table, page_size, n)
    for field, values in want.items():
        got = getattr(rows, field)
        assert got.dtype == (torch.int32 if field == "qo_indptr" else torch.int64), field
        assert got.tolist() == values, field


def test_layout_rejects_inconsistent_sizes() -> None:
    vl, prefix, table = torch.tensor([2, 1]), torch.tensor([0, 0]), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="total_rows"):
        build_verify_rows(vl, prefix, table, 4, 9, num_draft_tokens=4)  # more than B * N
    with pytest.raises(ValueError, match="prefix_lens"):
        build_verify_rows(vl, prefix[:1], table, 4, 3, num_draft_tokens=4)
    with pytest.raises(TypeError, match="integer"):
        build_verify_rows(vl.float(), prefix, table, 4, 3, num_draft_tokens=4)


# -- accept --------------------------------------------------------------------------------------

@st.composite
def accept_cases(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    num_reqs, gamma = draw(st.integers(1, 12)), draw(st.integers(1, 8))
    token = st.integers(0, 2)  # a tiny vocabulary makes long matching prefixes common
    target = draw(st.lists(st.lists(token, min_size=gamma + 1, max_size=gamma + 1),
                           min_size=num_reqs, max_size=num_reqs))
    drafts = draw(st.lists(st.lists(token, min_size=gamma, max_size=gamma),
                           min_size=num_reqs, max_size=num_reqs))
    lens = draw(st.lists(st.integers(1, gamma + 1), min_size=num_reqs, max_size=num_reqs))
    seq = draw(st.lists(st.integers(0, 1000), min_size=num_reqs, max_size=num_reqs))
    return drafts, target, lens, seq


@settings(max_examples=80, deadline=None)
@given(accept_cases())
def test_accept_reference_matches_loop(case: tuple[list[list[int]], list[list[int]], list[int], list[int]]
                                       ) -> None:
    drafts, target, lens, seq = case
    acc = greedy_accept(torch.tensor(drafts), torch.tensor(target), torch.tensor(lens, dtype=torch.int32),
                        torch.tensor(seq, dtype=torch.int32), impl="torch")
    correct = loop_accept(drafts, target, lens)
    assert acc.correct_len.tolist() == correct
    assert acc.commit_len.tolist() == [c + 1 for c in correct]
    assert acc.bonus.tolist() == [t[c] for t, c in zip(target, correct, strict=True)]
    assert acc.new_seq_lens is not None and acc.new_seq_lens.dtype == torch.int32
    assert acc.new_seq_lens.tolist() == [s + c + 1 for s, c in zip(seq, correct, strict=True)]
    assert all(t.dtype == torch.int64 for t in (acc.correct_len, acc.commit_len, acc.bonus))


def test_accept_cap_with_all_drafts_matching() -> None:
    acc = greedy_accept(torch.tensor([[1, 2, 3]] * 3), torch.tensor([[1, 2, 3, 4]] * 3),
                        torch.tensor([2, 1, 4]), torch.tensor([10, 20, 30]))
    assert acc.correct_len.tolist() == [1, 0, 3]
    assert acc.new_seq_lens is not None and acc.new_seq_lens.tolist() == [12, 21, 34]


def test_accept_without_seq_lens_has_no_new_seq_lens() -> None:
    assert greedy_accept(torch.tensor([[1]]), torch.tensor([[1, 2]]), torch.tensor([2])).new_seq_lens is None


def test_accept_rejects_target_of_wrong_width() -> None:
    with pytest.raises(ValueError, match=r"gamma \+ 1"):
        greedy_accept(torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), torch.tensor([2]))


# -- pack / scatter ------------------------------------------------------------------------------

def test_pack_and_scatter_round_trip_worked_example() -> None:
    src_index = torch.tensor([0, 1, 5, 10, 11, 12, 13])
    hidden = torch.arange(15 * 3, dtype=torch.float32).view(15, 3)
    packed = pack_rows(hidden, src_index)
    assert packed.tolist() == [hidden[i].tolist() for i in [0, 1, 5, 10, 11, 12, 13]]
    back = scatter_rows(packed, src_index, 15, fill=-5.0)
    planned = set(src_index.tolist())
    for i in range(15):
        assert back[i].tolist() == (hidden[i].tolist() if i in planned else [-5.0] * 3)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from([(), (1,), (4,), (2, 3)]))
def test_pack_scatter_reference_match_loop(case: tuple[list[int], list[int], list[list[int]], int, int],
                                           trailing: tuple[int, ...]) -> None:
    lens, _, _, _, n = case
    src = [r * n + k for r, length in enumerate(lens) for k in range(length)]
    num_fixed = len(lens) * n
    fixed = torch.randint(0, 100, (num_fixed, *trailing))
    packed = pack_rows(fixed, torch.tensor(src), impl="torch")
    assert packed.shape == (len(src), *trailing)
    for t, s in enumerate(src):
        assert torch.equal(packed[t], fixed[s])
    back = scatter_rows(packed, torch.tensor(src), num_fixed, fill=-1, impl="torch")
    for i in range(num_fixed):
        want = fixed[i] if i in src else torch.full(trailing, -1)
        assert torch.equal(back[i], want)


def test_scatter_rejects_fractional_fill_for_integers() -> None:
    with pytest.raises(ValueError, match="fill"):
        scatter_rows(torch.tensor([1, 2]), torch.tensor([0, 3]), 4, fill=0.5)
    with pytest.raises(TypeError, match="int64"):
        pack_rows(torch.zeros(4), torch.tensor([0, 1], dtype=torch.int32))


# -- dispatch ------------------------------------------------------------------------------------

def test_auto_takes_the_torch_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton path was taken for CPU tensors")

    monkeypatch.setattr(verify_rows, "build_verify_rows_triton", no_triton)
    monkeypatch.setattr(accept_module, "greedy_accept_triton", no_triton)
    monkeypatch.setattr(scatter, "launch_pack_rows", no_triton)
    monkeypatch.setattr(scatter, "launch_scatter_rows", no_triton)
    monkeypatch.setattr(rms_norm, "launch_rms_norm", no_triton)
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(rms_norm.rms_norm(x, w, 1e-5), rms_norm.rms_norm_torch(x, w, 1e-5))
    build_verify_rows(torch.tensor([2, 1]), torch.zeros(2, dtype=torch.int64),
                      torch.zeros(2, 1, dtype=torch.int32), 4, 3, num_draft_tokens=2, impl="auto")
    greedy_accept(torch.tensor([[1]]), torch.tensor([[1, 2]]), torch.tensor([2]), impl="auto")
    pack_rows(torch.zeros(4, 2), torch.tensor([0, 2]), impl="auto")
    scatter_rows(torch.zeros(2, 2), torch.tensor([0, 2]), 4, impl="auto")
    assert not dispatch.use_triton("auto", torch.zeros(1))


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pack_rows(torch.zeros(4, 2), torch.tensor([0, 2]), impl="triton")
    with pytest.raises(ValueError, match="impl"):
        dispatch.use_triton("cuda", torch.zeros(1))  # type: ignore[arg-type]


# -- Triton kernels under the interpreter ----------------------------------------------------------

@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    return interpreter_results("kernels_interp_checks.py")


@pytest.mark.parametrize("check", INTERP_CHECKS)
def test_triton_kernel_matches_reference_under_interpreter(interp_results: dict[str, str],
                                                           check: str) -> None:
    assert check in interp_results, f"the interpreter checks no longer run {check!r}"
    assert interp_results[check] == "ok", interp_results[check]


# -- CUDA: the compiled kernels (skipped on machines without a GPU) ------------------------------

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.HAS_TRITON),
                                   reason="needs a CUDA device and Triton")


@dataclass
class CudaStep:
    lens: torch.Tensor
    prefix: torch.Tensor
    table: torch.Tensor
    target: torch.Tensor
    drafts: torch.Tensor
    page_size: int
    n: int

    @property
    def total(self) -> int:
        return int(self.lens.sum())


def _cuda_step(seed: int) -> CudaStep:
    """One random verify step's inputs on the GPU (B up to 300 to exercise a wide BLOCK_B)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = int(torch.randint(1, 300, (1,), generator=gen))
    n = int(torch.randint(2, 10, (1,), generator=gen))
    page_size = int(torch.randint(1, 17, (1,), generator=gen))
    lens = torch.randint(1, n + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    prefix = torch.randint(0, 500, (num_reqs,), generator=gen, dtype=torch.int32)
    pages = -(-(500 + n) // page_size)
    table = torch.randperm(num_reqs * pages, generator=gen, dtype=torch.int32).view(num_reqs, pages)
    target = torch.randint(0, 3, (num_reqs, n), generator=gen)
    drafts = target[:, 1:].clone()
    drafts[torch.rand(drafts.shape, generator=gen) < 0.1] = 7
    return CudaStep(lens.cuda(), prefix.cuda(), table.cuda(), target.cuda(), drafts.cuda(), page_size, n)


def _run_step(s: CudaStep, total: int, hidden: torch.Tensor, impl: Impl) -> list[torch.Tensor | None]:
    """Layout, pack, scatter back and accept, as a compact verify step chains them."""
    rows = build_verify_rows(s.lens, s.prefix, s.table, s.page_size, total, num_draft_tokens=s.n, impl=impl)
    packed = pack_rows(hidden, rows.src_index, impl=impl)
    back = scatter_rows(packed, rows.src_index, hidden.shape[0], fill=-1.0, impl=impl)
    packed_ids = pack_rows(s.target.reshape(-1), rows.src_index, impl=impl)
    pred = scatter_rows(packed_ids, rows.src_index, hidden.shape[0], fill=-1, impl=impl)
    acc = greedy_accept(s.drafts, s.target, s.lens, s.prefix, impl=impl)
    return [rows.qo_indptr, rows.row_req, rows.positions, rows.out_cache_loc, rows.src_index, packed, back,
            packed_ids, pred, acc.correct_len, acc.commit_len, acc.bonus, acc.new_seq_lens]


def _assert_same(got: list[torch.Tensor | None], want: list[torch.Tensor | None], where: object) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None and w is not None, (where, i)
        assert g.dtype == w.dtype and torch.equal(g, w), (where, i)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_reference_without_host_sync(dtype: torch.dtype) -> None:
    for seed in range(5):
        s = _cuda_step(seed)
        total = s.total
        hidden = torch.randn(s.lens.shape[0] * s.n, 4100, device="cuda").to(dtype)  # H > MAX_BLOCK_H
        want = _run_step(s, total, hidden, "torch")
        _run_step(s, total, hidden, "auto")  # compile outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _run_step(s, total, hidden, "auto")
            _run_step(s, total, hidden, "torch")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _assert_same(got, want, seed)


@requires_cuda
def test_cuda_kernels_replay_in_a_captured_graph() -> None:
    s = _cuda_step(11)
    total = s.total
    hidden = torch.randn(s.lens.shape[0] * s.n, 256, device="cuda")
    _run_step(s, total, hidden, "auto")  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_step(s, total, hidden, "auto")
    # New values in the same buffers, keeping the row count: permuted requests, fresh hidden states.
    perm = torch.randperm(s.lens.shape[0], device="cuda")
    for t in (s.lens, s.prefix, s.table, s.target, s.drafts):
        t.copy_(t[perm])
    hidden.copy_(torch.randn_like(hidden))
    graph.replay()
    _assert_same(captured, _run_step(s, total, hidden, "torch"), "replay")


def test_rms_norm_reference_is_hugging_faces_recipe() -> None:
    """float32 statistics, cast back before the weight: bf16 rounds twice, as HF's LlamaRMSNorm does,
    bit for bit; rounding once (the weight applied in float32) is another result, which this tells apart."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    twice = w * normed.to(torch.bfloat16)
    once = (w.float() * normed).to(torch.bfloat16)
    assert torch.equal(rms_norm.rms_norm_torch(x, w, 1e-6), twice)
    assert not torch.equal(once, twice)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm.rms_norm(x, torch.ones(63), 1e-6)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rms_norm_matches_reference_and_is_row_invariant(dtype: torch.dtype) -> None:
    x = torch.randn(37, 4096, device="cuda").to(dtype)
    w = torch.randn(4096, device="cuda").to(dtype)
    got = rms_norm.rms_norm(x, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the mean's order may move one rounding
    torch.testing.assert_close(got, rms_norm.rms_norm_torch(x, w, 1e-5), atol=tol, rtol=tol)
    for r in (0, 36):  # a row alone has the bits it has among 37
        assert torch.equal(rms_norm.rms_norm(x[r:r + 1], w, 1e-5), got[r:r + 1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rms_norm.rms_norm(x, w, 1e-5)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, rms_norm.rms_norm(x, w, 1e-5))


def test_layout_allows_the_empty_slots_of_a_captured_graph() -> None:
    vl = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    prefix = torch.tensor([3, 0, 5, 0], dtype=torch.int32)
    table = torch.tensor([[1, 2], [0, 0], [3, 4], [0, 0]], dtype=torch.int32)
    rows = build_verify_rows(vl, prefix, table, 4, 3, num_draft_tokens=4)
    assert rows.qo_indptr.tolist() == [0, 2, 2, 3, 3]
    assert rows.row_req.tolist() == [0, 0, 2]
    assert rows.positions.tolist() == [3, 4, 5]
    assert rows.out_cache_loc.tolist() == [1 * 4 + 3, 2 * 4 + 0, 4 * 4 + 1]
    assert rows.src_index.tolist() == [0, 1, 8]
