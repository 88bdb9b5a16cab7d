"""Online STS calibration: the labels every decode step yields, refitted off the step path and swapped in
between steps, with drift detected.

The labels a step yields (for the drafts it verified: unbiased within a score bin) and the window that keeps
them are `label_window`'s.

`OnlineCalibrator` keeps the last `window` labelled request-steps (rows with non-finite logits dropped) and
every `refit_every` of them (and no sooner after the last than its CPU time over `CHECK_SHARE`) checks, in a
background thread, the calibration in use for drift. A step only hands its rows over as they are
(`Observed`): the check labels them and adds them to the window in its own thread (labelling and adding them
a step took 1 % of a step's time at B = 4 on the 2-core CPU). It refits the
temperatures (the shared STS fit, `sts.fit_temperatures`, by log loss, over each position's known labels in
the newest `TEMPERATURE_ROWS`; a position with fewer than `min_known` keeps its temperature) and then the
survival map on the whole window (its groups need the rows: replayed over four recorded out-of-distribution
runs, a map refitted on 4,096 request-steps averaged 0.83 of the compiled file's ECE, on 16,384 0.72; and
after a drift, while the window holds less than a full window of the new traffic, the newest of the steps it
forgot make up the rest: the temperatures follow the change, the map's shape needs the rows): at the first
check, once the window has refilled after a drift, and otherwise at intervals that double from `refit_every`
up to a quarter of `window`, at most `LONGEST_REFIT_INTERVAL`, while the traffic holds still, and no sooner
after the last than its CPU time over `REFIT_SHARE` (a refit costs tens of milliseconds of CPU that the steps
would otherwise have, more as the window fills; a stable calibration needs few, but one refitted rarely lags a
change of traffic the checks cannot see by thousands of steps: 1,024 kept the predicted tau within 1 % through
the switches of benchmarks/calibration_drift.py, where 4,096 let it run to -2 to -3 %). The result goes to the
step loop, which swaps it into its plan between steps (`poll`).

A check looks three ways. Calibration: the most recent `drift_window` request-steps' cumulative ECE at a
position, with the calibration in use, is drift when it exceeds, by `drift_ece`, what perfectly calibrated
labels of the same scores would measure at the 99th percentile (a few hundred steps in 15 bins measure 0.03
to 0.1 by noise alone: the threshold follows the noise of the window at hand, a request's labels moving
together). Prompts: the newest prompts' surprise to the target (`prompt`, scored by the prefill) is drift
when it lies more than `shift_z` standard errors from the prompts' before them (`traffic.prompt_shift`).
Confidence: the recent steps' mean confidence logit is drift when it lies more than `shift_z` standard
errors from the other requests' in the window's newest `TRAFFIC_ROWS` (`traffic.traffic_shift`). A
calibration that is off by a few hundredths, as on text the pair never saw, moves no ECE of a few hundred
steps beyond its noise, and the
draft's scores move by half a request's spread, which the few dozen requests a switch of traffic brings
tell only at the edge of their noise; a prompt's surprise moves by two to three of its spreads, so a
change of text is seen as soon as a few dozen new prompts are in (docs/results.md). Drift is logged once as it
starts; the window then forgets what came before the recent steps (and, where the prompts drifted, the prompts
before the newest), so the refit follows the new traffic (the map takes the forgotten steps back until the new
ones fill a window).
Temperatures only ever come from the grid, so no window (all accepted, all rejected, nothing known) can make
one invalid.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark.formats.sts_calibration import CalibrationFileContents, calibration_json
from dspark.runtime.config import OnlineCalibrationSettings
from dspark.runtime.planner.calibration_metrics import bin_index
from dspark.runtime.planner.label_window import LabelWindow, Observed, Rows, after_forgotten, observed_rows
from dspark.runtime.planner.sts import cumulative_survival, default_grid, fit_temperatures
from dspark.runtime.planner.survival_map import SurvivalMap, fit_survival_map
from dspark.runtime.planner.traffic import (
    PROMPT_RECENT,
    TRAFFIC_ROWS,
    PromptWindow,
    number_requests,
    prompt_shift,
    traffic_shift,
)

LOG = logging.getLogger("dspark.calibration")


# Known labels a position's survival map needs per group: fewer fit the noise (right after a drift the window
# is the last `drift_window` steps; the temperatures are refitted on them, the map waits for more).
MAP_ROWS_PER_BIN = 50
REFILL_AFTER_DRIFT = 4
# The newest request-steps the temperatures are fitted on: one parameter a position, which a few thousand
# rows pin down as well as the whole window would (the grid search costs some 4 ms per thousand rows); the
# survival map's groups, fitted after them, take the whole window.
TEMPERATURE_ROWS = 4096
# Labelled request-steps between refits at the most: longer lags a change of traffic neither check sees.
LONGEST_REFIT_INTERVAL = 1024
# The shares of wall time the background thread's checks and scheduled refits may take: a check (or refit)
# that took d seconds of its thread's CPU is followed by the next no sooner than d / CHECK_SHARE (d /
# REFIT_SHARE) later (the first refit and the first after a drift are not held back). On a machine whose cores
# the step keeps busy, every millisecond of the thread's is taken from the steps, and more: while it holds the
# interpreter lock the step waits at the end of each of its torch calls. Refitting every 1,024 request-steps a
# map over a growing window (40 ms at 36,000 rows) cost 2.6 % of the decode rate at B = 64 on the 2-core CPU;
# a check every 128 request-steps, every second step there, 1 to 2 ms each, another 1 to 2 %. A check also
# comes no sooner than `refit_every` request-steps after the last, so at small batches the rows, not the time,
# space them.
CHECK_SHARE = 0.005
REFIT_SHARE = 0.0025


def drifted(rows: Rows, calibration: LiveCalibration, num_bins: int, margin: float, min_known: int
            ) -> tuple[tuple[float | None, ...], bool]:
    """The rows' per-position cumulative ECE, and whether some position's exceeds, by `margin`, the 99th
    percentile of the ECE that perfectly calibrated labels, moving together within a request as these do,
    would measure (`calibrated_ece_quantiles`)."""
    s = calibration.survival(rows.logits)
    ece = known_eces(s, rows.labels, rows.known, num_bins, min_known)
    if all(e is None for e in ece):
        return ece, False
    noise = calibrated_ece_quantiles(s, num_bins, rows.labels, rows.known, rows.requests)
    return ece, any(e is not None and e > margin + q for e, q in zip(ece, noise.tolist(), strict=True))


def _known_cells(s: np.ndarray, known: np.ndarray, num_bins: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The known entries of `s [n, k]`, position by position and each position's rows in order: their rows,
    positions, values, and (position, bin) cells numbered from 0 to k * num_bins."""
    position, row = np.nonzero(known.T)
    p = s[row, position]
    return row, position, p, position * num_bins + bin_index(p, num_bins)


