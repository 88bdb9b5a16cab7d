"""Greedy acceptance: the accepted prefix stops at the first mismatch, capped by verify_len."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.kernels._dispatch import Impl, use_triton
from dspark.runtime.kernels.accept import greedy_accept_torch, greedy_accept_triton


@dataclass(frozen=True)
class AcceptResult:
    correct_len: torch.Tensor  # int64 [B]: accepted drafts
    commit_len: torch.Tensor  # int64 [B]: correct_len + 1 (the target's fallback/bonus token)
    bonus: torch.Tensor  # int64 [B]: the target's token after the accepted prefix
    new_seq_lens: torch.Tensor | None = None  # [B], seq_lens' dtype: seq_lens + commit_len


def greedy_accept(drafts: torch.Tensor, target_pred: torch.Tensor, verify_lens: torch.Tensor,
                  seq_lens: torch.Tensor | None = None, *, impl: Impl = "auto") -> AcceptResult:
    """`drafts[B, gamma]` against the target's argmax `target_pred[B, N]` at the verify rows.

    Row i of a request predicts the token after its i-th input (the root is input 0), so draft
    k (0-based) is accepted when it equals `target_pred[:, k]` and every earlier draft was, and
    only the first `verify_lens - 1` drafts are eligible (cap-accept: the rest were not planned).
    With `seq_lens`, `new_seq_lens` advances them by `commit_len` on the device, so a step can
    finish without reading the result on the host. CUDA tensors run a single Triton kernel.
    """
    _check_inputs(drafts, target_pred, verify_lens, seq_lens)
    if use_triton(impl, *(t for t in (drafts, target_pred, verify_lens, seq_lens) if t is not None)):
        correct_len, commit_len, bonus, new_seq_lens = greedy_accept_triton(drafts, target_pred, verify_lens,
                                                                            seq_lens)
    else:
        correct_len, commit_len, bonus, new_seq_lens = greedy_accept_torch(drafts, target_pred, verify_lens,
                                                                           seq_lens)
    return AcceptResult(correct_len, commit_len, bonus, new_seq_lens)


def _check_inputs(drafts: torch.Tensor, target_pred: torch.Tensor, verify_lens: torch.Tensor,
                  seq_lens: torch.Tensor | None) -> None:
    if drafts.dim() != 2:
        raise ValueError(f"drafts must be [B, gamma], got shape {tuple(drafts.shape)}")
    num_reqs, gamma = drafts.shape
    if target_pred.shape != (num_reqs, gamma + 1):
        raise ValueError(f"target_pred must be [B, gamma + 1] = [{num_reqs}, {gamma + 1}], "
                         f"got shape {tuple(target_pred.shape)}")
    if verify_lens.shape != (num_reqs,):
        raise ValueError(f"verify_lens must be [B={num_reqs}], got shape {tuple(verify_lens.shape)}")
    if seq_lens is not None and seq_lens.shape != (num_reqs,):
        raise ValueError(f"seq_lens must be [B={num_reqs}], got shape {tuple(seq_lens.shape)}")
