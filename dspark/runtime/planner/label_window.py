"""The labels a decode step yields for online calibration, and the window that keeps them.

A drafted step verifies `run_len` rows of a request (its root and `run_len - 1` drafts), so it knows, for the
run's own sampling policy, whether the accepted prefix reached each verified draft: label[k] = "the prefix
reached draft k" for k < run_len - 1 (`step_labels`). Which drafts are verified depends on the confidence
scores, not on the outcomes, so within a score bin the labels stay unbiased. (A rejection also tells that no
later draft was reached, but taking those labels where the draft was not verified would select rows by their
outcome: the rows that failed early, never those that would have gone on.)

The step hands its rows over as they are (`Observed`); the calibration's check labels them (`observed_rows`,
`step_labels`) and keeps them in a ring of the last request-steps (`LabelWindow`, of `Rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def step_labels(raw_correct: Sequence[int], run_lens: Sequence[int], gamma: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per request, label[k] = raw_correct > k (the prefix reached draft k, `raw_correct` the uncapped match
    over the rows that ran) and whether draft k was verified, which makes it known: `[B, gamma]` bool each."""
    raw = np.asarray(raw_correct, dtype=np.int64)[:, None]
    verified = np.asarray(run_lens, dtype=np.int64)[:, None] - 1  # drafts verified
    k = np.arange(gamma)[None, :]
    return k < raw, np.broadcast_to(k < verified, (raw.shape[0], gamma)).copy()


@dataclass(frozen=True)
class Rows:
    """Labelled request-steps: logits float64, labels and known masks bool `[n, gamma]`; which request each
    row is and the tokens it had generated, `[n]` int64 each."""

    logits: np.ndarray
    labels: np.ndarray
    known: np.ndarray
    requests: np.ndarray
    ages: np.ndarray

    def __getitem__(self, rows: slice | np.ndarray) -> Rows:
        return Rows(*(getattr(self, field.name)[rows] for field in dataclasses.fields(self)))

    def __len__(self) -> int:
        return int(self.logits.shape[0])

    def then(self, later: Rows) -> Rows:
        """These rows followed by `later`."""
        return Rows(*(np.concatenate([getattr(self, f.name), getattr(later, f.name)])
                      for f in dataclasses.fields(self)))


class Observed(NamedTuple):
    """A drafted step's request-steps as `OnlineCalibrator.observe` took them: the next check labels them,
    keeps those under the policy with finite logits and adds them to the window, in its own thread (each
    numpy call the step made for them cost it some 15 microseconds: the model's forward had just evicted
    the interpreter's caches)."""

    logits: np.ndarray  # [B, gamma] float64
    raw_correct: Sequence[int]
    run_lens: Sequence[int]
    requests: Sequence[int]
    ages: Sequence[int]
    include: Sequence[bool] | None  # the rows under the policy (None: all of them)


def observed_rows(inbox: Sequence[Observed], gamma: int) -> tuple[Rows, int]:
    """The rows of `inbox` under the policy with finite logits, labelled (`step_labels`), in order; and how
    many under the policy were left out for a non-finite logit."""
    if not inbox:
        return Rows(np.zeros((0, gamma)), np.zeros((0, gamma), dtype=bool), np.zeros((0, gamma), dtype=bool),
                    np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)), 0
    labels, known = step_labels([c for o in inbox for c in o.raw_correct],
                                [n for o in inbox for n in o.run_lens], gamma)
    logits = np.concatenate([o.logits for o in inbox])
    rows = Rows(logits, labels, known,
                *(np.array([v for o in inbox for v in getattr(o, name)], dtype=np.int64)
                  for name in ("requests", "ages")))
    included = np.array([i for o in inbox for i in (o.include or (True,) * o.logits.shape[0])], dtype=bool)
    finite = np.isfinite(logits).all(axis=1)
    kept = included & finite
    unusable = int((included & ~finite).sum())
    return (rows, 0) if kept.all() else (rows[kept], unusable)


class LabelWindow:
    """The last `capacity` labelled request-steps (`Rows`), in a ring."""

    def __init__(self, gamma: int, capacity: int) -> None:
        self.rows = Rows(np.zeros((capacity, gamma)), np.zeros((capacity, gamma), dtype=bool),
                         np.zeros((capacity, gamma), dtype=bool), np.zeros(capacity, dtype=np.int64),
                         np.zeros(capacity, dtype=np.int64))
        self.level = np.zeros(capacity)  # each row's mean logit: what the traffic check reads of every row
        self.capacity, self.size, self.next = capacity, 0, 0
        self.forgotten: Rows | None = None  # what `keep_recent` forgot (the newest `capacity`), oldest first

    def add(self, rows: Rows) -> None:
        """Append `rows` (the oldest fall out); their logits are finite (`observe` counts only those)."""
        newest = rows[max(0, len(rows) - self.capacity):]  # more than fit: only the newest stay
        start = (self.next + len(rows) - len(newest)) % self.capacity
        for field in dataclasses.fields(Rows):
            self._put(getattr(self.rows, field.name), start, getattr(newest, field.name))
        self._put(self.level, start, newest.logits.mean(axis=1))
        self.next = (self.next + len(rows)) % self.capacity
        self.size = min(self.size + len(rows), self.capacity)

    def recent(self, n: int | None = None) -> Rows:
        """A copy of the last `n` rows (all when None), oldest first."""
        return Rows(*(self._last(getattr(self.rows, field.name), n) for field in dataclasses.fields(Rows)))

    def levels(self, n: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the last `n` rows' (all when None) mean logit, request and age, oldest first (a few
        hundred KB where `recent()` copies megabytes: every check takes these)."""
        return self._last(self.level, n), self._last(self.rows.requests, n), self._last(self.rows.ages, n)

    def _put(self, array: np.ndarray, start: int, values: np.ndarray) -> None:
        """`values` (at most `capacity`) into the ring `array` from `start` on, wrapping at its end."""
        first = min(values.shape[0], self.capacity - start)
        array[start:start + first] = values[:first]
        array[:values.shape[0] - first] = values[first:]

    def _last(self, array: np.ndarray, n: int | None) -> np.ndarray:
        """A copy of the ring `array`'s last `n` entries (all when None), oldest first: one or two slices
        (a gather of a full window's indices took 2 ms)."""
        n = self.size if n is None else min(n, self.size)
        start = (self.next - n) % self.capacity
        if start + n <= self.capacity:
            return array[start:start + n].copy()
        return np.concatenate([array[start:], array[:self.next]])

    def keep_recent(self, n: int) -> None:
        """Forget all but the last `n` rows (kept aside in `forgotten` for `after_forgotten`)."""
        rows = self.recent()
        dropped = rows[:max(0, len(rows) - n)]
        if self.forgotten is not None:
            dropped = self.forgotten.then(dropped)
        self.forgotten = dropped[max(0, len(dropped) - self.capacity):]
        self.size, self.next = 0, 0
        self.add(rows[max(0, len(rows) - n):])


def after_forgotten(forgotten: Rows | None, rows: Rows, least: int) -> Rows:
    """`rows` (a copy of the window) after the newest `forgotten` rows, where it has fewer than `least`."""
    if forgotten is None or len(rows) >= least:
        return rows
    return forgotten[max(0, len(forgotten) - (least - len(rows))):].then(rows)
