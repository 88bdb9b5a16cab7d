"""Sampling keeps the target's distribution: warping, rejection-sampling verification, end to end.

The end-to-end test compares sampled continuations with the exact distribution of the target
(top-k 8 keeps the outcomes enumerable) by a chi-square goodness-of-fit test at a fixed seed,
and shows the same test rejects a verifier that accepts every draft.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dspark.runtime.engine import speculative as speculative_module
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.kernels.accept import AcceptResult
from dspark.runtime.package import load_package
from dspark.runtime.sampling import (
    BatchSampling,
    RowGenerators,
    SamplingAccept,
    SamplingParams,
    rejection_accept,
    sample,
    warp,
    warp_rows,
)

from .runtime_helpers import compile_variant


def test_warp_applies_temperature_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(warp(logits, SamplingParams(1.0)), torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_k=2)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.25 reaches it; the rest is dropped
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    hot = warp(logits, SamplingParams(2.0))
    assert hot[0] < 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError):
        warp(logits, SamplingParams(0.0))
    with pytest.raises(ValueError):
        SamplingParams(1.0, top_p=0.0)


@pytest.mark.parametrize("verify_len", [3, 2, 1])
def test_rejection_accept_commits_tokens_distributed_as_the_target(verify_len: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = 200_000
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]).expand(rows, -1, -1)
    p = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]).expand(rows, -1, -1)
    drafts = sample(q, gen)
    verdict = rejection_accept(drafts, q, p, torch.full((rows,), verify_len), gen)
    acc = verdict.result
    first = torch.where(acc.correct_len > 0, drafts[:, 0], acc.bonus)
    freq = torch.bincount(first, minlength=3).float() / rows
    assert torch.allclose(freq, p[0, 0], atol=0.005), freq  # the committed token follows p, not q
    assert int(acc.correct_len.max()) <= verify_len - 1
    assert bool((verdict.raw_correct_len >= acc.correct_len).all())


@torch.no_grad()
def _exact_joint(runtime: Runtime, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) under the target's warped distribution (top-k keeps the support small)."""
    target = runtime.target

    def next_probs(seqs: list[list[int]]) -> torch.Tensor:
        hidden = target.forward_dense(torch.tensor(seqs))
        return warp(target.dense_logits(hidden)[:, -1], params)

    out: dict[tuple[int, ...], float] = {}
    p1 = next_probs([prompt])[0]
    for x1 in p1.nonzero().flatten().tolist():
        p2 = next_probs([prompt + [x1]])[0]
        seconds = p2.nonzero().flatten().tolist()
        p3 = next_probs([prompt + [x1, x2] for x2 in seconds])
        for x2, row in zip(seconds, p3, strict=True):
            for x3 in row.nonzero().flatten().tolist():
                out[(x1, x2, x3)] = float(p1[x1] * p2[x2] * row[x3])
    return out


