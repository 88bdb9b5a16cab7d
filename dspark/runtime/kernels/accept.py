"""Greedy acceptance: the accepted prefix stops at the first mismatch, capped by verify_len.

`greedy_accept` is the entry; its torch reference and its Triton kernel return the same
`AcceptResult`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton

AcceptTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


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


def greedy_accept_torch(drafts: torch.Tensor, target_pred: torch.Tensor, verify_lens: torch.Tensor,
                        seq_lens: torch.Tensor | None) -> AcceptTensors:
    """Reference: the accepted prefix is the run of leading matches among the allowed drafts."""
    gamma = drafts.shape[1]
    allowed = torch.arange(gamma, device=drafts.device)[None, :] < (verify_lens.long() - 1)[:, None]
    match = (drafts == target_pred[:, :gamma]) & allowed
    correct_len = match.long().cumprod(dim=1).sum(dim=1)
    commit_len = correct_len + 1
    bonus = target_pred.gather(1, correct_len[:, None]).squeeze(1).long()
    new_seq_lens = None if seq_lens is None else (seq_lens + commit_len).to(seq_lens.dtype)
    return correct_len, commit_len, bonus, new_seq_lens


def greedy_accept_triton(drafts: torch.Tensor, target_pred: torch.Tensor, verify_lens: torch.Tensor,
                         seq_lens: torch.Tensor | None) -> AcceptTensors:
    num_reqs = drafts.shape[0]
    device = drafts.device
    correct_len = torch.empty(num_reqs, dtype=torch.int64, device=device)
    commit_len = torch.empty_like(correct_len)
    bonus = torch.empty_like(correct_len)
    new_seq_lens = None if seq_lens is None else torch.empty_like(seq_lens)
    launch_greedy_accept(drafts, target_pred, verify_lens, seq_lens,
                         correct_len, commit_len, bonus, new_seq_lens)
    return correct_len, commit_len, bonus, new_seq_lens


def launch_greedy_accept(drafts: torch.Tensor, target_pred: torch.Tensor, verify_lens: torch.Tensor,
                         seq_lens: torch.Tensor | None, correct_len: torch.Tensor, commit_len: torch.Tensor,
                         bonus: torch.Tensor, new_seq_lens: torch.Tensor | None) -> None:
    """Fill preallocated outputs (1-D, at least B long; entries past B are untouched)."""
    num_reqs, gamma = drafts.shape
    if num_reqs == 0:
        return
    has_seq = seq_lens is not None
    # Without seq_lens the kernel never touches these pointers; any tensor will do as a placeholder.
    seq_in = seq_lens if has_seq else verify_lens
    seq_out = new_seq_lens if has_seq else correct_len
    _greedy_accept_kernel[(num_reqs,)](
        drafts, drafts.stride(0), drafts.stride(1),
        target_pred, target_pred.stride(0), target_pred.stride(1),
        verify_lens, seq_in, correct_len, commit_len, bonus, seq_out, gamma,
        HAS_SEQ=has_seq, BLOCK_G=next_pow2(gamma),
    )


@jit
def _greedy_accept_kernel(drafts_ptr, d_stride_req, d_stride_pos, pred_ptr, p_stride_req, p_stride_pos,
                          verify_lens_ptr, seq_lens_ptr, correct_len_ptr, commit_len_ptr, bonus_ptr,
                          new_seq_lens_ptr, gamma,
                          HAS_SEQ: tl.constexpr, BLOCK_G: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_G)
    verify_len = tl.load(verify_lens_ptr + req).to(tl.int64)
    in_range = k < gamma
    draft = tl.load(drafts_ptr + req * d_stride_req + k * d_stride_pos, mask=in_range, other=0)
    pred = tl.load(pred_ptr + req * p_stride_req + k * p_stride_pos, mask=in_range, other=0)
    accepted = (draft == pred) & in_range & (k < verify_len - 1)
    # The first rejected position is the accepted length; lanes that accept (and gamma itself,
    # when everything is accepted) do not bound it.
    correct = tl.min(tl.where(accepted, gamma, k), axis=0).to(tl.int64)
    bonus = tl.load(pred_ptr + req * p_stride_req + correct * p_stride_pos)
    tl.store(correct_len_ptr + req, correct)
    tl.store(commit_len_ptr + req, correct + 1)
    tl.store(bonus_ptr + req, bonus.to(tl.int64))
    if HAS_SEQ:
        seq = tl.load(seq_lens_ptr + req)
        tl.store(new_seq_lens_ptr + req, (seq + correct + 1).to(seq.dtype))
