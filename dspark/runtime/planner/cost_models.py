"""Step-cost models the planner divides expected progress by (DESIGN.md §6).

Three kinds; the first two keep the JSON field names SGLang writes and reads:

- `SpsTable` ("sps-1d"): steps per second over the step's verify rows M, looked up by floor, so a graph
  tier cliff is represented exactly.
- `AdditiveCostTable` ("additive"): step seconds `T(B, M) = bias + alpha(B) + theta(M)`, alpha and theta
  linearly interpolated; it smooths tier cliffs.
- `TierCostTable` ("tier"): step seconds measured per (B, graph tier); a step of M rows costs what the
  smallest tier >= M costs (graph replay pads it there), interpolated along B only, never across a tier.

Any of them may carry a draft-cost term (seconds the draft model takes for B requests), which the planner
adds to the step time. No torch here: the compiler and the reports read these tables without a device stack.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dspark.atomic import atomic_write_text


class CostModelError(ValueError):
    """A cost-model table or file is malformed; the message names the field and says what to fix."""


def _as_ints(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise CostModelError(f"{name} must be a list of integers, got {values!r}")
    out = []
    for i, value in enumerate(values):
        # bool is an int subclass; a JSON `true` among probes is a typo, not the count 1.
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise CostModelError(f"{name} item {i} must be an integer, got {value!r}; "
                                 "probes are row or request counts")
        out.append(int(value))
    return tuple(out)


def _as_floats(name: str, values: Any) -> tuple[float, ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise CostModelError(f"{name} must be a list of numbers, got {values!r}")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise CostModelError(f"{name} item {i} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise CostModelError(f"{name} item {i} is {value}; re-measure that probe or drop it")
        out.append(float(value))
    return tuple(out)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CostModelError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CostModelError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise CostModelError(f"{name} is {value}; it must be a finite number of seconds")
    return float(value)


def _check_probes(name: str, probes: tuple[int, ...]) -> None:
    if not probes:
        raise CostModelError(f"{name} is empty; a table needs at least one probe")
    for i, probe in enumerate(probes):
        if probe < 1:
            raise CostModelError(f"{name} item {i} is {probe}; probes count rows or requests and must "
                                 "be >= 1")
        if i and probe <= probes[i - 1]:
            raise CostModelError(f"{name} must be strictly increasing: item {i} ({probe}) follows "
                                 f"{probes[i - 1]}; sort the probes and remove duplicates")


def _check_values(name: str, values: tuple[float, ...], probes_name: str, num_probes: int, *,
                  positive: bool) -> None:
    if len(values) != num_probes:
        raise CostModelError(f"{name} has {len(values)} values but {probes_name} has {num_probes} "
                             f"probes; give exactly one {name} value per probe")
    for i, value in enumerate(values):
        if positive and value <= 0:
            raise CostModelError(f"{name} item {i} is {value}; steps per second must be > 0 "
                                 "(re-measure that probe or drop it)")
        if not positive and value < 0:
            raise CostModelError(f"{name} item {i} is {value}; seconds must be >= 0 (check the fit)")


def _check_draft(probes: tuple[int, ...], seconds: tuple[float, ...]) -> None:
    if not probes and not seconds:
        return
    if not probes or not seconds:
        given, missing = ("draft_bs_probes", "draft_seconds") if probes else ("draft_seconds",
                                                                            "draft_bs_probes")
        raise CostModelError(f"{given} is given but {missing} is empty; give both draft lists or "
                             "neither")
    _check_probes("draft_bs_probes", probes)
    _check_values("draft_seconds", seconds, "draft_bs_probes", len(probes), positive=False)


def _check_rows(what: str, num: int) -> None:
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 0:
        raise CostModelError(f"{what} must be an integer >= 0, got {num!r}")


def _draft_time(probes: np.ndarray, seconds: np.ndarray, num_reqs: int) -> float:
    _check_rows("num_reqs", num_reqs)
    if seconds.size == 0:
        return 0.0
    return float(np.interp(num_reqs, probes, seconds))


def _draft_json(probes: tuple[int, ...], seconds: tuple[float, ...]) -> dict[str, Any]:
    return {"draft_bs_probes": list(probes), "draft_seconds": list(seconds)} if probes else {}


@dataclass(frozen=True)
class SpsTable:
    """Steps per second over verify rows M, measured at `sample_batch_tokens` and looked up by floor."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    draft_bs_probes: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()

    kind: ClassVar[str] = "sps-1d"

    # numpy copies of the tuples, built once because the planner looks the table up every step.
    _tokens: np.ndarray = field(init=False, repr=False, compare=False)
    _rates: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Coerce first so lists from JSON are accepted and the frozen table stays hashable.
        tokens = _as_ints("sample_batch_tokens", self.sample_batch_tokens)
        rates = _as_floats("sample_steps_per_sec", self.sample_steps_per_sec)
        max_tokens = _as_int("max_batch_tokens", self.max_batch_tokens)
        draft_probes = _as_ints("draft_bs_probes", self.draft_bs_probes)
        draft_seconds = _as_floats("draft_seconds", self.draft_seconds)
        _check_probes("sample_batch_tokens", tokens)
        _check_values("sample_steps_per_sec", rates, "sample_batch_tokens", len(tokens), positive=True)
        if max_tokens < 1:
            raise CostModelError(f"max_batch_tokens is {max_tokens}; it is the largest step (in verify "
                                 "rows) the table may be used for and must be >= 1")
        _check_draft(draft_probes, draft_seconds)
        for name, value in (("sample_batch_tokens", tokens), ("sample_steps_per_sec", rates),
                            ("max_batch_tokens", max_tokens), ("draft_bs_probes", draft_probes),
                            ("draft_seconds", draft_seconds), ("_tokens", np.array(tokens, np.int64)),
                            ("_rates", np.array(rates, np.float64)),
                            ("_draft_probes", np.array(draft_probes, np.float64)),
                            ("_draft_seconds", np.array(draft_seconds, np.float64))):
            object.__setattr__(self, name, value)

    @property
    def max_rows(self) -> int:
        """The largest feasible M: the table says nothing about steps beyond `max_batch_tokens`."""
        return self.max_batch_tokens

    def lookup(self, num_rows: int) -> float:
        """Steps per second at `num_rows` = M: the probe with the largest M <= num_rows (the first probe
        below it); no interpolation, so a tier cliff stays a cliff."""
        _check_rows("num_rows", num_rows)
        return float(self.lookup_many(np.array([num_rows]))[0])

    def lookup_many(self, num_rows: np.ndarray) -> np.ndarray:
        """`lookup` over an array of M values."""
        rows = np.asarray(num_rows)
        if rows.size and (rows.min() < 0 or rows.max() > self.max_batch_tokens):
            bad = int(rows.max()) if rows.max() > self.max_batch_tokens else int(rows.min())
            raise CostModelError(f"num_rows {bad} is outside [0, max_batch_tokens={self.max_batch_tokens}]"
                                 "; keep M within the profiled range or profile larger steps")
        index = np.searchsorted(self._tokens, rows, side="right") - 1
        return self._rates[np.maximum(index, 0)]

    def draft_time(self, num_reqs: int) -> float:
        """Seconds the draft model takes for `num_reqs` requests (0.0 without a draft term)."""
        return _draft_time(self._draft_probes, self._draft_seconds, num_reqs)

    def to_json(self) -> dict[str, Any]:
        return {"sample_batch_tokens": list(self.sample_batch_tokens),
                "sample_steps_per_sec": list(self.sample_steps_per_sec),
                "max_batch_tokens": self.max_batch_tokens,
                **_draft_json(self.draft_bs_probes, self.draft_seconds)}


