"""DSV4 reference model: incremental decoding against the whole-sequence reference, multi-row verify steps
against one-row decoding, and exact rollback of compressed state written by rejected drafts."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.families.dsv4.model import DSV4Model, DSV4State, StepResult

# csa_ratio 4 and a C128-kind ratio of 8: blocks close every few positions, the window (6) wraps often,
# and index_topk 3 leaves the indexer a real choice after 12 positions.
SMALL = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(0, 4, 8), csa_ratio=4, hca_ratio=8, n_heads=2,
                     head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=2, index_head_dim=8,
                     index_topk=3, inter_dim=48)
# the published ratios 4 and 128, at small widths
PUBLISHED_RATIOS = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(0, 4, 128), n_heads=2, head_dim=16,
                                rope_dim=4, q_lora_rank=16, window=16, index_n_heads=2, index_head_dim=8,
                                index_topk=4, inter_dim=48)


@functools.cache
def model(cfg: Dsv4Geometry) -> DSV4Model:
    return DSV4Model(cfg, seed=0)


def random_tokens(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(m: DSV4Model, state: DSV4State, tokens: list[int]) -> tuple[torch.Tensor, list[DSV4State]]:
    """Target-only decoding, one row per step: logits [n, V] and the state after each of 0..n tokens."""
    logits, states = [], [state]
    for token in tokens:
        result = m.step(states[-1], [token])
        logits.append(result.logits[0])
        states.append(result.state)
    return torch.stack(logits) if logits else torch.zeros(0, m.cfg.vocab_size), states


def greedy(m: DSV4Model, prompt: list[int], n_new: int) -> tuple[list[int], list[DSV4State]]:
    """Prompt (prefilled) plus n_new greedy tokens; states[k] is the target-only state after k positions
    (those of the prompt are filled in only at k = len(prompt))."""
    result = m.prefill(prompt)
    tokens = list(prompt) + [int(result.logits[-1].argmax())]
    states: list[DSV4State | None] = [None] * len(prompt) + [result.state]
    for _ in range(n_new - 1):
        result = m.step(states[-1], [tokens[-1]])  # type: ignore[arg-type]
        tokens.append(int(result.logits[0].argmax()))
        states.append(result.state)
    return tokens, states  # type: ignore[return-value]


def assert_same_greedy(reference: torch.Tensor, incremental: torch.Tensor) -> None:
    """Greedy choices agree wherever the reference's best two logits are not a float-rounding tie."""
    top2 = reference.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert decisive.float().mean() > 0.9
    assert torch.equal(reference.argmax(-1)[decisive], incremental.argmax(-1)[decisive])


def n_entries(state: DSV4State, layer: int) -> int:
    attn = state.layers[layer].attn
    return 0 if attn is None else attn.entries.shape[0]


# ---------------------------------------------------------------------------------------------------------
# (1) incremental decoding equals the whole-sequence reference


def test_greedy_decoding_one_token_at_a_time_matches_forward_full_small_ratios():
    m = model(SMALL)
    prompt = random_tokens(8, seed=1)
    tokens, _ = greedy(m, prompt, 88)
    incremental, states = decode(m, m.init_state(), tokens)
    reference = m.forward_full(tokens)
    torch.testing.assert_close(incremental, reference, atol=1e-4, rtol=1e-4)
    # the incremental argmax is the greedy continuation itself, so this says the reference picks it too
    assert_same_greedy(reference, incremental)
    final = states[-1]
    assert n_entries(final, 1) == len(tokens) // 4 and n_entries(final, 2) == len(tokens) // 8


def test_decoding_matches_forward_full_with_published_ratios_4_and_128():
    m = model(PUBLISHED_RATIOS)
    tokens = random_tokens(300, seed=2)  # teacher-forced: varied content through 2 C128 and 75 C4 blocks
    prefill = m.prefill(tokens[:40])  # prefill, then one row a step
    logits, states = decode(m, prefill.state, tokens[40:])
    incremental = torch.cat([prefill.logits, logits])
    reference = m.forward_full(tokens)
    torch.testing.assert_close(incremental, reference, atol=1e-4, rtol=1e-4)
    assert_same_greedy(reference, incremental)
    assert n_entries(states[-1], 2) == 2 and n_entries(states[-1], 1) == 75
    assert states[-1].layers[0].attn is None and states[-1].layers[1].index is not None