def calibrated_ece_quantiles(s: np.ndarray, num_bins: int, labels: np.ndarray | None = None,
                             known: np.ndarray | None = None, requests: np.ndarray | None = None
                             ) -> np.ndarray:
    """Per position of `s [n, k]`, over its rows `known` marks (all when None), the 99th percentile of the
    binned ECE of labels drawn from `s` itself, without drawing them: a bin's |sum of labels - sum of p| is
    about half-normal with the bin's variance V, so the ECE is a sum of half-normals (mean sum sqrt(2V/pi) /
    n, variance sum V(1 - 2/pi) / n^2), taken as normal. Within a few per cent of a Monte Carlo's on a few
    hundred rows or more (tested), in a fraction of a millisecond for every position at once: a check runs
    every `refit_every` request-steps beside the step.

    V is sum p(1-p) for labels drawn one by one. With the rows' `labels [n, k]` and `requests [n]`, V is at
    least the bin's variance clustered by request (its residuals y - p, centred on the bin's mean, summed per
    request, squared and summed): a drift window of a few hundred request-steps is a few dozen requests a
    dozen steps each, whose labels move together, and the binomial V alone put ECEs that stationary traffic
    measures past the threshold every few thousand steps (each such false drift throws the window away)."""
    n, gamma = s.shape
    known = np.ones((n, gamma), dtype=bool) if known is None else known
    row, position, p, cell = _known_cells(s, known, num_bins)
    cells = gamma * num_bins
    variance = np.bincount(cell, weights=p * (1.0 - p), minlength=cells)
    if labels is not None and requests is not None and p.shape[0] > 0:
        residual = labels[row, position].astype(np.float64) - p
        count = np.bincount(cell, minlength=cells)
        bin_mean = np.bincount(cell, weights=residual, minlength=cells) / np.maximum(count, 1)
        centred = residual - bin_mean[cell]
        width, request = number_requests(requests)
        by_request = cell * width + request[row]  # (position, bin, request)
        sums = np.bincount(by_request, weights=centred, minlength=cells * width).reshape(cells, width)
        clusters = np.count_nonzero(np.bincount(by_request, minlength=cells * width).reshape(cells, width),
                                    axis=1)
        clustered = (sums ** 2).sum(axis=1) * clusters / np.maximum(clusters - 1, 1)
        variance = np.maximum(variance, np.where(clusters > 1, clustered, 0.0))
    variance = variance.reshape(gamma, num_bins)
    rows = np.maximum(known.sum(axis=0), 1)
    mean = np.sqrt(2.0 * variance / np.pi).sum(axis=1) / rows
    sd = np.sqrt((variance * (1.0 - 2.0 / np.pi)).sum(axis=1)) / rows
    return mean + 2.326 * sd  # the normal's 99th percentile