@dataclass(frozen=True)
class AdditiveCostTable:
    """Step seconds `T(B, M) = bias + alpha(B) + theta(M)`, alpha and theta interpolated between probes."""

    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]
    draft_bs_probes: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()

    kind: ClassVar[str] = "additive"

    _bs: np.ndarray = field(init=False, repr=False, compare=False)
    _alpha: np.ndarray = field(init=False, repr=False, compare=False)
    _ms: np.ndarray = field(init=False, repr=False, compare=False)
    _theta: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bias = _as_float("bias_seconds", self.bias_seconds)
        bs = _as_ints("bs_probes", self.bs_probes)
        alpha = _as_floats("alpha_seconds", self.alpha_seconds)
        ms = _as_ints("m_probes", self.m_probes)
        theta = _as_floats("theta_seconds", self.theta_seconds)
        draft_probes = _as_ints("draft_bs_probes", self.draft_bs_probes)
        draft_seconds = _as_floats("draft_seconds", self.draft_seconds)
        if bias < 0:
            raise CostModelError(f"bias_seconds is {bias}; seconds must be >= 0 (check the fit)")
        _check_probes("bs_probes", bs)
        _check_values("alpha_seconds", alpha, "bs_probes", len(bs), positive=False)
        _check_probes("m_probes", ms)
        _check_values("theta_seconds", theta, "m_probes", len(ms), positive=False)
        # Interpolation never leaves [min, max] of the probe values, so this bounds every T(B, M) below;
        # a zero-second step would make every budget's objective infinite.
        if bias + min(alpha) + min(theta) <= 0:
            raise CostModelError("bias_seconds + min(alpha_seconds) + min(theta_seconds) is 0, so some "
                                 "steps would be predicted to take no time; re-fit the table")
        _check_draft(draft_probes, draft_seconds)
        for name, value in (("bias_seconds", bias), ("bs_probes", bs), ("alpha_seconds", alpha),
                            ("m_probes", ms), ("theta_seconds", theta), ("draft_bs_probes", draft_probes),
                            ("draft_seconds", draft_seconds), ("_bs", np.array(bs, np.float64)),
                            ("_alpha", np.array(alpha, np.float64)), ("_ms", np.array(ms, np.float64)),
                            ("_theta", np.array(theta, np.float64)),
                            ("_draft_probes", np.array(draft_probes, np.float64)),
                            ("_draft_seconds", np.array(draft_seconds, np.float64))):
            object.__setattr__(self, name, value)

    @property
    def max_rows(self) -> None:
        """No row limit: theta is held constant beyond the last probe."""
        return None

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

    def draft_time(self, num_reqs: int) -> float:
        """Seconds the draft model takes for `num_reqs` requests (0.0 without a draft term)."""
        return _draft_time(self._draft_probes, self._draft_seconds, num_reqs)

    def to_json(self) -> dict[str, Any]:
        return {"bias_seconds": self.bias_seconds, "bs_probes": list(self.bs_probes),
                "alpha_seconds": list(self.alpha_seconds), "m_probes": list(self.m_probes),
                "theta_seconds": list(self.theta_seconds),
                **_draft_json(self.draft_bs_probes, self.draft_seconds)}


