"""The CPU reference path must compute a row identically whatever else shares its step: this is
what makes greedy speculative output bit-exact with target-only output."""

import pytest
import torch

from dspark.runtime.attention.metadata import (
    KV_CHUNK,
    PAIR_TILE,
    SLAB_ROWS,
    QueryBlocks,
    TorchPagedMetadata,
    kv_read_bound,
)
from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import cache_slots
from dspark.runtime.models import ops
from tests import invariance_checks


@pytest.mark.parametrize("in_features, out_features", [(256, 688), (688, 256), (256, 259)])
def test_linear_rows_do_not_depend_on_row_count(in_features: int, out_features: int) -> None:
    # The embedded model's products: attention and MLP in, MLP out, the LM head.
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features)
    x = torch.randn(300, in_features)
    full = ops.linear(x, w)
    for rows in [*range(1, 40), 64, 257, 299]:
        assert torch.equal(ops.linear(x[:rows], w), full[:rows]), rows
    assert torch.equal(ops.linear(x[13:20], w), full[13:20])


def _meta(prefix: list[int], extend: list[int], page_table: torch.Tensor, page: int,
          query_group: int = 2) -> TorchPagedMetadata:
    qo = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
    row_req = torch.repeat_interleave(torch.arange(len(extend)), torch.tensor(extend))
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
    kv = [p + e for p, e in zip(prefix, extend, strict=True)]
    return TorchPagedMetadata(qo, torch.tensor(kv), page_table, pos,
                              cache_slots(page_table, row_req, pos, page), max(extend),
                              QueryBlocks.plan(qo.tolist(), kv, pos, page_table, page,
                                               query_group=query_group))