def known_eces(s: np.ndarray, labels: np.ndarray, known: np.ndarray, num_bins: int, min_known: int = 1
               ) -> tuple[float | None, ...]:
    """Per position of the survival `s [n, k]`, the binned ECE over the rows whose label is known (None below
    `min_known`): each the bits `binned_ece` gives on that position's known rows (the same per-bin order)."""
    n, gamma = s.shape
    row, position, p, cell = _known_cells(s, known, num_bins)
    sum_p = np.bincount(cell, weights=p, minlength=gamma * num_bins)
    sum_y = np.bincount(cell, weights=labels[row, position].astype(np.float64), minlength=gamma * num_bins)
    gaps = np.abs(sum_y - sum_p).reshape(gamma, num_bins).sum(axis=1)
    counts = known.sum(axis=0)
    return tuple(float(g / c) if c >= max(min_known, 1) else None
                 for g, c in zip(gaps.tolist(), counts.tolist(), strict=True))


def windowed_ece(logits: np.ndarray, labels: np.ndarray, known: np.ndarray, calibration: LiveCalibration,
                 num_bins: int, min_known: int = 1) -> tuple[float | None, ...]:
    """Per position, the cumulative-survival ECE of `calibration` over the rows whose label is known (None
    below `min_known`)."""
    if logits.shape[0] == 0:
        return (None,) * len(calibration.temperatures)
    return known_eces(calibration.survival(logits), labels, known, num_bins, min_known)


@dataclass(frozen=True)
class LiveCalibration:
    """What the planner computes its survival with: the temperatures, then the monotone map (or none)."""

    temperatures: tuple[float, ...]
    survival_map: SurvivalMap | None = None

    def survival(self, logits: np.ndarray) -> np.ndarray:
        return cumulative_survival(logits, self.temperatures, self.survival_map)


@dataclass(frozen=True)
class RefitResult:
    calibration: LiveCalibration | None  # None: a check that did not refit
    recent_ece: tuple[float | None, ...]  # of the temperatures in use before the check, on recent steps
    shift_z: float | None  # `traffic_shift` of the recent steps against the window's other requests
    prompt_z: float | None  # `prompt_shift` of the newest prompts against those before them
    drift: str | None  # what the check saw drift in: "calibration", "prompts", "traffic", or None
    refit_seconds: float = 0.0  # the refit's CPU time in its thread
    cpu_seconds: float = 0.0  # the whole check's (and refit's) CPU time in its thread
    unusable: int = 0  # request-steps under the policy `observe` counted whose logits were not finite


