"""Row-invariant building blocks for the reference (CPU) forward pass.

Greedy speculative decoding is lossless only if the target computes the same logits for a
position whether it runs as one row of a decode step or as one of `B x N` verify rows. A BLAS picks
its kernel, its blocking and its split of a reduction from the whole shape of a call (MKL, oneDNN and
OpenBLAS all take another path below some row count, which differs by CPU and build), and torch's
elementwise loops run a scalar tail and split work across threads by the tensor's size. So on the
CPU every call that reduces, or that evaluates a transcendental, has a shape fixed by the model and
never by the step:

- `linear`: rows in tiles of `ROW_TILE`, one `torch.mm` call per tile, every call `weight @ tileᵀ`
  with the same strides (the tile's rows are the product's vector lanes);
- `bmm`: batched products in calls of exactly `PROBLEMS_PER_CALL` problems of one shape (callers pad
  to whole calls);
- `ordered_product`: a product with few outputs (a head's gate, the confidence logit) as exact
  products and a fixed pairwise tree of adds, with no BLAS at all;
- `chunked_attention`: (query row, head) pairs in tiles of `PAIR_TILE`, the vector lanes of products
  against keys in chunks of `KV_CHUNK`, through `bmm`; chunk partials added in key order, one
  elementwise add at a time;
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
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.weak import WeakIdKeyDictionary

from dspark.formats.hf_config import RopeScaling, yarn_ramp
from dspark.runtime.attention.metadata import KV_CHUNK, PAIR_TILE
from dspark.runtime.kernels import rms_norm as rms_norm_kernels

# Rows of every CPU linear call. 16 keeps a one-row decode step as cheap as the smallest efficient
# GEMM, while a 256-row verify step runs 16 calls of it.
ROW_TILE = 16
# A product with fewer outputs per row than this is summed by `ordered_product` instead: a BLAS
# call with few columns takes a small-matrix path that can round a row by its place in the call.
BLAS_MIN_OUT = 64
# Problems in every CPU batched-product call: a call costs about 6 us plus 0.9 us a problem here, so 32
# keeps a small step's padding problems cheap and a large step's calls few.
PROBLEMS_PER_CALL = 32
# Elements of every elementwise transcendental call: a multiple of 2 x 16 float32 lanes (AVX-512's
# loop step; AVX2's is half) and below torch's parallel grain (32768), so it never splits.
ELEMENT_TILE = 16384
# The tile of call sites whose tensors stay small (a Markov head's [B, rank] state), which a tile of
# ELEMENT_TILE would mostly pad: a multiple of the same loop steps, below every threading grain.
SMALL_ELEMENT_TILE = 2048


def _tiles(count: int, tile: int) -> int:
    return -(-count // tile)


_WORKSPACE = threading.local()


def _scratch(role: str, like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous `shape` operand buffer in `like`'s dtype, the one every call for `role` on this
    thread reuses (allocated once, so always with the same alignment; no fresh pages to fault in).
    What a call does not overwrite holds an earlier call's values (zeros at first): only the padding
    problems or lanes of a product, independent of the others, whose results are dropped."""
    key = (role, like.dtype, like.device)
    numel = math.prod(shape)
    buf = _WORKSPACE.__dict__.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            buf = _WORKSPACE.__dict__[key] = like.new_zeros(numel)
    return buf[:numel].view(shape)


