"""The published DSpark loss (`dspark/train/dspark_loss.py`) against a slot-by-slot reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dspark.runtime.models.dspark_block_loader import load_block_draft
from dspark.train.dspark_loss import DSparkLossWeights, block_labels, dspark_loss, sample_anchors
from tests.test_dspark_block_draft import WIDTH, released_config, released_tensors, write_checkpoint


def reference_loss(draft: torch.Tensor, target: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                   conf: torch.Tensor) -> tuple[float, float, float, float]:
    """0.1 CE + 0.9 L1 + 1.0 BCE(conf, 1 - L1/2), each a mean weighted by exp(-k/4) over the slots
    of each block up to its first unsupervised one; one slot at a time, in float64."""
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    den = 0.0
    blocks, gamma = draft.shape[0], draft.shape[1]
    for a in range(blocks):
        for k in range(gamma):
            if not all(bool(valid[a, j]) for j in range(k + 1)):
                break
            w = math.exp(-k / 4.0)
            q = [math.exp(x) for x in draft[a, k].double().tolist()]
            p = [math.exp(x) for x in target[a, k].double().tolist()]
            q = [x / sum(q) for x in q]
            p = [x / sum(p) for x in p]
            l1 = sum(abs(x - y) for x, y in zip(q, p, strict=True))
            accept = min(1.0, max(0.0, 1.0 - l1 / 2))
            s = 1.0 / (1.0 + math.exp(-float(conf[a, k])))
            num["ce"] += w * -math.log(q[int(ids[a, k])])
            num["l1"] += w * l1
            num["conf"] += w * -(accept * math.log(s) + (1 - accept) * math.log(1 - s))
            den += w
    ce, l1, bce = (num[n] / (den + 1e-6) for n in ("ce", "l1", "conf"))
    return 0.1 * ce + 0.9 * l1 + bce, ce, l1, bce


def _batch(seed: int, blocks: int = 5, gamma: int = 4, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(blocks, gamma, vocab, generator=g) * 2
    # A target near the draft on some slots, far on others, so accept spans (0, 1).
    spread = torch.rand(blocks, gamma, 1, generator=g) * 3
    target = draft + torch.randn(blocks, gamma, vocab, generator=g) * spread
    ids = torch.randint(0, vocab, (blocks, gamma), generator=g)
    valid = torch.rand(blocks, gamma, generator=g) > 0.2
    conf = torch.randn(blocks, gamma, generator=g)
    return draft, target, ids, valid, conf


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_the_reference(seed: int) -> None:
    draft, target, ids, valid, conf = _batch(seed)
    out = dspark_loss(draft, target, ids, valid, conf)
    total, ce, l1, bce = reference_loss(draft, target, ids, valid, conf)
    for got, want in ((out.total, total), (out.ce, ce), (out.l1, l1), (out.confidence, bce)):
        assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_weights_decay_by_position_and_stop_at_the_first_unsupervised_slot() -> None:
    valid = torch.tensor([[True, True, False, True], [True, True, True, True]])
    draft, target, ids, _, conf = _batch(0, blocks=2)
    w = dspark_loss(draft, target, ids, valid, conf).weights
    e = [math.exp(-k / 4) for k in range(4)]
    torch.testing.assert_close(w, torch.tensor([[e[0], e[1], 0.0, 0.0], e]))
    # A slot outside the supervised prefix does not move the loss.
    moved = draft.clone()
    moved[0, 3] += 5.0
    assert float(dspark_loss(moved, target, ids, valid, conf).total) == float(
        dspark_loss(draft, target, ids, valid, conf).total)


def test_accept_is_one_minus_total_variation_and_the_confidence_target_is_a_constant() -> None:
    draft, target, ids, valid, conf = _batch(3)
    draft.requires_grad_(True)
    conf.requires_grad_(True)
    out = dspark_loss(draft, target, ids, valid, conf,
                      DSparkLossWeights(ce=0.0, l1=0.0, confidence=1.0))
    tv = 0.5 * (torch.softmax(draft, -1) - torch.softmax(target, -1)).abs().sum(-1)
    torch.testing.assert_close(out.accept, (1 - tv).detach())
    out.total.backward()
    # The confidence loss trains the confidence head only: no gradient reaches the draft logits.
    assert draft.grad is None or torch.count_nonzero(draft.grad) == 0
    assert torch.count_nonzero(conf.grad) > 0


def test_identical_distributions_and_empty_batches() -> None:
    draft, _, ids, valid, conf = _batch(4)
    out = dspark_loss(draft, draft, ids, valid, conf)
    assert float(out.l1) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(out.accept, torch.ones_like(out.accept))
    none = dspark_loss(draft, draft, ids, torch.zeros_like(valid), conf)
    assert float(none.total) == 0.0
    with pytest.raises(ValueError, match="no confidence logits"):
        dspark_loss(draft, draft, ids, valid, None)


def test_a_training_step_on_the_block_draft_lowers_the_loss(tmp_path: Path) -> None:
    """The loss over `forward_blocks` is differentiable end to end: a few Adam steps toward a fixed
    random target distribution lower it."""
    cfg = released_config("rnn")
    draft = load_block_draft(write_checkpoint(tmp_path / "d", cfg, released_tensors(cfg)))
    draft.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (2, 16), generator=g)
    feats = torch.randn(2, 16, WIDTH, generator=g)
    anchors = torch.tensor([[1, 6, 10], [0, 4, 11]])
    target_logits = torch.randn(2, 3, 4, 64, generator=g) * 3
    ids = tokens.gather(1, (anchors[..., None] + torch.arange(1, 5)).clamp(max=15).flatten(1)).view(2, 3, 4)
    valid = (anchors[..., None] + torch.arange(1, 5)) < 16
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out = draft.forward_blocks(feats, tokens, anchors)
        loss = dspark_loss(out.logits, target_logits, ids, valid, out.conf_logits).total
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_block_labels_are_the_next_tokens_and_the_target_predicted_them_one_position_earlier() -> None:
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1]])
    keep = torch.tensor([[True, True, False]])
    labels = block_labels(tokens, torch.tensor([[1, 4, 0]]), 3, loss_mask, keep=keep)
    assert labels.target_ids.tolist() == [[[12, 13, 14], [15, 16, 16], [11, 12, 13]]]
    # Anchor 1: tokens 12, 13 supervised, 14 not. Anchor 4: 15, 16, then past the end. Block 3 dropped.
    assert labels.valid.tolist() == [[[True, True, False], [True, True, False], [False, False, False]]]
    assert labels.target_positions.tolist() == [[[1, 2, 3], [4, 5, 5], [0, 1, 2]]]


def test_anchors_are_distinct_supervised_positions_with_a_supervised_successor() -> None:
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(3, 40, dtype=torch.long)
    loss_mask[0, 5:30] = 1  # 24 candidates: 5..28
    loss_mask[1, [3, 4, 10, 11, 12]] = 1  # candidates 3, 10, 11
    seen = set()
    for _ in range(20):
        anchors, keep = sample_anchors(loss_mask, 6, g)
        assert keep.tolist() == [[True] * 6, [True] * 3 + [False] * 3, [False] * 6]
        row = anchors[0].tolist()
        assert row == sorted(set(row)) and all(5 <= a <= 28 for a in row)
        seen.update(row)
        assert anchors[1].tolist() == [3, 10, 11, 0, 0, 0] and anchors[2].tolist() == [0] * 6
    assert len(seen) > 15  # drawn at random, not the first six every time
    anchors, keep = sample_anchors(torch.ones(1, 1), 4, g)
    assert anchors.tolist() == [[0] * 4] and not keep.any()
