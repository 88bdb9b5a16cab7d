"""Ragged paged attention (dspark/runtime/kernels/paged_attention.py).

The torch reference is checked against a per-row loop (softmax over exactly the allowed keys) and
against the CPU attention backend on layouts from `plan_verify` / `plan_extend`; then input
validation, dispatch, and, on a GPU, the Triton kernel in bf16 and fp32 and inside a CUDA graph.
The Triton kernel meets the reference on the CPU under the Triton interpreter, in
kernels_interp_checks.py (run by test_runtime_kernels.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from dspark.runtime.attention.metadata import QueryBlocks, TorchPagedMetadata
from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.kernels import dispatch
from dspark.runtime.kernels import paged_attention as paged_attention_module
from dspark.runtime.kernels.dispatch import Impl
from dspark.runtime.kernels.paged_attention import launch_paged_attention, paged_attention
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import ExtendLayout, StepShape, VerifyLayout, plan_extend, plan_verify

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Step:
    """One ragged step's attention inputs, and the per-slot lists they were built from."""

    rows: list[int]
    prefix: list[int]
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    scale: float

    @property
    def max_rows(self) -> int:
        return max(self.rows)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.qo_indptr, self.kv_lens, self.positions,
                self.page_table)

    def run(self, impl: Impl = "torch", **overrides: object) -> torch.Tensor:
        kw: dict[str, object] = {"page_size": self.page_size, "scale": self.scale,
                                 "max_rows_per_request": self.max_rows, "impl": impl, **overrides}
        return paged_attention(*self.inputs(), **kw)  # type: ignore[arg-type]

    def to(self, device: str, dtype: torch.dtype) -> Step:
        return replace(self, q=self.q.to(device, dtype), k_cache=self.k_cache.to(device, dtype),
                       v_cache=self.v_cache.to(device, dtype), qo_indptr=self.qo_indptr.to(device),
                       kv_lens=self.kv_lens.to(device), positions=self.positions.to(device),
                       page_table=self.page_table.to(device))


