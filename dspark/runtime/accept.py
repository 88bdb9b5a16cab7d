"""Greedy acceptance: the accepted prefix stops at the first mismatch, capped by verify_len."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptResult:
    correct_len: torch.Tensor  # int64 [B]: accepted drafts
    commit_len: torch.Tensor  # int64 [B]: correct_len + 1 (the target's fallback/bonus token)
    bonus: torch.Tensor  # int64 [B]: the target's token after the accepted prefix


def greedy_accept(drafts: torch.Tensor, target_pred: torch.Tensor,
                  verify_lens: torch.Tensor) -> AcceptResult:
    """`drafts[B, gamma]` against the target's argmax `target_pred[B, N]` at the verify rows.

    Row i of a request predicts the token after its i-th input (the root is input 0), so draft
    k (0-based) is accepted when it equals `target_pred[:, k]` and every earlier draft was.
    """
    gamma = drafts.shape[1]
    allowed = torch.arange(gamma, device=drafts.device)[None, :] < (verify_lens.long() - 1)[:, None]
    match = (drafts == target_pred[:, :gamma]) & allowed
    correct_len = match.long().cumprod(dim=1).sum(dim=1)
    bonus = target_pred.gather(1, correct_len[:, None]).squeeze(1)
    return AcceptResult(correct_len, correct_len + 1, bonus)
