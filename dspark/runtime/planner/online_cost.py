"""The additive cost table refitted to the served steps' measured seconds (docs/planner.md, "Online cost
refit").

The step offset (`step_offset.py`) corrects the table by one line, measured ≈ a · priced + b: it cannot
move the table's shape, and the shape is what the planner weighs when it chooses how many rows to verify
(a table whose rows are half as dear as the served steps' makes it verify too many). The engine measures
every decode step, so the table's own knots can follow the load: each refit fits the residual of the
window's steps, measured − the compiled table's price of that step at its context, as

    r = s · price + c + sum_j a_j · hat_j(B) + sum_k t_k · hat_k(M)   (drafted: B requests, M verified rows)
    r = s · price + c + sum_j d_j · hat_j(B)                          (steps without speculation)

with hat functions at the table's own probes (`bs_probes`, `m_probes`, `decode_bs_probes`): piecewise-linear
interpolation weights, so adding a_j to alpha at `bs_probes[j]` is exactly what the correction says between
the knots too. The scale s multiplies every field of the table, the context term's included: what grows with
the price grows with the context too (a served step's attention reads cost more than the profile's, in
proportion), which a correction shared by every context could not follow when the traffic moves between
contexts. The intercept c is the bias's correction and shifts every price, the decode step's included,
as the step offset does, and is left almost free; the scale is penalised as a knot is (`ridge` pseudo-steps
at the window's median price: a few steps of one shape cannot tell a scale from an intercept, and a free one
swings to its limits on their noise), and the knot corrections are ridge-penalised towards zero (`ridge`
pseudo-steps at the table's own value), so a knot the traffic never visits keeps the table's value. The fit
is robust: one weighted least-squares solve, the steps beyond `outlier_mads` robust deviations of its
residuals left out, solved again until the set holds (a step that waited on a page fault or a garbage
collection is not the table's business).

The residual is always taken against the compiled table, never against the last refit, so corrections do not
compound and a knot the window no longer visits returns to the compiled value. The corrected table is every
context's fields (the context term's too, scaled and shifted by the same correction so the context shape is
kept) made non-decreasing along the probes as table files must be (pooled adjacent violators, each knot
weighted by its steps plus the ridge), negative parts moved into the bias (which leaves every price as it
was), the smallest step held above a hundredth of the compiled one, and validated by constructing the
`AdditiveCostTable`: the planner never sees a table a file could not hold.

Steps that cannot be priced or measured (non-finite or non-positive seconds, no request, a table without the
decode term for a step without speculation) are ignored. Appending a step costs a few array stores; a refit
over 512 steps is a few hundred microseconds of numpy, run between steps (`poll`), outside any step's
measured time. numpy only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.formats.cost_tables import CostTableError
from dspark.runtime.config import OnlineCostSettings
from dspark.runtime.planner.cost_models import CONTEXT_QUANTUM, AdditiveCostTable
from dspark.runtime.planner.isotonic import isotonic

LOG = logging.getLogger("dspark.cost")

DRAFTED, OFF = 0, 1  # the kind of a window's step: drafted and verified, or target-only
# A refitted table's smallest step at a context is at least this share of the compiled table's there: a fit
# that drives it to zero or below has extrapolated, and a step priced at nothing makes every budget infinite.
MIN_STEP_SHARE = 0.01
# Residuals within this share of the window's median step are never outliers: on an exact stream the
# robust deviation is rounding noise, and trimming by it would drop good steps.
OUTLIER_FLOOR = 1e-3
# The intercept is the level the hats cannot tell apart from it (their weights sum to one); it is left
# almost free, this little penalty only keeps the solve defined on a window of one step.
INTERCEPT_RIDGE = 1e-9
# The refitted table is the compiled one times 1 + s: held to this range, as the step offset's slope is.
SCALE_RANGE = (0.1, 10.0)


def hats(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """`[len(x), len(knots)]`: the weights with which `np.interp(x, knots, values)` mixes `values`, clamped
    beyond the end knots as it is (a single knot takes every point)."""
    out = np.zeros((x.size, knots.size))
    if knots.size == 1:
        out[:, 0] = 1.0
        return out
    left = np.clip(np.searchsorted(knots, x, side="right") - 1, 0, knots.size - 2)
    weight = np.clip((x - knots[left]) / (knots[left + 1] - knots[left]), 0.0, 1.0)
    rows = np.arange(x.size)
    out[rows, left] = 1.0 - weight
    out[rows, left + 1] += weight
    return out


@dataclass(frozen=True)
class Correction:
    """One refit: the scale (every price times 1 + scale), the intercept (seconds added to every price),
    each knot's correction, each knot's steps (the sum of its hat weights over the steps kept) and how many
    steps were fitted and left out."""

    scale: float
    intercept: float
    alpha: np.ndarray
    theta: np.ndarray
    decode: np.ndarray
    alpha_support: np.ndarray
    theta_support: np.ndarray
    decode_support: np.ndarray
    steps: int
    outliers: int


class OnlineCostRefit:
    """The window of measured decode steps and the refitted table (`table`: the compiled one until the first
    refit). The engine calls `observe_drafted` / `observe_off` after each step and `poll` between steps."""

    def __init__(self, table: AdditiveCostTable, settings: OnlineCostSettings) -> None:
        if not isinstance(table, AdditiveCostTable):
            raise TypeError(f"the online cost refit corrects an additive table, got {type(table).__name__}")
        self.compiled = table
        self.table = table
        self.settings = settings
        size = settings.window
        self._kind = np.zeros(size, np.int8)
        self._reqs = np.zeros(size)
        self._rows = np.zeros(size)
        self._context = np.zeros(size)
        self._measured = np.zeros(size)
        self._price = np.full(size, np.nan)  # the compiled table's, filled in by the next refit
        self._bs = np.asarray(table.bs_probes, np.float64)
        self._ms = np.asarray(table.m_probes, np.float64)
        self._ds = np.asarray(table.decode_bs_probes, np.float64)
        # each step's row of the fit's design (price, intercept, B hats, M hats, decode B hats)
        self._design = np.zeros((size, 2 + self._bs.size + self._ms.size + self._ds.size))
        self._next = 0
        self.size = 0  # steps in the window
        self.samples = 0  # steps observed since start
        self.ignored = 0  # steps that could not be priced or measured
        self.refits = 0  # refitted tables handed out by `poll`
        self.rejected = 0  # refits whose table failed validation (kept the table in use)
        self.last: Correction | None = None
        self._since = 0

    # -- on the step path: a few stores --------------------------------------------------------------------
    def observe_drafted(self, num_reqs: int, rows: int, context_len: float, seconds: float) -> None:
        """A drafted step: B requests, M rows verified (`sum(verify_lens)`, what the planner priced), the
        batch's mean cached tokens and the measured wall time."""
        if rows < num_reqs:
            self.ignored += 1
            return
        self._append(DRAFTED, num_reqs, rows, context_len, seconds)

    def observe_off(self, num_reqs: int, context_len: float, seconds: float) -> None:
        """A decode step without speculation (target-only, one row a request)."""
        if not self._ds.size:
            self.ignored += 1  # nothing to correct: the table does not price such steps
            return
        self._append(OFF, num_reqs, num_reqs, context_len, seconds)

    def _append(self, kind: int, num_reqs: int, rows: int, context_len: float, seconds: float) -> None:
        if not (num_reqs >= 1 and math.isfinite(seconds) and seconds > 0 and math.isfinite(context_len)
                and context_len >= 0):
            self.ignored += 1
            return
        at = self._next
        self._kind[at], self._reqs[at], self._rows[at] = kind, num_reqs, rows
        self._context[at], self._measured[at], self._price[at] = context_len, seconds, np.nan
        self._next = (at + 1) % self.settings.window
        self.size = min(self.size + 1, self.settings.window)
        self.samples += 1
        self._since += 1

    # -- between steps ---------------------------------------------------------------------------------------
    def poll(self) -> AdditiveCostTable | None:
        """The refitted table once `refit_every` new steps have come since the last refit (to swap in before
        the next step), else None; the table in use stays where a refit fails validation."""
        if self._since < self.settings.refit_every:
            return None
        self._since = 0
        table = self.refit()
        if table is None:
            return None
        self.table = table
        self.refits += 1
        return table

    def refit(self) -> AdditiveCostTable | None:
        """The window's refit of the compiled table (None on an empty window or a table that does not
        validate, which is logged)."""
        if not self.size:
            return None
        order = (self._next - self.size + np.arange(self.size)) % self.settings.window
        self._prepare(order[np.isnan(self._price[order])])
        correction = self.fit(order[np.isfinite(self._price[order])])
        self.last = correction
        try:
            return self.corrected(correction)
        except (CostTableError, ValueError) as error:
            self.rejected += 1
            LOG.warning("online cost refit: the refitted table is invalid (%s); the table in use stays",
                        error)
            return None

    def _prepare(self, steps: np.ndarray) -> None:
        """New steps' rows of the design and their price by the compiled table at their context (draft term
        included, step offset left out), as the planner computes it: the same context quantum, the same
        interpolation. Once per step, so a refit reads the window's rows without recomputing them."""
        if not steps.size:
            return
        drafted = (self._kind[steps] == DRAFTED)[:, None]
        reqs, nb, nm = self._reqs[steps], self._bs.size, self._ms.size
        design = self._design
        design[steps, 1] = 1.0
        design[steps, 2:2 + nb] = hats(reqs, self._bs) * drafted
        design[steps, 2 + nb:2 + nb + nm] = hats(self._rows[steps], self._ms) * drafted
        if self._ds.size:
            design[steps, 2 + nb + nm:] = hats(reqs, self._ds) * ~drafted
        # one price per context quantum, as the planner asks (one group where the table has no context term)
        keys = np.zeros(steps.size, np.int64)
        if self.compiled.context_lens:
            keys = np.round(self._context[steps] / CONTEXT_QUANTUM).astype(np.int64)
        for key in np.unique(keys):
            group = steps[keys == key]
            table = self.compiled.at_context(float(key * CONTEXT_QUANTUM))
            reqs, rows = self._reqs[group], self._rows[group]
            drafted = table.bias_seconds + np.interp(reqs, table.bs_probes, table.alpha_seconds) \
                + np.interp(rows, table.m_probes, table.theta_seconds)
            if table.draft_seconds:
                drafted = drafted + np.interp(reqs, table.draft_bs_probes, table.draft_seconds)
            off = np.interp(reqs, table.decode_bs_probes, table.decode_seconds) if table.decode_seconds \
                else np.full(group.size, np.nan)
            self._price[group] = np.where(self._kind[group] == DRAFTED, drafted, off)
        design[steps, 0] = self._price[steps]

    def fit(self, steps: np.ndarray) -> Correction:
        """The robust ridge fit of the residuals of `steps` (module docstring)."""
        s = self.settings
        nb, nm, nd = self._bs.size, self._ms.size, self._ds.size
        design = self._design[steps]
        measured = self._measured[steps]
        residual = measured - self._price[steps]
        penalty = np.full(design.shape[1], s.ridge)
        penalty[0] = s.ridge * float(np.median(self._price[steps])) ** 2 + INTERCEPT_RIDGE
        penalty[1] = INTERCEPT_RIDGE
        floor = OUTLIER_FLOOR * float(np.median(measured))
        keep = np.ones(steps.size, dtype=bool)
        for _ in range(4):  # refit without the outliers until the set holds (it rarely moves twice)
            x, r = design[keep], residual[keep]
            beta = np.linalg.solve(x.T @ x + np.diag(penalty), x.T @ r)
            error = residual - design @ beta
            centre = float(np.median(error[keep]))
            spread = max(1.4826 * float(np.median(np.abs(error[keep] - centre))), floor)
            kept = np.abs(error - centre) <= s.outlier_mads * spread
            if (kept == keep).all():
                break
            keep = kept
        support = design[keep].sum(axis=0)
        cut = np.cumsum((2, nb, nm, nd))
        scale = float(np.clip(1.0 + beta[0], *SCALE_RANGE)) - 1.0
        return Correction(scale=scale, intercept=float(beta[1]), alpha=beta[2:cut[1]],
                          theta=beta[cut[1]:cut[2]], decode=beta[cut[2]:cut[3]],
                          alpha_support=support[2:cut[1]], theta_support=support[cut[1]:cut[2]],
                          decode_support=support[cut[2]:cut[3]], steps=int(keep.sum()),
                          outliers=int((~keep).sum()))

    def corrected(self, c: Correction) -> AdditiveCostTable:
        """The compiled table with `c` added at every context, made a valid table (module docstring)."""
        base, ridge = self.compiled, self.settings.ridge
        if not all(np.isfinite(v).all() for v in (c.scale, c.intercept, c.alpha, c.theta, c.decode)):
            raise ValueError("the fit is not finite")
        k = 1.0 + c.scale

        def scaled(values: tuple[float, ...]) -> np.ndarray:
            return k * np.asarray(values, np.float64)

        def one(bias: float, alpha: tuple[float, ...], theta: tuple[float, ...], decode: tuple[float, ...]
                ) -> tuple[float, tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
            lowest = bias + alpha[0] + theta[0]  # the compiled smallest step here (> 0: the table is valid)
            new_bias = k * bias + c.intercept
            new_alpha = isotonic(scaled(alpha) + c.alpha, c.alpha_support + ridge)
            new_theta = isotonic(scaled(theta) + c.theta, c.theta_support + ridge)
            # Negative parts go into the bias, then a negative bias back out of alpha and theta: every price
            # stays what the fit says wherever it can.
            for values in (new_alpha, new_theta):
                if values[0] < 0:
                    new_bias += values[0]
                    values -= values[0]
            for values in (new_alpha, new_theta):
                if new_bias < 0:
                    moved = min(-new_bias, values[0])
                    values -= moved
                    new_bias += moved
            new_bias = max(new_bias, 0.0)
            new_bias += max(0.0, MIN_STEP_SHARE * lowest - (new_bias + new_alpha[0] + new_theta[0]))
            new_decode: tuple[float, ...] = ()
            if decode:
                pooled = isotonic(scaled(decode) + c.intercept + c.decode, c.decode_support + ridge)
                new_decode = tuple(np.maximum(pooled, MIN_STEP_SHARE * decode[0]).tolist())
            return float(new_bias), tuple(new_alpha.tolist()), tuple(new_theta.tolist()), new_decode

        bias, alpha, theta, decode = one(base.bias_seconds, base.alpha_seconds, base.theta_seconds,
                                         base.decode_seconds)
        contexts = [one(*fields) for fields in zip(
            base.context_bias_seconds, base.context_alpha_seconds, base.context_theta_seconds,
            base.context_decode_seconds or ((),) * len(base.context_lens), strict=True)]
        return AdditiveCostTable(
            bias_seconds=bias, bs_probes=base.bs_probes, alpha_seconds=alpha, m_probes=base.m_probes,
            theta_seconds=theta, draft_bs_probes=base.draft_bs_probes,
            draft_seconds=tuple(scaled(base.draft_seconds).tolist()),
            decode_bs_probes=base.decode_bs_probes, decode_seconds=decode, context_len=base.context_len,
            context_lens=base.context_lens, context_bias_seconds=tuple(b for b, _, _, _ in contexts),
            context_alpha_seconds=tuple(a for _, a, _, _ in contexts),
            context_theta_seconds=tuple(t for _, _, t, _ in contexts),
            context_draft_seconds=tuple(tuple(scaled(d).tolist()) for d in base.context_draft_seconds),
            context_decode_seconds=tuple(d for _, _, _, d in contexts) if base.decode_seconds else ())

    def state(self) -> dict[str, Any]:
        """The live figures (any thread): steps observed and ignored, the window's size, refits swapped in
        and rejected, and the last fit's intercept, steps and outliers (None before the first)."""
        last = self.last
        return {"samples": self.samples, "ignored": self.ignored, "window": self.size, "refits": self.refits,
                "rejected": self.rejected, "scale": None if last is None else 1.0 + last.scale,
                "intercept_seconds": None if last is None else last.intercept,
                "fitted_steps": None if last is None else last.steps,
                "outliers": None if last is None else last.outliers}


def plan_cost_model(table: AdditiveCostTable) -> dict[str, Any]:
    """The table as a plan embeds it (`AdaptiveVerifyPlan.cost_model`, what the compiler writes: its fields
    without the defaults), read off the validated table rather than validated once more on the way (the
    plan validates what it is given)."""
    fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(table) if f.init}
    return {"type": table.kind, **{name: value for name, value in fields.items()
                                   if value != AdditiveCostTable.__dataclass_fields__[name].default}}
