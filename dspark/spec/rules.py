"""Whole-spec rules: checks that need more than one section (or the resolved checkpoints).

Each rule returns issues carrying the field path they concern; the loader turns the path into a
`file:line:col`. Rules skip silently when a fact they need could not be resolved, because that
failure is already reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from dspark.fingerprint import sampling_policy
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.modes import SpeculationOff
from dspark.spec.derived import num_draft_tokens, resolved_max_verify_len
from dspark.spec.errors import SpecIssue
from dspark.spec.facts import SpecFacts
from dspark.spec.family_rules import (
    check_dsv4_ascend_ratios,
    check_family_attention,
)
from dspark.spec.tier_rules import check_tier_coverage, check_tier_lists, check_tiers_need_graphs

Rule = Callable[[SpecFacts], Iterator[SpecIssue]]

# The byte-level tokenizer's ids: 256 bytes, BOS and EOS.
BYTE_VOCAB = 258


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


def check_online_calibration(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    online = spec.online_calibration
    if online is None or not online.enabled:
        return
    if not spec.verify.mode.plans or not spec.draft.confidence_head:
        yield SpecIssue(("online_calibration", "enabled"),
                        f"online calibration refits the planner's temperatures, but {spec.verify.mode} mode "
                        f"{'has no planner' if not spec.verify.mode.plans else 'has no confidence head'}",
                        "remove online_calibration, or use verify.mode: cap-accept or compact with a draft "
                        "that has a confidence head")


def check_online_cost(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    online = spec.online_cost
    if online is None or not online.enabled:
        return
    if not spec.verify.mode.plans:
        yield SpecIssue(("online_cost", "enabled"),
                        f"the online cost refit corrects the table the planner prices steps with, but "
                        f"{spec.verify.mode} mode has no planner",
                        "remove online_cost, or use verify.mode: cap-accept or compact with an additive "
                        "cost_model")
    elif spec.cost_model is None or spec.cost_model.type != "additive":
        kind = "no cost_model" if spec.cost_model is None else f"a {spec.cost_model.type} cost_model"
        yield SpecIssue(("online_cost", "enabled"),
                        f"the online cost refit corrects an additive table's knots (bias, alpha, theta, "
                        f"decode), but the spec has {kind}",
                        "remove online_cost, or set cost_model to an additive table (`dspark profile` writes "
                        "additive.json: cost_model: {type: additive, file: .../additive.json})")


def check_tensor_parallel(facts: SpecFacts) -> Iterator[SpecIssue]:
    geometry, parallelism = facts.geometry, facts.spec.parallelism
    tp = parallelism.tp
    # Under DP attention a request's heads are split over its DP rank's tp / dp ranks only.
    dp_attention = parallelism.dp_attention and parallelism.dp > 1 and tp % parallelism.dp == 0
    heads_tp = tp // parallelism.dp if dp_attention else tp
    if isinstance(geometry, Dsv4Geometry):
        # DeepSeek-V4's one latent K=V head is read by every query head: each rank keeps a copy.
        what = f"the attention TP size tp / dp = {heads_tp}" if dp_attention else f"tp {tp}"
        knob = "tp / dp" if dp_attention else "tp"
        if geometry.num_heads % heads_tp:
            yield SpecIssue(("parallelism", "tp"), f"{what} does not divide n_heads ({geometry.num_heads})",
                            f"every rank needs whole query heads (the latent K=V head is replicated); "
                            f"use {knob} in {_divisors(geometry.num_heads)}")
        elif geometry.o_groups and geometry.o_groups % heads_tp:
            yield SpecIssue(("parallelism", "tp"), f"{what} does not divide o_groups ({geometry.o_groups})",
                            "every rank projects whole groups of heads (the grouped output projection); use "
                            f"{knob} in {_divisors(geometry.o_groups)}, or DP attention over more "
                            "ranks with a smaller attention TP size")
        return
    if geometry is None or (geometry.num_heads % heads_tp == 0 and geometry.num_kv_heads % heads_tp == 0):
        return
    valid = _divisors(math.gcd(geometry.num_heads, geometry.num_kv_heads))
    if dp_attention:
        yield SpecIssue(("parallelism", "tp"),
                        f"the attention TP size tp / dp = {heads_tp} does not divide num_heads "
                        f"({geometry.num_heads}) and num_kv_heads ({geometry.num_kv_heads})",
                        f"every attention rank needs whole heads; use tp / dp in {valid}")
        return
    yield SpecIssue(("parallelism", "tp"),
                    f"tp {tp} does not divide num_heads ({geometry.num_heads}) and num_kv_heads "
                    f"({geometry.num_kv_heads})",
                    f"every rank needs whole heads; use tp in {valid}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_expert_parallel(facts: SpecFacts) -> Iterator[SpecIssue]:
    """ep shards DeepSeek-V4's routed experts over every rank of a model instance (tp, the whole world under
    DP attention): ep is 1 or tp, and divides the experts."""
    spec, geometry = facts.spec, facts.geometry
    parallelism = spec.parallelism
    ep = parallelism.ep
    if ep == 1:
        return
    where = ("parallelism", "ep")
    if geometry is None and spec.model.family.has_experts:
        return  # its experts are unknown: the geometry's own issue says why
    if not spec.model.family.has_experts or not isinstance(geometry, Dsv4Geometry) or geometry.ffn != "moe":
        model = (f"{spec.model.family} is a dense model with" if not spec.model.family.has_experts
                 else "this DeepSeek-V4 geometry has a dense FFN (ffn: dense):")
        yield SpecIssue(where, f"ep is {ep}, but {model} no experts to shard across ranks",
                        "set parallelism.ep: 1 and scale with tp or dp")
        return
    if ep != parallelism.tp or (parallelism.dp > 1 and not parallelism.dp_attention):
        yield SpecIssue(where, f"ep {ep} is not the ranks of one model instance (tp {parallelism.tp})",
                        f"set ep: {parallelism.tp} (the experts over every rank; with dp > 1 use "
                        "dp_attention), or ep: 1")
    elif geometry.n_routed_experts % ep:
        experts = geometry.n_routed_experts
        yield SpecIssue(where, f"ep {ep} does not divide n_routed_experts ({experts})",
                        f"every rank holds whole experts; use tp = ep in {_divisors(experts)}")


def check_dp_attention(facts: SpecFacts) -> Iterator[SpecIssue]:
    parallelism = facts.spec.parallelism
    if not parallelism.dp_attention:
        return
    tp, dp = parallelism.tp, parallelism.dp
    if dp < 2:
        yield SpecIssue(("parallelism", "dp_attention"),
                        "dp_attention shards attention across data-parallel replicas, but dp is 1",
                        "set parallelism.dp to 2 or more, or dp_attention: false")
    elif tp % dp:
        # As SGLang computes it: each of the dp attention groups runs attention at TP = tp / dp.
        valid = [d for d in range(2, tp + 1) if tp % d == 0][:8]
        yield SpecIssue(("parallelism", "dp"),
                        f"with dp_attention the attention TP size is tp / dp, but tp {tp} is not a "
                        f"multiple of dp {dp}",
                        f"use a dp that divides tp ({', '.join(map(str, valid))})" if valid
                        else "raise parallelism.tp to a multiple of dp, or set dp_attention: false")


# What FlashInfer's paged prefill kernels are built for.
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def check_flashinfer(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec, geometry = facts.spec, facts.geometry
    if spec.attention_impl != "flashinfer" or isinstance(geometry, Dsv4Geometry):
        return  # FlashInfer does not run DeepSeek-V4 at all: check_family_attention says so
    if spec.model.dtype not in FLASHINFER_DTYPES:
        yield SpecIssue(("backend", "attention"),
                        f"FlashInfer's attention runs bfloat16 or float16, but model.dtype is "
                        f"{spec.model.dtype}",
                        "set model.dtype: bfloat16, or backend.attention: triton (which also runs float32)")
    if geometry is not None and geometry.head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        yield SpecIssue(("backend", "attention"),
                        f"FlashInfer's attention is built for head_dim {dims}, but the model's is "
                        f"{geometry.head_dim}",
                        "use backend.attention: triton for this model")


def check_dummy_weights(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec, geometry = facts.spec, facts.geometry
    ref = facts.model_checkpoint
    byte_tokenizer = spec.model.load_format == "dummy" and ref is not None and not ref.present
    if byte_tokenizer and geometry is not None and geometry.vocab_size < BYTE_VOCAB:
        yield SpecIssue(("model", "load_format"),
                        f"a dummy model whose checkpoint is not here decodes with the byte-level "
                        f"tokenizer, which needs vocab_size >= {BYTE_VOCAB}, but the geometry has "
                        f"{geometry.vocab_size}",
                        "point model.checkpoint at a directory with the model's tokenizer, or use a "
                        f"vocab_size of at least {BYTE_VOCAB}")


def check_compact_cost_model(facts: SpecFacts) -> Iterator[SpecIssue]:
    spec = facts.spec
    if (spec.verify.mode.needs_cost_model and spec.cost_model is None
            and not spec.verify.allow_no_cost_model):
        yield SpecIssue(("verify", "mode"),
                        "compact mode needs a cost model to choose how many rows to verify",
                        "add cost_model (sps-1d or additive, e.g. from a profiling run), or set "
                        "verify.allow_no_cost_model: true to verify every row")


def check_speculation_off(facts: SpecFacts) -> Iterator[SpecIssue]:
    """`verify.off: auto` written out must have something to decide with: a planner and a table that
    prices a target-only decode step (left at its default it simply resolves to never without one)."""
    spec = facts.spec
    if "off" not in spec.verify.model_fields_set or spec.verify.off is not SpeculationOff.AUTO:
        return
    if not spec.verify.mode.plans:
        yield SpecIssue(("verify", "off"), "static mode has no planner to switch speculation off",
                        "use verify.mode: compact (or cap-accept) with a profiled cost model, or drop "
                        "verify.off")
    elif facts.cost_model is not None and not facts.cost_model.decode_bs_probes:
        yield SpecIssue(("verify", "off"),
                        "the cost model has no decode term (decode_bs_probes, decode_seconds), so no "
                        "step without speculation can be priced",
                        "profile the deployment again with `dspark profile` (it measures the decode "
                        "step), or set verify.off: never")
    elif spec.cost_model is None:
        yield SpecIssue(("verify", "off"), "without a cost model no step without speculation can be priced",
                        "add a cost_model profiled by `dspark profile`, or set verify.off: never")


def check_context_len(facts: SpecFacts) -> Iterator[SpecIssue]:
    geometry, serving = facts.geometry, facts.spec.serving
    if geometry is None or isinstance(geometry, Dsv4Geometry):
        # A Dsv4Geometry has no max_position_embeddings: it changes nothing computed (YaRN's frequencies
        # come from its own factor and original context), so the config reader reads it only for a
        # missing YaRN factor.
        return
    if serving.max_context_len > geometry.max_position_embeddings:
        limit = geometry.max_position_embeddings // serving.page_size * serving.page_size
        yield SpecIssue(("serving", "max_context_len"),
                        f"max_context_len {serving.max_context_len} exceeds the model's "
                        f"max_position_embeddings ({geometry.max_position_embeddings})",
                        f"use at most {limit} (a multiple of page_size)")


def check_context_holds_a_request(facts: SpecFacts) -> Iterator[SpecIssue]:
    """A request reserves prompt + max_new_tokens + N KV slots (the N verify rows of its last step),
    so a context that cannot hold a 1-token prompt and 1 new token besides N serves nothing."""
    spec = facts.spec
    n, context = num_draft_tokens(spec), spec.serving.max_context_len
    if context < n + 2:
        yield SpecIssue(("serving", "max_context_len"),
                        f"max_context_len {context} cannot hold one request: a 1-token prompt and 1 "
                        f"new token plus the N = gamma + 1 = {n} rows of a verify step need {n + 2}",
                        f"raise serving.max_context_len to at least {n + 2} (a multiple of page_size), "
                        f"or lower draft.gamma")


def check_kv_pool(facts: SpecFacts) -> Iterator[SpecIssue]:
    serving = facts.spec.serving
    pages = serving.max_total_tokens // serving.page_size
    needed = serving.max_context_len // serving.page_size
    if pages < needed:
        yield SpecIssue(("serving", "max_total_tokens"),
                        f"the KV pool holds {pages} pages of {serving.page_size} tokens "
                        f"(max_total_tokens {serving.max_total_tokens}), fewer than the {needed} pages one "
                        f"request of max_context_len ({serving.max_context_len}) may need",
                        f"raise serving.max_total_tokens to at least {needed * serving.page_size}, or "
                        f"lower serving.max_context_len")


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
    check_online_calibration,
    check_online_cost,
    check_tiers_need_graphs,
    check_tier_lists,
    check_tier_coverage,
    check_family_attention,
    check_dsv4_ascend_ratios,
    check_tensor_parallel,
    check_expert_parallel,
    check_dp_attention,
    check_dummy_weights,
    check_flashinfer,
    check_compact_cost_model,
    check_speculation_off,
    check_context_len,
    check_context_holds_a_request,
    check_kv_pool,
    check_calibration_policy,
)


def run_rules(facts: SpecFacts) -> list[SpecIssue]:
    return [issue for rule in RULES for issue in rule(facts)]
