"""Whole-spec rules: checks that need more than one section (or the resolved checkpoints).

Each rule returns issues carrying the field path they concern; the loader turns the path into a
`file:line:col`. Rules skip silently when a fact they need could not be resolved, because that
failure is already reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from dspark.fingerprint import sampling_policy
from dspark.spec.errors import SpecIssue
from dspark.spec.facts import SpecFacts
from dspark.spec.models import DeploymentSpec

Rule = Callable[[SpecFacts], Iterator[SpecIssue]]


def num_draft_tokens(spec: DeploymentSpec) -> int:
    """N = gamma + 1: the root row plus the drafts."""
    return spec.draft.gamma + 1


def resolved_max_verify_len(spec: DeploymentSpec) -> int:
    return spec.verify.max_verify_len or num_draft_tokens(spec)


def tier_grid(spec: DeploymentSpec) -> tuple[int, ...]:
    """Token counts captured as graphs; empty when graph capture is off."""
    if not spec.graph.enabled:
        return ()
    if spec.graph.token_tiers:
        return spec.graph.token_tiers
    n = num_draft_tokens(spec)
    return tuple(bs * n for bs in spec.graph.capture_batch_sizes)


def verify_len_range(spec: DeploymentSpec) -> tuple[int, int]:
    """Fewest and most rows one request can put into a step in the configured mode."""
    return spec.verify.mode.rows_per_request(max(spec.verify.min_verify_len, 1),
                                             resolved_max_verify_len(spec), num_draft_tokens(spec))


def check_num_draft_tokens(facts: SpecFacts) -> Iterator[SpecIssue]:
    n = num_draft_tokens(facts.spec)
    if n < 2:
        yield SpecIssue(("draft", "gamma"), f"N = gamma + 1 = {n} leaves nothing to verify",
                        "set draft.gamma to at least 1")


def check_verify_lens(facts: SpecFacts) -> Iterator[SpecIssue]:
    verify, n = facts.spec.verify, num_draft_tokens(facts.spec)
    if verify.max_verify_len > n:
        yield SpecIssue(("verify", "max_verify_len"),
                        f"max_verify_len {verify.max_verify_len} exceeds N = gamma + 1 = {n}",
                        f"use at most {n}, or 0 for N")
        return
    longest = resolved_max_verify_len(facts.spec)
    if verify.min_verify_len > longest:
        yield SpecIssue(("verify", "min_verify_len"),
                        f"min_verify_len {verify.min_verify_len} exceeds max_verify_len {longest}",
                        f"use a min_verify_len between 0 and {longest}")


def check_confidence_head(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if spec.verify.mode.plans and not spec.draft.confidence_head:
        yield SpecIssue(("verify", "mode"),
                        f"{spec.verify.mode} mode plans with per-position confidence, but "
                        f"draft.confidence_head is false",
                        "set draft.confidence_head: true (with a draft that has the head) or use "
                        "verify.mode: static")


def check_calibration_count(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec, temperatures = facts.spec, facts.temperatures
    if temperatures is None or len(temperatures) == spec.draft.gamma:
        return
    field = "temperatures" if spec.calibration is not None and hasattr(
        spec.calibration, "temperatures") else "file"
    yield SpecIssue(("calibration", field),
                    f"calibration has {len(temperatures)} temperatures but gamma is "
                    f"{spec.draft.gamma}", "give one temperature per draft position "
                    "(recalibrate after changing gamma)")


def check_tier_coverage(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if not spec.graph.enabled:
        if spec.verify.align_to_graph_tier:
            yield SpecIssue(("verify", "align_to_graph_tier"),
                            "tier alignment needs graph tiers, but graph.enabled is false",
                            "set graph.enabled: true with tiers, or align_to_graph_tier: false")
        return
    tiers = tier_grid(spec)
    if not tiers:
        yield SpecIssue(("graph", "enabled"), "graph capture is enabled but defines no tiers",
                        "set graph.capture_batch_sizes (tiers = batch size x N) or "
                        "graph.token_tiers, or set graph.enabled: false")
        return
    largest, requests = tiers[-1], spec.serving.max_running_requests
    shortest, longest = verify_len_range(spec)
    if requests * longest <= largest:
        return
    # Token counts grow with B, so the requests that overflow form a suffix B = first..requests.
    first = largest // longest + 1
    low = min(b * length for b in range(first, requests + 1)
              for length in range(shortest, longest + 1) if b * length > largest)
    high = requests * longest
    span = f"B={first}" if first == requests else f"B={first}..{requests}"
    tokens = f"{high}" if low == high else f"{low}..{high}"
    uses_tiers = bool(spec.graph.token_tiers)
    field = "token_tiers" if uses_tiers else "capture_batch_sizes"
    fix = (f"add a tier >= {high} to graph.token_tiers" if uses_tiers
           else f"add {requests} to graph.capture_batch_sizes")
    if first > 1:
        fix += f", or lower serving.max_running_requests to {first - 1}"
    yield SpecIssue(("graph", field),
                    f"{spec.verify.mode} mode produces steps of up to {high} tokens that no "
                    f"graph tier covers: {span} ({tokens} tokens) exceed the largest tier "
                    f"{largest}", fix)


def check_tensor_parallel(facts: SpecFacts) -> Iterator[SpecIssue]:
    geometry, tp = facts.geometry, facts.spec.parallelism.tp
    if geometry is None or (geometry.num_heads % tp == 0 and geometry.num_kv_heads % tp == 0):
        return
    common = math.gcd(geometry.num_heads, geometry.num_kv_heads)
    valid = [d for d in range(1, common + 1) if common % d == 0]
    yield SpecIssue(("parallelism", "tp"),
                    f"tp {tp} does not divide num_heads ({geometry.num_heads}) and num_kv_heads "
                    f"({geometry.num_kv_heads})",
                    f"every rank needs whole heads; use tp in {valid}")


def check_expert_parallel(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if spec.parallelism.ep != 1:
        yield SpecIssue(("parallelism", "ep"),
                        f"ep is {spec.parallelism.ep}, but {spec.model.family} is a dense model "
                        f"with no experts to shard across ranks",
                        "set parallelism.ep: 1 and scale with tp or dp")


def check_dp_attention(facts: SpecFacts) -> Iterator[SpecIssue]:
    parallelism = facts.spec.parallelism
    if parallelism.dp_attention and parallelism.dp < 2:
        yield SpecIssue(("parallelism", "dp_attention"),
                        "dp_attention shards attention across data-parallel replicas, but dp is 1",
                        "set parallelism.dp to 2 or more, or dp_attention: false")


def check_draft_checkpoint(facts: SpecFacts) -> Iterator[SpecIssue]:
    config, spec = facts.draft_config, facts.spec
    if config is None:
        return
    where = "the draft checkpoint's config.json"
    for key in ("gamma", "markov_embedding_size"):
        if key in config and config[key] != getattr(spec.draft, key):
            yield SpecIssue(("draft", key),
                            f"{key} is {getattr(spec.draft, key)} here but the draft was trained "
                            f"with {config[key]} ({where})",
                            f"set draft.{key}: {config[key]} or use a draft trained for "
                            f"{getattr(spec.draft, key)}")
    if spec.draft.confidence_head and config.get("confidence_head") is False:
        yield SpecIssue(("draft", "confidence_head"),
                        f"confidence_head is true here but the draft has no confidence head "
                        f"({where})", "set draft.confidence_head: false and verify.mode: static, "
                        "or use a draft trained with a confidence head")
    geometry = facts.geometry
    if geometry is None:
        return
    for key, expected in (("target_hidden_size", geometry.hidden_size),
                          ("vocab_size", geometry.vocab_size)):
        if key in config and config[key] != expected:
            yield SpecIssue(("draft", "checkpoint"),
                            f"the draft's {key} is {config[key]} ({where}) but the target model "
                            f"has {expected}", "use a draft trained for this target model")


def check_compact_cost_model(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if (spec.verify.mode.needs_cost_model and spec.cost_model is None
            and not spec.verify.allow_no_cost_model):
        yield SpecIssue(("verify", "mode"),
                        "compact mode needs a cost model to choose how many rows to verify",
                        "add cost_model (sps-1d or additive, e.g. from a profiling run), or set "
                        "verify.allow_no_cost_model: true to verify every row")


def check_context_len(facts: SpecFacts) -> Iterator[SpecIssue]:
    geometry, serving = facts.geometry, facts.spec.serving
    if geometry is not None and serving.max_context_len > geometry.max_position_embeddings:
        limit = geometry.max_position_embeddings // serving.page_size * serving.page_size
        yield SpecIssue(("serving", "max_context_len"),
                        f"max_context_len {serving.max_context_len} exceeds the model's "
                        f"max_position_embeddings ({geometry.max_position_embeddings})",
                        f"use at most {limit} (a multiple of page_size)")


def check_calibration_policy(facts: SpecFacts) -> Iterator[SpecIssue]:
    calibration = facts.spec.calibration
    if calibration is None or calibration.policy is None:
        return
    generation = facts.spec.serving.generation
    serving = sampling_policy(generation.temperature, generation.top_p, generation.top_k)
    if calibration.policy != serving:
        yield SpecIssue(("calibration", "policy"),
                        f"the calibration was fitted for {calibration.policy!r} but "
                        f"serving.generation gives the policy {serving!r}",
                        "greedy labels do not carry over to sampling: re-calibrate under the serving "
                        "policy, or set serving.generation to the policy the calibration was fitted for")
    contents = facts.calibration_file
    if contents is not None and contents.policy is not None and contents.policy != calibration.policy:
        yield SpecIssue(("calibration", "policy"),
                        f"calibration.policy is {calibration.policy!r} but the calibration file says "
                        f"it was fitted for {contents.policy!r}",
                        "point calibration.file at a calibration fitted for this policy, or correct "
                        "calibration.policy")


RULES: tuple[Rule, ...] = (
    check_num_draft_tokens,
    check_verify_lens,
    check_confidence_head,
    check_calibration_count,
    check_tier_coverage,
    check_tensor_parallel,
    check_expert_parallel,
    check_dp_attention,
    check_draft_checkpoint,
    check_compact_cost_model,
    check_context_len,
    check_calibration_policy,
)


def run_rules(facts: SpecFacts) -> list[SpecIssue]:
    return [issue for rule in RULES for issue in rule(facts)]
