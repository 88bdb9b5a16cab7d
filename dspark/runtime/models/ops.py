"""Row-invariant building blocks for the reference (CPU) forward pass.

Greedy speculative decoding is lossless only if the target computes the same logits for a
position whether it runs as one row of a decode step or as one of `B x N` verify rows. A BLAS picks
its kernel, its blocking and its split of a reduction from the whole shape of a call (MKL, oneDNN and
OpenBLAS all take another path below some row count, which differs by CPU and build), and torch's
elementwise loops run a scalar tail and split work across threads by the tensor's size. So on the
CPU every call that reduces, or that evaluates a transcendental, has a shape fixed by the model and
never by the step:

- `linear`: rows in tiles of `ROW_TILE`, one `torch.mm` call per tile, every call `[ROW_TILE, in] @
  [in, out]` with the same strides;
- `bmm`: batched products in calls of exactly `PROBLEMS_PER_CALL` problems of one shape;
- `ordered_product`: a product with few outputs (a head's gate, the confidence logit) as exact
  products and a fixed pairwise tree of adds, with no BLAS at all;
- `chunked_attention`: query rows in tiles of `ROWS_PER_PAIR_TILE` rows (all heads of a KV group), a
  row's place in its tile set by its own position, against keys in chunks of `KV_CHUNK`, through
  `bmm`; chunk partials added in key order, one elementwise add at a time;
- `lanewise`: an elementwise transcendental on fixed tiles of `ELEMENT_TILE` elements, a whole number
  of vector iterations on any x86 ISA and below torch's threading grain, so no element falls in a
  scalar tail or at a thread boundary.

A row's result then depends on its own inputs and on the model only, whatever BLAS runs underneath;
docs/exactness.md says exactly what is guaranteed and what is assumed, and
`tests/test_runtime_invariance.py` checks it, also under an adversarial product and other kernels.
On a GPU none of this applies (cuBLAS and the Triton kernels choose tiles by the whole shape): the
functions there are the plain operations, and the device tests check tolerance and greedy equality.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark.formats.hf_config import RopeScaling
from dspark.runtime.attention.metadata import KV_CHUNK
from dspark.runtime.kernels import rms_norm as rms_norm_kernels

# Rows of every CPU linear call. 16 keeps a one-row decode step as cheap as the smallest efficient
# GEMM, while a 256-row verify step runs 16 calls of it.
ROW_TILE = 16
# A product with fewer outputs per row than this is summed by `ordered_product` instead: a BLAS
# call with few columns takes a small-matrix path that can round a row by its place in the call.
BLAS_MIN_OUT = 64
# Problems in every CPU batched-product call, and the query rows of one attention problem (each with
# all query heads of its KV group).
PROBLEMS_PER_CALL = 16
ROWS_PER_PAIR_TILE = 4
# Elements of every elementwise transcendental call: a multiple of 2 x 16 float32 lanes (AVX-512's
# loop step; AVX2's is half) and below torch's parallel grain (32768), so it never splits.
ELEMENT_TILE = 8192


def _tiles(count: int, tile: int) -> int:
    return -(-count // tile)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for 2-D `x`; on the CPU each row's bits do not depend on how many rows
    `x` has nor where a row sits among them beyond its place in a tile (the bias is added row by row)."""
    if x.device.type != "cpu":
        # Fixed tiles would not make cuBLAS row-invariant (it picks a kernel by the whole shape) and
        # would cost a launch per tile.
        return F.linear(x, weight, bias)
    if weight.shape[0] < BLAS_MIN_OUT:
        out = ordered_product(x, weight)
        return out + bias if bias is not None else out
    rows, width = x.shape
    tiles = _tiles(rows, ROW_TILE)
    # A fresh buffer, so every call's operands have one alignment and one set of strides.
    padded = x.new_zeros(tiles, ROW_TILE, width)
    padded.view(-1, width)[:rows] = x
    # `weight @ tileᵀ`: the tile's rows are the vector lanes of the product (the dimension a BLAS
    # kernel vectorises), not its register-blocked columns, whose remainder blocks (and the split
    # between threads) round a row by its place in the tile on some CPUs.
    out_t = x.new_empty(tiles, weight.shape[0], ROW_TILE)
    for t in range(tiles):
        torch.mm(weight, padded[t].t(), out=out_t[t])
    out = out_t.transpose(1, 2).reshape(-1, weight.shape[0])[:rows]
    return out + bias if bias is not None else out