def _as_float_rows(name: str, rows: Any) -> tuple[tuple[float, ...], ...]:
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, (Sequence, np.ndarray)):
        raise CostModelError(f"{name} must be a list of rows (one list of seconds over the tiers per "
                             f"bs_probes entry), got {rows!r}")
    return tuple(_as_floats(f"{name} row {i}", row) for i, row in enumerate(rows))


@dataclass(frozen=True)
class TierCostTable:
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

    kind: ClassVar[str] = "tier"

    _tiers: np.ndarray = field(init=False, repr=False, compare=False)
    _bs: np.ndarray = field(init=False, repr=False, compare=False)
    _seconds: np.ndarray = field(init=False, repr=False, compare=False)  # [len(bs_probes), len(tiers)]
    _draft_probes: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_seconds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tiers = _as_ints("tiers", self.tiers)
        bs = _as_ints("bs_probes", self.bs_probes)
        seconds = _as_float_rows("step_seconds", self.step_seconds)
        draft_probes = _as_ints("draft_bs_probes", self.draft_bs_probes)
        draft_seconds = _as_floats("draft_seconds", self.draft_seconds)
        _check_probes("tiers", tiers)
        _check_probes("bs_probes", bs)
        if len(seconds) != len(bs):
            raise CostModelError(f"step_seconds has {len(seconds)} rows but bs_probes has {len(bs)} probes; "
                                 "give one row (a list over the tiers) per bs_probes entry")
        for i, row in enumerate(seconds):
            if len(row) != len(tiers):
                raise CostModelError(f"step_seconds row {i} (B={bs[i]}) has {len(row)} values but tiers has "
                                     f"{len(tiers)}; give one value per tier")
            for j, value in enumerate(row):
                if value <= 0:
                    raise CostModelError(f"step_seconds row {i} (B={bs[i]}) item {j} (tier {tiers[j]}) is "
                                         f"{value}; step seconds must be > 0 (re-measure that cell or "
                                         "re-fit the table)")
        _check_draft(draft_probes, draft_seconds)
        for name, value in (("tiers", tiers), ("bs_probes", bs), ("step_seconds", seconds),
                            ("draft_bs_probes", draft_probes), ("draft_seconds", draft_seconds),
                            ("_tiers", np.array(tiers, np.int64)), ("_bs", np.array(bs, np.float64)),
                            ("_seconds", np.array(seconds, np.float64).reshape(len(bs), len(tiers))),
                            ("_draft_probes", np.array(draft_probes, np.float64)),
                            ("_draft_seconds", np.array(draft_seconds, np.float64))):
            object.__setattr__(self, name, value)

    @property
    def max_rows(self) -> int:
        """The largest feasible M: the last tier; a bigger step has no captured graph to replay in."""
        return self.tiers[-1]

    def tier_of(self, num_rows: int) -> int:
        """The tier a step of `num_rows` rows replays in: the smallest tier >= M."""
        _check_rows("num_rows", num_rows)
        return self.tiers[int(self._tier_index(np.array([num_rows]))[0])]

    def _tier_index(self, rows: np.ndarray) -> np.ndarray:
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
        per_tier = self._seconds_at(num_reqs)
        return per_tier[self._tier_index(np.asarray(num_rows))]

    def draft_time(self, num_reqs: int) -> float:
        """Seconds the draft model takes for `num_reqs` requests (0.0 without a draft term)."""
        return _draft_time(self._draft_probes, self._draft_seconds, num_reqs)

    def to_json(self) -> dict[str, Any]:
        return {"tiers": list(self.tiers), "bs_probes": list(self.bs_probes),
                "step_seconds": [list(row) for row in self.step_seconds],
                **_draft_json(self.draft_bs_probes, self.draft_seconds)}


