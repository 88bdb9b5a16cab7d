"""Graph tiers proved against every step the planner can produce, at compile time.

A step with B running requests runs M rows: static and cap-accept run exactly B x N, compact any M
in [B * f, B * cap] (f = max(min_verify_len, 1), cap = the resolved max_verify_len), for B from 1 to
serving.max_running_requests. With graph capture a step replays the smallest tier >= M, so:

- every feasible M must fit under the largest tier (else that step has no graph to replay);
- every tier must be the smallest tier >= M for some feasible M (else it is captured, holds
  memory and is never replayed: a tier above the largest step, or between two others with no
  step size in its range);
- static and cap-accept tiers are whole multiples of N (a request never runs part of its N rows),
  which also makes each hold at least one request.

"Some B in [lo, hi] has a step in the range" is an interval test on B, so the checks take time
proportional to the number of tiers, whatever max_running_requests or gamma are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dspark.spec.derived import num_draft_tokens, resolved_max_verify_len, tier_grid, verify_len_range
from dspark.spec.errors import SpecIssue
from dspark.spec.facts import SpecFacts
from dspark.spec.models import DeploymentSpec

_LISTED = 8  # tiers named in one message before "and k more"


@dataclass(frozen=True)
class StepShapes:
    """The row counts M a step can have: union over B = 1..requests of [B * floor, B * cap]."""

    mode: str
    requests: int
    floor: int  # fewest rows per request
    cap: int  # most rows per request

    @property
    def largest(self) -> int:
        return self.requests * self.cap

    def any_between(self, low: int, high: int) -> bool:
        """Whether some feasible M has low < M <= high."""
        first_b = max(1, -(-(low + 1) // self.cap))  # the fewest requests that can exceed `low`
        last_b = min(self.requests, high // self.floor)  # the most that can stay within `high`
        return first_b <= last_b

    def describe(self) -> str:
        if self.floor == self.cap:
            return f"B x {self.cap} rows for B = 1..{self.requests}"
        return f"between B x {self.floor} and B x {self.cap} rows for B = 1..{self.requests}"


def step_shapes(spec: DeploymentSpec) -> StepShapes:
    floor, cap = verify_len_range(spec)
    return StepShapes(str(spec.verify.mode), spec.serving.max_running_requests, floor, cap)


def _lens_valid(spec: DeploymentSpec) -> bool:
    # Invalid verify lengths are reported by check_verify_lens; step shapes are meaningless then.
    n, verify = num_draft_tokens(spec), spec.verify
    return n >= 2 and verify.max_verify_len <= n and verify.min_verify_len <= resolved_max_verify_len(spec)


def check_tiers_need_graphs(facts: SpecFacts) -> Iterator[SpecIssue]:
    graph, verify = facts.spec.graph, facts.spec.verify
    if graph.enabled:
        return
    for field in ("capture_batch_sizes", "token_tiers"):
        if getattr(graph, field):
            yield SpecIssue(("graph", field), f"graph.{field} is set but graph.enabled is false, so no "
                            f"graph is captured and the tiers would be silently ignored",
                            f"set graph.enabled: true, or remove graph.{field}")
    if verify.align_to_graph_tier:
        yield SpecIssue(("verify", "align_to_graph_tier"),
                        "tier alignment needs graph tiers, but graph.enabled is false",
                        "set graph.enabled: true with tiers, or align_to_graph_tier: false")


def check_tier_lists(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    graph, requests = spec.graph, spec.serving.max_running_requests
    if not graph.enabled:
        return
    if graph.capture_batch_sizes and graph.token_tiers:
        yield SpecIssue(("graph", "capture_batch_sizes"),
                        "graph.capture_batch_sizes is ignored when graph.token_tiers is given (the "
                        "token tiers replace batch size x N)",
                        "keep one of the two: token_tiers for explicit token counts, or "
                        "capture_batch_sizes for tiers of batch size x N")
        return
    over = [(i, bs) for i, bs in enumerate(graph.capture_batch_sizes) if bs > requests]
    if over:
        yield SpecIssue(("graph", "capture_batch_sizes", over[0][0]),
                        f"capture batch size{'s' if len(over) > 1 else ''} "
                        f"{_listing([bs for _, bs in over])} exceed serving.max_running_requests "
                        f"({requests}): no step runs that many requests, so the graph is never replayed",
                        f"remove them from graph.capture_batch_sizes, or raise "
                        f"serving.max_running_requests to {over[-1][1]}")


def check_tier_coverage(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if not spec.graph.enabled or not _lens_valid(spec):
        return
    tiers = tier_grid(spec)
    if not tiers:
        yield SpecIssue(("graph", "enabled"), "graph capture is enabled but defines no tiers",
                        "set graph.capture_batch_sizes (tiers = batch size x N) or "
                        "graph.token_tiers, or set graph.enabled: false")
        return
    if spec.graph.capture_batch_sizes and spec.graph.token_tiers:
        return  # check_tier_lists reports the conflict; the grid is ambiguous until it is fixed
    shapes = step_shapes(spec)
    field = "token_tiers" if spec.graph.token_tiers else "capture_batch_sizes"
    yield from _overflow(spec, shapes, tiers, field)
    partial = _partial_requests(spec, shapes, tiers, field)
    if partial:
        yield _partial_issue(shapes, tiers, field, partial)
    if field == "capture_batch_sizes" and any(bs > shapes.requests for bs in spec.graph.capture_batch_sizes):
        return  # check_tier_lists blames those batch sizes; their tiers are unreachable for that reason
    yield from _unreachable(shapes, tiers, field, set(partial))


def _overflow(spec: DeploymentSpec, shapes: StepShapes, tiers: tuple[int, ...],
              field: str) -> Iterator[SpecIssue]:
    largest, requests = tiers[-1], shapes.requests
    if shapes.largest <= largest:
        return
    first = largest // shapes.cap + 1  # steps with B >= first can exceed the largest tier
    low, high = max(first * shapes.floor, largest + 1), shapes.largest
    span = f"B={first}" if first == requests else f"B={first}..{requests}"
    tokens = f"{high}" if low == high else f"{low}..{high}"
    fix = (f"add a tier >= {high} to graph.token_tiers" if field == "token_tiers"
           else f"add {requests} to graph.capture_batch_sizes")
    if first > 1:
        fix += f", or lower serving.max_running_requests to {first - 1}"
    yield SpecIssue(("graph", field),
                    f"{shapes.mode} mode produces steps of up to {high} tokens that no graph tier "
                    f"covers: {span} ({tokens} tokens) exceed the largest tier {largest}", fix)


def _partial_requests(spec: DeploymentSpec, shapes: StepShapes, tiers: tuple[int, ...],
                      field: str) -> list[int]:
    """Tiers that are not whole multiples of N in a mode whose steps are (static, cap-accept)."""
    if spec.verify.mode.packs_rows or field != "token_tiers":
        return []  # compact packs any row count; capture batch sizes give multiples of N already
    return [tier for tier in tiers if tier % shapes.cap]


def _partial_issue(shapes: StepShapes, tiers: tuple[int, ...], field: str, bad: list[int]) -> SpecIssue:
    n, many = shapes.cap, len(bad) > 1
    return SpecIssue(("graph", field, tiers.index(bad[0])),
                     f"{shapes.mode} steps run whole requests of N = {n} rows, but tier{'s' if many else ''} "
                     f"{_listing(bad)} {'are not multiples' if many else 'is not a multiple'} of {n}: a "
                     f"step would pad up to it and waste the rows beyond its last whole request (and a "
                     f"tier below {n} holds no request at all)",
                     f"use multiples of {n} (B x {n} for each batch size to capture), or list the batch "
                     f"sizes in graph.capture_batch_sizes instead")


def _unreachable(shapes: StepShapes, tiers: tuple[int, ...], field: str,
                 skip: set[int]) -> Iterator[SpecIssue]:
    unused: list[tuple[int, str]] = []  # (index, reason)
    previous = 0
    for i, tier in enumerate(tiers):
        if tier not in skip and not shapes.any_between(previous, tier):
            if previous >= shapes.largest:
                reason = f"{tier} (above the largest step, {shapes.largest} rows)"
            elif previous + 1 == tier:
                reason = f"{tier} (no step has {tier} row{'s' if tier > 1 else ''})"
            else:
                reason = f"{tier} (no step has {previous + 1}..{tier} rows)"
            unused.append((i, reason))
        previous = tier
    if not unused:
        return
    above = any("above the largest" in reason for _, reason in unused)
    hint = f"remove {'them' if len(unused) > 1 else 'it'} from graph.{field}"
    if above:
        hint += f", or raise serving.max_running_requests (now {shapes.requests})"
    many = len(unused) > 1
    yield SpecIssue(("graph", field, unused[0][0]),
                    f"{'tiers' if many else 'tier'} {_listing([reason for _, reason in unused])} "
                    f"{'are' if many else 'is'} never used: a step of M rows replays the smallest tier "
                    f">= M, and {shapes.mode} steps run {shapes.describe()}", hint)


def _listing(values: list[int] | list[str]) -> str:
    shown = ", ".join(map(str, values[:_LISTED]))
    return shown + (f" and {len(values) - _LISTED} more" if len(values) > _LISTED else "")
