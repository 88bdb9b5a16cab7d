"""The draft block's attention in a serving step, computed so a row's result does not depend on the
batch: not on how many requests share the step, nor on how far the longest of them pads the context.

Each request's block queries attend to its cached context (the first `ctx_lens[b]` of `C` entries)
and to its own block. A fused attention kernel reduces over all `C + Q` keys at once, and its
blocking, hence its rounding, follows `C`, which the longest request in the batch sets. Here:

* the context is read in fixed 64-key chunks from key 0, every product of one shape whatever `C`
  (chunks wholly past a request's context are fully masked and add exact zeros);
* the softmax shift is the maximum over all scores, which is exact in any order;
* the normaliser is an extra all-ones value column, so it accumulates inside the same products as
  the numerator, chunk after chunk in key order, the block's own keys last.

Scores, probabilities and sums are float32 whatever the model's dtype, as in a fused kernel: chunk
sums added in bfloat16 would lose the context's tail on long prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.runtime.models.ops import lanewise

CHUNK = 64
def block_step_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_lens: torch.Tensor,
                         blk_k: torch.Tensor, blk_v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of block queries `q[B, Q, H, D]` over the context `ctx_k/ctx_v[B, C, Hkv, D]` (request
    b's first `ctx_lens[b]` entries valid) followed by the block's own `blk_k/blk_v[B, Q, Hkv, D]`,
    with no mask inside the block. Query head h reads key/value head `h // (H / Hkv)`. Returns
    `[B, Q, H, D]`."""
    b, nq, h, d = q.shape
    c, hkv = ctx_k.shape[1], ctx_k.shape[2]
    group = h // hkv
    # [B, Hkv, group * Q, D]: the query heads that share a key/value head, as rows of one product.
    f32 = torch.promote_types(q.dtype, torch.float32)  # float32 at least (float64 stays)
    qg = q.permute(0, 2, 1, 3).reshape(b, hkv, group * nq, d).to(f32) * scale
    pad = -c % CHUNK
    ck = F.pad(ctx_k.to(f32), (0, 0, 0, 0, 0, pad)).permute(0, 2, 1, 3)  # [B, Hkv, C', D]
    ones = torch.ones(*ctx_v.shape[:-1], 1, dtype=f32, device=ctx_v.device)
    cv = F.pad(torch.cat((ctx_v.to(f32), ones), dim=-1), (0, 0, 0, 0, 0, pad))
    cv = cv.permute(0, 2, 1, 3)  # [B, Hkv, C', D+1]
    visible = torch.arange(c + pad, device=q.device)[None, :] < ctx_lens[:, None]  # [B, C']

    scores = [qg @ ck[:, :, i:i + CHUNK].transpose(-1, -2) for i in range(0, c + pad, CHUNK)]
    scores = [s.masked_fill(~visible[:, None, None, i * CHUNK:(i + 1) * CHUNK], float("-inf"))
              for i, s in enumerate(scores)]
    bk = blk_k.to(f32).permute(0, 2, 1, 3)
    bv = torch.cat((blk_v.to(f32), torch.ones(*blk_v.shape[:-1], 1, dtype=f32, device=blk_v.device)),
                   dim=-1).permute(0, 2, 1, 3)  # [B, Hkv, Q, D+1]
    blk_scores = qg @ bk.transpose(-1, -2)  # [B, Hkv, group*Q, Q]; the block is always visible
    shift = blk_scores.amax(-1, keepdim=True)
    for s in scores:
        shift = torch.maximum(shift, s.amax(-1, keepdim=True))

    acc = torch.zeros(b, hkv, group * nq, d + 1, dtype=f32, device=q.device)
    for i, s in enumerate(scores):
        acc = acc + lanewise(torch.exp, s - shift) @ cv[:, :, i * CHUNK:(i + 1) * CHUNK]
    acc = acc + lanewise(torch.exp, blk_scores - shift) @ bv
    out = (acc[..., :d] / acc[..., d:]).to(q.dtype)
    return out.reshape(b, hkv, group, nq, d).reshape(b, h, nq, d).transpose(1, 2)
