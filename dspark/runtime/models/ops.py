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

import torch
import torch.nn.functional as F

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


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for 2-D `x`, bitwise independent of how many rows `x` has."""
    rows = x.shape[0]
    return F.linear(pad_rows(x), weight)[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables in the Hugging Face Llama layout (halves, not interleaved pairs)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., T, H, D]` by per-position tables `cos/sin[..., T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
