"""Row-invariance checks of the CPU reference path, runnable in this process or as a script.

`tests/test_runtime_invariance.py` runs them in-process, under an adversarial product (`adversarial`);
`tests/test_invariance_kernel_selections.py` runs this file as a script under other CPU kernel
selections (ATen's capability, MKL's and oneDNN's instruction sets, thread counts) and emulated CPU
models, where the BLAS underneath takes other paths. Each check asserts bit-equality of a row computed
beside different rows, so it holds only if the project fixes every reduction order itself.

    python tests/invariance_checks.py            # every check; exit 1 naming the first that fails
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# An adversarial BLAS: every product rounds by the shape of its call, as a BLAS that picks its kernel
# or its reduction split by the row count does, only more so.


def _split(k: int, *shape: int) -> int:
    """Where a call of this shape splits its reduction over `k` (a different place per shape)."""
    if k < 2:
        return 0
    return 1 + zlib.crc32(repr(shape).encode()) % (k - 1)


@contextlib.contextmanager
def adversarial() -> Iterator[None]:
    """Patch torch's products (mm, bmm, matmul and @, linear, addmm, baddbmm, einsum) so each sums
    its reduction as two partial products split at a point set by the call's whole shape: rows
    computed in calls of different shapes round differently. Only a row-invariant construction whose
    every call has one shape survives it."""
    orig = {name: getattr(torch, name) for name in ("mm", "bmm", "matmul", "addmm", "baddbmm", "einsum")}
    orig_linear, orig_tmatmul = F.linear, torch.Tensor.__matmul__

    def split_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        k = a.shape[-1]
        s = _split(k, *a.shape, *b.shape)
        if s == 0:
            return orig["matmul"](a, b)
        return orig["matmul"](a[..., :s], b[..., :s, :]) + orig["matmul"](a[..., s:], b[..., s:, :])

    def with_out(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return result
        out.copy_(result)
        return out

    def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return with_out(split_matmul(a, b), out)

    def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = split_matmul(x, w.t())
        return y + bias if bias is not None else y

    def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return with_out(beta * c + alpha * split_matmul(a, b), out)

    def einsum(*args: object) -> torch.Tensor:
        # Perturb by one unit in the last place, by the operands' shapes (einsum has no split here).
        result = orig["einsum"](*args)
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        nudge = (zlib.crc32(repr(shapes).encode()) % 3 - 1) * torch.finfo(result.dtype).eps
        return result + result * nudge

    patches = {"mm": mm, "bmm": mm, "matmul": lambda a, b, out=None: with_out(split_matmul(a, b), out),
               "addmm": addmm, "baddbmm": addmm, "einsum": einsum}
    try:
        for name, fn in patches.items():
            setattr(torch, name, fn)
        F.linear = linear
        torch.Tensor.__matmul__ = lambda a, b: split_matmul(a, b)
        yield
    finally:
        for name, fn in orig.items():
            setattr(torch, name, fn)
        F.linear = orig_linear
        torch.Tensor.__matmul__ = orig_tmatmul


# ---------------------------------------------------------------------------------------------------
# The checks.


def check_linear_rows() -> None:
    """A row of every product shape of the embedded pair (and a head's tiny ones) has the same bits
    whatever the row count and wherever the row sits."""
    from dspark.runtime.models import ops

    torch.manual_seed(0)
    for in_f, out_f in ((256, 704), (704, 256), (256, 258), (256, 64), (38, 6), (320, 1)):
        w = torch.randn(out_f, in_f)
        x = torch.randn(300, in_f)
        full = ops.linear(x, w)
        for rows in (1, 2, 3, 7, 8, 15, 16, 17, 33, 64, 257):
            assert torch.equal(ops.linear(x[:rows], w), full[:rows]), (in_f, out_f, rows)
        for start in (1, 5, 13, 130):
            assert torch.equal(ops.linear(x[start:start + 9], w), full[start:start + 9]), (in_f, out_f, start)


def check_lanewise() -> None:
    from dspark.runtime.models import ops

    torch.manual_seed(1)
    x = torch.randn(70, 704) * 4
    for fn in (torch.exp, torch.sigmoid, torch.tanh, F.silu):
        for tile in (ops.ELEMENT_TILE, ops.SMALL_ELEMENT_TILE):
            full = ops.lanewise(fn, x, tile)
            for rows in (1, 3, 47):
                assert torch.equal(ops.lanewise(fn, x[:rows], tile), full[:rows]), (fn, tile, rows)
            assert torch.equal(ops.lanewise(fn, x[5:9, 1:300], tile), full[5:9, 1:300]), (fn, tile)
    # RoPE's rows come from a table of every position so far (grown past its end): each equals the
    # row computed for that position alone or among any others
    ops._ROPE_TABLES.clear()
    for positions in (torch.tensor([3]), torch.arange(40, 48), torch.tensor([[5, 1500], [2047, 0]])):
        table = ops.rope_cos_sin(positions, 32, 10000.0)
        for i, p in enumerate(positions.flatten().tolist()):
            alone = ops._rope_cos_sin(torch.tensor([p]), 32, 10000.0, None)
            for got, want in zip(table, alone, strict=True):
                assert torch.equal(got.reshape(-1, 32)[i], want[0]), p


def _paged_step(heads: int, kv_heads: int, dim: int) -> None:
    from dspark.runtime.attention.metadata import QueryBlocks, TorchPagedMetadata
    from dspark.runtime.attention.torch_paged import TorchPagedAttention
    from dspark.runtime.kv_cache import PagedKVCache
    from dspark.runtime.layout import cache_slots

    def meta(prefix: list[int], extend: list[int], table: torch.Tensor, page: int) -> TorchPagedMetadata:
        qo = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
        row_req = torch.repeat_interleave(torch.arange(len(extend)), torch.tensor(extend))
        pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
        kv = [p + e for p, e in zip(prefix, extend, strict=True)]
        return TorchPagedMetadata(qo, torch.tensor(kv), table, pos, cache_slots(table, row_req, pos, page),
                                  max(extend), QueryBlocks.plan(qo.tolist(), kv, pos, table, page,
                                                                query_group=heads // kv_heads))

    torch.manual_seed(2)
    page, ctx = 4, 70
    pages = -(-(ctx + 16) // page)
    cache = PagedKVCache(1, 3 * pages + 1, page, kv_heads, dim, torch.float32)
    attn = TorchPagedAttention(cache, page, heads, dim ** -0.5)
    table = torch.arange(1, 3 * pages + 1, dtype=torch.int32).view(3, pages)
    for r in range(3):
        n = ctx + 5 * r
        kv = torch.randn(2, n, kv_heads, dim)
        attn.attend(0, torch.randn(n, heads, dim), kv[0], kv[1], meta([0], [n], table[r:r + 1], page))
    q, k, v = torch.randn(8, heads, dim), torch.randn(8, kv_heads, dim), torch.randn(8, kv_heads, dim)
    others = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim))
              for n in (3, 8)]
    # Request 0's 8 verify rows beside two other requests (a long one: more key chunks for all).
    qkv = [torch.cat((mine, *(o[i] for o in others))) for i, mine in enumerate((q, k, v))]
    block = attn.attend(0, *qkv, meta([ctx, ctx + 5, ctx + 10], [8, 3, 8], table, page))
    for i in range(8):  # each row alone, as target-only decoding runs it
        one = attn.attend(0, q[i:i + 1], k[i:i + 1], v[i:i + 1], meta([ctx + i], [1], table[:1], page))
        assert torch.equal(one[0], block[i]), (heads, kv_heads, dim, i)
    # and the first 3 rows as a compact step's shorter verify block, alone
    attn.attend(0, q[:3], k[:3], v[:3], meta([ctx], [3], table[:1], page))
    short = attn.attend(0, q[:3], k[:3], v[:3], meta([ctx], [3], table[:1], page))
    assert torch.equal(short, block[:3]), (heads, kv_heads, dim)


def check_paged_attention_rows() -> None:
    for heads, kv_heads, dim in ((4, 2, 8), (4, 4, 16), (1, 1, 16), (8, 2, 32)):
        _paged_step(heads, kv_heads, dim)


def check_block_draft_rows() -> None:
    """A DSpark draft (each Markov head) proposes bit for bit the same for a request alone and beside
    others with longer and shorter contexts."""
    import tempfile

    from tests.test_dspark_block_draft import (
        load_block_draft,
        propose_batch,
        released_config,
        released_tensors,
        write_checkpoint,
    )

    g = torch.Generator().manual_seed(3)
    for kind in ("vanilla", "gated", "rnn"):
        cfg = released_config(kind)
        with tempfile.TemporaryDirectory() as tmp:
            draft = load_block_draft(write_checkpoint(Path(tmp) / "draft", cfg, released_tensors(cfg)))
        width = draft.fc.weight.shape[1]
        lengths = (37, 5, 130, 64, 1, 77)
        feats = [torch.randn(n, width, generator=g) for n in lengths]
        anchors = list(range(3, 3 + len(lengths)))
        full = propose_batch(draft, feats, anchors)
        for r in range(len(lengths)):
            alone = propose_batch(draft, [feats[r]], [anchors[r]])
            assert torch.equal(alone.logits[0], full.logits[r]), (kind, r)
            assert torch.equal(alone.conf_logits[0], full.conf_logits[r]), (kind, r)
            assert torch.equal(alone.drafts[0], full.drafts[r]), (kind, r)


def check_lossless_embedded() -> None:
    """Greedy speculative output equals target-only output on the embedded compact build."""
    from dspark.corpus import held_out_text
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    pkg = load_package(REPO / "generated" / "tiny_cpu_compact")
    text = "".join(held_out_text(20_000))
    prompts = [pkg.tokenizer.encode(text[300 * i:300 * i + 11 + 13 * i]) for i in range(4)]
    runtime = Runtime(pkg)
    expected, _ = runtime.generate(prompts, 24, target_only=True)
    got, stats = runtime.generate(prompts, 24)
    assert got == expected
    assert sum(stats.drafts_accepted) > 0


CHECKS: dict[str, Callable[[], None]] = {
    "linear_rows": check_linear_rows,
    "lanewise": check_lanewise,
    "paged_attention_rows": check_paged_attention_rows,
    "block_draft_rows": check_block_draft_rows,
    "lossless_embedded": check_lossless_embedded,
}


def main(argv: list[str]) -> int:
    import torch.backends.cpu

    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    names = argv or list(CHECKS)
    adversary = contextlib.nullcontext()
    if names and names[0] == "--adversarial":
        names, adversary = names[1:] or list(CHECKS), adversarial()
    with adversary:
        for name in names:
            try:
                CHECKS[name]()
            except AssertionError as exc:
                print(f"FAILED {name}: {exc!r}")
                return 1
            print(f"ok {name}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