def test_prefill_state_is_bitwise_the_one_token_at_a_time_state():
    m = model(SMALL)
    tokens = random_tokens(37, seed=3)
    prefill = m.prefill(tokens)
    logits, states = decode(m, m.init_state(), tokens)
    assert torch.equal(prefill.logits, logits)
    assert prefill.state.bitwise_equal(states[-1])


# ---------------------------------------------------------------------------------------------------------
# (2) a multi-row verify step equals the same rows decoded one by one


@settings(deadline=None, max_examples=25)
@given(start=st.integers(0, 40), n_rows=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_verify_step_equals_rows_decoded_one_by_one(start: int, n_rows: int, seed: int):
    m = model(SMALL)
    tokens = random_tokens(start + n_rows, seed=seed)
    state = m.prefill(tokens[:start]).state if start else m.init_state()
    result = m.step(state, tokens[start:])
    logits, states = decode(m, state, tokens[start:])
    assert torch.equal(result.logits, logits)  # rows after an in-step boundary read the entry it wrote
    assert result.state.bitwise_equal(states[-1])


# ---------------------------------------------------------------------------------------------------------
# (3) scripted drafts: rollback is exact


def boundaries(start: int, n_rows: int, ratio: int) -> int:
    return sum((start + i + 1) % ratio == 0 for i in range(n_rows))


def check_every_commit(m: DSV4Model, state: DSV4State, result: StepResult, tokens: list[int]) -> None:
    """commit(k) is bitwise target-only decoding of the step's first k tokens, for every k."""
    _, states = decode(m, state, tokens)
    for k in range(len(tokens) + 1):
        assert m.commit(state, result, k).bitwise_equal(states[k]), k


def test_scripted_drafts_roll_back_exactly_across_block_boundaries():
    m = model(SMALL)
    prompt = random_tokens(6, seed=4)
    target, ref_states = greedy(m, prompt, 40)  # the target's own greedy continuation
    crossed: dict[int, set[int]] = {4: set(), 8: set()}
    dropped_entries = 0
    for start in range(8, 24):
        for gamma in (1, 4, 8):
            for accept in range(gamma + 1):  # drafts accepted; the draft after them is wrong
                drafts = target[start + 1 : start + 1 + gamma]
                if accept < gamma:
                    drafts[accept] = (drafts[accept] + 1) % SMALL.vocab_size
                step_tokens = [target[start]] + drafts
                result = m.step(ref_states[start], step_tokens)
                for ratio in crossed:
                    crossed[ratio].add(boundaries(start, gamma + 1, ratio))
                # greedy verification accepts exactly the scripted prefix
                choices = result.logits.argmax(-1).tolist()
                accepted = 0
                while accepted < gamma and drafts[accepted] == choices[accepted]:
                    accepted += 1
                assert accepted == accept
                committed = m.commit(ref_states[start], result, accepted + 1)
                assert committed.bitwise_equal(ref_states[start + accepted + 1])
                dropped_entries += sum(n_entries(result.state, i) - n_entries(committed, i) for i in (1, 2))
                # continued decoding from the committed state is target-only decoding
                bonus = choices[accepted]
                assert bonus == target[start + accepted + 1]
                continued = m.step(committed, [bonus, target[start + accepted + 2]])
                reference = m.step(ref_states[start + accepted + 1], [bonus, target[start + accepted + 2]])
                assert torch.equal(continued.logits, reference.logits)
                assert continued.state.bitwise_equal(reference.state)
                if accept == 0:
                    check_every_commit(m, ref_states[start], result, step_tokens)
    assert crossed[4] >= {0, 1, 2} and crossed[8] >= {0, 1, 2}
    assert dropped_entries > 0  # rejected rows did close blocks, and commit dropped their entries


def test_rollback_across_a_128_boundary_with_published_ratios():
    m = model(PUBLISHED_RATIOS)
    tokens = random_tokens(140, seed=5)
    state = m.prefill(tokens[:124]).state
    for _ in range(5):  # steps at 124 .. 128 around the first C128 boundary (position 127)
        start = state.length
        result = m.step(state, tokens[start : start + 6])
        check_every_commit(m, state, result, tokens[start : start + 6])
        state = m.commit(state, result, 1)
    assert n_entries(state, 2) == 1


@settings(deadline=None, max_examples=15)
@given(prompt_len=st.integers(1, 12), gamma=st.integers(1, 8),
       errors=st.sets(st.integers(0, 47), max_size=16))
def test_speculative_loop_equals_target_only(prompt_len: int, gamma: int, errors: set[int]):
    m = model(SMALL)
    n_new = 36
    prompt = random_tokens(prompt_len, seed=6)
    target, ref_states = greedy(m, prompt, n_new + gamma + 2)

    def draft(position: int) -> int:  # the target's own next token, wrong at the scripted positions
        wrong = position - prompt_len in errors
        return (target[position] + 1) % SMALL.vocab_size if wrong else target[position]

    prefill = m.prefill(prompt)
    state, out = prefill.state, list(prompt) + [int(prefill.logits[-1].argmax())]
    while len(out) < prompt_len + n_new:
        start = state.length  # out[start] is the last emitted token, not yet in the state
        drafts = [draft(start + 1 + i) for i in range(gamma)]
        result = m.step(state, [out[start]] + drafts)
        choices = result.logits.argmax(-1).tolist()
        accepted = 0
        while accepted < gamma and drafts[accepted] == choices[accepted]:
            accepted += 1
        state = m.commit(state, result, accepted + 1)
        out += drafts[:accepted] + [choices[accepted]]
        assert state.bitwise_equal(ref_states[state.length])
    assert out == target[: len(out)]
    tail = target[len(out) - 1 : len(out) + 2]
    assert torch.equal(decode(m, state, tail)[0], decode(m, ref_states[state.length], tail)[0])


# ---------------------------------------------------------------------------------------------------------
# (4) the config refuses what it cannot run, naming the field


@pytest.mark.parametrize(("field", "overrides"), [
    ("compress_ratios", {"compress_ratios": (0, 5)}),
    ("compress_ratios", {"compress_ratios": ()}),
    ("compress_ratios", {"compress_ratios": (0, True)}),
    ("window", {"window": 0}),
    ("index_topk", {"index_topk": 0}),
    ("index_n_heads", {"index_n_heads": -1}),
    ("head_dim", {"head_dim": 2.5}),
    ("n_heads", {"n_heads": False}),
    ("rope_dim", {"rope_dim": 3}),
    ("rope_dim", {"rope_dim": 64}),
    ("rope_dim", {"index_head_dim": 4, "rope_dim": 8}),
    ("hca_ratio", {"hca_ratio": 4}),
    ("csa_ratio", {"csa_ratio": 0}),
    ("norm_eps", {"norm_eps": 0.0}),
    ("compress_rope_theta", {"compress_rope_theta": -1.0}),
])
def test_config_refuses_invalid_values_naming_the_field(field: str, overrides: dict):
    with pytest.raises(ValueError, match=rf"\(Dsv4Geometry\.{field}\)"):
        Dsv4Geometry(**overrides)


def test_config_defaults_and_list_ratios():
    assert Dsv4Geometry().n_layers == 4
    assert Dsv4Geometry(compress_ratios=[0, 4]).compress_ratios == (0, 4)  # type: ignore[arg-type]


def test_commit_and_step_refuse_bad_arguments():
    m = model(SMALL)
    state = m.prefill(random_tokens(5, seed=7)).state
    result = m.step(state, [1, 2, 3])
    with pytest.raises(ValueError, match="accepted"):
        m.commit(state, result, 4)
    with pytest.raises(ValueError, match="position"):
        m.commit(result.state, result, 1)
    with pytest.raises(ValueError, match="at least one"):
        m.step(state, [])