CostModel = SpsTable | AdditiveCostTable | TierCostTable

_KEYS: dict[str, tuple[str, ...]] = {
    SpsTable.kind: ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"),
    AdditiveCostTable.kind: ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"),
    TierCostTable.kind: ("tiers", "bs_probes", "step_seconds"),
}
_CLASSES: dict[str, type[SpsTable] | type[AdditiveCostTable] | type[TierCostTable]] = {
    SpsTable.kind: SpsTable, AdditiveCostTable.kind: AdditiveCostTable, TierCostTable.kind: TierCostTable,
}
_DRAFT_KEYS = ("draft_bs_probes", "draft_seconds")
# A key two kinds share (bs_probes) says nothing about which kind a table is; only these do.
_DISTINCT_KEYS: dict[str, tuple[str, ...]] = {
    kind: tuple(key for key in keys if not any(key in other for k, other in _KEYS.items() if k != kind))
    for kind, keys in _KEYS.items()
}


def _kinds_text() -> str:
    names = [repr(kind) for kind in _KEYS]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _article(kind: str) -> str:
    # Read aloud: "an ess-pee-ess", "an additive", "a tier".
    return "a" if kind == TierCostTable.kind else "an"


def _kind_of(data: Mapping[str, Any], where: str) -> str:
    declared = data.get("type")
    if declared is not None and declared not in _KEYS:
        raise CostModelError(f"{where}: type must be {_kinds_text()}, got {declared!r}")
    present = {kind: [key for key in keys if key in data] for kind, keys in _DISTINCT_KEYS.items()}
    found = [kind for kind, keys in present.items() if keys]
    if len(found) > 1:
        mixed = " and ".join(f"{kind} keys {present[kind]}" for kind in found)
        raise CostModelError(f"{where}: mixes {mixed}; a table is one kind, keep one set of keys")
    if not found:
        if declared is not None:
            return str(declared)
        options = ", ".join(f"the {kind} keys {list(keys)}" for kind, keys in _KEYS.items())
        raise CostModelError(f"{where}: cannot tell the cost-model kind; give one of {options}")
    if declared is not None and declared != found[0]:
        raise CostModelError(f"{where}: type is {declared!r} but the keys {present[found[0]]} are those "
                             f"of {_article(found[0])} {found[0]!r} table; fix the type or the keys")
    return found[0]


def cost_model_from_dict(data: Mapping[str, Any], where: str) -> CostModel:
    """Build a table from its JSON object; `where` (a file path or a spec location) prefixes errors.

    The kind is detected from the keys only one kind uses; an optional "type" must agree with them.
    """
    if not isinstance(data, Mapping):
        raise CostModelError(f"{where}: a cost model must be a JSON object, got {type(data).__name__}")
    # "fingerprint" records what the table was measured on (dspark.fingerprint); the compiler checks
    # it, the table itself does not depend on it, so it is accepted and left out of the fields.
    known = {"type", "fingerprint", *_DRAFT_KEYS, *(key for keys in _KEYS.values() for key in keys)}
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        uses = ", ".join(f"{kind} tables use {list(keys)}" for kind, keys in _KEYS.items())
        raise CostModelError(f"{where}: unknown cost-model keys {unknown}; {uses}, and all may add "
                             f"{list(_DRAFT_KEYS)}")
    kind = _kind_of(data, where)
    missing = [key for key in _KEYS[kind] if key not in data]
    if missing:
        raise CostModelError(f"{where}: the {kind} table is missing {missing}")
    fields = {key: data[key] for key in (*_KEYS[kind], *_DRAFT_KEYS) if key in data}
    try:
        return _CLASSES[kind](**fields)
    except CostModelError as error:
        raise CostModelError(f"{where}: {error}") from None


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """Read a table from a JSON file (the SGLang format)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise CostModelError(f"{path}: cannot read the cost-model file ({error.strerror or error}); "
                             "check the path") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CostModelError(f"{path}: not valid JSON at line {error.lineno} column {error.colno}: "
                             f"{error.msg}") from error
    return cost_model_from_dict(data, str(path))


def save_cost_model(table: CostModel, path: str | os.PathLike[str],
                    fingerprint: Mapping[str, Any] | None = None) -> Path:
    """Write `table` as JSON; atomic, so a reader never sees a half-written table. Returns the path.

    `fingerprint` (what the table was measured on) is stored beside the table's fields; the
    compiler compares it with the spec that names the file.
    """
    data = table.to_json()
    if fingerprint is not None:
        data["fingerprint"] = dict(fingerprint)
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")
