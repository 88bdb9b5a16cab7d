"""Row-invariant building blocks for the reference (CPU) forward pass.

Greedy speculative decoding is lossless only if the target computes the same logits for a
position whether it runs as one row of a decode step or as one of `B x N` verify rows. The
CPU GEMM kernels work on blocks of 4 rows and, for small row counts, handle a partial block or
few rows with a different micro-kernel, which changes rounding; how few depends on the CPU and
the shape (fewer than 8 rows on an AVX2 machine, fewer than 16 on an AVX-512 one for the embedded
model's 256-, 688- and 259-wide products). Every row-wise product here therefore runs on a padded
row count (`padded_rows`); `tests/test_runtime_invariance.py` checks the property on the machine
it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark.formats.hf_config import RopeScaling
from dspark.runtime.kernels import rms_norm as rms_norm_kernels

MIN_ROWS = 16
ROW_BLOCK = 4


def padded_rows(rows: int, minimum: int = MIN_ROWS) -> int:
    """Row count a GEMM runs on: a whole number of row blocks, at least `minimum`."""
    return max(minimum, -(-rows // ROW_BLOCK) * ROW_BLOCK)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim -2 up to `padded_rows` (`x` itself when it is already that shape: F.pad would copy)."""
    rows = x.shape[-2]
    extra = padded_rows(rows) - rows
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for 2-D `x`, bitwise independent of how many rows `x` has on the CPU
    (the bias is added row by row, which no row count changes)."""
    if x.device.type != "cpu":
        # The floor is for the CPU's GEMM micro-kernels. On a GPU it would not make the product
        # row-invariant (cuBLAS picks its kernel by the whole shape), and its 225 pad kernels cost
        # 0.7 ms of an 8B step at 8 rows on an H200, twice the step's attention.
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    return F.linear(pad_rows(x), weight, bias)[:rows]


# torch's elementwise CPU loop runs two vector registers per iteration (2 x 16 float32 lanes with
# AVX-512) and the remainder through a scalar loop that rounds differently.
LANES = 32


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise transcendental (exp, sigmoid, tanh, silu) run on a last dim padded
    to a multiple of `LANES`, so no element falls in the scalar remainder; otherwise which elements
    do depends on the tensor's size, i.e. on the batch. (A product large enough for torch to split
    across threads can still put a remainder at a thread boundary.)"""
    extra = -x.shape[-1] % LANES
    if not extra:
        return fn(x)
    return fn(F.pad(x, (0, extra)))[..., :x.shape[-1]]


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
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., T, H, D]` by per-position tables `cos/sin[..., T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