def _training(*tensors: torch.Tensor) -> bool:
    """Training a draft (autograd, or bf16 autocast): plain operations, no exactness to keep."""
    return torch.is_autocast_enabled("cpu") or (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for 2-D `x`; on the CPU each row's bits do not depend on how many rows
    `x` has nor where a row sits among them beyond its place in a tile (the bias is added row by row)."""
    if x.device.type != "cpu":
        # Fixed tiles would not make cuBLAS row-invariant (it picks a kernel by the whole shape) and
        # would cost a launch per tile.
        return F.linear(x, weight, bias)
    if _training(x, weight):
        return F.linear(x, weight, bias)
    if weight.shape[0] < BLAS_MIN_OUT:
        out = ordered_product(x, weight)
        return out + bias if bias is not None else out
    rows, width = x.shape
    out_features = weight.shape[0]
    tiles = _tiles(rows, ROW_TILE)
    rows_in, products, calls = _linear_operands(x, out_features, tiles)
    rows_in.view(-1, width)[:rows] = x
    # `weight @ tileᵀ`: the tile's rows are the vector lanes of the product (the dimension a BLAS
    # kernel vectorises), not its register-blocked columns, whose remainder blocks (and the split
    # between threads) round a row by its place in the tile on some CPUs.
    for tile, dst in calls[:tiles]:
        torch.mm(weight, tile, out=dst)
    out = x.new_empty(tiles * ROW_TILE, out_features)
    out.view(tiles, ROW_TILE, out_features).copy_(products[:tiles].transpose(1, 2))
    out = out[:rows]
    return out + bias if bias is not None else out


def _linear_operands(x: torch.Tensor, out_features: int, tiles: int
                     ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """This thread's operand buffers of a `linear` from `x`'s width to `out_features`, for at least
    `tiles` tiles: the rows `[cap, ROW_TILE, width]`, the products `[cap, out_features, ROW_TILE]`,
    and each call's (tileᵀ, product) views, made once (a step runs dozens of linears)."""
    key = ("linear", x.dtype, x.device, x.shape[1], out_features)
    entry = _WORKSPACE.__dict__.get(key)
    if entry is None or len(entry[2]) < tiles:
        cap = max(tiles, 2 * len(entry[2]) if entry else 1)
        with torch.inference_mode(False):  # normal tensors and views: written in and out of inference mode
            rows_in = x.new_zeros(cap, ROW_TILE, x.shape[1])
            products = x.new_zeros(cap, out_features, ROW_TILE)
            calls = list(zip(rows_in.transpose(1, 2).unbind(0), products.unbind(0), strict=True))
        entry = _WORKSPACE.__dict__[key] = (rows_in, products, calls)
    return entry


# Keyed by the first weight's identity (a tensor's `==` is elementwise), dropped with it.
_STACKED = WeakIdKeyDictionary()


def linear_many(x: torch.Tensor, weights: Sequence[torch.Tensor],
                biases: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """`x @ w.T (+ b)` for several weights read from the same rows (q, k and v; gate and up), as one
    `linear` over the weights stacked: fewer, wider calls. The stack is cached while the weights are
    the same tensors at the same versions (loading new weights in place rebuilds it)."""
    if x.device.type != "cpu" or _training(x, *weights):
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    parts = [*weights, *(b for b in biases if b is not None)]
    stamp = tuple((id(t), t._version) for t in parts)
    hit = _STACKED.get(weights[0])
    if hit is None or hit[0] != stamp:
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases, strict=True)])
        hit = (stamp, torch.cat(list(weights)), bias)
        _STACKED[weights[0]] = hit
    out = linear(x, hit[1], hit[2])
    # Contiguous parts: a row reduction (a head's RMSNorm) over a strided view may be vectorised across
    # rows, in an order set by how many there are.
    return tuple(part.contiguous() for part in out.split([w.shape[0] for w in weights], dim=-1))


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


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a[P, m, k] @ b[P, k, n]` -> `[P, m, n]` for `P` a multiple of `PROBLEMS_PER_CALL` (the caller
    lays out padding problems); on the CPU as calls of exactly that many problems of one shape, so a
    problem's bits do not depend on how many problems the step has."""
    if a.device.type != "cpu" or _training(a, b):
        return torch.bmm(a, b)
    problems, m, _ = a.shape
    assert problems % PROBLEMS_PER_CALL == 0, f"{problems} problems: not whole calls"
    a, b = _canonical(a), _canonical(b)
    out = a.new_empty(problems, m, b.shape[2])
    for start in range(0, problems, PROBLEMS_PER_CALL):
        call = slice(start, start + PROBLEMS_PER_CALL)
        torch.bmm(a[call], b[call], out=out[call])
    return out


def _element_tiles(apply: Callable[[torch.Tensor, torch.Tensor], object], src: torch.Tensor,
                   dst: torch.Tensor, tile: int = ELEMENT_TILE) -> None:
    """`apply(tile, out_tile)` over flat `src` in tiles of `tile` elements, the last padded to one."""
    count = src.numel()
    full = count // tile * tile
    for start in range(0, full, tile):
        apply(src[start:start + tile], dst[start:start + tile])
    if full < count:
        # The lanes past the end hold an earlier call's values: elementwise, they touch no other lane.
        tail = _scratch(f"lanewise.{tile}", src, tile)
        tail[:count - full] = src[full:]
        apply(tail, tail)
        dst[full:count] = tail[:count - full]


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             tile: int = ELEMENT_TILE) -> torch.Tensor:
    """`fn(x)` for an elementwise transcendental (exp, sigmoid, tanh, silu, cos); on the CPU over
    fixed tiles of `tile` elements, so every element runs in a full vector iteration of one unsplit
    loop whatever the tensor's size (a vector lane and the scalar tail round differently). A call
    site passes one `tile` for all its calls (`SMALL_ELEMENT_TILE` where its tensors stay small)."""
    if x.device.type != "cpu" or _training(x):
        return fn(x)
    out = x.new_empty(x.numel())
    _element_tiles(lambda part, dst: dst.copy_(fn(part)), x.reshape(-1), out, tile)
    return out.view(x.shape)


def lanewise_(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> torch.Tensor:
    """`fn(tile)`, elementwise operations that update `tile` in place, over a contiguous `x` in the
    tiles of `lanewise` (every operation of `fn` runs on a tile while it is in cache)."""
    if x.device.type != "cpu":
        fn(x)
        return x
    flat = x.view(-1)
    _element_tiles(lambda tile, _: fn(tile), flat, flat)
    return x


# Below exp(-87) (float32's smallest normal numbers, and -inf) exp's vector code takes a slow path,
# several times the cost of the rest; a softmax weight there is under 1.7e-38 of the largest.
EXP_FLOOR = -87.0
_EXP_AT_FLOOR: dict[torch.dtype, float] = {}


def _exp_(tile: torch.Tensor) -> None:
    torch.exp(tile, out=tile)


def _softmax_weights_(shifted: torch.Tensor) -> None:
    """`exp` in place of shifted scores (<= 0; -inf for a hidden key), floored at `EXP_FLOOR` and less
    `exp(EXP_FLOOR)`: exactly 0 for a hidden key and for one at or below the floor, and all on the fast
    path. Elementwise, so a row's weights depend on its own scores alone: the floor and the subtraction
    are correctly rounded in vector and scalar code alike and run over the whole tensor; only `exp`
    runs in `lanewise` tiles."""
    at_floor = _EXP_AT_FLOOR.get(shifted.dtype)
    if at_floor is None:  # as the tiles compute it, vector code included
        full = torch.full((ELEMENT_TILE,), EXP_FLOOR, dtype=shifted.dtype, device=shifted.device)
        at_floor = _EXP_AT_FLOOR[shifted.dtype] = float(torch.exp(full)[0])
    shifted.clamp_min_(EXP_FLOOR)
    lanewise_(_exp_, shifted)
    shifted.sub_(at_floor)


class PairMask:
    """Which keys each (query row, query head) pair of `chunked_attention` must not see, laid out once
    (a step's layers share it) as its problems read it: `bias [tiles, 1, N, chunks, KV_CHUNK,
    PAIR_TILE]`, contiguous, 0 for a key the pair sees and -inf for one it does not, the pairs past the
    last hidden from every key. Added to the scores (finite: a cache starts zeroed and holds finite
    keys), it leaves a seen score unchanged and makes a hidden one -inf, several times faster than
    `masked_fill` of the same layout."""

    def __init__(self, hidden: torch.Tensor, dtype: torch.dtype) -> None:
        """`hidden [N, pairs, L]`: True for a key the pair must not see (`L` a multiple of `KV_CHUNK`);
        `dtype`: the scores'."""
        seqs, pairs, length = hidden.shape
        tiles = _tiles(pairs, PAIR_TILE)
        padded = F.pad(hidden, (0, 0, 0, tiles * PAIR_TILE - pairs), value=True)
        layout = padded.view(seqs, tiles, PAIR_TILE, length // KV_CHUNK, KV_CHUNK).permute(1, 0, 3, 4, 2)
        self.pairs = pairs
        self.bias = torch.zeros(layout.shape, dtype=dtype, device=hidden.device).masked_fill_(
            layout, float("-inf"))[:, None]


def _pair_maximum(scores: torch.Tensor) -> torch.Tensor:
    """`scores [T, chunks * KV_CHUNK, PAIR_TILE]` -> each pair's maximum `[T, 1, PAIR_TILE]`: the chunks
    folded in turn, then the chunk's keys by halves (elementwise maxima, exact in any order, are
    several times faster than `amax` over the strided dimension)."""
    top = scores[:, :KV_CHUNK]
    for start in range(KV_CHUNK, scores.shape[1], KV_CHUNK):
        top = torch.maximum(top, scores[:, start:start + KV_CHUNK])
    while top.shape[1] > 1:
        half = top.shape[1] // 2
        top = torch.maximum(top[:, :half], top[:, half:])
    return top


def chunked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: PairMask) -> torch.Tensor:
    """Softmax attention `[Hkv, N, pairs, D]` of pre-scaled queries `q [Hkv, N, pairs, D]` over
    `keys`/`values [N, L, Hkv, D]` (token-major, as a cache holds them; `L` a multiple of `KV_CHUNK`),
    where `mask` says which keys a pair must not see; computed in `q`'s dtype (float32 or float64). A
    pair is one (query row, query head of the KV group), row-major; a pair that sees no key gets zeros.

    Every product is a `bmm` problem of one shape: one chunk of keys against a tile of `PAIR_TILE`
    pairs, then the chunk's values, with a row of ones (the softmax normaliser accumulates in the same
    product), against their probabilities; the pairs are the products' vector lanes. The shift is each
    pair's maximum score (exact in any order), and the chunks' partial sums are added in key order."""
    hkv, seqs, pairs, dim = q.shape
    assert mask.pairs == pairs, f"a mask of {mask.pairs} pairs for {pairs}"
    chunks = keys.shape[1] // KV_CHUNK
    tiles = _tiles(pairs, PAIR_TILE)
    width = tiles * PAIR_TILE
    # Problems are (pair tile, KV head, sequence, key chunk), laid out once in buffers of whole
    # `bmm` calls: the problems past the last make every call the same call.
    shape = (tiles, hkv, seqs, chunks)
    count = math.prod(shape)
    padded = _tiles(count, PROBLEMS_PER_CALL) * PROBLEMS_PER_CALL

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [N, L, Hkv, D] -> [tiles, Hkv, N, chunks, KV_CHUNK, D]
        return t.unflatten(1, (chunks, KV_CHUNK)).permute(3, 0, 1, 2, 4)[None].expand(*shape, KV_CHUNK, dim)

    k = _scratch("attention.keys", q, padded, KV_CHUNK, dim)
    k[:count].view(*shape, KV_CHUNK, dim).copy_(chunked(keys))
    # Values with a column of ones, key-major as they are read (the product reads them transposed).
    v = _scratch("attention.values", q, padded, KV_CHUNK, dim + 1)
    v[:count, :, :dim].view(*shape, KV_CHUNK, dim).copy_(chunked(values))
    v[:count, :, dim] = 1
    a = _scratch("attention.queries", q, padded, PAIR_TILE, dim)
    tiled = F.pad(q, (0, 0, 0, width - pairs)).view(hkv, seqs, tiles, PAIR_TILE, dim)
    a[:count].view(*shape, PAIR_TILE, dim).copy_(
        tiled.permute(2, 0, 1, 3, 4)[:, :, :, None].expand(*shape, PAIR_TILE, dim))
    scores = bmm(k, a.transpose(1, 2))  # [padded, KV_CHUNK, PAIR_TILE]
    real = scores[:count]
    real.view(*shape, KV_CHUNK, PAIR_TILE).add_(mask.bias)
    # [tiles * Hkv * N, chunks * KV_CHUNK, PAIR_TILE]: a pair's keys are one dimension
    by_pair = real.view(-1, chunks * KV_CHUNK, PAIR_TILE)
    # A pair that sees no key has the maximum -inf; clamped, its scores stay -inf (weights 0).
    by_pair -= _pair_maximum(by_pair).clamp_min_(torch.finfo(q.dtype).min)
    _softmax_weights_(real)  # the padding problems' scores are never read
    part = bmm(v.transpose(1, 2), scores)[:count].view(*shape, dim + 1, PAIR_TILE)
    acc = part[:, :, :, 0]
    for chunk in range(1, chunks):  # in key order; a chunk past every pair's keys adds exact zeros
        acc = acc + part[:, :, :, chunk]
    weighted, total = acc[:, :, :, :dim], acc[:, :, :, dim:]
    out = weighted / total.clamp_min(1e-30)  # a pair that sees no key: 0 / 1e-30
    # [tiles, Hkv, N, D, PAIR_TILE] -> [Hkv, N, pairs, D]
    return out.permute(1, 2, 0, 4, 3).reshape(hkv, seqs, width, dim)[:, :, :pairs]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as Hugging Face computes it: in float32, cast back, then
    scaled (for float32 `x` the casts are no-ops); one Triton kernel on a GPU. On the CPU `x` is made
    contiguous first: torch may vectorise a reduction over a strided view across rows, in an order set
    by how many rows there are."""
    if x.device.type == "cpu":
        x = x.contiguous()
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
    low, high = yarn_ramp(head_dim, theta, scaling.original_max_position_embeddings, scaling.beta_fast,
                          scaling.beta_slow, bool(scaling.truncate))
    ramp = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (scaling.factor * base)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, scaling.attention_factor


# Per (head_dim, theta, scaling): cos and sin of positions 0 … n - 1 on the CPU, grown as positions do.
_ROPE_TABLES: dict[tuple[int, float, RopeScaling | None], tuple[torch.Tensor, torch.Tensor]] = {}
ROPE_TABLE_MIN = 1024


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[..., T, head_dim]` in the Hugging Face layout (halves, not interleaved
    pairs). Each position's row depends on that position only, so the tables are batch-invariant.

    On the CPU the rows are read from a table of every position so far, computed (`lanewise`, as
    here) when a position first passes its end: a step evaluates no cos or sin, where a few rows
    would otherwise cost a whole tile of each. Under a dispatch mode (a graph being captured, fake
    tensors) they are computed directly, to the same bits: the table's growth reads the positions."""
    if (positions.device.type != "cpu" or torch.is_autocast_enabled("cpu") or not positions.numel()
            or positions.is_floating_point() or _get_current_dispatch_mode() is not None):
        return _rope_cos_sin(positions, head_dim, theta, scaling)
    lowest, highest = (int(v) for v in torch.aminmax(positions))
    if lowest < 0:
        return _rope_cos_sin(positions, head_dim, theta, scaling)
    key = (head_dim, theta, scaling)
    table = _ROPE_TABLES.get(key)
    need = highest + 1
    if table is None or table[0].shape[0] < need:
        size = max(ROPE_TABLE_MIN, 1 << (need - 1).bit_length())
        # a normal tensor, read in and out of inference mode (training saves cos and sin for backward)
        with torch.inference_mode(False), torch.no_grad():
            table = _ROPE_TABLES[key] = _rope_cos_sin(torch.arange(size), head_dim, theta, scaling)
    index = positions.long()
    return table[0][index], table[1][index]


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
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