# GQA; MHA and a single head, whose one-row blocks are padded so the products keep two columns
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 8), (4, 4, 16), (1, 1, 16)])
def test_paged_attention_row_is_the_same_alone_or_in_a_verify_block(heads: int, kv_heads: int,
                                                                     dim: int) -> None:
    torch.manual_seed(1)
    page = 4
    cache = PagedKVCache(1, 16, page, kv_heads, dim, torch.float32)
    attn = TorchPagedAttention(cache, page, heads, dim ** -0.5)
    table = torch.tensor([[3, 5, 7, 9], [2, 4, 6, 8]], dtype=torch.int32)
    ctx = 6  # cached prefix of request 0
    k = torch.randn(ctx + 5, kv_heads, dim)
    v = torch.randn(ctx + 5, kv_heads, dim)
    q = torch.randn(ctx + 5, heads, dim)
    group = heads // kv_heads
    prefill = _meta([0], [ctx], table[:1], page, group)
    attn.attend(0, q[:ctx], k[:ctx], v[:ctx], prefill)
    block = _meta([ctx, 0], [5, 3], table, page, group)  # 5 verify rows beside another request
    q2 = torch.cat((q[ctx:], torch.randn(3, heads, dim)))
    k2 = torch.cat((k[ctx:], torch.randn(3, kv_heads, dim)))
    v2 = torch.cat((v[ctx:], torch.randn(3, kv_heads, dim)))
    out_block = attn.attend(0, q2, k2, v2, block)
    for i in range(5):  # the same rows one at a time, as target-only decoding runs them
        single = _meta([ctx + i], [1], table[:1], page, group)
        out = attn.attend(0, q[ctx + i:ctx + i + 1], k[ctx + i:ctx + i + 1], v[ctx + i:ctx + i + 1], single)
        assert torch.equal(out[0], out_block[i]), i
    # and it is ordinary causal attention
    keys = k.repeat_interleave(heads // kv_heads, 1)
    vals = v.repeat_interleave(heads // kv_heads, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], is_causal=True)
    torch.testing.assert_close(out_block[:5], ref[0].transpose(0, 1)[ctx:], rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_how_far_other_requests_keys_go() -> None:
    """Keys are read in chunks up to the step's longest KV length: a request beside a much longer one
    reads more (fully masked) chunks, which must leave its rows unchanged bit for bit."""
    torch.manual_seed(2)
    page, heads, kv_heads, dim = 16, 4, 2, 16
    short, long = KV_CHUNK + 37, 5 * KV_CHUNK + 3  # 2 chunks, 6 chunks
    pages = -(-(long + 8) // page)
    cache = PagedKVCache(1, 2 * pages + 1, page, kv_heads, dim, torch.float32)
    attn = TorchPagedAttention(cache, page, heads, dim ** -0.5)
    table = torch.arange(1, 2 * pages + 1, dtype=torch.int32).view(2, pages)
    for r, length in enumerate((short, long)):  # prefill both contexts
        attn.attend(0, torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim),
                    torch.randn(length, kv_heads, dim), _meta([0], [length], table[r:r + 1], page))
    q, k, v = torch.randn(4, heads, dim), torch.randn(4, kv_heads, dim), torch.randn(4, kv_heads, dim)
    alone = attn.attend(0, q, k, v, _meta([short], [4], table[:1], page))
    other = (torch.randn(4, heads, dim), torch.randn(4, kv_heads, dim), torch.randn(4, kv_heads, dim))
    beside = attn.attend(0, torch.cat((q, other[0])), torch.cat((k, other[1])), torch.cat((v, other[2])),
                         _meta([short, long], [4, 4], table, page))
    assert kv_read_bound([short + 4]) < kv_read_bound([short + 4, long + 4])
    assert torch.equal(alone, beside[:4])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])  # MHA, and GQA groups of 3 and 4
def test_a_row_is_the_same_in_a_block_of_any_width(heads: int, kv_heads: int) -> None:
    """Requests run in blocks by the product tiles their rows fill, padded to the widest request of
    the block: a request's rows must come out the same whichever block it lands in and whoever
    shares it, down to a block of one row with one query head per KV head (a single column in each
    product)."""
    torch.manual_seed(3)
    page, dim, ctx = 8, 16, 21
    group = heads // kv_heads

    def tiles(rows: int) -> int:
        return -(-rows * group // PAIR_TILE)

    cache = PagedKVCache(1, 40, page, kv_heads, dim, torch.float32)
    attn = TorchPagedAttention(cache, page, heads, dim ** -0.5)
    table = torch.arange(1, 37, dtype=torch.int32).view(4, 9)
    for r in range(4):
        attn.attend(0, torch.randn(ctx + r, heads, dim), torch.randn(ctx + r, kv_heads, dim),
                    torch.randn(ctx + r, kv_heads, dim), _meta([0], [ctx + r], table[r:r + 1], page, group))
    q, k, v = torch.randn(7, heads, dim), torch.randn(7, kv_heads, dim), torch.randn(7, kv_heads, dim)
    outs = []
    for rows in (1, 2, 3, 5, 7):  # request 0's first `rows` rows, beside requests of other widths
        others = [1, 4, 8][: rows % 3 + 1]
        extra = sum(others)
        meta = _meta([ctx, *(ctx + 1 + i for i in range(len(others)))], [rows, *others],
                     table[: 1 + len(others)], page, group)
        blocks = meta.blocks.blocks
        # padding at most doubles the product tiles a request fills
        assert sum(b.num_requests * tiles(b.width) for b in blocks) <= 2 * sum(map(tiles, [rows, *others]))
        out = attn.attend(0, torch.cat((q[:rows], torch.randn(extra, heads, dim))),
                          torch.cat((k[:rows], torch.randn(extra, kv_heads, dim))),
                          torch.cat((v[:rows], torch.randn(extra, kv_heads, dim))), meta)
        outs.append(out[:rows])
    for out in outs:
        assert torch.equal(out, outs[-1][: out.shape[0]])


def test_query_blocks_group_requests_by_the_product_tiles_their_rows_fill() -> None:
    qo = [0, 1, 9, 9, 12, 14, 19]  # rows 1, 8, 0, 3, 2, 5
    kv = [100, 30, 5, 200, 64, 65]
    positions = torch.arange(19)
    table = torch.arange(6 * 3, dtype=torch.int32).view(6, 3)  # 3 pages of 64 per request
    # Four query heads per KV head: up to four rows fill one tile of PAIR_TILE pairs, five to eight two.
    assert PAIR_TILE == 16
    blocks = QueryBlocks.plan(qo, kv, positions, table, page_size=64, query_group=4)
    # Rows 1, 3 and 2 share a block of width 3, rows 8 and 5 one of width 8; the request with no rows
    # joins none; each block reads its own longest KV length, page by page (past the page table: its
    # last page again, masked).
    assert [(b.width, b.kv_bound, b.pages.tolist()) for b in blocks.blocks] == [
        (3, 256, [0, 1, 2, 2, 9, 10, 11, 11, 12, 13, 14, 14]), (8, 128, [3, 4, 15, 16])]
    wide = blocks.blocks[-1]
    assert wide.gather.tolist() == [list(range(1, 9)), [14, 15, 16, 17, 18, 19, 19, 19]]  # 19: zero row
    assert wide.hidden.shape == (2, 128, 1, 8)
    assert wide.hidden[0, :4, 0, 0].tolist() == [False, False, True, True]  # row at position 1
    assert wide.hidden[1, :, 0, 5:].all()  # padding entries see no key
    # Laid end to end the blocks' rows are 9 + 16; scatter finds every row's place.
    flat = torch.cat([b.gather.flatten() for b in blocks.blocks])
    assert flat[blocks.scatter].tolist() == list(range(19))
    # One query head per KV head: sixteen rows fill a tile, so every request joins one block.
    single = QueryBlocks.plan(qo, kv, positions, table, page_size=64, query_group=1)
    assert [(b.width, b.num_requests) for b in single.blocks] == [(8, 5)]


def test_a_long_prefill_chunk_runs_in_slabs_that_read_only_their_keys() -> None:
    """300 rows after 20 cached tokens: slabs of SLAB_ROWS rows, each a block of its own reading keys
    up to its last row; the attention equals the unsplit causal attention."""
    torch.manual_seed(5)
    page, heads, kv_heads, dim, ctx, rows = 16, 4, 2, 8, 20, 300
    assert rows > 2 * SLAB_ROWS
    table = torch.arange(1, 22, dtype=torch.int32).view(1, 21)
    meta = _meta([ctx], [rows], table, page)
    blocks = meta.blocks.blocks
    assert [(b.width, b.kv_bound) for b in blocks] == [(128, 192), (128, 320), (44, 320)]
    cache = PagedKVCache(1, 22, page, kv_heads, dim, torch.float32)
    attn = TorchPagedAttention(cache, page, heads, dim ** -0.5)
    q, k, v = torch.randn(ctx + rows, heads, dim), torch.randn(ctx + rows, kv_heads, dim), \
        torch.randn(ctx + rows, kv_heads, dim)
    attn.attend(0, q[:ctx], k[:ctx], v[:ctx], _meta([0], [ctx], table, page))
    out = attn.attend(0, q[ctx:], k[ctx:], v[ctx:], meta)
    keys, vals = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], is_causal=True)
    torch.testing.assert_close(out, ref[0].transpose(0, 1)[ctx:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Not trusting the machine: the same properties under a product that rounds by its call's shape.


def test_the_adversarial_product_breaks_a_product_that_trusts_the_blas() -> None:
    """The adversary has teeth: a linear that pads rows to a floor and runs one BLAS call (what a
    row-count threshold would ask for) gives a row other bits at 16 rows than at 20."""
    torch.manual_seed(4)
    w, x = torch.randn(704, 256), torch.randn(20, 256)
    with invariance_checks.adversarial():
        padded = [torch.nn.functional.linear(torch.nn.functional.pad(x[:n], (0, 0, 0, max(16, n) - n)), w)[:n]
                  for n in (16, 20)]
    assert not torch.equal(padded[0], padded[1][:16])


@pytest.mark.parametrize("check", sorted(invariance_checks.CHECKS))
def test_rows_are_invariant_under_an_adversarial_product(check: str) -> None:
    with invariance_checks.adversarial():
        invariance_checks.CHECKS[check]()
