"""`profile.json`: the one definition of a step-time profile, with its plan, samples, reader and writer.

`dspark profile` measures the verify step at the `(B, M)` points of a `ProfilePlan` and keeps every
measured repeat (`ProfileSample`) in a `ProfileResult`, saved as `profile.json` beside the tables it
fitted, so a fit can be redone without the device. `dspark cost-eval` and `dspark report` read it back.
`meta` records what was profiled (deployment, backend, device, dtype, verify mode, context length and
the graph tiers as "8,16,32"; docs/formats.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark.formats.json_io import (
    FormatError,
    errors_as,
    int_field,
    int_list,
    read_json_file,
    reject_unknown,
    require_object,
    typed_field,
    write_json_file,
)

PROFILE_FORMAT = "dspark-profile"
PROFILE_VERSION = 1
DEFAULT_M_BIN = 64  # the additive fit's M bin width unless the plan says otherwise

Sample = tuple[int, int, float]
"""One measurement: `(num_reqs B, num_rows M, seconds)`."""


class ProfileError(FormatError):
    """A profile (file, plan or sample) is malformed; the message names where and what."""


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure.

    Static sweep: `M = B·N` for each batch size (the 1D SPS table). Off-diagonal grid: for each `B`,
    `grid_density` row counts spaced evenly over `[B·f, B·N]` (the additive fit), plus every `extra_rows`
    value inside that range (rows around the graph tiers, where tier cliffs sit). Each point runs `warmup`
    unmeasured steps (first replay of a shape, allocator growth) and then `repeats` measured ones, whose
    median is the point's time. `max_rows` (e.g. the largest graph tier) drops any point with more rows; a
    batch size whose static point exceeds it keeps only its grid points.
    """

    batch_sizes: tuple[int, ...]
    num_draft_tokens: int
    min_verify_len: int = 1
    grid_density: int = 8
    repeats: int = 5
    warmup: int = 2
    m_bin: int = DEFAULT_M_BIN
    max_rows: int | None = None
    extra_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Canonical form (sorted tuples) so equal plans compare equal and JSON round-trips exactly.
        given = [int(b) for b in self.batch_sizes]
        if not given:
            raise ProfileError("ProfilePlan.batch_sizes is empty; list the batch sizes to profile, "
                               "e.g. (1, 2, 4, 8)")
        if any(b < 1 for b in given) or len(set(given)) != len(given):
            raise ProfileError(f"ProfilePlan.batch_sizes must be distinct integers >= 1, got {tuple(given)}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(given)))
        object.__setattr__(self, "extra_rows", tuple(sorted({int(m) for m in self.extra_rows})))
        if self.num_draft_tokens < 1:
            raise ProfileError(f"ProfilePlan.num_draft_tokens (N = gamma + 1) must be >= 1, got "
                               f"{self.num_draft_tokens}")
        if not 1 <= self.min_verify_len <= self.num_draft_tokens:
            raise ProfileError(f"ProfilePlan.min_verify_len must be in [1, N={self.num_draft_tokens}], got "
                               f"{self.min_verify_len}")
        if self.grid_density < 2:
            raise ProfileError(f"ProfilePlan.grid_density must be >= 2 (both ends of [B·f, B·N]), got "
                               f"{self.grid_density}")
        for name, low in (("repeats", 1), ("warmup", 0), ("m_bin", 1)):
            if getattr(self, name) < low:
                raise ProfileError(f"ProfilePlan.{name} must be >= {low}, got {getattr(self, name)}")
        if any(m < 1 for m in self.extra_rows):
            raise ProfileError(f"ProfilePlan.extra_rows must be >= 1, got {self.extra_rows}")
        if self.max_rows is not None:
            too_big = [b for b in self.batch_sizes if b * self.min_verify_len > self.max_rows]
            if too_big:
                raise ProfileError(f"batch sizes {too_big} need at least B·min_verify_len rows, more than "
                                   f"max_rows={self.max_rows}; drop them or raise max_rows")
            if not self.static_batch_sizes:
                raise ProfileError(f"no batch size has B·N <= max_rows={self.max_rows}, so the static sweep "
                                   "would be empty; add a smaller batch size or raise max_rows")

    @property
    def static_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose full static step `B·N` fits under `max_rows`, ascending."""
        limit = self.max_rows
        return tuple(b for b in self.batch_sizes if limit is None or b * self.num_draft_tokens <= limit)

    @property
    def max_batch_tokens(self) -> int:
        """The most rows a step may have: `max_rows`, or the largest static step when unset."""
        if self.max_rows is not None:
            return self.max_rows
        return max(self.batch_sizes) * self.num_draft_tokens

    def grid_rows(self, num_reqs: int) -> tuple[int, ...]:
        """Off-diagonal row counts for one batch size, ascending, without the static point `B·N`."""
        low = num_reqs * self.min_verify_len
        high = num_reqs * self.num_draft_tokens
        if self.max_rows is not None:
            high = min(high, self.max_rows)
        spaced = np.rint(np.linspace(low, high, self.grid_density)).astype(int).tolist()
        rows = set(spaced) | {m for m in self.extra_rows if low <= m <= high}
        rows.discard(num_reqs * self.num_draft_tokens)
        return tuple(sorted(rows))

    def points(self) -> list[tuple[str, int, int]]:
        """Every `(kind, B, M)` the profile measures: the static sweep first, then the grid."""
        static = [("static", b, b * self.num_draft_tokens) for b in self.static_batch_sizes]
        grid = [("grid", b, m) for b in self.batch_sizes for m in self.grid_rows(b)]
        return static + grid

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["batch_sizes"] = list(self.batch_sizes)
        out["extra_rows"] = list(self.extra_rows)
        return out

    @classmethod
    @errors_as(ProfileError)
    def from_json(cls, data: Any, where: str = "plan") -> ProfilePlan:
        data = require_object(data, where, "a profile plan")
        reject_unknown(data, [f.name for f in dataclasses.fields(cls)], where)
        values: dict[str, Any] = {"batch_sizes": int_list(data, "batch_sizes", where, minimum=1),
                                  "num_draft_tokens": int_field(data, "num_draft_tokens", where, minimum=1),
                                  "extra_rows": int_list(data, "extra_rows", where, minimum=1)
                                  if "extra_rows" in data else ()}
        for name in ("min_verify_len", "grid_density", "repeats", "warmup", "m_bin"):
            if name in data:
                values[name] = int_field(data, name, where)
        values["max_rows"] = int_field(data, "max_rows", where, nullable=True, minimum=1)
        try:
            return cls(**values)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None


@dataclass(frozen=True)
class ProfileSample:
    """Every measured repeat of one `(B, M)` point, in call order, warmup excluded."""

    num_reqs: int
    num_rows: int
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        if not self.seconds:
            raise ProfileError(f"sample (B={self.num_reqs}, M={self.num_rows}) has no measurements")
        bad = [s for s in self.seconds if not np.isfinite(s) or s <= 0.0]
        if bad:
            raise ProfileError(f"sample (B={self.num_reqs}, M={self.num_rows}) has step times {bad}; the "
                               "timer must return the wall seconds of one synchronised forward (> 0)")

    @property
    def median_seconds(self) -> float:
        return float(np.median(self.seconds))

    def as_sample(self) -> Sample:
        return (self.num_reqs, self.num_rows, self.median_seconds)

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "num_rows": self.num_rows, "seconds": list(self.seconds)}

    @classmethod
    @errors_as(ProfileError)
    def from_json(cls, data: Any, where: str) -> ProfileSample:
        data = require_object(data, where, "a profile sample")
        reject_unknown(data, ("num_reqs", "num_rows", "seconds"), where)
        seconds = typed_field(data, "seconds", (list,), where)
        if any(isinstance(s, bool) or not isinstance(s, (int, float)) for s in seconds):
            raise ProfileError(f"{where}: field 'seconds' must hold numbers, got {seconds!r:.60}")
        try:
            return cls(int_field(data, "num_reqs", where, minimum=1),
                       int_field(data, "num_rows", where, minimum=1), tuple(seconds))
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None


def parse_tiers(text: str) -> tuple[int, ...]:
    """The graph tiers of a profile's `meta["tiers"]` ("8,16,24"); () when it records none."""
    text = text.strip()
    if not text:
        return ()
    try:
        tiers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ProfileError(f"meta.tiers is {text!r}; expected comma-separated integers such as "
                           "'8,16,32'") from None
    if any(t < 1 for t in tiers) or any(b <= a for a, b in zip(tiers, tiers[1:], strict=False)):
        raise ProfileError(f"meta.tiers is {text!r}; tiers must be >= 1 and strictly increasing")
    return tiers


@dataclass(frozen=True)
class ProfileResult:
    """The raw measurements of one profile; `save`/`load` keep them so the fit can be redone offline."""

    plan: ProfilePlan
    static: tuple[ProfileSample, ...]
    grid: tuple[ProfileSample, ...]
    meta: Mapping[str, str] = field(default_factory=dict)
    tiers: tuple[int, ...] = field(init=False)  # the graph tiers meta records, parsed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", parse_tiers(self.meta.get("tiers", "")))

    @property
    def max_batch_tokens(self) -> int:
        return self.plan.max_batch_tokens

    def static_samples(self) -> list[Sample]:
        return [s.as_sample() for s in self.static]

    def fit_samples(self) -> list[Sample]:
        """Static and grid medians together: the additive fit uses every measured point."""
        return [s.as_sample() for s in (*self.static, *self.grid)]

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "plan": self.plan.to_json(),
                "meta": dict(self.meta), "static": [s.to_json() for s in self.static],
                "grid": [s.to_json() for s in self.grid]}

    @classmethod
    @errors_as(ProfileError)
    def from_json(cls, data: Any, where: str = "profile") -> ProfileResult:
        data = require_object(data, where, "a profile")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: not a profile result (format={data.get('format')!r}, expected "
                               f"{PROFILE_FORMAT!r}); pass the profile.json that `dspark profile` wrote")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}: profile result version {data.get('version')!r} is not supported "
                               f"(this dspark reads version {PROFILE_VERSION}); re-run the profile")
        reject_unknown(data, ("format", "version", "plan", "meta", "static", "grid"), where)
        meta = typed_field(data, "meta", (dict,), where, nullable=True) or {}
        samples = {kind: tuple(ProfileSample.from_json(s, f"{where}: {kind}[{i}]")
                               for i, s in enumerate(typed_field(data, kind, (list,), where)))
                   for kind in ("static", "grid")}
        try:
            return cls(plan=ProfilePlan.from_json(data.get("plan"), f"{where}: plan"),
                       static=samples["static"], grid=samples["grid"],
                       meta={str(k): str(v) for k, v in meta.items()})
        except ProfileError as err:
            message = str(err)
            raise ProfileError(message if message.startswith(where) else f"{where}: {message}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_json_file(path, self.to_json(), indent=1)

    @classmethod
    @errors_as(ProfileError)
    def load(cls, path: str | os.PathLike[str]) -> ProfileResult:
        data = read_json_file(path, "profile", "pass the profile.json `dspark profile` wrote", ProfileError)
        return cls.from_json(data, str(path))
