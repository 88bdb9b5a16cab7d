"""The draft block's attention in a serving step, computed so a row's result does not depend on the
batch: not on how many requests share the step, nor on how far the longest of them pads the context.

Each request's block queries attend to its cached context (the first `ctx_lens[b]` of `C` entries)
and to its own block. A fused attention kernel reduces over all `C + Q` keys at once, and its
blocking, hence its rounding, follows `C`, which the longest request in the batch sets. Here each
request's keys are its context followed by its block, from key 0 in whole `KV_CHUNK` chunks, and
`ops.chunked_attention` runs every product in one shape fixed by the model, adding the chunks in key
order (chunks wholly past a request's keys are masked and add exact zeros; docs/exactness.md).

Scores, probabilities and sums are float32 whatever the model's dtype, as in a fused kernel: chunk
sums added in bfloat16 would lose the context's tail on long prompts.
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import KV_CHUNK
from dspark.runtime.models import ops


def block_step_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_lens: torch.Tensor,
                         blk_k: torch.Tensor, blk_v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of block queries `q[B, Q, H, D]` over the context `ctx_k/ctx_v[B, C, Hkv, D]` (request
    b's first `ctx_lens[b]` entries valid) followed by the block's own `blk_k/blk_v[B, Q, Hkv, D]`,
    with no mask inside the block. Query head h reads key/value head `h // (H / Hkv)`. Returns
    `[B, Q, H, D]`."""
    b, nq, h, d = q.shape
    c, hkv = ctx_k.shape[1], ctx_k.shape[2]
    group = h // hkv
    f32 = torch.promote_types(q.dtype, torch.float32)  # float32 at least (float64 stays)
    # Request b's block keys follow its own context, at positions ctx_lens[b] …: where a request's keys
    # sit depends on that request alone, and the batch's longest context only adds masked chunks.
    length = -(-(c + nq) // KV_CHUNK) * KV_CHUNK
    rows = torch.arange(b, device=q.device)[:, None].expand(b, nq)
    slots = ctx_lens.long()[:, None] + torch.arange(nq, device=q.device)[None, :]  # [B, Q]

    def keys_of(ctx: torch.Tensor, blk: torch.Tensor) -> torch.Tensor:  # [B, length, Hkv, D]
        both = ctx.new_zeros(b, length, hkv, d)
        both[:, :c] = ctx
        both[rows, slots] = blk
        return both

    # Pairs (block slot, query head of the KV group), row-major: [Hkv, B, Q * group, D].
    qg = (q.to(f32) * scale).view(b, nq, hkv, group, d).permute(2, 0, 1, 3, 4).reshape(hkv, b, nq * group, d)
    visible = torch.arange(length, device=q.device)[None, :] < (ctx_lens.long() + nq)[:, None]  # B, length
    mask = ops.PairMask((~visible)[:, None, :].expand(b, nq * group, length), f32)
    out = ops.chunked_attention(qg, keys_of(ctx_k, blk_k), keys_of(ctx_v, blk_v), mask)
    out = out.reshape(hkv, b, nq, group, d).permute(1, 2, 0, 3, 4)
    return out.reshape(b, nq, h, d).to(q.dtype)
