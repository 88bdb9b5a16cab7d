"""The published DSpark training loss (DeepSpec's `compute_dspark_loss`, single process).

For every supervised draft slot (block a, slot k predicting the token at `anchor + k + 1`), with the
draft's distribution `q = softmax(draft logits)` and the target's `p = softmax(target logits)` at
the same position:

    ce         = cross-entropy of q against the sequence's token there
    l1         = sum_v |q_v - p_v|                  (the L1 distance: twice the total variation)
    accept     = clamp(1 - l1 / 2, 0, 1)            (= 1 - TV, the chance a draft sampled from q is
                                                     accepted by rejection sampling against p)
    confidence = BCE(sigmoid(confidence logit), accept)   with accept treated as a constant

each averaged over the slots with weights `exp(-k / decay)` (decay 4: later slots, which are only
reached when every earlier one was accepted, count less), and combined as

    loss = 0.1 * ce + 0.9 * l1 + 1.0 * confidence

(DeepSpec's `ce_loss_alpha`, `l1_loss_alpha`, `confidence_head_alpha`, `loss_decay_gamma` in its
released training configs). The distance term is DeepSpec's "l1": the sum of absolute differences,
not halved, so its weight 0.9 is on 2·TV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# DeepSpec adds this to every weighted average's denominator, so a batch with no supervised slot
# gives a zero loss instead of NaN.
DENOMINATOR_EPS = 1e-6


@dataclass(frozen=True)
class BlockLabels:
    """What each draft slot of each block is trained against."""

    target_ids: torch.Tensor  # [b, A, gamma] the sequence's token at anchor + k + 1 (clamped inside)
    valid: torch.Tensor  # [b, A, gamma] bool: that token exists, is supervised and the block is kept
    target_positions: torch.Tensor  # [b, A, gamma] where the target predicted it: anchor + k


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` block anchors per sequence of `loss_mask[b, S]`, sorted, and which are real.

    An anchor is a supervised position whose next token is supervised too (its block's first slot
    has a label). Candidates are drawn uniformly without replacement; a sequence with fewer fills
    the rest with anchor 0 and `keep` False. Returns `anchors[b, A]` (long) and `keep[b, A]` (bool).
    """
    b, seq_len = loss_mask.shape
    dev = loss_mask.device
    cand = (loss_mask[:, :-1] > 0.5) & (loss_mask[:, 1:] > 0.5)  # [b, S-1]
    if cand.shape[1] == 0:
        return (torch.zeros(b, num_anchors, dtype=torch.long, device=dev),
                torch.zeros(b, num_anchors, dtype=torch.bool, device=dev))
    noise = torch.rand(cand.shape, generator=generator, device=dev)
    # Candidates sort first, in random order; the rest (key 2.0) after them.
    order = torch.where(cand, noise, torch.full_like(noise, 2.0)).argsort(dim=1)
    take = min(num_anchors, cand.shape[1])
    picked = order[:, :take]
    count = cand.sum(dim=1, keepdim=True).clamp(max=num_anchors)
    keep = torch.arange(num_anchors, device=dev)[None, :] < count
    anchors = torch.zeros(b, num_anchors, dtype=torch.long, device=dev)
    # Real anchors ascending, padding (anchor 0) after them.
    real = torch.where(keep[:, :take], picked, torch.full_like(picked, seq_len)).sort(dim=1).values
    anchors[:, :take] = torch.where(keep[:, :take], real, torch.zeros_like(real))
    return anchors, keep


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, gamma: int,
                 loss_mask: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> BlockLabels:
    """Labels of the blocks anchored at `anchors[b, A]` in `tokens[b, S]`: slot k predicts the
    token at `anchor + k + 1`, which the target predicted at `anchor + k`; a slot is valid while
    that position is inside the sequence and supervised (`loss_mask`), in a kept block (`keep`)."""
    seq_len = tokens.shape[1]
    label = anchors[..., None] + torch.arange(1, gamma + 1, device=tokens.device)  # [b, A, gamma]
    inside = label < seq_len
    safe = label.clamp(max=seq_len - 1)
    ids = tokens.gather(1, safe.flatten(1)).view_as(label)
    valid = inside
    if loss_mask is not None:
        valid = valid & (loss_mask.gather(1, safe.flatten(1)).view_as(label) > 0.5)
    if keep is not None:
        valid = valid & keep[..., None]
    return BlockLabels(target_ids=ids, valid=valid, target_positions=safe - 1)


@dataclass(frozen=True)
class DSparkLossWeights:
    ce: float = 0.1
    l1: float = 0.9  # on sum |q - p| (= 2 TV)
    confidence: float = 1.0
    decay: float | None = 4.0  # slot k weighs exp(-k / decay); None or <= 0: every slot weighs 1


@dataclass(frozen=True)
class DSparkLoss:
    total: torch.Tensor  # scalar: what training minimises
    ce: torch.Tensor  # scalar, weighted mean
    l1: torch.Tensor  # scalar, weighted mean of sum |q - p|
    confidence: torch.Tensor  # scalar, weighted mean BCE (0 without confidence logits)
    accept: torch.Tensor  # [..., gamma] 1 - TV per slot, detached (the confidence head's target)
    weights: torch.Tensor  # [..., gamma] each slot's weight (0 where not supervised)


def slot_weights(valid: torch.Tensor, decay: float | None) -> torch.Tensor:
    """`[..., gamma]` float32 weights: `exp(-k / decay)` on the supervised prefix of each block.

    A slot counts only while every earlier slot of its block does (DeepSpec's eval mask is the
    running product of the per-slot validity): a draft past an unsupervised slot is never verified.
    """
    w = valid.to(torch.int32).cumprod(dim=-1).to(torch.float32)
    if decay is not None and decay > 0:
        k = torch.arange(valid.shape[-1], device=valid.device, dtype=torch.float32)
        w = w * torch.exp(-k / float(decay))
    return w


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, target_ids: torch.Tensor,
                valid: torch.Tensor, conf_logits: torch.Tensor | None = None,
                weights: DSparkLossWeights = DSparkLossWeights()) -> DSparkLoss:
    """The loss of draft slots `draft_logits[..., gamma, V]` against the target's logits at the same
    positions `target_logits[..., gamma, V]`, the sequence's tokens `target_ids[..., gamma]`, the
    slots to supervise `valid[..., gamma]` (bool) and the confidence logits `conf_logits[..., gamma]`.
    """
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits "
                         f"{tuple(target_logits.shape)} must have one shape")
    if conf_logits is None and weights.confidence > 0:
        raise ValueError("the confidence term has weight > 0 but no confidence logits were given")
    w = slot_weights(valid, weights.decay)
    den = w.sum() + DENOMINATOR_EPS

    ce_tok = F.cross_entropy(draft_logits.float().flatten(0, -2), target_ids.flatten(),
                             reduction="none").view_as(w)
    ce = (ce_tok * w).sum() / den

    q = torch.softmax(draft_logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    l1_tok = (q - p).abs().sum(dim=-1)
    l1 = (l1_tok * w).sum() / den
    accept = (1.0 - 0.5 * l1_tok).clamp(0.0, 1.0).detach()

    confidence = ce.new_zeros(())
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        confidence = (bce * w).sum() / den
    total = weights.ce * ce + weights.l1 * l1 + weights.confidence * confidence
    return DSparkLoss(total=total, ce=ce, l1=l1, confidence=confidence, accept=accept, weights=w)