class OnlineCalibrator:
    def __init__(self, gamma: int, temperatures: Sequence[float] | None, settings: OnlineCalibrationSettings,
                 *, survival_map: SurvivalMap | None = None, background: bool = True,
                 check_share: float | None = None, refit_share: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`background` False: check and refit in the caller (tests, offline replays), where no step waits on
        them and `check_share` and `refit_share` (the wall time's shares the checks and the scheduled refits
        may take; default `CHECK_SHARE` and `REFIT_SHARE` in the background, none in the caller) hold
        nothing back unless given; `clock` reads the wall time."""
        self.settings, self.gamma = settings, gamma
        temps = tuple(float(t) for t in temperatures) if temperatures else (1.0,) * gamma
        if len(temps) != gamma:
            raise ValueError(f"{len(temps)} temperatures for gamma {gamma}")
        if survival_map is not None and survival_map.gamma != gamma:
            raise ValueError(f"a survival map of {survival_map.gamma} positions for gamma {gamma}")
        self.calibration = LiveCalibration(temps, survival_map)
        self.window = LabelWindow(gamma, settings.window)
        self.grid = default_grid(settings.grid_points, settings.t_min, settings.t_max)
        self.background = background
        self.check_share = (CHECK_SHARE if background else 0.0) if check_share is None else check_share
        self.refit_share = (REFIT_SHARE if background else 0.0) if refit_share is None else refit_share
        self.clock = clock  # the wall time, for the refit budget
        self._check_not_before = 0.0  # `clock` time before which no check starts
        self._refit_not_before = 0.0  # ... and no scheduled refit
        self.step_seconds = 0.0  # wall time spent on the step path (observe, poll): the price to account
        self.background_seconds = 0.0  # CPU time of the finished checks and refits
        self.samples = 0  # labelled request-steps seen (the non-finite ones off once their check is polled)
        self.refits = 0
        self.drift = False
        self.drift_at: int | None = None  # `samples` when the current drift was detected
        self._refit_interval = settings.refit_every  # doubles up to `_longest_interval` between drifts
        self._since_fit = 0  # labelled request-steps since the last refit's snapshot
        self._refill = 0  # after a drift: the window size the next check waits for
        # A drift's first refit (when the window has refilled) is not held back by the refit budget; while
        # the drift lasts, the others are (refitting at every check of a long drift cost tens of ms each).
        self._refit_on_drift = False
        self.drift_cause: str | None = None  # what the current drift is in (`RefitResult.drift`)
        self.recent_ece: tuple[float | None, ...] = (None,) * gamma
        self.shift_z: float | None = None  # the last check's `traffic_shift`
        self.prompts = PromptWindow()  # the served prompts' surprise to the target (`prompt`)
        self.prompt_z: float | None = None  # the last check's `prompt_shift`
        self._since_refit = 0
        self._explore = random.Random(0)  # which steps explore: reproducible run to run
        self._lock = threading.Lock()  # the window, between the check's thread and `state`'s callers
        self._inbox: list[Observed] = []  # the steps' rows since the last check began, for the next
        self._inbox_rows = 0
        # One worker thread for every check, made on the first: starting a thread a check cost the step
        # thread a third of a millisecond, waiting for the new thread to run.
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future[RefitResult] | None = None  # the check under way or done, not yet polled

    # -- on the step path: cheap --------------------------------------------------------------------------
    def prompt(self, surprise: float) -> None:
        """A prefilled prompt's surprise to the target: the mean negative log-likelihood (nats) of its last
        `prompt_probe` tokens."""
        self.prompts.add(surprise)

    def explores(self) -> bool:
        """Whether this step verifies every draft (the `exploration` share of steps): the planner verifies
        what its scores promise, so without these the low scores of later positions get no labels."""
        return self.settings.exploration > 0 and self._explore.random() < self.settings.exploration

    def observe(self, conf_logits: torch.Tensor, raw_correct: Sequence[int], run_lens: Sequence[int],
                requests: Sequence[int], ages: Sequence[int], include: Sequence[bool] | None = None) -> None:
        """A drafted step's requests (`requests`: their ids; `ages`: the tokens each had generated;
        `include`: those under the policy the temperatures are for), kept for the next check (the lists as
        given: the caller makes them afresh each step)."""
        start = time.perf_counter()
        self._observe(conf_logits, raw_correct, run_lens, requests, ages, include)
        self.step_seconds += time.perf_counter() - start

    def _observe(self, conf_logits: torch.Tensor, raw_correct: Sequence[int], run_lens: Sequence[int],
                 requests: Sequence[int], ages: Sequence[int], include: Sequence[bool] | None) -> None:
        # a copy: the inbox keeps it until the next check, and a step's buffers may be reused
        logits = conf_logits.detach().to("cpu", torch.float64, copy=True).numpy()
        added = len(requests) if include is None else sum(include)  # the check drops non-finite ones
        if added:
            self._inbox.append(Observed(logits, raw_correct, run_lens, requests, ages, include))
        self.samples += added
        self._since_refit += added
        self._since_fit += added
        self._inbox_rows += added
        # the window is read only while no check runs (the check adds to it)
        if (self._since_refit >= self.settings.refit_every and self._pending is None
                and (not self.drift or self.window.size + self._inbox_rows >= self._refill)
                and self.clock() >= self._check_not_before):
            self._since_refit = 0
            scheduled = self._since_fit >= self._refit_interval and self.clock() >= self._refit_not_before
            refit = self.refits == 0 or scheduled or self._refit_on_drift
            if refit:
                self._since_fit, self._refit_on_drift = 0, False
            inbox, self._inbox, self._inbox_rows = self._inbox, [], 0
            check = (inbox, self.prompts.recent(), refit, self.calibration)
            if self.background:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="dspark-online-calibration")
                self._pending = self._worker.submit(self._check, *check)
            else:
                result = self._check(*check)
                self._pending = Future()
                self._pending.set_result(result)

    def settle(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the check under way, if any; `poll` hands it over as ever.
        For measurements that must not let a check's work run into what they time next."""
        if self._pending is not None:
            wait([self._pending], timeout)

    @property
    def _longest_interval(self) -> int:
        return max(self.settings.refit_every, min(self.settings.window // 4, LONGEST_REFIT_INTERVAL))

    @property
    def temperatures(self) -> tuple[float, ...]:
        return self.calibration.temperatures

    def poll(self) -> LiveCalibration | None:
        """The refitted temperatures, once, when a refit has finished (to swap in between steps); a check
        without a refit updates the drift figures and returns None."""
        start = time.perf_counter()
        try:
            return self._poll()
        finally:
            self.step_seconds += time.perf_counter() - start

    def _poll(self) -> LiveCalibration | None:
        pending = self._pending
        if pending is None or not pending.done():
            return None
        self._pending = None
        try:
            result = pending.result()
        except Exception:  # a failed check leaves the calibration in use as it was; the next one runs
            LOG.exception("online calibration: a check failed; the calibration in use stays")
            return None
        self.background_seconds += result.cpu_seconds
        self.samples -= result.unusable  # counted as they came, they never entered the window
        if self.check_share > 0:
            check_seconds = result.cpu_seconds - result.refit_seconds
            self._check_not_before = self.clock() + check_seconds / self.check_share
        if result.drift and not self.drift:
            if result.drift == "calibration":
                worst = max((e for e in result.recent_ece if e is not None), default=0.0)
                LOG.warning("online calibration: drift: the last %d request-steps' cumulative ECE reaches "
                            "%.3f, above calibrated labels' noise by more than %.3f; refitting on them",
                            self.settings.drift_window, worst, self.settings.drift_ece)
            elif result.drift == "prompts":
                LOG.warning("online calibration: traffic shift: the last %d prompts are %.1f standard errors "
                            "%s surprising to the target than those before them; refitting on the new "
                            "traffic",
                            PROMPT_RECENT, abs(result.prompt_z or 0.0),
                            "less" if (result.prompt_z or 0.0) < 0 else "more")
            else:
                LOG.warning("online calibration: traffic shift: the last %d request-steps' mean confidence "
                            "logit is %.1f standard errors %s the other requests' in the window; "
                            "refitting on them",
                            self.settings.drift_window, abs(result.shift_z or 0.0),
                            "below" if (result.shift_z or 0.0) < 0 else "above")
            with self._lock:
                self.window.keep_recent(self.settings.drift_window)
            if result.drift == "prompts":  # the prompts the next checks compare with are the new traffic's
                self.prompts.keep_recent(PROMPT_RECENT)
            # (A drift seen in the labels or the scores leaves the prompts be: forgotten, the prompt check
            # could not run again for PROMPT_OLDER prompts, and at T 0.8 a false traffic drift in
            # distribution made it miss the switch that followed, in three runs of five.)
            self._refit_on_drift = True
            # The recent steps alone are too few to refit on (a few dozen requests' worth): the next check
            # waits until the window holds REFILL_AFTER_DRIFT times as many, all of the new traffic.
            self._refill = min(REFILL_AFTER_DRIFT * self.settings.drift_window, self.settings.window)
            self.drift_at = self.samples
        self.drift, self.drift_cause = result.drift is not None, result.drift
        self.recent_ece, self.shift_z, self.prompt_z = result.recent_ece, result.shift_z, result.prompt_z
        if result.drift:
            self._refit_interval = self.settings.refit_every
        if result.calibration is None:
            return None
        if not result.drift:
            self._refit_interval = min(2 * self._refit_interval, self._longest_interval)
        if self.refit_share > 0:
            self._refit_not_before = self.clock() + result.refit_seconds / self.refit_share
        self.calibration = result.calibration
        self.refits += 1
        return result.calibration

    # -- off the step path -----------------------------------------------------------------------------------
    def _check(self, inbox: list[Observed], prompts: np.ndarray, refit: bool, in_use: LiveCalibration
               ) -> RefitResult:
        """The steps' rows in `inbox` into the window; a check of its last `drift_window` rows, of its newest
        `TRAFFIC_ROWS` (`traffic_shift`) and of `prompts` (`PromptWindow.recent`); then, when `refit`, the
        refit: temperatures on the window's newest rows, the map on all of them and, before them, the newest
        `forgotten` (`after_forgotten`). Only this thread changes the window while a check runs (the step
        thread fills the inbox, and `poll` forgets on drift once the check is done)."""
        s, started = self.settings, time.thread_time()
        window = self.window
        with self._lock:  # `state` reads the window from the server's thread
            rows, unusable = observed_rows(inbox, self.gamma)
            window.add(rows)
        recent = window.recent(s.drift_window)
        recent_ece, miscalibrated = drifted(recent, in_use, s.num_bins, s.drift_ece, s.min_known // 2)
        shift_z, prompt_z = traffic_shift(*window.levels(TRAFFIC_ROWS), s.drift_window), prompt_shift(prompts)
        drift = ("calibration" if miscalibrated
                 else "prompts" if prompt_z is not None and abs(prompt_z) > s.shift_z
                 else "traffic" if shift_z is not None and abs(shift_z) > s.shift_z else None)
        if drift and not self.drift:
            refit = False  # the drift starts: `poll` forgets the older steps; the refit waits for new ones
        fitted, cpu = None, time.thread_time()
        if refit:
            newest = window.recent(TEMPERATURE_ROWS)
            temps = fit_temperatures(newest.logits, newest.labels, self.grid, s.num_bins, known=newest.known,
                                     previous=in_use.temperatures, min_known=s.min_known, objective="nll")
            survival_map = None
            if s.map_bins:
                map_rows = after_forgotten(window.forgotten, window.recent(), s.window)
                survival_map = fit_survival_map(cumulative_survival(map_rows.logits, temps), map_rows.labels,
                                                map_rows.known, s.map_bins,
                                                max(s.min_known, MAP_ROWS_PER_BIN * s.map_bins),
                                                previous=in_use.survival_map)
            fitted = LiveCalibration(temps, survival_map)
        done = time.thread_time()
        return RefitResult(fitted, recent_ece, shift_z, prompt_z, drift, done - cpu if refit else 0.0,
                           done - started, unusable)

    def state(self) -> dict[str, Any]:
        """The live figures (any thread): the calibration in use (`calibration`; its temperatures also under
        `temperatures`), request-steps labelled since start, refits, the window's size and per-position
        cumulative ECE with that calibration (None below `min_known` known labels; the window as of the
        last check, which adds the steps since the one before), the recent steps' ECE at
        the last check, whether they had drifted, and at which request-step the drift was detected."""
        with self._lock:
            rows = self.window.recent()
            calibration = self.calibration
        s = self.settings
        ece = windowed_ece(rows.logits, rows.labels, rows.known, calibration, s.num_bins, s.min_known)
        return {"calibration": calibration, "temperatures": list(calibration.temperatures),
                "samples": self.samples, "refits": self.refits, "window": len(rows),
                "window_ece": list(ece), "recent_ece": list(self.recent_ece), "shift_z": self.shift_z,
                "prompt_z": self.prompt_z,
                "drift": self.drift, "drift_cause": self.drift_cause, "drift_at": self.drift_at}

    def calibration_contents(self, dataset: str, policy: str | None,
                             state: dict[str, Any] | None = None) -> CalibrationFileContents:
        """The live calibration as a calibration file's contents (`dspark calibrate`'s format: it can be
        saved and named in a spec): the temperatures and survival map in use, the window's size and ECE."""
        state = self.state() if state is None else state
        ece, calibration = state["window_ece"], state["calibration"]
        survival_map = calibration.survival_map
        return CalibrationFileContents(
            temperatures=calibration.temperatures, dataset=dataset, num_samples=state["window"],
            num_bins=self.settings.num_bins, grid=tuple(float(t) for t in self.grid), policy=policy,
            ece_after=None if None in ece else tuple(ece),
            survival_map=None if survival_map is None else survival_map.to_knots())

    def calibration_file(self, dataset: str, policy: str | None) -> dict[str, Any]:
        """`calibration_contents` as JSON, with `state()`'s figures beside it under their own keys."""
        state = self.state()
        figures = ("samples", "refits", "window_ece", "shift_z", "prompt_z", "drift", "drift_cause",
                   "drift_at")
        return {**calibration_json(self.calibration_contents(dataset, policy, state)),
                **{name: state[name] for name in figures}}
