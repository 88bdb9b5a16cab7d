"""Step-cost tables (`sps-1d`, `additive`, `tier`): the one definition of their JSON format.

The spec validates an inline table or a table file with these models, `dspark profile` writes
them, the planner prices steps with tables built from them (`dspark.runtime.planner.cost_models`)
and the report and `dspark cost-eval` read them. Field names follow SGLang's tables; a table file
holds the table's fields (without `type`: the kind follows from the keys only one kind uses) plus
an optional `fingerprint` of the deployment it was measured on. docs/formats.md describes the files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dspark.formats.fields import (
    FieldValueError,
    FloatTuple,
    IntTuple,
    Section,
    TableFingerprint,
    same_length,
    strictly_increasing,
)
from dspark.formats.json_io import FormatError, read_json_file, validation_message, write_json_file

# Rows of per-tier seconds; the outer list becomes a tuple here, each row through FloatTuple.
FloatRows = Annotated[tuple[FloatTuple, ...],
                      BeforeValidator(lambda value: tuple(value) if isinstance(value, list) else value)]


class CostTableError(FormatError):
    """A cost table (a file, or the object a generated config embeds) is malformed; names where and why."""


REFIT_HINT = ("re-fit the table from the profile it came from with `dspark refit-tables DIR` (this "
              "dspark fits monotone tables), or profile again")


def never_cheaper(values: tuple[float, ...], probes: tuple[int, ...] | None, what: str, probe_name: str,
                  law: str, decreasing: bool = False) -> None:
    """Refuse a series that prices more work as cheaper: `values` must not decrease along `probes`
    (must not increase, for a rate, when `decreasing`)."""
    named = probes is not None and len(probes) == len(values)

    def at(k: int) -> str:
        return f"{probe_name}[{k}] = {probes[k]}" if named else f"item {k}"

    for i in range(1, len(values)):
        a, b = values[i - 1], values[i]
        if (b > a) if decreasing else (b < a):
            raise FieldValueError(f"{what} must not {'increase' if decreasing else 'decrease'} ({law}), "
                                  f"but it is {a:.6g} at {at(i - 1)} and {b:.6g} at {at(i)}", REFIT_HINT)


def _probes_field(term: str) -> Any:
    return Field(default=(), description=f"Optional: batch sizes at which the {term} step time was "
                                         "measured, strictly increasing.")


def _draft_seconds_field() -> Any:
    return Field(default=(), description="Optional: the draft's seconds per step at each draft_bs_probes "
                                         "entry (≥ 0); the planner adds them to the verify step time.")


def _decode_seconds_field() -> Any:
    return Field(default=(), description="Optional: seconds of one target-only decode step (one row per "
                                         "request, the draft's context appended) at each "
                                         "decode_bs_probes entry (> 0); the planner prices the step "
                                         "without speculation by it.")


# The per-batch-size terms any table may carry: (probes, seconds, what the seconds time, the law).
BATCH_TERMS = (
    ("draft_bs_probes", "draft_seconds", "the draft step",
     "drafting for more requests never takes less time"),
    ("decode_bs_probes", "decode_seconds", "the target-only decode step",
     "decoding more requests never takes less time"),
)


class _BatchTerms(Section):
    """Validators of the optional per-batch-size terms every cost table may carry: the draft's step
    time and the target-only decode step time (fields declared per table, after its own, so that dumps
    and the generated code list the table's fields first)."""

    @field_validator("draft_bs_probes", "decode_bs_probes", check_fields=False)
    @classmethod
    def _probes_increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))

    @field_validator("draft_seconds", "decode_seconds", check_fields=False)
    @classmethod
    def _seconds_valid(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        probes, _, what, law = next(t for t in BATCH_TERMS if t[1] == info.field_name)
        same_length(value, info, probes)
        decode = info.field_name == "decode_seconds"
        if any(seconds < 0 or (decode and seconds == 0) for seconds in value):
            term = str(info.field_name).removesuffix("_seconds")
            raise FieldValueError(f"{term} times must be {'> 0' if decode else '≥ 0'}", f"re-measure {what}")
        never_cheaper(value, info.data.get(probes), str(info.field_name), probes, law)
        return value

    @model_validator(mode="after")
    def _terms_both_or_neither(self) -> _BatchTerms:
        # A default is not validated field by field, so one list given without the other lands here.
        for probes_name, seconds_name, what, _ in BATCH_TERMS:
            probes, seconds = getattr(self, probes_name, ()), getattr(self, seconds_name, ())
            if bool(probes) != bool(seconds):
                given, missing = (probes_name, seconds_name) if probes else (seconds_name, probes_name)
                raise FieldValueError(f"{given} is given but {missing} is empty",
                                      f"give both lists of {what} (one time per probe) or neither")
        return self


class Sps1dCostModel(_BatchTerms):
    """Steps-per-second table over the step's token count, looked up by floor."""

    type: Literal["sps-1d"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    sample_batch_tokens: IntTuple = Field(
        min_length=1, description="Probed token counts M, strictly increasing.")
    sample_steps_per_sec: FloatTuple = Field(
        min_length=1, description="Measured steps per second at each probed M (> 0).")
    max_batch_tokens: int = Field(
        ge=1, description="Largest token count the table may be used for (at least the last probe).")

    @field_validator("sample_batch_tokens")
    @classmethod
    def _increasing(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return strictly_increasing(value, "sample_batch_tokens")

    @field_validator("sample_steps_per_sec")
    @classmethod
    def _positive_rates(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        same_length(value, info, "sample_batch_tokens")
        if any(rate <= 0 for rate in value):
            raise FieldValueError("steps per second must all be > 0",
                                 "re-measure or drop the probes with a zero rate")
        never_cheaper(value, info.data.get("sample_batch_tokens"), "sample_steps_per_sec",
                      "sample_batch_tokens", "a step of more tokens is never faster", decreasing=True)
        return value

    @field_validator("max_batch_tokens")
    @classmethod
    def _covers_the_probes(cls, value: int, info: ValidationInfo) -> int:
        # A probe past the limit was measured but could never be looked up: the table contradicts itself.
        tokens = info.data.get("sample_batch_tokens")
        if tokens and tokens[-1] > value:
            raise FieldValueError(f"is {value} but sample_batch_tokens reaches {tokens[-1]}",
                                  "raise max_batch_tokens to the largest probe (or beyond), or drop "
                                  "the probes above it")
        return value

    draft_bs_probes: IntTuple = _probes_field("draft's")
    draft_seconds: FloatTuple = _draft_seconds_field()
    decode_bs_probes: IntTuple = _probes_field("target-only decode")
    decode_seconds: FloatTuple = _decode_seconds_field()


class AdditiveCostModel(_BatchTerms):
    """Step time T(B, M) = bias + alpha(B) + theta(M), theta linearly interpolated."""

    type: Literal["additive"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    bias_seconds: float = Field(ge=0, description="Constant step overhead in seconds.")
    bs_probes: IntTuple = Field(
        min_length=1, description="Probed batch sizes B, strictly increasing.")
    alpha_seconds: FloatTuple = Field(description="Seconds added per probed batch size (≥ 0).")
    m_probes: IntTuple = Field(
        min_length=1, description="Probed token counts M, strictly increasing.")
    theta_seconds: FloatTuple = Field(description="Seconds added per probed token count (≥ 0).")
    context_len: int | None = Field(
        default=None, ge=1,
        description="Optional: the context (tokens cached per request) the fields above were profiled at; "
                    "with context_lens the table prices other contexts.")
    context_lens: IntTuple = Field(
        default=(),
        description="Optional: further contexts profiled, strictly increasing, above context_len.")
    context_bias_seconds: FloatTuple = Field(
        default=(), description="bias_seconds at each context_lens entry.")
    context_alpha_seconds: FloatRows = Field(
        default=(), description="alpha_seconds at each context_lens entry.")
    context_theta_seconds: FloatRows = Field(
        default=(), description="theta_seconds at each context_lens entry.")
    context_draft_seconds: FloatRows = Field(
        default=(), description="draft_seconds at each context_lens entry (with the draft term).")
    context_decode_seconds: FloatRows = Field(
        default=(), description="decode_seconds at each context_lens entry (with the decode term).")

    @field_validator("bs_probes", "m_probes")
    @classmethod
    def _increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))

    @field_validator("alpha_seconds", "theta_seconds")
    @classmethod
    def _non_negative(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        same_length(value, info, "bs_probes" if info.field_name == "alpha_seconds" else "m_probes")
        if any(seconds < 0 for seconds in value):
            raise FieldValueError("times must be ≥ 0", "check the fit; negative times are invalid")
        if info.field_name == "alpha_seconds":
            never_cheaper(value, info.data.get("bs_probes"), "alpha_seconds", "bs_probes",
                          "more requests never make a step cheaper")
        else:
            never_cheaper(value, info.data.get("m_probes"), "theta_seconds", "m_probes",
                          "verifying more rows never costs less")
        return value

    @model_validator(mode="after")
    def _some_time_per_step(self) -> AdditiveCostModel:
        # Interpolation never leaves [min, max] of the probe values, so this bounds every T(B, M) below;
        # a zero-second step would make every budget's objective infinite.
        if self.bias_seconds + min(self.alpha_seconds) + min(self.theta_seconds) <= 0:
            raise FieldValueError("bias_seconds + min(alpha_seconds) + min(theta_seconds) is 0, so some "
                                  "steps would be predicted to take no time", "re-fit the table")
        self.at_contexts()  # every profiled context's table obeys the same rules
        return self

    def at_contexts(self) -> tuple[AdditiveCostModel, ...]:
        """The table at each `context_lens` entry (the context term), validated: empty without one."""
        lengths = self.context_lens
        if not lengths:
            if self.context_len is None and any(getattr(self, key) for key in CONTEXT_KEYS):
                raise FieldValueError("context_* lists are given without context_len and context_lens",
                                      "profile with `dspark profile --context-len L1,L2,...`")
            return ()
        if self.context_len is None:
            raise FieldValueError("context_lens needs context_len, the context of the table's own fields",
                                  "profile with `dspark profile --context-len L1,L2,...`")
        strictly_increasing((self.context_len, *lengths), "context_len, context_lens")
        terms = {"context_bias_seconds": True, "context_alpha_seconds": True, "context_theta_seconds": True,
                 "context_draft_seconds": bool(self.draft_seconds),
                 "context_decode_seconds": bool(self.decode_seconds)}
        for name, wanted in terms.items():
            count = len(getattr(self, name))
            if count != (len(lengths) if wanted else 0):
                raise FieldValueError(f"{name} has {count} entries for {len(lengths)} context_lens",
                                      "give one per context (draft and decode ones only with those terms)")
        tables = []
        for j, length in enumerate(lengths):
            fields = {"bias_seconds": self.context_bias_seconds[j],
                      "alpha_seconds": self.context_alpha_seconds[j],
                      "theta_seconds": self.context_theta_seconds[j],
                      "draft_seconds": self.context_draft_seconds[j] if self.draft_seconds else (),
                      "decode_seconds": self.context_decode_seconds[j] if self.decode_seconds else ()}
            try:
                tables.append(AdditiveCostModel(**{**self.model_dump(include=set(_BASE_ADDITIVE)), **fields}))
            except ValidationError as error:
                raise FieldValueError(f"at context {length}: {validation_message(error)}",
                                      "re-profile that context") from None
        return tuple(tables)

    draft_bs_probes: IntTuple = _probes_field("draft's")
    draft_seconds: FloatTuple = _draft_seconds_field()
    decode_bs_probes: IntTuple = _probes_field("target-only decode")
    decode_seconds: FloatTuple = _decode_seconds_field()


class TierCostModel(_BatchTerms):
    """Step time measured per (batch size, graph tier); M rows cost what the smallest tier >= M costs."""

    type: Literal["tier"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    tiers: IntTuple = Field(
        min_length=1, description="Graph tiers (token counts), strictly increasing; M above the last is "
                                  "infeasible.")
    bs_probes: IntTuple = Field(
        min_length=1, description="Probed batch sizes B, strictly increasing.")
    step_seconds: FloatRows = Field(
        description="One row per bs_probes entry, each with one step time per tier in seconds (> 0); "
                    "interpolated along B within a tier, never across tiers.")

    @field_validator("tiers", "bs_probes")
    @classmethod
    def _increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))

    @field_validator("step_seconds")
    @classmethod
    def _grid(cls, value: tuple[tuple[float, ...], ...],
              info: ValidationInfo) -> tuple[tuple[float, ...], ...]:
        same_length(value, info, "bs_probes")
        tiers = info.data.get("tiers")
        for i, row in enumerate(value):
            if tiers is not None and len(row) != len(tiers):
                raise FieldValueError(f"row {i} has {len(row)} entries but tiers has {len(tiers)}",
                                     "give one step time per tier in every row")
            if any(seconds <= 0 for seconds in row):
                raise FieldValueError(f"row {i} has a step time ≤ 0",
                                     "re-measure that cell or re-fit the table; step times are > 0")
            never_cheaper(row, tiers, f"row {i}", "tiers", "a larger tier never costs less")
        probes = info.data.get("bs_probes")
        for j in range(min(map(len, value), default=0)):
            never_cheaper(tuple(row[j] for row in value), probes, f"column {j}", "bs_probes",
                          "more requests never make a step cheaper")
        return value

    draft_bs_probes: IntTuple = _probes_field("draft's")
    draft_seconds: FloatTuple = _draft_seconds_field()
    decode_bs_probes: IntTuple = _probes_field("target-only decode")
    decode_seconds: FloatTuple = _decode_seconds_field()


CostTable = Sps1dCostModel | AdditiveCostModel | TierCostModel

# The model a cost-model file of each `type` is validated against.
COST_TABLE_MODELS: dict[str, type[Sps1dCostModel] | type[AdditiveCostModel] | type[TierCostModel]] = {
    "sps-1d": Sps1dCostModel, "additive": AdditiveCostModel, "tier": TierCostModel,
}

DRAFT_KEYS = ("draft_bs_probes", "draft_seconds")
DECODE_KEYS = ("decode_bs_probes", "decode_seconds")
# The additive table's context term (written only where it has one).
CONTEXT_KEYS = ("context_len", "context_lens", "context_bias_seconds", "context_alpha_seconds",
                "context_theta_seconds", "context_draft_seconds", "context_decode_seconds")
# An additive table's fields without the context term: what each profiled context's table has.
_BASE_ADDITIVE = ("type", "bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds",
                  *DRAFT_KEYS, *DECODE_KEYS)
# Each kind's own fields, in file order (the per-batch terms and the fingerprint follow them).
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    kind: tuple(name for name in model.model_fields
                if name not in ("type", "fingerprint", *DRAFT_KEYS, *DECODE_KEYS, *CONTEXT_KEYS))
    for kind, model in COST_TABLE_MODELS.items()
}
# A key two kinds share (bs_probes) says nothing about which kind a table is; only these do.
_DISTINCT_KEYS: dict[str, tuple[str, ...]] = {
    kind: tuple(key for key in keys if not any(key in other for k, other in TABLE_KEYS.items() if k != kind))
    for kind, keys in TABLE_KEYS.items()
}


def cost_table_kind(data: Mapping[str, Any], where: str) -> str:
    """The kind of a table object: from the keys only one kind uses; an optional `type` must agree."""
    declared = data.get("type")
    if declared is not None and declared not in COST_TABLE_MODELS:
        raise CostTableError(f"{where}: type must be 'sps-1d', 'additive' or 'tier', got {declared!r}")
    present = {kind: [key for key in keys if key in data] for kind, keys in _DISTINCT_KEYS.items()}
    found = [kind for kind, keys in present.items() if keys]
    if len(found) > 1:
        mixed = " and ".join(f"{kind} keys {present[kind]}" for kind in found)
        raise CostTableError(f"{where}: mixes {mixed}; a table is one kind, keep one set of keys")
    if not found:
        if declared is not None:
            return str(declared)
        options = ", ".join(f"the {kind} keys {list(keys)}" for kind, keys in TABLE_KEYS.items())
        raise CostTableError(f"{where}: cannot tell the cost-model kind; give one of {options}")
    if declared is not None and declared != found[0]:
        raise CostTableError(f"{where}: type is {declared!r} but the keys {present[found[0]]} are those "
                             f"of the {found[0]!r} kind; fix the type or the keys")
    return found[0]


def cost_table_from_json(data: Any, where: str) -> CostTable:
    """Validate a table object (a file's contents or an embedded dict); `where` prefixes every error."""
    if not isinstance(data, Mapping):
        raise CostTableError(f"{where}: a cost model must be a JSON object, got {type(data).__name__}")
    kind = cost_table_kind(data, where)
    try:
        return COST_TABLE_MODELS[kind].model_validate({**data, "type": kind})
    except ValidationError as error:
        raise CostTableError(f"{where}: {kind} table: {validation_message(error)}") from None


def read_cost_table(path: str | os.PathLike[str]) -> CostTable:
    """A table file, validated; errors start with the path."""
    data = read_json_file(path, "cost-model file", "pass a table `dspark profile` wrote", CostTableError)
    return cost_table_from_json(data, str(path))


def cost_table_json(table: CostTable, fingerprint: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The file's object: the table's own fields (SGLang's names), the draft and decode terms where
    there are, then `fingerprint` when given. `type` is left out, as SGLang's files do."""
    data = table.model_dump(include=set(TABLE_KEYS[table.type]))
    out: dict[str, Any] = {key: _as_json(data[key]) for key in TABLE_KEYS[table.type]}
    for keys in (DRAFT_KEYS, DECODE_KEYS):
        if getattr(table, keys[0]):
            out.update({key: _as_json(getattr(table, key)) for key in keys})
    if getattr(table, "context_len", None) is not None:
        out.update({key: _as_json(getattr(table, key)) for key in CONTEXT_KEYS if getattr(table, key)})
    if fingerprint is not None:
        out["fingerprint"] = dict(fingerprint)
    return out


def _as_json(value: Any) -> Any:
    return [_as_json(item) for item in value] if isinstance(value, tuple) else value


def write_cost_table(path: str | os.PathLike[str], table: CostTable,
                     fingerprint: Mapping[str, Any] | None = None) -> Path:
    """Write a table file atomically, so a reader never sees a half-written table. Returns the path."""
    return write_json_file(path, cost_table_json(table, fingerprint))
