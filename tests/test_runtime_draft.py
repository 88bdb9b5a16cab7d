"""The draft's serving path (context K/V cache + one block forward + sequential head) must match
the training path it was trained with, or a trained draft would decode differently."""

import torch

from dspark.runtime.models.dspark_draft import DraftConfig, DSparkDraft


def _draft(markov: int, draft_stats: bool = False) -> DSparkDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, target_hidden_size=24, gamma=4,
                      markov_embedding_size=markov, max_position_embeddings=128,
                      confidence_draft_stats=draft_stats)
    return DSparkDraft(cfg).eval()


def _check(markov: int, draft_stats: bool = False) -> None:
    draft = _draft(markov, draft_stats)
    gamma = draft.cfg.gamma
    seq_len, anchor = 20, 11
    tokens = torch.randint(0, 40, (1, seq_len))
    hidden = torch.randn(1, seq_len, 24)

    ctx = draft.context_kv(hidden[0, :anchor], torch.arange(anchor))
    ctx = [(k[None], v[None]) for k, v in ctx]
    out = draft.propose(tokens[0, anchor:anchor + 1], torch.tensor([anchor]), ctx, torch.tensor([anchor]))
    drafts, conf = out.drafts, out.conf_logits
    # Teacher-force the training path with the drafted tokens: it must reproduce them.
    forced = tokens.clone()
    forced[0, anchor + 1:anchor + 1 + gamma] = drafts[0]
    with torch.no_grad():
        logits, conf_train = draft.forward_train(hidden, forced, torch.tensor([[anchor]]))
    assert logits.argmax(-1)[0, 0].tolist() == drafts[0].tolist()
    torch.testing.assert_close(conf_train[0, 0], conf[0], rtol=1e-4, atol=1e-5)


def test_serving_path_matches_training_path() -> None:
    _check(markov=16)


def test_serving_path_without_markov_embedding() -> None:
    _check(markov=0)


def test_serving_path_with_draft_stats_in_the_confidence_head() -> None:
    _check(markov=16, draft_stats=True)


def test_draft_stats_inputs_are_the_draft_distributions_statistics() -> None:
    draft = _draft(16, draft_stats=True)
    assert draft.confidence_head.in_features == 32 + 16 + 3
    g, state = torch.randn(3, 32), torch.zeros(3, 32)
    step = draft.head(g, torch.tensor([1, 2, 3]), state)
    p = torch.softmax(step.logits, -1)
    top = p.topk(2, -1).values
    stats = step.conf_input[:, -3:]
    torch.testing.assert_close(stats[:, 0], top[:, 0].log())
    torch.testing.assert_close(stats[:, 1], (top[:, 0] / top[:, 1]).log())
    torch.testing.assert_close(stats[:, 2], -(p * p.log()).sum(-1))
    torch.testing.assert_close(step.conf_logit, draft.confidence_head(step.conf_input).squeeze(-1))


def test_context_beyond_anchor_is_invisible_in_training() -> None:
    draft = _draft(16)
    tokens = torch.randint(0, 40, (1, 20))
    hidden = torch.randn(1, 20, 24)
    anchors = torch.tensor([[6]])
    with torch.no_grad():
        a, _ = draft.forward_train(hidden, tokens, anchors)
        hidden2 = hidden.clone()
        hidden2[0, 6:] = torch.randn(14, 24)  # the future must not leak into the block
        tokens2 = tokens.clone()
        tokens2[0, 11:] = 0
        b, _ = draft.forward_train(hidden2, tokens2, anchors)
    torch.testing.assert_close(a, b)
