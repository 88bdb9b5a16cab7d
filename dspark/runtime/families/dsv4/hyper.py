"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams per token.

Before a sub-layer (attention, the FFN) a learned map of the normalised streams gives three mixes: `pre`
collapses the streams into the sub-layer's input, `post` spreads its output over the streams, and `comb`, a
doubly-stochastic matrix (Sinkhorn-Knopp), mixes the old streams into the new ones:

    new_k = post_k * out + sum_j comb[j, k] * streams_j

The head collapses the streams once more with its own `pre` before the final norm. Read from transformers'
`DeepseekV4HyperConnection` / `DeepseekV4HyperHead` and DeepSeek's V4 inference code (`hc_pre`, `hc_post`,
`hc_head`); the parameters are the release's `hc_{attn,ffn}_{fn,base,scale}` and `hc_head_{fn,base,scale}`.
Every sum over the streams is written out in stream order, so a row's result depends on that row alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dspark.runtime.families.dsv4.ops import ordered_sum, rms_norm, row_linear, row_softmax, tiled


class HyperConnection(nn.Module):
    """The mixes of one sub-layer: fn [(2 + n) * n, n * dim], base [(2 + n) * n], scale [3] (pre, post,
    comb)."""

    def __init__(self, hc_mult: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def mixes(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [L, n, dim] -> pre [L, n], post [L, n], comb [L, n, n] (comb[:, j, k]: stream j into k)."""
        n = self.n
        mix = row_linear(rms_norm(streams.flatten(1), None, self.norm_eps), self.fn)  # [L, (2 + n) * n]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = tiled(torch.sigmoid, pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * tiled(torch.sigmoid, post_w * self.scale[1] + post_b)
        comb = row_softmax((comb_w * self.scale[2] + comb_b).unflatten(-1, (n, n))) + self.hc_eps
        comb = comb / (_column_sums(comb) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (_column_sums(comb) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(streams: Tensor, pre: Tensor) -> Tensor:
        """streams [L, n, dim], pre [L, n] -> the sub-layer's input [L, dim]."""
        return ordered_sum([pre[:, j, None] * streams[:, j] for j in range(streams.shape[1])])

    @staticmethod
    def expand(streams: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """The streams after a sub-layer whose output is out [L, dim] -> [L, n, dim]."""
        n = streams.shape[1]
        mixed = [ordered_sum([comb[:, j, k, None] * streams[:, j] for j in range(n)]) for k in range(n)]
        return torch.stack([post[:, k, None] * out + mixed[k] for k in range(n)], dim=1)


def _column_sums(m: Tensor) -> Tensor:
    """m [L, n, n] -> [L, 1, n]: each column's sum, rows added in order."""
    return ordered_sum([m[:, j : j + 1] for j in range(m.shape[1])])


class HyperHead(nn.Module):
    """The head's collapse of the streams: fn [n, n * dim], base [n], scale [1]."""

    def __init__(self, hc_mult: int, dim: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * dim))
        self.base = nn.Parameter(torch.empty(hc_mult))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: Tensor) -> Tensor:
        """streams [L, n, dim] -> [L, dim]."""
        mix = row_linear(rms_norm(streams.flatten(1), None, self.norm_eps), self.fn)  # [L, n]
        pre = tiled(torch.sigmoid, mix * self.scale + self.base) + self.hc_eps
        return HyperConnection.collapse(streams, pre)
