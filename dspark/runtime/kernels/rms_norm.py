"""RMSNorm over the last dimension, as Hugging Face computes it, in one kernel.

`rms_norm_torch` is the reference: normalise in float32, cast back to x's dtype, then scale by the
weight (for float32 `x` the casts are no-ops). In torch that is eight kernels (upcast, square,
mean, add, rsqrt, multiply, downcast, scale); a layer runs two norms (four with Qwen3's q/k norms),
so on a GPU at small batch those launches cost more than the norms' arithmetic. The Triton kernel
does the same operations in the same dtypes in one program per row, with a fixed block: a row's
result does not depend on how many rows share the launch.
"""

from __future__ import annotations

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton

MAX_BLOCK_D = 16384  # widest row one program normalises (Llama's hidden size 4096 … 16384)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: Impl = "auto") -> torch.Tensor:
    """`weight * (x / sqrt(mean(x², -1) + eps))` over the last dimension of any-shaped `x`."""
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"weight must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    # The kernel writes x's dtype; a weight of another dtype promotes the result (the reference's
    # `weight * y`), which only the reference reproduces.
    if (use_triton(impl, x, weight) and weight.dtype == x.dtype and x.shape[-1] <= MAX_BLOCK_D
            and x.numel()):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        launch_rms_norm(rows, weight, out, eps)
        return out.view(x.shape)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """Normalise the rows of `x [R, d]` (unit stride along d) into `out [R, d]`."""
    rows, width = x.shape
    block = next_pow2(width)
    _rms_norm_kernel[(rows,)](x, x.stride(0), weight, out, out.stride(0), width, float(eps),
                              BLOCK_D=block, num_warps=8 if block >= 4096 else 4)


@jit
def _rms_norm_kernel(x_ptr, x_s_row, w_ptr, o_ptr, o_s_row, width, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < width
    x = tl.load(x_ptr + row * x_s_row + cols, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / width
    y = (x * tl.rsqrt(var + eps)).to(o_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # bf16 * bf16 in torch is the float32 product rounded once: the same here.
    out = (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * o_s_row + cols, out, mask=ok)
