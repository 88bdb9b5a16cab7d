"""Online STS calibration (`dspark.runtime.planner.online_calibration`): the labels a step's verified rows
determine; a synthetic stream whose true acceptance curve changes mid-run, where the refit converges to the
generating temperatures, the change is detected within a few hundred request-steps and the refit then follows
it; hostile windows (everything accepted, everything rejected, nothing known, non-finite logits) that never
produce an invalid temperature; the background refit handed over between steps."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dspark.corpus import (
    distribution_prose,
    header_prompts,
    out_of_distribution_prompts,
    package_files,
    package_prompts,
)
from dspark.runtime.planner import online_calibration
from dspark.runtime.planner.calibration_metrics import binned_ece, binned_eces
from dspark.runtime.planner.label_window import LabelWindow, Rows, after_forgotten, step_labels
from dspark.runtime.planner.online_calibration import (
    OnlineCalibrationSettings,
    OnlineCalibrator,
    calibrated_ece_quantiles,
    known_eces,
)
from dspark.runtime.planner.sts import (
    cumulative_survival,
    default_grid,
    fit_temperatures,
    grid_eces,
    grid_nlls,
)
from dspark.runtime.planner.traffic import PROMPT_RECENT, number_requests, traffic_shift

from .runtime_helpers import compile_on_and_off, spec_with

GAMMA = 4
ROWS_A_REQUEST = 12  # request-steps a synthetic request lasts (as a 64-token request at ~5 tokens a step)
TOKENS_A_STEP = 5


def test_a_step_knows_the_labels_of_its_verified_drafts() -> None:
    labels, known = step_labels([2, 1, 3, 0], [4, 5, 4, 1], GAMMA)
    # request 0: 3 drafts verified, the first 2 accepted, the third rejected; draft 3 not verified
    assert labels[0].tolist() == [True, True, False, False] and known[0].tolist() == [True, True, True, False]
    # request 1: 4 verified, rejected at draft 1: every label known
    assert labels[1].tolist() == [True, False, False, False] and known[1].all()
    # request 2: all 3 verified drafts accepted; draft 3 not verified
    assert labels[2].tolist() == [True, True, True, False] and known[2].tolist() == [True, True, True, False]
    # request 3: nothing verified (the root alone): nothing known, even where a label would follow
    assert not known[3].any()


def stream(calibrator: OnlineCalibrator, steps: int, true_t: float, gen: np.random.Generator,
           planned: bool = True, shift: float = 0.0, request_sd: float = 0.0) -> list[int]:
    """`steps` request-steps whose draft k is accepted with sigmoid(z_k / true_t) once the prefix reached it,
    `ROWS_A_REQUEST` a request, the logits `shift` + the request's own offset (sd `request_sd`) + noise; a
    planner-like run length (score-dependent) when `planned`. Returns the refit steps."""
    refit_at = []
    offset = 0.0
    for i in range(steps):
        request = calibrator.samples // ROWS_A_REQUEST
        if calibrator.samples % ROWS_A_REQUEST == 0:
            offset = gen.normal(0.0, request_sd) if request_sd else 0.0
        z = shift + offset + gen.normal(0.0, 2.5, size=(1, GAMMA))
        accept = gen.random(GAMMA) < 1 / (1 + np.exp(-z[0] / true_t))
        raw = int(np.argmin(accept)) if not accept.all() else GAMMA
        survival = np.cumprod(1 / (1 + np.exp(-z[0] / np.asarray(calibrator.temperatures))))
        run_len = 1 + (int((survival > 0.3).sum()) if planned else GAMMA)
        run_len = max(run_len, 2)
        age = TOKENS_A_STEP * (calibrator.samples % ROWS_A_REQUEST)
        calibrator.observe(torch.from_numpy(z), [min(raw, run_len - 1)], [run_len], [request], [age])
        if calibrator.poll() is not None:
            refit_at.append(i)
    return refit_at


def close_on_grid(t: float, want: float) -> bool:
    return abs(math.log(t / want)) < 0.35  # within a few grid steps (41 over 0.1 .. 10: 0.115 each)


def test_the_refit_converges_to_the_generating_temperatures() -> None:
    # every draft verified: every label known, so every position's temperature is identified
    gen = np.random.default_rng(0)
    settings = OnlineCalibrationSettings(window=4096, refit_every=256, min_known=150, drift_window=256)
    cal = OnlineCalibrator(GAMMA, None, settings, background=False)
    stream(cal, 4000, 2.0, gen, planned=False)
    assert all(close_on_grid(t, 2.0) for t in cal.temperatures), cal.temperatures
    stream(cal, 4000, 0.5, gen, planned=False)
    assert all(close_on_grid(t, 0.5) for t in cal.temperatures), cal.temperatures


def test_a_drift_under_planned_verification_is_detected_and_followed(caplog: pytest.LogCaptureFixture
                                                                     ) -> None:
    gen = np.random.default_rng(1)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150, drift_window=256)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False)
    with caplog.at_level(logging.WARNING, logger="dspark.calibration"):
        stream(cal, 3000, 2.0, gen)
        assert not [r for r in caplog.records if "drift" in r.message], "a drift where there is none"
        assert not stream(cal, 500, 0.4, gen)  # the refit waits for four drift windows of the new traffic ...
        assert cal.drift and cal.drift_at is not None and cal.drift_at - 3000 < 500  # ... the check saw it
        refits = stream(cal, 2500, 0.4, gen)
    assert refits and refits[0] + 500 < 1024 + 500  # ... then the refits follow the new traffic
    assert close_on_grid(cal.temperatures[0], 0.4), cal.temperatures
    assert not cal.drift  # the refit followed the new traffic


@pytest.mark.parametrize("window", [4096, 65536])
def test_refits_back_off_while_the_traffic_holds_still_and_resume_on_drift(window: int) -> None:
    gen = np.random.default_rng(2)
    settings = OnlineCalibrationSettings(window=window, refit_every=128, min_known=150, drift_window=256)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False)
    stream(cal, 8000, 2.0, gen, planned=False)
    # checks every 128 request-steps (62 of them); refits at 128, 384, 896 and 1920 (256, 512, 1024 apart),
    # then every 1024 (a quarter of the smaller window, the longest interval for the larger: 2944 ... 7040)
    assert cal.refits == 9, cal.refits
    before = cal.refits
    stream(cal, 2000, 0.4, gen, planned=False)
    assert cal.drift_at is not None and cal.drift_at - 8000 < 500
    # after the window refills (4 x 256 request-steps of the new traffic), refits resume at 128 apart
    assert cal.refits - before >= 3 and close_on_grid(cal.temperatures[0], 0.4), cal.temperatures


def test_scheduled_refits_take_at_most_their_share_of_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # a refit that takes 0.1 s of CPU (a fake thread clock) at a share of 1 %: the next scheduled one waits
    # 10 s of the wall clock, here 1,000 request-steps at 10 ms each, where the doubling alone would refit
    # 1,024 request-steps apart only after four refits; a drift is refitted on at once
    cpu, now = [0.0], [0.0]

    def thread_time() -> float:
        cpu[0] += 0.1  # 0.1 s between one read and the next
        return cpu[0]

    monkeypatch.setattr(time, "thread_time", thread_time)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False, refit_share=0.01,
                           clock=lambda: now[0])
    gen = np.random.default_rng(13)
    refitted_at = []
    for _ in range(5000):
        now[0] += 0.01
        if stream(cal, 1, 2.0, gen, planned=False):
            refitted_at.append(now[0])
    gaps = np.diff(refitted_at)
    assert len(refitted_at) >= 4 and gaps.min() >= 10.0, refitted_at
    # each check reads the fake thread clock at its start, before its refit and at its end: 0.2 s of "CPU"
    checks = 5000 // settings.refit_every
    assert cal.background_seconds == pytest.approx(0.2 * checks) and cal.step_seconds > 0
    free = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False, refit_share=0.0)
    assert len(stream(free, 5000, 2.0, np.random.default_rng(13), planned=False)) > len(refitted_at)
    before = cal.refits
    stream(cal, 2500, 0.4, gen, planned=False)  # no wall time passes: only the drift's refits run
    assert cal.drift_at is not None and cal.refits > before


def test_checks_take_at_most_their_share_of_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # a check that takes 0.05 s of CPU (a fake thread clock) at a share of 1 %: the next waits 5 s of the wall
    # clock, 500 request-steps at 10 ms each, where `refit_every` alone would check every 128
    cpu, now = [0.0], [0.0]

    def thread_time() -> float:
        cpu[0] += 0.05  # from one read to the next: a check reads at its start, before a refit and at its end
        return cpu[0]

    monkeypatch.setattr(time, "thread_time", thread_time)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150)
    checks = []
    for share in (0.01, 0.0):
        cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False, check_share=share,
                               clock=lambda: now[0])
        times: list[float] = []
        check = cal._check

        def timed(*args: Any, check: Any = check, times: list[float] = times) -> Any:
            times.append(now[0])
            return check(*args)

        monkeypatch.setattr(cal, "_check", timed)
        gen = np.random.default_rng(13)
        for _ in range(5000):
            now[0] += 0.01
            stream(cal, 1, 2.0, gen, planned=False)
        checks.append(times)
    budgeted, free = checks
    assert np.diff(budgeted).min() >= 5.0 - 1e-9 and len(budgeted) <= 11, budgeted  # 50 s of wall time
    assert len(free) > 3 * len(budgeted) and np.diff(free).min() < 1.3 + 1e-9  # every 128 request-steps


def test_a_drift_not_in_the_prompts_leaves_the_prompt_check_ready_for_the_next_switch(
        caplog: pytest.LogCaptureFixture) -> None:
    # a traffic drift in the draft's scores (the prompts as before), then a switch only the prompts tell:
    # the prompt check still has its older prompts and sees the switch at its next check
    gen = np.random.default_rng(8)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False)
    for _ in range(10):
        for _ in range(24):
            cal.prompt(gen.normal(1.8, 0.5))
        stream(cal, 400, 2.0, gen, request_sd=1.0)
    stream(cal, 500, 2.0, gen, shift=-2.0, request_sd=1.0)
    assert cal.drift_cause == "traffic" and cal.prompts.size == 240  # the prompts were not forgotten
    stream(cal, 3000, 2.0, gen, shift=-2.0, request_sd=1.0)
    assert not cal.drift
    with caplog.at_level(logging.WARNING, logger="dspark.calibration"):
        for _ in range(PROMPT_RECENT):
            cal.prompt(gen.normal(2.75, 0.6))
        switched = cal.samples
        stream(cal, 128, 2.0, gen, shift=-2.0, request_sd=1.0)
    assert cal.drift_cause == "prompts" and cal.drift_at is not None and cal.drift_at - switched <= 128
    assert cal.prompts.size == PROMPT_RECENT  # a drift in the prompts does forget them


def test_a_lasting_drift_refits_once_at_once_then_within_the_refit_budget(monkeypatch: pytest.MonkeyPatch
                                                                          ) -> None:
    # a drift that lasts (the prompt check, made to see one at every check): the first refit after the window
    # refills runs at once, the later ones wait for the budget (0.1 s of CPU at 1 %: 10 s of wall time)
    cpu, now = [0.0], [0.0]

    def thread_time() -> float:
        cpu[0] += 0.1
        return cpu[0]

    monkeypatch.setattr(time, "thread_time", thread_time)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150, drift_window=256)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False, refit_share=0.01,
                           clock=lambda: now[0])
    gen = np.random.default_rng(5)
    stream(cal, 128, 2.0, gen)  # the first refit
    monkeypatch.setattr(online_calibration, "prompt_shift", lambda prompts: 10.0)
    refitted_at = []
    for i in range(3000):
        now[0] += 0.001  # 3 s of wall time in all: no scheduled refit comes due
        if stream(cal, 1, 2.0, gen):
            refitted_at.append(i)
    assert cal.drift and cal.drift_cause == "prompts" and cal.drift_at == 256
    # the drift's first refit, once the window (the 256 it kept) holds 4 x 256 request-steps, and no other
    assert refitted_at == [4 * 256 - 128 - 1], refitted_at
    now[0] += 10.0
    assert stream(cal, 128, 2.0, gen)  # the budget allows the next


def test_request_numbers_are_np_unique_s_without_its_sort() -> None:
    gen = np.random.default_rng(2)
    for requests in (gen.integers(1000, 1100, 500), gen.permutation(10**9)[:300], np.array([7] * 5),
                     np.zeros(0, dtype=np.int64)):
        count, numbers = number_requests(requests)
        ids, inverse = np.unique(requests, return_inverse=True)
        assert count == ids.shape[0] and np.array_equal(numbers, inverse)


def test_the_traffic_check_counts_requests_not_rows() -> None:
    # each request's rows share an offset (sd 1.5 against 0.5 within): 384 rows are 32 requests, not 384
    # independent draws (and the older 640, 53); a shift of 2 in the recent rows' mean is 6 standard errors
    gen = np.random.default_rng(7)

    def window(shift: float) -> Rows:
        requests = np.repeat(np.arange(1024 // ROWS_A_REQUEST + 1), ROWS_A_REQUEST)[:1024]
        ages = TOKENS_A_STEP * (np.arange(1024) % ROWS_A_REQUEST)
        offset = gen.normal(0.0, 1.5, requests.max() + 1)[requests]
        offset += np.where(np.arange(1024) >= 640, shift, 0.0)
        logits = offset[:, None] + gen.normal(0.0, 0.5, (1024, GAMMA))
        return Rows(logits, np.zeros((1024, GAMMA), bool), np.zeros((1024, GAMMA), bool), requests, ages)

    def levels(rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return rows.logits.mean(1), rows.requests, rows.ages

    def naive(rows: Rows) -> float:  # every row independent: what the check must not assume
        x = rows.logits.mean(1)
        return float((x[640:].mean() - x[:640].mean()) / np.sqrt(x[640:].var() / 384 + x[:640].var() / 640))

    still = [window(0.0) for _ in range(300)]
    assert sum(abs(traffic_shift(*levels(w), 384)) > 4.0 for w in still) <= 1  # type: ignore[arg-type]
    assert sum(abs(naive(w)) > 4.0 for w in still) > 30  # rows taken as independent: false alarms
    assert np.std([traffic_shift(*levels(w), 384) for w in still]) == pytest.approx(1.0, abs=0.15)
    shifted = [traffic_shift(*levels(window(-2.0)), 384) for _ in range(100)]
    assert sum(z < -4.0 for z in shifted) >= 90  # type: ignore[operator]
    few = window(0.0)
    few = dataclasses.replace(few, requests=few.requests // 8)  # 8 requests in the recent rows
    assert traffic_shift(*levels(few), 384) is None
    assert traffic_shift(*levels(still[0]), 600) is None  # the older side shorter than the recent


def test_the_traffic_check_compares_the_recent_requests_with_other_requests() -> None:
    """A request's own earlier rows are no baseline for its recent ones (the same text, a few tokens younger):
    the older side is the rows of other requests, age for age."""
    gen = np.random.default_rng(11)

    def window(shift: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # 64 finished requests of 80 steps, then 32 in lockstep 60 steps in; the confidence falls with age
        requests = np.concatenate([np.repeat(np.arange(64), 80), np.tile(np.arange(100, 132), 60)])
        steps = np.concatenate([np.tile(np.arange(80), 64), np.repeat(np.arange(60), 32)])
        offset = gen.normal(0.0, 0.3, 132)[np.where(requests >= 100, requests - 68, requests)]
        level = offset - 0.05 * steps + gen.normal(0.0, 0.2, steps.shape[0])
        level += np.where(requests >= 100, shift, 0.0)
        return level, requests, TOKENS_A_STEP * steps

    level, requests, ages = window(0.0)
    z = traffic_shift(level, requests, ages, 384)
    assert z is not None and abs(z) < 3.0
    own = (requests >= 100) & (np.arange(level.shape[0]) < level.shape[0] - 384)  # their own older rows
    assert traffic_shift(np.where(own, level + 5.0, level), requests, ages, 384) == z  # not read
    level, requests, ages = window(-1.0)
    assert traffic_shift(level, requests, ages, 384) < -4.5  # type: ignore[operator]


def test_the_window_copies_its_last_rows_in_order_wherever_the_ring_stands() -> None:
    window = LabelWindow(2, 8)
    gen = np.random.default_rng(4)
    everything: list[Rows] = []
    for batch in (3, 5, 1, 7, 8, 2, 11):  # past the end of the ring, exactly to it, more than it holds
        rows = Rows(gen.normal(size=(batch, 2)), gen.random((batch, 2)) < 0.5, gen.random((batch, 2)) < 0.5,
                    gen.integers(0, 100, batch), gen.integers(0, 100, batch))
        window.add(rows)
        everything.append(rows)
        seen = everything[0]
        for later in everything[1:]:
            seen = seen.then(later)
        for n in (None, 0, 1, 4, 8, 20):
            tail = seen[max(0, len(seen) - (8 if n is None else min(n, 8))):]
            got = window.recent(n)
            for field in dataclasses.fields(Rows):
                assert np.array_equal(getattr(got, field.name), getattr(tail, field.name)), (batch, n)
            level, requests, ages = window.levels(n)
            assert np.array_equal(level, tail.logits.mean(axis=1)) and np.array_equal(requests, tail.requests)
            assert np.array_equal(ages, tail.ages)
    got.logits[:] = np.nan  # a copy: the window's rows are its own
    assert np.isfinite(window.recent().logits).all()


def test_the_window_keeps_what_a_drift_forgot_for_the_map() -> None:
    window = LabelWindow(1, 8)
    rows = Rows(np.arange(12.0)[:, None], np.zeros((12, 1), bool), np.ones((12, 1), bool), np.arange(12),
                np.zeros(12, dtype=np.int64))
    window.add(rows[:6])
    window.keep_recent(2)  # forgets rows 0-3
    window.add(rows[6:9])
    kept = window.recent()
    assert kept.logits[:, 0].tolist() == [4, 5, 6, 7, 8]
    assert after_forgotten(window.forgotten, kept, 8).logits[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert after_forgotten(window.forgotten, kept, 4) is kept  # the window alone holds enough
    window.keep_recent(1)  # forgets rows 4-7 too: the newest 8 forgotten are kept
    assert window.forgotten is not None and window.forgotten.logits[:, 0].tolist() == list(range(8))


def test_a_batch_of_long_generations_started_together_is_no_traffic_shift(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # 32 requests decode together for 200 steps, their confidence rising as the generations go on (text falls
    # into repetition), then the next 32 start: recent rows are older, or younger, than most of the window's
    def run() -> OnlineCalibrator:
        gen = np.random.default_rng(9)
        cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, OnlineCalibrationSettings(), background=False)
        for batch in range(4):
            offsets = gen.normal(0.0, 1.0, (32, 1))
            for step in range(200):
                z = offsets + 0.02 * step + gen.normal(0.0, 2.5, (32, GAMMA))
                accept = gen.random((32, GAMMA)) < 1 / (1 + np.exp(-z / 2.0))
                raw = [int(np.argmin(a)) if not a.all() else GAMMA for a in accept]
                requests = list(range(32 * batch, 32 * batch + 32))
                cal.observe(torch.from_numpy(z), raw, [GAMMA + 1] * 32, requests, [TOKENS_A_STEP * step] * 32)
                cal.poll()
        return cal

    with caplog.at_level(logging.WARNING, logger="dspark.calibration"):
        assert run().drift_at is None and not caplog.records  # the window weighted to the recent rows' ages
        with monkeypatch.context() as m:  # one age group: the ageing alone reads as new traffic
            m.setattr("dspark.runtime.planner.traffic.age_group", lambda ages: np.zeros_like(ages))
            assert run().drift_at is not None
    assert [r for r in caplog.records if "traffic shift" in r.message]


def test_a_traffic_shift_is_detected_within_a_few_hundred_request_steps(caplog: pytest.LogCaptureFixture
                                                                         ) -> None:
    # the draft's scores fall (harder text) while the temperatures stay right: no calibration drift to see
    gen = np.random.default_rng(8)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False)
    with caplog.at_level(logging.WARNING, logger="dspark.calibration"):
        stream(cal, 4000, 2.0, gen, request_sd=1.0)
        assert not cal.drift and not caplog.records, "a drift where there is none"
        stream(cal, 500, 2.0, gen, shift=-2.0, request_sd=1.0)
    assert cal.drift_cause == "traffic" and cal.drift_at is not None and cal.drift_at - 4000 <= 500
    assert [r for r in caplog.records if "traffic shift" in r.message]
    assert cal.shift_z is not None and cal.shift_z < -settings.shift_z
    stream(cal, 3000, 2.0, gen, shift=-2.0, request_sd=1.0)
    assert not cal.drift and abs(cal.state()["shift_z"]) < settings.shift_z  # the window is the new traffic


def test_new_prompts_more_surprising_to_the_target_are_a_traffic_shift_at_the_next_check(
        caplog: pytest.LogCaptureFixture) -> None:
    # the labels and the draft's scores stay as they were: only the prompts tell the traffic changed (by 1.9
    # of the old prompts' spread, as other packages' code and prose against the standard library)
    gen = np.random.default_rng(12)
    settings = OnlineCalibrationSettings(window=4096, refit_every=128, min_known=150)
    cal = OnlineCalibrator(GAMMA, (2.0,) * GAMMA, settings, background=False)
    with caplog.at_level(logging.WARNING, logger="dspark.calibration"):
        for _ in range(10):
            for _ in range(24):
                cal.prompt(gen.normal(1.8, 0.5))
            stream(cal, 200, 2.0, gen)
        assert not cal.drift and cal.prompt_z is not None and abs(cal.prompt_z) < settings.shift_z
        assert not caplog.records
        for _ in range(PROMPT_RECENT):
            cal.prompt(gen.normal(2.75, 0.6))
        stream(cal, 128, 2.0, gen)
    assert cal.drift_cause == "prompts" and cal.drift_at is not None and cal.drift_at - 2000 <= 128
    assert cal.prompt_z is not None and cal.prompt_z > settings.shift_z
    assert [r for r in caplog.records if "prompts are" in r.message and "more surprising" in r.message]
    assert cal.prompts.size == PROMPT_RECENT  # the older side is the new traffic from now on
    for _ in range(8):
        for _ in range(24):
            cal.prompt(gen.normal(2.75, 0.6))
        stream(cal, 200, 2.0, gen)
    assert not cal.drift and cal.prompt_z is not None and abs(cal.prompt_z) < settings.shift_z


def test_the_vectorised_fit_scores_every_temperature_as_the_naive_loop_does() -> None:
    gen = np.random.default_rng(4)
    z = gen.normal(0.5, 2.0, size=(700, 3))
    y = gen.random(700) < 0.4
    grid = default_grid()
    prefix = cumulative_survival(z[:, :2], [0.7, 1.3])[:, 1]
    naive = [binned_ece(cumulative_survival(z, [0.7, 1.3, t])[:, 2], y, 15) for t in grid]
    assert grid_eces(prefix, np.ascontiguousarray(z[:, 2]), y, grid, 15).tolist() == naive
    draws = gen.random((5, 700)) < prefix
    assert binned_eces(prefix, draws, 15).tolist() == [binned_ece(prefix, d, 15) for d in draws]


def test_the_log_loss_fit_scores_every_temperature_as_the_naive_loop_and_finds_the_generating_one() -> None:
    gen = np.random.default_rng(6)
    z = gen.normal(0.5, 2.0, size=(4000, 2))
    prefix = cumulative_survival(z[:, :1], [1.0])[:, 0]
    grid = default_grid()
    y = gen.random(z.shape[0]) < 0.4
    ours = grid_nlls(prefix, np.ascontiguousarray(z[:, 1]), y, grid)
    naive = [-np.mean(np.where(y, np.log(s), np.log1p(-s)))
             for s in (np.clip(cumulative_survival(z, [1.0, t])[:, 1], 1e-12, 1 - 1e-12) for t in grid)]
    assert np.allclose(ours, naive, rtol=1e-12, atol=0)
    # labels drawn from temperatures (1.0, 2.0): the log-loss fit finds them, also where only the rows the
    # planner would verify (high scores) are known at the second position
    labels = gen.random(z.shape) < cumulative_survival(z, [1.0, 2.0])
    labels[:, 1] &= labels[:, 0]
    known = np.ones_like(labels)
    known[:, 1] = z[:, 0] > 0.0
    temps = fit_temperatures(z, labels, grid, 15, known=known, objective="nll")
    assert close_on_grid(temps[0], 1.0) and close_on_grid(temps[1], 2.0), temps


def test_the_drift_checks_noise_quantile_is_the_monte_carlo_one() -> None:
    gen = np.random.default_rng(5)
    for n in (200, 400, 2000):
        p = 1 / (1 + np.exp(-gen.normal(0.8, 1.5, n)))
        monte_carlo = float(np.quantile(binned_eces(p, gen.random((4000, n)) < p, 15), 0.99))
        assert abs(quantile(p, 15) / monte_carlo - 1) < 0.08, (n, monte_carlo)


def test_the_out_of_distribution_prompts_come_in_two_parts_with_no_file_in_common() -> None:
    parts = [package_files(part, ("no_such_package", "yaml", "jinja2")) for part in (0, 1)]
    files = [{p for files in part.values() for p in files} for part in parts]
    assert files[0] and files[1] and not files[0] & files[1]
    assert list(parts[0]) == ["yaml", "jinja2"]  # the absent one left out
    prompts = package_prompts(40, 0, packages=("yaml", "jinja2"))
    assert len(prompts) == 40 and all(0 < len(p) <= 200 for p in prompts)  # a file's end cuts some short
    with pytest.raises(ValueError, match="part"):
        package_files(2)
    with pytest.raises(ValueError, match="json is part of the standard library"):
        package_files(0, ("json",))


def test_the_prose_is_the_descriptions_and_mixes_with_code_half_and_half() -> None:
    prose = distribution_prose(5000, 0)
    fields = ("Metadata-Version:", "License-File:", "Requires-Dist:", "Classifier:", "Project-URL:")
    assert prose and not any(p.startswith(fields) for p in prose)  # the descriptions, not the header fields
    assert len(set(prose) & set(distribution_prose(5000, 1))) <= 3  # a few passages repeat (a citation)
    mixed = out_of_distribution_prompts(5000, 0)
    # in turn while both last: code outlasts the prose, and a part of code alone would mix them otherwise
    assert mixed[1::2] == prose and len(mixed) == 2 * len(prose)
    assert out_of_distribution_prompts(7, 0) == mixed[:7]


def test_the_header_prompts_come_in_two_parts_from_different_headers() -> None:
    parts = [header_prompts(60, part) for part in (0, 1)]
    assert all(len(part) == 60 and all(0 < len(p) <= 200 for p in part) for part in parts)
    # parts split the headers, not the prompts: a few lines (licence text) repeat across files
    assert len(set(parts[0]) & set(parts[1])) <= 3
    assert header_prompts(60, 0) == parts[0]  # a fixed order
    assert header_prompts(5, 0, package="no_such_package") == []
    with pytest.raises(ValueError, match="part"):
        header_prompts(5, 2)


@pytest.mark.parametrize("case", ["all_accepted", "all_rejected", "nothing_known", "non_finite"])
def test_a_hostile_window_never_yields_an_invalid_temperature(case: str) -> None:
    settings = OnlineCalibrationSettings(window=512, refit_every=64, min_known=32, drift_window=64)
    cal = OnlineCalibrator(GAMMA, (1.5, 1.0, 0.8, 2.0), settings, background=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        z = torch.randn(8, GAMMA, generator=gen) * 3
        if case == "non_finite":
            z[::2, 1] = float("nan")
            z[1::4, 2] = float("inf")
        raw = {"all_accepted": [GAMMA] * 8, "all_rejected": [0] * 8}.get(case, [1] * 8)
        run = [1] * 8 if case == "nothing_known" else [GAMMA + 1] * 8
        cal.observe(z, raw, run, list(range(8)), [0] * 8)
        cal.poll()
        assert len(cal.temperatures) == GAMMA
        assert all(math.isfinite(t) and settings.t_min <= t <= settings.t_max or t in (1.5, 1.0, 0.8, 2.0)
                   for t in cal.temperatures), cal.temperatures
    if case == "nothing_known":
        assert cal.temperatures == (1.5, 1.0, 0.8, 2.0) and cal.samples == 2400
    if case == "non_finite":
        assert cal.samples < 2400  # rows with a non-finite logit never enter the window


def test_the_background_refit_is_handed_over_between_steps() -> None:
    settings = OnlineCalibrationSettings(window=1024, refit_every=256, min_known=64, drift_window=128)
    cal = OnlineCalibrator(GAMMA, None, settings)
    gen = np.random.default_rng(3)
    stream(cal, 256, 2.0, gen, planned=False)
    deadline = time.monotonic() + 30
    while (new := cal.poll()) is None:
        assert time.monotonic() < deadline, "the background refit never finished"
        time.sleep(0.01)
    assert new == cal.calibration and cal.refits == 1 and cal.state()["samples"] == 256


def test_a_failed_check_is_logged_and_the_next_one_runs(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    settings = OnlineCalibrationSettings(window=1024, refit_every=64, min_known=32, drift_window=64)
    cal = OnlineCalibrator(GAMMA, None, settings)
    gen = np.random.default_rng(3)

    def fails(*args: object) -> None:
        raise RuntimeError("a check that fails")

    with monkeypatch.context() as patch:
        patch.setattr(cal, "_check", fails)
        stream(cal, 64, 2.0, gen, planned=False)
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.ERROR, logger="dspark.calibration"):
            while "a check failed" not in caplog.text:
                assert time.monotonic() < deadline, "the failed check was never reported"
                assert cal.poll() is None  # the calibration in use stays
                time.sleep(0.01)
    assert cal.calibration.temperatures == (1.0,) * GAMMA and cal.refits == 0
    stream(cal, 64, 2.0, gen, planned=False)  # the next check runs, on the same worker thread
    deadline = time.monotonic() + 30
    while cal.poll() is None:
        assert time.monotonic() < deadline, "the next check never finished"
        time.sleep(0.01)
    assert cal.refits == 1


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="drift_window"):
        OnlineCalibrationSettings(window=100, drift_window=200)
    with pytest.raises(ValueError, match="refit_every"):
        OnlineCalibrationSettings(refit_every=0)
    with pytest.raises(ValueError, match="shift_z"):
        OnlineCalibrationSettings(shift_z=0.0)
    with pytest.raises(ValueError, match="prompt_probe must be 0"):
        OnlineCalibrationSettings(prompt_probe=-1)


@pytest.mark.parametrize("build", ["tiny_cpu_cap_accept", "tiny_cpu_compact"])
def test_swapped_temperatures_never_change_what_is_committed(build: str) -> None:
    from dspark.corpus import held_out_prompts
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    package = load_package(Path(__file__).resolve().parents[1] / "generated" / build)
    prompts = [package.tokenizer.encode(p) for p in held_out_prompts(6)]
    settings = OnlineCalibrationSettings(window=256, refit_every=24, min_known=16, drift_window=32)
    runtime = Runtime(package, online_calibration=settings)
    online = runtime.speculative.online
    assert online is not None and online.temperatures == package.plan.temperatures
    want, _ = runtime.generate(prompts, 48, target_only=True)
    got, _ = runtime.generate(prompts, 48)
    assert got == want  # lossless with the temperatures swapped while it ran
    assert online.refits >= 1 and online.samples > 24
    assert runtime.speculative.plan.temperatures == online.temperatures  # the last refit is the one planning


def test_online_calibration_needs_a_planner() -> None:
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    with pytest.raises(RequestError, match="cap-accept or compact"):
        Runtime(load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_static"),
                online_calibration=OnlineCalibrationSettings())


def test_the_server_reports_its_live_calibration() -> None:
    import httpx

    from dspark.corpus import held_out_prompts
    from dspark.formats.sts_calibration import calibration_from_json
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package
    from dspark.runtime.serve.server import CompletionServer

    from .server_helpers import serving_in_process

    generated = Path(__file__).resolve().parents[1] / "generated"
    settings = OnlineCalibrationSettings(window=256, refit_every=16, min_known=8, drift_window=32)
    runtime = Runtime(load_package(generated / "tiny_cpu_compact"), online_calibration=settings)
    server = CompletionServer(runtime)
    with serving_in_process(server) as (_, url):
        for prompt in held_out_prompts(6):
            body = {"model": server.model_name, "prompt": prompt, "max_tokens": 32}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        live = httpx.get(f"{url}/v1/dspark/calibration", timeout=30).json()
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    figures = ("samples", "refits", "window_ece", "shift_z", "prompt_z", "drift", "drift_cause", "drift_at")
    saved = calibration_from_json({k: v for k, v in live.items() if k not in figures}, "the live calibration")
    assert len(saved.temperatures) == len(live["window_ece"]) and saved.policy == "greedy"
    assert saved.survival_map is not None and len(saved.survival_map.x) == len(saved.temperatures)
    assert live["samples"] > 16 and live["refits"] >= 1 and isinstance(live["drift"], bool)
    samples = re.escape(str(float(live["samples"])))
    assert re.search(r"dspark_calibration_samples\{[^}]*\} " + samples, metrics)
    assert 'dspark_calibration_temperature{deployment="tiny_cpu_compact",position="0"' in metrics
    assert all(f"dspark_calibration_{check}_shift_z{{" in metrics for check in ("traffic", "prompt"))
    for name in ("step_seconds", "background_cpu_seconds"):  # its own time, accounted
        seconds = re.search(rf"dspark_calibration_{name}\{{[^}}]*\}} (\S+)", metrics)
        assert seconds is not None and float(seconds.group(1)) > 0, name
    assert live["drift_cause"] in (None, "calibration", "prompts", "traffic")

    plain = CompletionServer(Runtime(load_package(generated / "tiny_cpu_compact")))
    with serving_in_process(plain) as (_, url):
        off = httpx.get(f"{url}/v1/dspark/calibration", timeout=30)
    assert off.status_code == 404 and off.json()["error"]["code"] == "online_calibration_off"


def _spec_with(tmp_path, build: str, section: dict | None) -> Path:
    return spec_with(tmp_path, build, f"{build}_online", {"online_calibration": section})


def test_the_spec_turns_online_calibration_on_with_its_settings(tmp_path) -> None:
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    pkg = compile_on_and_off(tmp_path, lambda section: _spec_with(tmp_path, "tiny_cpu_compact", section),
                             {"refit_every": 64, "drift_window": 128, "prompt_probe": 32},
                             "online_calibration", "OnlineCalibrationSettings")
    deployment = load_package(pkg).deployment
    assert deployment.online_calibration == OnlineCalibrationSettings(refit_every=64, drift_window=128,
                                                                      prompt_probe=32)
    runtime = Runtime(load_package(pkg), online_calibration=deployment.online_calibration)
    assert runtime.speculative.online is not None and runtime.extend.prompt_probe == 32


@pytest.mark.parametrize(("build", "section", "where", "message"), [
    ("tiny_cpu_static", {}, "online_calibration.enabled", "static mode has no planner"),
    ("tiny_cpu_compact", {"window": 100, "drift_window": 200}, "online_calibration.drift_window",
     "more than window"),
    # a drift_window left at its default (384) must fit the window the spec wrote too
    ("tiny_cpu_compact", {"window": 200}, "online_calibration.window", "less than drift_window (384)"),
])
def test_a_spec_that_cannot_calibrate_online_is_refused_at_its_line(tmp_path, capsys, build, section, where,
                                                                     message) -> None:
    from dspark.cli.compile import main as compile_main

    spec = _spec_with(tmp_path, build, section)
    assert compile_main(["build", str(spec), "-o", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert f"{spec.name}:" in err and where in err and message in err, err
    assert not (tmp_path / "pkg").exists()


def test_the_live_calibration_is_saved_as_a_file_a_spec_can_name(tmp_path: Path) -> None:
    from dspark.cli.serve import save_live_calibration
    from dspark.corpus import held_out_prompts
    from dspark.formats.sts_calibration import read_calibration
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    package = load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_compact")
    settings = OnlineCalibrationSettings(window=256, refit_every=16, min_known=8, drift_window=32)
    runtime = Runtime(package, online_calibration=settings)
    runtime.generate([package.tokenizer.encode(p) for p in held_out_prompts(4)], 32)
    save_live_calibration(runtime, tmp_path / "live.json")
    saved = read_calibration(tmp_path / "live.json")
    assert saved.temperatures == runtime.speculative.online.temperatures and saved.policy == "greedy"
    assert saved.dataset == "online: tiny_cpu_compact served traffic"
    live_map = runtime.speculative.online.calibration.survival_map
    assert live_map is not None and saved.survival_map == live_map.to_knots()

    # Named in a spec, the file compiles into the plan: temperatures and survival map, lossless.
    import yaml

    from dspark.compiler.api import build

    spec = _spec_with(tmp_path, "tiny_cpu_compact", None)
    data = yaml.safe_load(spec.read_text())
    del data["online_calibration"]
    data["calibration"] = {"file": str(tmp_path / "live.json")}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    build(spec, tmp_path / "pkg")
    assert "SURVIVAL_MAP = SurvivalMap(" in (tmp_path / "pkg" / "planner_config.py").read_text()
    compiled = load_package(tmp_path / "pkg")
    assert compiled.plan.survival_map == live_map and compiled.plan.temperatures == saved.temperatures
    mapped = Runtime(compiled)
    prompts = [compiled.tokenizer.encode(p) for p in held_out_prompts(3)]
    assert mapped.generate(prompts, 24)[0] == mapped.generate(prompts, 24, target_only=True)[0]


def test_exploration_verifies_every_draft_on_its_share_of_steps() -> None:
    from dspark.corpus import held_out_prompts
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    package = load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_compact")
    prompts = [package.tokenizer.encode(p) for p in held_out_prompts(6)]
    known_last, rows = {}, {}
    for share in (0.0, 0.5):
        settings = OnlineCalibrationSettings(window=4096, refit_every=32, exploration=share)
        runtime = Runtime(package, online_calibration=settings)
        got, stats = runtime.generate(prompts, 48)
        assert got == runtime.generate(prompts, 48, target_only=True)[0]  # lossless either way
        online = runtime.speculative.online
        assert online is not None
        online.settle()  # the window holds the rows up to the last check's start
        window = online.window
        known_last[share] = int(window.rows.known[:window.size, -1].sum())
        rows[share] = stats.verify_rows / stats.request_steps
    # the last position is labelled only where every draft ran: exploration supplies those labels, at the
    # price of more verify rows per request-step
    assert known_last[0.5] > known_last[0.0] and rows[0.5] > rows[0.0]


def test_a_recording_run_keeps_every_swap_in_its_step_records(tmp_path: Path) -> None:
    from dspark.cli.compile import main as compile_main
    from dspark.cli.main import main as dspark_main
    from dspark.corpus import held_out_prompts
    from dspark.formats.step_records import read_steps

    spec = _spec_with(tmp_path, "tiny_cpu_cap_accept", {"refit_every": 16, "min_known": 8, "drift_window": 32,
                                                        "window": 256})
    assert compile_main(["build", str(spec), "-o", str(tmp_path / "pkg")]) == 0
    prompts = [arg for p in held_out_prompts(6) for arg in ("--prompt", p)]
    assert dspark_main(["run", str(tmp_path / "pkg"), *prompts, "--max-new-tokens", "48",
                        "--record", str(tmp_path / "rec")]) == 0
    steps = read_steps(next((tmp_path / "rec").rglob("steps.jsonl")), gamma=7)
    swaps = [s for s in steps if s.temperatures is not None]
    assert swaps and all(len(s.temperatures) == 7 and min(s.temperatures) > 0 for s in swaps)
    assert len(swaps) < len(steps)  # only the steps a refit was swapped in before


def test_the_drift_checks_noise_quantile_counts_a_request_s_labels_once() -> None:
    """A drift window is a few dozen requests a dozen steps each; their labels move together, and the
    binomial quantile alone is half of what calibrated labels then measure."""
    gen = np.random.default_rng(7)
    requests = np.repeat(np.arange(32), 12)
    p = 1 / (1 + np.exp(-(gen.normal(0.8, 1.5, 32)[requests] + gen.normal(0, 0.3, requests.shape[0]))))

    def draw(n: int) -> np.ndarray:  # calibrated labels, one uniform a request
        return gen.random((n, 32))[:, requests] < p

    monte_carlo = float(np.quantile(binned_eces(p, draw(4000), 15), 0.99))
    clustered = np.median([quantile(p, 15, y, requests) for y in draw(40)])
    assert quantile(p, 15) < 0.5 * monte_carlo
    assert 0.7 * monte_carlo < clustered < 1.1 * monte_carlo, (clustered, monte_carlo)
    independent = [quantile(p, 15, y, requests) for y in gen.random((40, p.shape[0])) < p]
    assert 1.0 <= np.median(independent) / quantile(p, 15) < 1.15


def quantile(p: np.ndarray, num_bins: int, labels: np.ndarray | None = None,
             requests: np.ndarray | None = None) -> float:
    """`calibrated_ece_quantiles` of one position's scores."""
    return float(calibrated_ece_quantiles(p[:, None], num_bins, None if labels is None else labels[:, None],
                                          None, requests)[0])


def test_every_position_s_ece_and_noise_quantile_at_once_are_each_position_s_alone() -> None:
    gen = np.random.default_rng(9)
    requests = np.repeat(gen.permutation(1000)[:40], 10)  # 40 requests, ids neither small nor in order
    s = cumulative_survival(gen.normal(0.8, 1.5, (400, 5)), [1.0] * 5)
    labels, known = gen.random(s.shape) < s, gen.random(s.shape) < 0.7
    known[:, 4] = False  # a position without a known label
    ece = known_eces(s, labels, known, 15, min_known=1)
    noise = calibrated_ece_quantiles(s, 15, labels, known, requests)
    for k in range(4):
        rows = known[:, k]
        assert ece[k] == binned_ece(s[rows, k], labels[rows, k], 15)  # the bits
        assert noise[k] == pytest.approx(quantile(s[rows, k], 15, labels[rows, k], requests[rows]), rel=1e-12)
    assert ece[4] is None and noise[4] == 0.0
    assert known_eces(s, labels, known, 15, min_known=300)[0] is None  # fewer known than asked for