def layout_tensors(rows: list[int], prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr, kv_lens, positions) of slots running `rows` after `prefix` (kv_len >= 1, as the
    layout gives an empty slot)."""
    qo = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32)
    kv = torch.tensor([max(p + r, 1) for p, r in zip(prefix, rows, strict=True)], dtype=torch.int32)
    positions = torch.cat([torch.arange(p, p + r) for p, r in zip(prefix, rows, strict=True)]).long()
    return qo, kv, positions


def ragged_step(seed: int, *, long_prefix: int = 0, wide: bool = False) -> Step:
    """Real requests (1..12 rows after prefixes spanning several pages), 0-row slots and a padding
    request on the null page, shuffled; GQA group, head_dim and page size cycle with `seed`.
    `long_prefix` adds a request with that many cached positions; `wide` uses a model-sized head
    layout (32 query heads over 8 KV heads of 128)."""
    rng = random.Random(seed)
    group, head_dim, page_size = (1, 2, 4)[seed % 3], (16, 32, 64)[seed // 3 % 3], (4, 16)[seed % 2]
    num_kv = rng.choice([1, 2])
    if wide:
        group, head_dim, num_kv = 4, 128, 8
    kinds = ["real"] * rng.randint(2, 4) + ["empty"] * rng.randint(1, 2) + ["pad"]
    rng.shuffle(kinds)
    rows = [0 if k == "empty" else rng.randint(1, 3) if k == "pad" else rng.randint(1, 12) for k in kinds]
    prefix = [rng.randint(0, 3 * page_size + 5) if k == "real" else 0 for k in kinds]
    if long_prefix:
        kinds.append("real")
        rows.append(rng.randint(1, 8))
        prefix.append(long_prefix)
    held = [-(-(p + r) // page_size) if k == "real" else 0
            for k, p, r in zip(kinds, prefix, rows, strict=True)]
    num_pages = 1 + sum(held)  # page 0 is the null page
    pool = list(range(1, num_pages))
    rng.shuffle(pool)
    table = torch.zeros(len(kinds), max(held) + 1, dtype=torch.int32)  # unused entries: the null page
    for r, n in enumerate(held):
        table[r, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (num_pages * page_size, num_kv, head_dim)
    qo, kv, positions = layout_tensors(rows, prefix)
    return Step(rows, prefix, torch.randn(sum(rows), group * num_kv, head_dim, generator=gen),
                torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen),
                qo, kv, positions, table, page_size, rng.choice([1.0, head_dim ** -0.5]))


def loop_attention(step: Step) -> torch.Tensor:
    """The definition, one row and head at a time in float64: softmax over exactly the keys at
    positions 0 … min(position, kv_len - 1) of the row's own slot, read through its page table."""
    q, k_cache, v_cache = step.q.double(), step.k_cache.double(), step.v_cache.double()
    num_heads, num_kv = q.shape[1], k_cache.shape[1]
    qo, kv, pos, table = (step.qo_indptr.tolist(), step.kv_lens.tolist(), step.positions.tolist(),
                          step.page_table.tolist())
    out = torch.zeros_like(q)
    for r in range(len(kv)):
        for t in range(qo[r], qo[r + 1]):
            last = min(pos[t], kv[r] - 1)
            slots = [table[r][p // step.page_size] * step.page_size + p % step.page_size
                     for p in range(last + 1)]
            for h in range(num_heads):
                g = h // (num_heads // num_kv)
                probs = torch.softmax(k_cache[slots, g] @ q[t, h] * step.scale, dim=0)
                out[t, h] = probs @ v_cache[slots, g]
    return out.float()


# -- the reference against the definition ----------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_reference_matches_per_row_loop(seed: int) -> None:
    step = ragged_step(seed, long_prefix=40 if seed % 4 == 0 else 0)
    assert 0 in step.rows and step.q.shape[0] == sum(step.rows)
    got = step.run("torch")
    assert got.shape == step.q.shape and got.dtype == step.q.dtype
    torch.testing.assert_close(got, loop_attention(step), atol=1e-5, rtol=1e-5)


def test_reference_reads_no_key_past_a_row_position() -> None:
    """Every cache entry a row may not see is replaced: no output changes."""
    step = ragged_step(3)
    want = step.run("torch")
    seen = torch.zeros(step.k_cache.shape[0], dtype=torch.bool)
    for r, (p, n) in enumerate(zip(step.prefix, step.rows, strict=True)):
        for pos in range(p + n):
            seen[step.page_table[r, pos // step.page_size] * step.page_size + pos % step.page_size] = True
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    k_cache[~seen] = 1e4
    v_cache[~seen] = -1e4
    torch.testing.assert_close(replace(step, k_cache=k_cache, v_cache=v_cache).run("torch"), want)


def test_reference_of_a_step_without_rows_is_empty() -> None:
    step = ragged_step(0)
    empty = replace(step, rows=[0] * len(step.rows), q=step.q[:0], positions=step.positions[:0],
                    qo_indptr=torch.zeros_like(step.qo_indptr))
    assert empty.run("torch", max_rows_per_request=0).shape == (0, *step.q.shape[1:])


def test_reference_waits_on_no_device_value() -> None:
    """On the meta device no tensor has a value: anything that read one would fail."""
    step = ragged_step(1)
    meta = step.to("meta", torch.bfloat16)
    out = meta.run("torch")
    assert out.device.type == "meta" and out.shape == step.q.shape and out.dtype == torch.bfloat16


# -- the reference against the CPU attention backend on planned layouts ---------------------------

def _backend_vs_reference(layout: VerifyLayout | ExtendLayout, max_rows: int, num_pages: int, page_size: int,
                          group: int, num_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(TorchPagedAttention.attend, the reference on the cache it wrote) for one layer of `layout`."""
    gen = torch.Generator().manual_seed(page_size * 100 + head_dim + group)
    cache = PagedKVCache(1, num_pages, page_size, num_kv, head_dim, torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))  # the cached prefixes
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    total = layout.positions.shape[0]
    q = torch.randn(total, group * num_kv, head_dim, generator=gen)
    k, v = (torch.randn(total, num_kv, head_dim, generator=gen) for _ in range(2))
    # As the CPU template's metadata builders fill it in.
    meta = TorchPagedMetadata(qo_indptr=layout.qo_indptr, kv_lens=layout.kv_lens,
                              page_table=layout.page_table, positions=layout.positions,
                              out_cache_loc=layout.out_cache_loc,
                              max_seqlen_q=max_rows,
                              blocks=QueryBlocks.plan(layout.host_qo_indptr, layout.host_kv_lens,
                                                      layout.positions, layout.page_table, page_size,
                                                      query_group=group))
    scale = head_dim ** -0.5
    backend = TorchPagedAttention(cache, page_size, group * num_kv, scale).attend(0, q, k, v, meta)
    ours = paged_attention(q, cache.k[0], cache.v[0], meta.qo_indptr, meta.kv_lens, meta.positions,
                           meta.page_table, page_size=page_size, scale=scale, max_rows_per_request=max_rows)
    return backend, ours


def _request_table(prefix: list[int], rows: list[int], page_size: int,
                   pages: int) -> tuple[torch.Tensor, int]:
    """(page table, pages in the pool): each request's pages, shuffled, from a shared pool whose
    page 0 stays null."""
    need = [-(-(p + r) // page_size) for p, r in zip(prefix, rows, strict=True)]
    pool = torch.randperm(sum(need), generator=torch.Generator().manual_seed(7)).add(1).tolist()
    table = torch.zeros(len(rows), pages, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return table, 1 + sum(need)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_backend_on_a_padded_verify_step(group: int, head_dim: int, page_size: int) -> None:
    n = 5
    prefix, run, verify = [9, 0, 37], [5, 2, 3], [4, 2, 1]
    table, num_pages = _request_table(prefix, run, page_size, 64 // page_size)
    # 10 rows go up to tier 16 as 3 padding requests on the null page, and slot padding adds empty slots.
    shape = StepShape(page_size=page_size, num_draft_tokens=n, tiers=(8, 16), padding_request_rows=2,
                      slots_for_tier=lambda tier: tier // 2)
    layout = plan_verify(run, verify, prefix, table, shape, CPU)
    assert layout.num_slots == 8 and layout.num_padding_rows == 6
    backend, ours = _backend_vs_reference(layout, n, num_pages, page_size, group, 2, head_dim)
    torch.testing.assert_close(ours, backend, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_backend_on_an_extend_step(group: int, head_dim: int, page_size: int) -> None:
    prefix, extend = [0, 21, 3, 50], [19, 1, 6, 2]  # a prefill chunk, decodes, a chunk after a prefix
    table, num_pages = _request_table(prefix, extend, page_size, 64 // page_size)
    layout = plan_extend(prefix, extend, table, page_size, CPU)
    backend, ours = _backend_vs_reference(layout, layout.max_rows, num_pages, page_size, group, 2, head_dim)
    torch.testing.assert_close(ours, backend, atol=1e-5, rtol=1e-5)


# -- validation and dispatch ------------------------------------------------------------------------

STEP = ragged_step(7)  # 4 query heads over 2 KV heads of 64
assert STEP.q.shape[1:] == (4, 64) and STEP.k_cache.shape[1] == 2

BAD_INPUTS: dict[str, tuple[Callable[[Step], Step], type[Exception], str]] = {
    "q not 3-D": (lambda s: replace(s, q=s.q.flatten(1)), ValueError, r"q must be \[T, H, D\]"),
    "cache head_dim": (lambda s: replace(s, k_cache=s.k_cache[..., :8], v_cache=s.v_cache[..., :8]),
                       ValueError, "k_cache must be"),
    "v shape": (lambda s: replace(s, v_cache=s.v_cache[:-1]), ValueError, "v_cache must have"),
    "heads": (lambda s: replace(s, q=s.q[:, :3]), ValueError, "multiple of the 2 KV heads"),
    "q dtype": (lambda s: replace(s, q=s.q.double()), TypeError, "q must be float32"),
    "cache dtype": (lambda s: replace(s, k_cache=s.k_cache.half()), TypeError, "q's dtype"),
    "kv_lens dtype": (lambda s: replace(s, kv_lens=s.kv_lens.long()), TypeError, "kv_lens must be"),
    "qo_indptr length": (lambda s: replace(s, qo_indptr=s.qo_indptr[:-1]), TypeError, "qo_indptr must be"),
    "positions dtype": (lambda s: replace(s, positions=s.positions.int()), TypeError, "positions must be"),
    "positions length": (lambda s: replace(s, positions=s.positions[1:]), TypeError, "positions must be"),
    "page_table rows": (lambda s: replace(s, page_table=s.page_table[1:]), TypeError, "page_table must be"),
    "page_table dtype": (lambda s: replace(s, page_table=s.page_table.long()), TypeError,
                         "page_table must be"),
    "devices": (lambda s: replace(s, kv_lens=s.kv_lens.to("meta")), ValueError, "one device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_malformed_inputs(case: str) -> None:
    change, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        change(STEP).run("torch")


@pytest.mark.parametrize(("overrides", "match"), [
    ({"page_size": 0}, "page_size"), ({"scale": float("nan")}, "scale"),
    ({"max_rows_per_request": 0}, "max_rows_per_request"), ({"impl": "cuda"}, "impl"),
])
def test_rejects_bad_sizes(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        STEP.run(**overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(("block_m", "block_n"), [(3, 16), (8, 8), (4, 16)])  # 4 rows x group 2 < 16
def test_launch_rejects_blocks_the_gpu_cannot_multiply(block_m: int, block_n: int) -> None:
    out = torch.empty_like(STEP.q)
    with pytest.raises(ValueError, match="powers of two"):
        launch_paged_attention(*STEP.inputs(), out, page_size=STEP.page_size, scale=STEP.scale,
                               max_rows_per_request=STEP.max_rows, block_m=block_m, block_n=block_n)


def test_auto_takes_the_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton path was taken for CPU tensors")

    monkeypatch.setattr(paged_attention_module, "paged_attention_triton", no_triton)
    torch.testing.assert_close(STEP.run("auto"), STEP.run("torch"))


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        STEP.run("triton")


# -- CUDA: the compiled kernel (skipped on machines without a GPU) ---------------------------------

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.HAS_TRITON),
                                   reason="needs a CUDA device and Triton")
# bf16: the kernel rounds the probabilities to bf16 for the P·V product, the reference does not.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _cuda_steps() -> list[Step]:
    return [*(ragged_step(seed) for seed in range(9)), ragged_step(9, long_prefix=1500),
            ragged_step(10, long_prefix=3000, wide=True)]


@pytest.fixture
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 reference multiplies in full precision, as the kernel does for fp32 inputs."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_reference_without_host_sync(dtype: torch.dtype, no_tf32: None) -> None:
    for i, host_step in enumerate(_cuda_steps()):
        step = host_step.to("cuda", dtype)
        step.run("auto")  # compile outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = step.run("auto")
            want = step.run("torch")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.dtype == dtype and got.shape == step.q.shape, i
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                   msg=lambda m, i=i: f"step {i}: {m}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_replays_in_a_captured_graph(dtype: torch.dtype, no_tf32: None) -> None:
    host = ragged_step(9, long_prefix=700)
    step = host.to("cuda", dtype)
    step.run("auto")  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step.run("auto")
    # Another step of the same shapes in the same buffers: the slots permuted, fresh queries and keys.
    perm = torch.randperm(len(host.rows), generator=torch.Generator().manual_seed(1)).tolist()
    rows, prefix = [host.rows[i] for i in perm], [host.prefix[i] for i in perm]
    for buf, new in zip((step.qo_indptr, step.kv_lens, step.positions), layout_tensors(rows, prefix),
                        strict=True):
        buf.copy_(new)
    step.page_table.copy_(host.page_table[perm])
    for buf in (step.q, step.k_cache, step.v_cache):
        buf.copy_(torch.randn_like(buf))
    graph.replay()
    want = replace(step, rows=rows, prefix=prefix).run("torch")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(captured.float(), want.float(), atol=tol, rtol=tol)



def rows_alone(step: Step, slot: int, first: int) -> Step:
    """A step of only `slot`'s rows from absolute row `first` on (its last row alone: a decode)."""
    end = int(step.qo_indptr[slot + 1])
    n = end - first
    return replace(step, rows=[n], prefix=[int(step.positions[first])], q=step.q[first:end],
                   qo_indptr=torch.tensor([0, n], dtype=torch.int32, device=step.q.device),
                   kv_lens=step.kv_lens[slot:slot + 1], positions=step.positions[first:end],
                   page_table=step.page_table[slot:slot + 1])


@requires_cuda
def test_cuda_rows_have_the_same_bits_in_any_step() -> None:
    """Greedy losslessness needs a row's output independent of its step: each request's rows alone,
    and its last row as a one-row decode, give exactly the bits they have in the full step."""
    for host_step in (ragged_step(4), ragged_step(10, long_prefix=900, wide=True)):
        step = host_step.to("cuda", torch.bfloat16)
        full = step.run("auto")
        qo = host_step.qo_indptr.tolist()
        for r, n in enumerate(host_step.rows):
            for first in {qo[r], qo[r + 1] - 1} if n else ():
                assert torch.equal(rows_alone(step, r, first).run("auto"), full[first:qo[r + 1]]), (r, first)