def ordered_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x[M, K] @ weight[N, K].T` summed in an order fixed by `K` alone: exact float products, then a
    pairwise tree over `K` (zero-padded to a power of two) of elementwise adds, each rounded once. No
    BLAS is involved, so a row's bits depend on that row only. For small `N · K` (a head's gate or
    confidence projection): it materialises `[M, N, K]`."""
    k = x.shape[-1]
    terms = x[:, None, :] * weight[None, :, :]  # [M, N, K]
    terms = F.pad(terms, (0, (1 << max(k - 1, 0).bit_length()) - k))
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = terms[..., :half] + terms[..., half:]
    return terms[..., 0]


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """`t [P, m, k]` with the batch outermost and each matrix contiguous or transposed, as a BLAS reads
    it; anything else is copied contiguous (a stride pattern is part of a call's shape)."""
    return t if t.is_contiguous() or t.transpose(1, 2).is_contiguous() else t.contiguous()


def _zero_problems(like: torch.Tensor, count: int) -> torch.Tensor:
    """`count` zero problems laid out as the canonical `like` is."""
    _, m, k = like.shape
    if like.is_contiguous():
        return like.new_zeros(count, m, k)
    return like.new_zeros(count, k, m).transpose(1, 2)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a[P, m, k] @ b[P, k, n]` -> `[P, m, n]`; on the CPU as calls of exactly `PROBLEMS_PER_CALL`
    problems of one shape (the last call's missing problems are zeros), so a problem's bits do not
    depend on how many problems the step has."""
    if a.device.type != "cpu":
        return torch.bmm(a, b)
    problems, m, _ = a.shape
    n = b.shape[2]
    a, b = _canonical(a), _canonical(b)
    full = problems // PROBLEMS_PER_CALL * PROBLEMS_PER_CALL
    out = a.new_empty(_tiles(problems, PROBLEMS_PER_CALL) * PROBLEMS_PER_CALL, m, n)
    for start in range(0, full, PROBLEMS_PER_CALL):
        call = slice(start, start + PROBLEMS_PER_CALL)
        torch.bmm(a[call], b[call], out=out[call])
    if full < problems:
        rest = problems - full
        # Zero problems laid out as `a` and `b` are, so the last call is the same call as the others.
        a_tail, b_tail = _zero_problems(a, PROBLEMS_PER_CALL), _zero_problems(b, PROBLEMS_PER_CALL)
        a_tail[:rest], b_tail[:rest] = a[full:], b[full:]
        torch.bmm(a_tail, b_tail, out=out[full:])
    return out[:problems]


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise transcendental (exp, sigmoid, tanh, silu, cos); on the CPU over
    fixed tiles of `ELEMENT_TILE` elements, so every element runs in a full vector iteration of one
    unsplit loop whatever the tensor's size (a vector lane and the scalar tail round differently)."""
    if x.device.type != "cpu":
        return fn(x)
    count = x.numel()
    tiles = _tiles(count, ELEMENT_TILE)
    flat = x.new_zeros(tiles * ELEMENT_TILE)
    flat[:count] = x.reshape(-1)
    out = torch.empty_like(flat)
    for t in range(tiles):
        tile = slice(t * ELEMENT_TILE, (t + 1) * ELEMENT_TILE)
        out[tile] = fn(flat[tile])
    return out[:count].view(x.shape)


def attention_columns(first_positions: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """Where a sequence's `rows` consecutive query rows, the first at `first_positions[b]`, sit in the
    columns `chunked_attention` runs: row i at `first % ROWS_PER_PAIR_TILE + i`, so a row's place in its
    attention problem is set by its own position, never by the rows beside it. Returns `[N, rows]`
    column indices and the column count (a whole number of tiles)."""
    offset = first_positions.long() % ROWS_PER_PAIR_TILE  # [N]
    columns = offset[:, None] + torch.arange(rows, device=first_positions.device)[None, :]
    return columns, _tiles(rows + ROWS_PER_PAIR_TILE - 1, ROWS_PER_PAIR_TILE) * ROWS_PER_PAIR_TILE


def chunked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      hidden: torch.Tensor) -> torch.Tensor:
    """Softmax attention `[Hkv, N, C, G, D]` of pre-scaled queries `q [Hkv, N, C, G, D]` (C query
    columns, a multiple of `ROWS_PER_PAIR_TILE`, laid out by `attention_columns`; G query heads per KV
    head) over `keys`/`values [Hkv, N, L, D]` (`L` a multiple of `KV_CHUNK`), where `hidden [N, C, L]`
    is True for a key a column must not see; float32 (or float64) throughout. A column that sees no key
    (padding) gets zeros.

    Every product is a `bmm` problem of one shape: a tile of `ROWS_PER_PAIR_TILE` columns x G heads
    against one chunk of keys, then their probabilities against the chunk's values with a column of
    ones (the softmax normaliser accumulates in the same product), each output a dot of two contiguous
    vectors. The shift is each pair's maximum score (exact in any order), and the chunks' partial sums
    are added in key order."""
    hkv, seqs, cols, group, dim = q.shape
    length = keys.shape[2]
    chunks, tiles = length // KV_CHUNK, cols // ROWS_PER_PAIR_TILE
    pairs = ROWS_PER_PAIR_TILE * group
    # Problems are (KV head, sequence, column tile, key chunk), in that order.
    shape = (hkv, seqs, tiles, chunks)
    a = q.reshape(hkv, seqs, tiles, 1, pairs, dim).expand(*shape, pairs, dim)
    k = keys.reshape(hkv, seqs, 1, chunks, KV_CHUNK, dim).expand(*shape, KV_CHUNK, dim)
    scores = bmm(a.reshape(-1, pairs, dim), k.reshape(-1, KV_CHUNK, dim).transpose(1, 2))
    scores = scores.view(*shape, ROWS_PER_PAIR_TILE, group, KV_CHUNK)
    mask = hidden.view(seqs, tiles, ROWS_PER_PAIR_TILE, chunks, KV_CHUNK).transpose(2, 3)
    scores.masked_fill_(mask[:, :, :, :, None], float("-inf"))
    top = scores.amax(dim=(3, 6), keepdim=True)
    probs = lanewise(torch.exp, scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    # The values' columns (and the ones) as contiguous rows over the chunk's keys, so this product is
    # laid out as the scores' and every linear's.
    ones = values.new_ones(*values.shape[:-1], 1)
    v = torch.cat((values, ones), dim=-1).view(hkv, seqs, chunks, KV_CHUNK, dim + 1).transpose(-1, -2)
    v = v.contiguous().view(hkv, seqs, 1, chunks, dim + 1, KV_CHUNK).expand(*shape, dim + 1, KV_CHUNK)
    part = bmm(probs.view(-1, pairs, KV_CHUNK), v.reshape(-1, dim + 1, KV_CHUNK).transpose(1, 2))
    part = part.view(*shape, pairs, dim + 1)
    acc = part[:, :, :, 0]
    for chunk in range(1, chunks):  # in key order; a chunk past every pair's keys adds exact zeros
        acc = acc + part[:, :, :, chunk]
    total = acc[..., dim:]
    out = torch.where(total > 0, acc[..., :dim] / total.clamp_min(1e-30), torch.zeros_like(acc[..., :dim]))
    return out.reshape(hkv, seqs, cols, group, dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as Hugging Face computes it: in float32, cast back, then
    scaled (for float32 `x` the casts are no-ops); one Triton kernel on a GPU."""
    return rms_norm_kernels.rms_norm(x, weight, eps)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies `[head_dim / 2]` (float32) and the factor cos and sin are scaled by,
    computed with the operations of transformers' `ROPE_INIT_FUNCTIONS` so they match it bitwise."""
    kind = scaling.rope_type if scaling else "default"
    if scaling is not None and kind == "dynamic":
        # transformers' dynamic NTK base at a sequence length of max_position_embeddings (written here
        # as original_max_position_embeddings), where the correction is 1 up to rounding; dspark
        # serves no position past it, where the base would follow the batch's longest sequence.
        assert scaling.original_max_position_embeddings
        seq_len = max_len = scaling.original_max_position_embeddings
        factor = scaling.factor
        theta = theta * ((factor * seq_len / max_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    base = theta ** exponents  # [head_dim / 2]
    inv_freq = 1.0 / base
    if scaling is None or kind == "dynamic":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        assert scaling.original_max_position_embeddings
        assert scaling.low_freq_factor and scaling.high_freq_factor
        old_context = scaling.original_max_position_embeddings
        low_wavelen = old_context / scaling.low_freq_factor
        high_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are interpolated by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    # dimensions that rotate beta_slow and beta_fast times over the original context
    assert kind == "yarn" and scaling.original_max_position_embeddings and scaling.attention_factor
    assert scaling.beta_fast and scaling.beta_slow
    dim, original = head_dim, scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (scaling.factor * base)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, scaling.attention_factor


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[..., T, head_dim]` in the Hugging Face layout (halves, not interleaved
    pairs). Each position's row depends on that position only, so the tables are batch-invariant."""
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = lanewise(torch.cos, emb), lanewise(torch.sin, emb)
    if attention_factor == 1.0:
        return cos, sin
    return cos * attention_factor, sin * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., T, H, D]` by per-position tables `cos/sin[..., T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
