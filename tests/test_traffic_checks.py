"""The online calibration's prompt check (`dspark.runtime.planner.traffic.prompt_shift`) and the prefill's
probe that scores each prompt for it (`dspark.runtime.engine.extend`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dspark.runtime.engine.extend import probe_rows
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import PrefillChunk
from dspark.runtime.planner.traffic import PROMPT_OLDER, PROMPT_RECENT, PromptWindow, prompt_shift

ROOT = Path(__file__).resolve().parents[1]


def correlated(gen: np.random.Generator, n: int, rho: float) -> np.ndarray:
    """Stationary prompt scores (spread 1) whose neighbours correlate by `rho`, as pieces of one document."""
    x = np.empty(n)
    x[0] = gen.normal()
    for i in range(1, n):
        x[i] = rho * x[i - 1] + gen.normal(0.0, math.sqrt(1.0 - rho * rho))
    return x


def test_the_prompt_check_holds_still_on_correlated_prompts_and_sees_a_shift_in_a_few_dozen() -> None:
    gen = np.random.default_rng(3)
    scores = correlated(gen, 3000, 0.3)
    ends = range(PROMPT_RECENT + PROMPT_OLDER, 3001, 4)
    z = np.array([prompt_shift(scores[:end]) for end in ends])
    assert np.abs(z).max() < 4.5 and np.std(z) == pytest.approx(1.0, abs=0.2)

    def independent(end: int) -> float:  # every prompt counted once: what the check must not assume
        old, new = scores[:end - PROMPT_RECENT], scores[end - PROMPT_RECENT:end]
        return float((new.mean() - old.mean()) / (old.std() * math.sqrt(1 / PROMPT_RECENT + 1 / len(old))))

    assert np.std([independent(end) for end in ends]) > 1.25
    for shift in (1.5, -1.5):  # the newest prompts harder, or easier, by 1.5 of their spread
        shifted = prompt_shift(np.concatenate([scores[:1000], scores[1000:1000 + PROMPT_RECENT] + shift]))
        assert shifted is not None and shifted * np.sign(shift) > 4.5
    assert prompt_shift(scores[:PROMPT_RECENT + PROMPT_OLDER - 1]) is None  # too few before them
    assert prompt_shift(np.ones(PROMPT_RECENT + PROMPT_OLDER)) is None  # no spread to measure against


def test_the_prompt_window_keeps_the_newest_finite_scores() -> None:
    window = PromptWindow(4)
    for score in (1.0, 2.0, math.nan, 3.0, math.inf, 4.0, 5.0):
        window.add(score)
    assert window.recent().tolist() == [2.0, 3.0, 4.0, 5.0] and window.recent(2).tolist() == [4.0, 5.0]
    window.keep_recent(1)
    window.add(6.0)
    assert window.recent().tolist() == [5.0, 6.0]


def test_the_probe_takes_the_rows_that_predict_a_prompt_s_last_tokens() -> None:
    # a 10-token prompt prefilled in chunks of 4, 4 and 2, probing 5: the rows at positions 4 to 8 predict
    # tokens 5 to 9; the last row (position 9) predicts the first new token and is never probed
    r = Request(rid=0, prompt=list(range(100, 110)), max_new_tokens=1)
    got = []
    for take in (4, 4, 2):
        got += [(r.prefilled + row, token) for _, row, token in probe_rows([PrefillChunk(r, take)], 5)]
        r.prefilled += take
    assert got == [(position, 100 + position + 1) for position in range(4, 9)]
    a = Request(rid=1, prompt=[1, 2, 3], max_new_tokens=1)
    b = Request(rid=2, prompt=[4, 5, 6, 7], max_new_tokens=1)
    # a probe longer than the prompts: every row but each prompt's last, by chunk
    assert probe_rows([PrefillChunk(a, 3), PrefillChunk(b, 4)], 64) == [
        (0, 0, 2), (0, 1, 3), (1, 0, 5), (1, 1, 6), (1, 2, 7)]
    assert probe_rows([PrefillChunk(a, 3)], 0) == []


def test_the_prefill_scores_each_prompt_as_the_model_s_own_forward_does_and_commits_the_same_tokens() -> None:
    from dspark.corpus import distribution_prose, held_out_prompts
    from dspark.runtime.config import OnlineCalibrationSettings
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.models.checkpoint import load_target
    from dspark.runtime.package import load_package

    package = load_package(ROOT / "generated" / "tiny_cpu_cap_accept")
    texts = held_out_prompts(3) + distribution_prose(2, 0) + ["x = 1"]  # the last shorter than the probe
    prompts = [package.tokenizer.encode(t) for t in texts]
    runtime = Runtime(package, online_calibration=OnlineCalibrationSettings(prompt_probe=64))
    got, _ = runtime.generate(prompts, 16)
    want, _ = Runtime(package).generate(prompts, 16)  # no online calibration: no probe
    assert got == want

    target = load_target(str(ROOT / "dspark" / "checkpoints" / "tiny" / "target"))
    reference = []
    with torch.no_grad():
        for ids in prompts:
            tokens = torch.tensor([ids])
            logits = target.dense_logits(target.forward_dense(tokens[:, :-1]))[0]
            reference.append(F.cross_entropy(logits, tokens[0, 1:], reduction="none")[-64:].mean().item())
    assert runtime.speculative.online is not None
    assert runtime.speculative.online.prompts.recent().tolist() == pytest.approx(reference, rel=1e-4)
