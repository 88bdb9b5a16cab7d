"""Step-cost models the planner divides expected progress by (docs/planner.md): evaluation only.

Three kinds, each built from its validated table (`dspark.formats.cost_tables`, the one definition of
the JSON, its fields and its rules):

- `SpsTable` ("sps-1d"): steps per second over the step's verify rows M, looked up by floor, so a graph
  tier cliff is represented exactly.
- `AdditiveCostTable` ("additive"): step seconds `T(B, M) = bias + alpha(B) + theta(M)`, alpha and theta
  linearly interpolated; it smooths tier cliffs.
- `TierCostTable` ("tier"): step seconds measured per (B, graph tier); a step of M rows costs what the
  smallest tier >= M costs (graph replay pads it there), interpolated along B only, never across a tier.

Any of them may carry a draft-cost term (seconds the draft model takes for B requests), which the planner
adds to the step time, and a decode term (seconds of a target-only decode step of B requests), the price
of a step without speculation that the planner weighs speculating against. No torch here: the reports
and `dspark cost-eval` read these tables without a device stack.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import ValidationError

from dspark.formats.cost_tables import (
    AdditiveCostModel,
    CostTable,
    CostTableError,
    Sps1dCostModel,
    TierCostModel,
    cost_table_from_json,
    read_cost_table,
)
from dspark.formats.json_io import validation_message

# Contexts closer than this are priced alike (the interpolated tables are remembered per quantum).
CONTEXT_QUANTUM = 16


class CostModelError(ValueError):
    """A table was asked about a step it says nothing of (M beyond its range, a negative count)."""


class _FromFormat:
    """Construction shared by the three tables: a table built in code (the profiler's fit, a test) passes
    the same validation as one read from JSON, and keeps the validated values."""

    kind: ClassVar[str]
    format_model: ClassVar[type[Any]]
    _draft_probes: np.ndarray
    _draft_seconds: np.ndarray
    _decode_probes: np.ndarray
    _decode_seconds: np.ndarray
    _memo: dict[tuple[str, int], Any]

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}  # type: ignore[arg-type]

    def _validate(self) -> None:
        values = self._fields()
        try:
            model = self.format_model.model_validate({"type": self.kind, **values})
        except ValidationError as error:
            raise CostTableError(f"{self.kind} table: {validation_message(error)}") from None
        # The validated values (tuples, floats) replace what the caller passed (lists, ints).
        for name in values:
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "_draft_probes", np.array(model.draft_bs_probes, np.float64))
        object.__setattr__(self, "_draft_seconds", np.array(model.draft_seconds, np.float64))
        object.__setattr__(self, "_decode_probes", np.array(model.decode_bs_probes, np.float64))
        object.__setattr__(self, "_decode_seconds", np.array(model.decode_seconds, np.float64))
        # Lookups derived from the (immutable) table: per-B scalars and per-M arrays (_per_batch, _dense).
        object.__setattr__(self, "_memo", {})

    @classmethod
    def from_format(cls, model: CostTable) -> Any:
        """The runtime table of a validated format model of this kind."""
        if not isinstance(model, cls.format_model):
            raise TypeError(f"{cls.__name__} is built from a {cls.format_model.__name__}, got "
                            f"{type(model).__name__}")
        return cls(**model.model_dump(exclude={"type", "fingerprint"}))

    def to_format(self) -> Any:
        """The table as its format model (what a table file holds)."""
        return self.format_model(type=self.kind, **self._fields())

    def at_context(self, context_len: float) -> Any:
        """The table at a mean context of `context_len` tokens a request: itself, unless it has a context
        term (`AdditiveCostTable`)."""
        return self

    def draft_time(self, num_reqs: int) -> float:
        """Seconds the draft model takes for `num_reqs` requests (0.0 without a draft term)."""
        _check_rows("num_reqs", num_reqs)
        if self._draft_seconds.size == 0:
            return 0.0
        return self._per_batch("draft", num_reqs,  # type: ignore[no-any-return]
                               lambda b: float(np.interp(b, self._draft_probes, self._draft_seconds)))

    @property
    def prices_decode(self) -> bool:
        """Whether the table prices a step without speculation (it has the target-only decode term)."""
        return self._decode_seconds.size > 0

    def decode_time(self, num_reqs: int) -> float:
        """Seconds of one target-only decode step of `num_reqs` requests (one row each, the draft's
        context appended), interpolated along B and clamped at the end probes; the table must have the
        decode term (`prices_decode`)."""
        _check_rows("num_reqs", num_reqs)
        if not self.prices_decode:
            raise CostModelError("the table has no decode term (decode_bs_probes, decode_seconds), so it "
                                 "cannot price a step without speculation; profile the deployment again")
        return self._per_batch("decode", num_reqs,  # type: ignore[no-any-return]
                               lambda b: float(np.interp(b, self._decode_probes, self._decode_seconds)))

    def _per_batch(self, name: str, num_reqs: int, compute: Callable[[int], Any]) -> Any:
        """`compute(num_reqs)`, remembered per batch size: the planner asks about the same few B every
        step, and a scalar np.interp costs more than the dict lookup."""
        cache: dict[tuple[str, int], Any] = self._memo
        key = (name, num_reqs)
        value = cache.get(key)
        if value is None:
            value = cache[key] = compute(num_reqs)
        return value

    def _dense(self, name: str, length: int, compute: Callable[[np.ndarray], np.ndarray],
               limit: int | None = None) -> np.ndarray:
        """`compute(np.arange(n))` for some n >= `length` (n <= `limit`), built on first use and regrown by
        doubling.

        A step's M values are consecutive (B·f .. B·f + top), so with the table tabulated at every
        integer M the planner's lookup is a slice instead of a search or an interpolation per
        candidate; each entry is what `compute` gives for that M alone, so the values are the same.
        """
        dense: np.ndarray | None = self._memo.get((name, -1))
        if dense is None or dense.size < length:
            size = max(length, 64 if dense is None else 2 * dense.size)
            size = size if limit is None else min(size, limit)  # limit >= length: callers check the range
            dense = compute(np.arange(size))
            dense.flags.writeable = False  # slices of it are handed out
            self._memo[(name, -1)] = dense
        return dense


def _check_rows(what: str, num: int) -> None:
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 0:
        raise CostModelError(f"{what} must be an integer >= 0, got {num!r}")


def _check_range(first_row: int, count: int) -> None:
    """The integers of a run of `count` consecutive M values from `first_row` (each table checks the
    range against its own limits)."""
    for what, value in (("first_row", first_row), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise CostModelError(f"{what} must be an integer, got {value!r}")
    if count < 0:
        raise CostModelError(f"count must be >= 0 (how many consecutive M values), got {count}")


@dataclass(frozen=True)
class SpsTable(_FromFormat):
    """Steps per second over verify rows M, measured at `sample_batch_tokens` and looked up by floor."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    draft_bs_probes: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    decode_bs_probes: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()

    kind: ClassVar[str] = "sps-1d"
    format_model: ClassVar[type[Sps1dCostModel]] = Sps1dCostModel

    # numpy copies of the tuples, built once because the planner looks the table up every step.
    _tokens: np.ndarray = field(init=False, repr=False, compare=False)
    _rates: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "_tokens", np.array(self.sample_batch_tokens, np.int64))
        object.__setattr__(self, "_rates", np.array(self.sample_steps_per_sec, np.float64))

    @property
    def max_rows(self) -> int:
        """The largest feasible M: the table says nothing about steps beyond `max_batch_tokens`."""
        return self.max_batch_tokens

    def lookup(self, num_rows: int) -> float:
        """Steps per second at `num_rows` = M: the probe with the largest M <= num_rows (the first probe
        below it); no interpolation, so a tier cliff stays a cliff."""
        _check_rows("num_rows", num_rows)
        return float(self.lookup_many(np.array([num_rows]))[0])

    def step_time(self, num_reqs: int, num_rows: int) -> float:
        """Seconds of one verify step of M = `num_rows` rows, `1 / lookup(M)`: the table prices rows only,
        so `num_reqs` (there for the other kinds' signature) changes nothing."""
        return 1.0 / self.lookup(num_rows)

    def lookup_many(self, num_rows: np.ndarray) -> np.ndarray:
        """`lookup` over an array of M values."""
        rows = np.asarray(num_rows)
        if rows.size and (rows.min() < 0 or rows.max() > self.max_batch_tokens):
            bad = int(rows.max()) if rows.max() > self.max_batch_tokens else int(rows.min())
            raise CostModelError(f"num_rows {bad} is outside [0, max_batch_tokens={self.max_batch_tokens}]"
                                 "; keep M within the profiled range or profile larger steps")
        index = np.searchsorted(self._tokens, rows, side="right") - 1
        return self._rates[np.maximum(index, 0)]

    def rates_for_rows(self, first_row: int, count: int) -> np.ndarray:
        """`lookup_many(np.arange(first_row, first_row + count))`, as a read-only slice of the table
        tabulated at every M."""
        _check_range(first_row, count)
        last = first_row + count - 1
        if count and (first_row < 0 or last > self.max_batch_tokens):
            bad = last if last > self.max_batch_tokens else first_row
            raise CostModelError(f"num_rows {bad} is outside [0, max_batch_tokens={self.max_batch_tokens}]"
                                 "; keep M within the profiled range or profile larger steps")
        rates = self._dense("rates", first_row + count, self.lookup_many, limit=self.max_batch_tokens + 1)
        return rates[first_row:first_row + count]