def _chi_square(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom, pooling outcomes expected fewer than 5 times."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for outcome, prob in expected.items():
        if prob * n >= 5:
            stat += (counts.get(outcome, 0) - prob * n) ** 2 / (prob * n)
            df += 1
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
    unexpected = sum(c for o, c in counts.items() if o not in expected)
    pooled_obs += unexpected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return stat, df


def _critical(df: int) -> float:
    """Chi-square quantile at p = 0.999 (Wilson–Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_speculative_sampling_matches_the_exact_target_distribution(tmp_path, monkeypatch) -> None:
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"verify": {"mode": "compact", "allow_no_cost_model": True},
                                        "serving": {"max_running_requests": 32}}, "sampled"))
    params = SamplingParams(temperature=1.0, top_k=8)
    runtime = Runtime(pkg, sampling=params, seed=1)
    prompt = pkg.tokenizer.encode("    def __init__(self, ")
    expected = _exact_joint(runtime, prompt, params)
    n = 1536

    def joint(rt: Runtime, **kwargs: bool) -> Counter:
        outputs, _ = rt.generate([prompt] * n, 3, **kwargs)
        return Counter(tuple(o) for o in outputs)

    speculative = joint(runtime)
    stat, df = _chi_square(speculative, expected, n)
    assert stat < _critical(df), f"speculative sampling: chi-square {stat:.1f} on {df} df"
    target_only = joint(Runtime(pkg, sampling=params, seed=2), target_only=True)
    stat_ref, df_ref = _chi_square(target_only, expected, n)
    assert stat_ref < _critical(df_ref)

    # Power check: a verifier that accepts every draft commits the draft's distribution instead.
    def accept_all(drafts, q_probs, p_probs, verify_lens, generator) -> SamplingAccept:
        honest = rejection_accept(drafts, q_probs, p_probs, verify_lens, generator)
        correct = verify_lens.long() - 1
        bonus = honest.result.bonus
        return SamplingAccept(AcceptResult(correct, correct + 1, bonus), correct, honest.accept_prob)

    monkeypatch.setattr(speculative_module, "rejection_accept", accept_all)
    broken = joint(Runtime(pkg, sampling=params, seed=3))
    stat_bad, df_bad = _chi_square(broken, expected, n)
    assert stat_bad > _critical(df_bad), "the test cannot tell a broken verifier apart"


def test_warp_rows_applies_each_requests_parameters_and_one_hot_for_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    params = (SamplingParams(0.8, 0.95, 0), SamplingParams(0.0), SamplingParams(1.3, 0.5, 7),
              SamplingParams(0.7, 1.0, 3))
    probs = warp_rows(logits, BatchSampling(params))
    for b, p in enumerate(params):
        expected = (torch.nn.functional.one_hot(logits[b].argmax(-1), 50).float() if p.greedy
                    else warp(logits[b], p))
        torch.testing.assert_close(probs[b], expected)


@pytest.mark.slow
def test_one_batch_mixing_greedy_and_two_sampling_policies_keeps_each_distribution(tmp_path) -> None:
    """The server batches requests of different policies into one step: greedy requests must still
    equal target-only greedy decoding, and each sampled policy must keep its own distribution."""
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"verify": {"mode": "compact", "allow_no_cost_model": True},
                                        "serving": {"max_running_requests": 48}}, "mixed"))
    hot, cool = SamplingParams(temperature=1.0, top_k=8), SamplingParams(temperature=0.6, top_k=8)
    runtime = Runtime(pkg, seed=4)
    prompt = pkg.tokenizer.encode("    def __init__(self, ")
    greedy_ref, _ = Runtime(pkg).generate([prompt], 3, target_only=True)
    n = 384
    # The cool requests have seeds: they sample from their own streams (inverse-CDF sampling).
    requests = {name: [runtime.new_request(prompt, 3, params, seed=i if name == "cool" else None)
                       for i in range(n)]
                for name, params in (("hot", hot), ("cool", cool), ("greedy", SamplingParams()))}
    for i in range(n):  # interleaved, so every step mixes the three policies
        for group in requests.values():
            runtime.enqueue(group[i])
    while runtime.has_work:
        runtime.step()
    assert all(r.output == greedy_ref[0] for r in requests["greedy"])
    for name, params in (("hot", hot), ("cool", cool)):
        counts = Counter(tuple(r.output) for r in requests[name])
        stat, df = _chi_square(counts, _exact_joint(runtime, prompt, params), n)
        assert stat < _critical(df), f"{name}: chi-square {stat:.1f} on {df} df"
    # the two sampled policies really are different distributions (the test can tell them apart)
    stat_swapped, df_swapped = _chi_square(Counter(tuple(r.output) for r in requests["hot"]),
                                           _exact_joint(runtime, prompt, cool), n)
    assert stat_swapped > _critical(df_swapped)


def test_per_request_generators_sample_each_row_from_its_own_stream() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]])

    def row_gens(seeds: list[int | None]) -> RowGenerators:
        rows = tuple(None if s is None else torch.Generator().manual_seed(s) for s in seeds)
        return RowGenerators(rows, torch.Generator().manual_seed(99))

    # A seeded row draws the same whatever shares the batch with it.
    alone = sample(probs[:1].expand(50, -1)[:1], row_gens([7]))
    together = sample(probs, row_gens([7, None, 8]))
    assert alone[0] == together[0] and together[1] == 3
    # Inverse-CDF sampling keeps the row's distribution and never picks a zero-probability token.
    n = 20_000
    gens = row_gens(list(range(n)))
    draws = sample(probs[:1].expand(n, -1), gens)
    freq = torch.bincount(draws, minlength=4).float() / n
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.015), freq


def test_rejection_accept_with_per_request_generators_keeps_the_target_distribution() -> None:
    rows = 20_000
    gens = RowGenerators(tuple(torch.Generator().manual_seed(i) for i in range(rows)), None)
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]).expand(rows, -1, -1)
    p = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]).expand(rows, -1, -1)
    drafts = sample(q, gens)
    verdict = rejection_accept(drafts, q, p, torch.full((rows,), 3), gens)
    first = torch.where(verdict.result.correct_len > 0, drafts[:, 0], verdict.result.bonus)
    freq = torch.bincount(first, minlength=3).float() / rows
    assert torch.allclose(freq, p[0, 0], atol=0.015), freq


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(tmp_path) -> None:
    """Static verification and the CPU backend's batch-invariant numerics: a seeded request's
    continuation does not depend on the requests that share its steps."""
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                       {"serving": {"max_running_requests": 8}}, "seeded"))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = pkg.tokenizer.encode("def parse(self, text):\n")

    def run(others: int, seed: int) -> list[int]:
        runtime = Runtime(pkg, seed=others)
        mine = runtime.new_request(prompt, 40, params, seed=seed)
        runtime.enqueue(mine)
        for i in range(others):
            runtime.enqueue(runtime.new_request(pkg.tokenizer.encode(f"import os{i}\n"), 40, params))
        while runtime.has_work:
            runtime.step()
        return mine.output

    alone = run(0, seed=5)
    assert run(5, seed=5) == alone and run(3, seed=5) == alone
    assert len({tuple(run(0, seed=s)) for s in (1, 2, 3)}) > 1  # the seed matters


@pytest.mark.parametrize("params", [SamplingParams(1e-4), SamplingParams(2e-5, top_p=1e-45),
                                    SamplingParams(0.7, top_p=1e-45), SamplingParams(0.9, top_k=10**20),
                                    SamplingParams(1e-300), SamplingParams(50.0, top_p=0.3, top_k=3)])
def test_no_request_parameters_make_a_distribution_nan(params: SamplingParams) -> None:
    """Extreme but valid values (a request's, so one cannot be allowed to stop the engine)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 40) * 30
    batch = BatchSampling((params, SamplingParams(0.8, 0.9, 5), SamplingParams()))
    probs = warp_rows(logits, batch)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3, 2))
    assert (probs.argmax(-1)[0] == logits[0].argmax(-1)).all()  # the most likely token always stays
    if not params.greedy:
        single = warp(logits[0], params)
        assert torch.isfinite(single).all() and torch.allclose(single.sum(-1), torch.ones(2))
    assert SamplingParams(1e-6).greedy and SamplingParams(1e-6).policy == "greedy"