@dataclass(frozen=True)
class AdditiveCostTable(_FromFormat):
    """Step seconds `T(B, M) = bias + alpha(B) + theta(M)`, alpha and theta interpolated between probes."""

    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]
    draft_bs_probes: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    decode_bs_probes: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()
    context_len: int | None = None
    context_lens: tuple[int, ...] = ()
    context_bias_seconds: tuple[float, ...] = ()
    context_alpha_seconds: tuple[tuple[float, ...], ...] = ()
    context_theta_seconds: tuple[tuple[float, ...], ...] = ()
    context_draft_seconds: tuple[tuple[float, ...], ...] = ()
    context_decode_seconds: tuple[tuple[float, ...], ...] = ()

    kind: ClassVar[str] = "additive"
    format_model: ClassVar[type[AdditiveCostModel]] = AdditiveCostModel

    _bs: np.ndarray = field(init=False, repr=False, compare=False)
    _alpha: np.ndarray = field(init=False, repr=False, compare=False)
    _ms: np.ndarray = field(init=False, repr=False, compare=False)
    _theta: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        for name, values in (("_bs", self.bs_probes), ("_alpha", self.alpha_seconds), ("_ms", self.m_probes),
                             ("_theta", self.theta_seconds)):
            object.__setattr__(self, name, np.array(values, np.float64))

    @property
    def max_rows(self) -> None:
        """No row limit: theta is held constant beyond the last probe."""
        return None

    def at_context(self, context_len: float) -> AdditiveCostTable:
        """The table at a mean context of `context_len` tokens a request: every field interpolated linearly
        between the two profiled contexts around it; below the first, the first; beyond the last,
        extrapolated from the last two (attention reads grow with the context) up to twice the last context
        and held there, never cheaper than the last and kept monotone. Remembered per CONTEXT_QUANTUM tokens:
        the planner asks every step."""
        if not self.context_lens:
            return self
        key = int(round(max(context_len, 0.0) / CONTEXT_QUANTUM))
        return self._per_batch("context", key, self._interpolated)  # type: ignore[no-any-return]

    def _interpolated(self, key: int) -> AdditiveCostTable:
        assert self.context_len is not None
        lengths = np.array((self.context_len, *self.context_lens), np.float64)
        at = min(max(key * CONTEXT_QUANTUM, lengths[0]), 2 * lengths[-1])
        j = int(np.clip(np.searchsorted(lengths, at, side="right") - 1, 0, lengths.size - 2))
        weight = (at - lengths[j]) / (lengths[j + 1] - lengths[j])

        def blend(base: Any, rows: tuple[Any, ...]) -> Any:
            values = (base, *rows)
            a, b = np.asarray(values[j], np.float64), np.asarray(values[j + 1], np.float64)
            mixed = a + weight * (b - a)
            if weight > 1:  # extrapolated: never below the last profiled context, still monotone
                mixed = np.maximum(mixed, b)
                mixed = np.maximum.accumulate(mixed) if mixed.ndim else mixed
            return float(mixed) if np.ndim(mixed) == 0 else tuple(float(v) for v in mixed)

        terms = {"draft_seconds": blend(self.draft_seconds, self.context_draft_seconds) if self.draft_seconds
                 else (), "decode_seconds": blend(self.decode_seconds, self.context_decode_seconds)
                 if self.decode_seconds else ()}
        return AdditiveCostTable(
            bias_seconds=blend(self.bias_seconds, self.context_bias_seconds), bs_probes=self.bs_probes,
            alpha_seconds=blend(self.alpha_seconds, self.context_alpha_seconds), m_probes=self.m_probes,
            theta_seconds=blend(self.theta_seconds, self.context_theta_seconds),
            draft_bs_probes=self.draft_bs_probes, decode_bs_probes=self.decode_bs_probes, **terms)

    def step_time(self, num_reqs: int, num_rows: int) -> float:
        """Predicted seconds of one verify step with B = `num_reqs` requests and M = `num_rows` rows."""
        _check_rows("num_rows", num_rows)
        return float(self.step_time_many(num_reqs, np.array([num_rows]))[0])

    def step_time_many(self, num_reqs: int, num_rows: np.ndarray) -> np.ndarray:
        """`step_time` for one B over an array of M values."""
        _check_rows("num_reqs", num_reqs)
        rows = np.asarray(num_rows)
        if rows.size and rows.min() < 0:
            raise CostModelError(f"num_rows must be >= 0, got {int(rows.min())}")
        alpha = float(np.interp(num_reqs, self._bs, self._alpha))
        return self.bias_seconds + alpha + np.interp(rows, self._ms, self._theta)

    def step_time_for_rows(self, num_reqs: int, first_row: int, count: int) -> np.ndarray:
        """`step_time_many(num_reqs, np.arange(first_row, first_row + count))`, from alpha remembered per B
        and theta tabulated at every M."""
        _check_rows("num_reqs", num_reqs)
        _check_range(first_row, count)
        if count and first_row < 0:
            raise CostModelError(f"num_rows must be >= 0, got {first_row}")
        alpha = self._per_batch("alpha", num_reqs, lambda b: float(np.interp(b, self._bs, self._alpha)))
        theta = self._dense("theta", first_row + count, lambda rows: np.interp(rows, self._ms, self._theta))
        return self.bias_seconds + alpha + theta[first_row:first_row + count]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TierCostTable(_FromFormat):
    """Step seconds measured per (B, graph tier): a step of M rows costs what its tier costs.

    With graph replay a step is padded up to the smallest captured tier >= M, so every M in
    `(previous tier, tier]` costs the same; the table keeps that step exactly instead of smoothing it.
    `step_seconds[i][j]` is the time at `bs_probes[i]` requests in `tiers[j]`. Along B the time is
    linearly interpolated within one tier's column and clamped at the end probes; nothing is ever
    interpolated across a tier boundary. M above the last tier has no graph and is infeasible.
    """

    tiers: tuple[int, ...]
    bs_probes: tuple[int, ...]
    step_seconds: tuple[tuple[float, ...], ...]
    draft_bs_probes: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    decode_bs_probes: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()

    kind: ClassVar[str] = "tier"
    format_model: ClassVar[type[TierCostModel]] = TierCostModel

    _tiers: np.ndarray = field(init=False, repr=False, compare=False)
    _bs: np.ndarray = field(init=False, repr=False, compare=False)
    _seconds: np.ndarray = field(init=False, repr=False, compare=False)  # [len(bs_probes), len(tiers)]
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _decode_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "_tiers", np.array(self.tiers, np.int64))
        object.__setattr__(self, "_bs", np.array(self.bs_probes, np.float64))
        object.__setattr__(self, "_seconds", np.array(self.step_seconds, np.float64).reshape(
            len(self.bs_probes), len(self.tiers)))

    @property
    def max_rows(self) -> int:
        """The largest feasible M: the last tier; a bigger step has no captured graph to replay in."""
        return self.tiers[-1]

    def tier_of(self, num_rows: int) -> int:
        """The tier a step of `num_rows` rows replays in: the smallest tier >= M."""
        _check_rows("num_rows", num_rows)
        return self.tiers[int(self._tier_index(np.array([num_rows]))[0])]

    def _tier_index(self, rows: np.ndarray) -> np.ndarray:
        """Index into `tiers` of the tier each M replays in."""
        if rows.size and (rows.min() < 0 or rows.max() > self.tiers[-1]):
            bad = int(rows.max()) if rows.max() > self.tiers[-1] else int(rows.min())
            raise CostModelError(f"num_rows {bad} is outside [0, last tier={self.tiers[-1]}]; a step above "
                                 "the last tier has no graph to replay in, so keep M within the tiers or "
                                 "capture and profile a larger tier")
        return np.searchsorted(self._tiers, rows, side="left")

    def _seconds_at(self, num_reqs: int) -> np.ndarray:
        """Seconds per tier at B = `num_reqs`: each tier's column interpolated along B, clamped."""
        _check_rows("num_reqs", num_reqs)
        hi = int(np.searchsorted(self._bs, num_reqs, side="left"))
        if hi == len(self.bs_probes):
            return self._seconds[-1]
        if hi == 0 or self.bs_probes[hi] == num_reqs:
            return self._seconds[hi]
        lo = hi - 1
        weight = (num_reqs - self._bs[lo]) / (self._bs[hi] - self._bs[lo])
        return (1.0 - weight) * self._seconds[lo] + weight * self._seconds[hi]

    def step_time(self, num_reqs: int, num_rows: int) -> float:
        """Predicted seconds of one verify step with B = `num_reqs` requests and M = `num_rows` rows."""
        _check_rows("num_rows", num_rows)
        return float(self.step_time_many(num_reqs, np.array([num_rows]))[0])

    def step_time_many(self, num_reqs: int, num_rows: np.ndarray) -> np.ndarray:
        """`step_time` for one B over an array of M values."""
        return self._seconds_at(num_reqs)[self._tier_index(np.asarray(num_rows))]

    def step_time_for_rows(self, num_reqs: int, first_row: int, count: int) -> np.ndarray:
        """`step_time_many(num_reqs, np.arange(first_row, first_row + count))`, from the per-tier seconds
        remembered per B and the tier index tabulated at every M."""
        _check_rows("num_reqs", num_reqs)
        _check_range(first_row, count)
        last = first_row + count - 1
        if count and (first_row < 0 or last > self.tiers[-1]):
            self._tier_index(np.array([last if last > self.tiers[-1] else first_row]))  # raises its error
        index = self._dense("tier_index", first_row + count, self._tier_index, limit=self.tiers[-1] + 1)
        seconds: np.ndarray = self._per_batch("seconds", num_reqs, self._seconds_at)
        return seconds[index[first_row:first_row + count]]


CostModel = SpsTable | AdditiveCostTable | TierCostTable


def cost_model_from_format(table: CostTable) -> CostModel:
    """The runtime table of a validated format model."""
    runtime_class = {SpsTable.kind: SpsTable, AdditiveCostTable.kind: AdditiveCostTable,
                     TierCostTable.kind: TierCostTable}[table.type]
    return runtime_class.from_format(table)  # type: ignore[no-any-return]


def cost_model_from_dict(data: Mapping[str, Any], where: str) -> CostModel:
    """A runtime table from its JSON object (as a generated config embeds it); `where` (a file path or a
    place such as `PLAN.cost_model`) starts every error. The kind follows from the keys, and an
    optional "type" must agree with them (`dspark.formats.cost_tables.cost_table_kind`)."""
    return cost_model_from_format(cost_table_from_json(data, where))


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """A runtime table from a table file (SGLang's format)."""
    return cost_model_from_format(read_cost_table(path))
