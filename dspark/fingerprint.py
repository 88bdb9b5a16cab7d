"""What a measurement was taken on, so a table measured on one deployment is not used on another.

A cost table (`dspark profile`) or an STS calibration (`dspark calibrate`) is only valid for the
deployment it was measured on. Files carry a `Fingerprint` of that deployment; the compiler compares
it with the fingerprint of the spec being compiled and refuses a stale table.

Which fields matter depends on what the file measured:

- Cost tables (`COST_FIELDS`) time the verify step (and the draft step) on real hardware. The time
  depends on the backend and device, the dtype, the model's shapes, the draft (its own step time is
  in the table, and gamma sets N and so the rows per request), the per-rank shapes that tp and dp
  produce and the tier grid (a step is padded to its tier, so the tiers are where the cost jumps).
  The checkpoints' content is compared too: weights with the same shapes can still differ in what
  a step computes (a confidence head refitted to read extra draft statistics changes the draft's
  config and its step, not the target's geometry), and a table is only trusted for the checkpoints
  it was measured with. A table without the draft-time term (`draft_bs_probes`) timed the verify
  step alone, which the draft does not take part in, so its draft fields (`DRAFT_FIELDS`: the
  draft's settings and weights; gamma stays, it sets N) are not compared. The verify mode is
  recorded but not compared: `dspark profile` of a compact
  build times ragged (B, M) steps, and the same table prices the budget of a cap-accept build (as in
  SGLang); a static or cap-accept build's profile is its static sweep of B x N rows. The sampling
  policy does not change the cost of a step either.
- Calibrations (`CALIBRATION_FIELDS`) map confidence logits to the probability that a draft is
  accepted. That depends on what the two models predict (the target and the draft, each identified
  by its geometry or settings and by the content of its checkpoint), on gamma (one temperature per
  position) and on the sampling policy: the labels are prefix matches under that policy, and
  greedy labels do not carry over to sampling. It does
  not depend on the hardware, the parallel layout, the tiers or the verify mode, so one
  calibration serves every build of the same model pair and policy.

Checkpoints are identified by content (`model_weights`, `draft_weights`: the first 16 hex digits of
`dspark.checkpoints.digest.checkpoint_digest` of the directory, config.json and weights), never by
their path or name, so a copy elsewhere is the same checkpoint and a retrained one under the same
name is not. A weights field is "" when the checkpoint was not on the machine that compiled the
spec; `dspark.spec.staleness` then cannot compare it and says so.

`fingerprint_of_spec` (compiler side, from the resolved spec) and `fingerprint_of_deployment`
(runtime side, from a generated package's DEPLOYMENT, whose model and draft references carry the
digests computed at compile time, and graph tiers) must agree for every spec; both go through
`_build`, so they differ only in where they read each value.

No torch and no pydantic here: the compiler and the runtime both import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspark.backends import default_attention
from dspark.families import ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.hf_config import ROPE_SCALING_FIELDS
from dspark.modes import BLOCK_DRAFT, VerifyMode

if TYPE_CHECKING:
    from dspark.runtime.config import DeploymentConfig
    from dspark.spec.models import DeploymentSpec, TargetGeometry
    from dspark.spec.resolved import ResolvedSpec

COST_FIELDS = ("backend", "device", "dtype", "model_geometry", "model_weights", "draft", "draft_weights",
               "tp", "dp", "tiers", "gamma")
CALIBRATION_FIELDS = ("model_geometry", "model_weights", "draft", "draft_weights", "gamma", "policy")
WEIGHT_FIELDS = ("model_weights", "draft_weights")  # "" = checkpoint not present when compiled
DRAFT_FIELDS = ("draft", "draft_weights")  # what only a table that times the draft step depends on

GEOMETRY_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps")
_FLOAT_GEOMETRY = ("rope_theta", "rms_norm_eps")
_FLAG_GEOMETRY = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_DSV4_FLOATS = ("norm_eps", "rope_theta", "compress_rope_theta")
_DIGEST_CHARS = 16  # 64 bits: enough to tell deployments apart, short enough to read in an error
_VERIFY_MODES = tuple(mode.value for mode in VerifyMode)
GREEDY = "greedy"


class FingerprintError(ValueError):
    """A fingerprint is malformed; the message names the field and says what is wrong."""


@dataclass(frozen=True)
class Fingerprint:
    """The deployment a table was measured on (see the module docstring for what each field is for)."""

    backend: str  # the backend kind, with "+attention" when it runs a non-default attention
    device: str
    dtype: str
    model_geometry: str  # short sha256 of the target geometry's canonical JSON
    model_weights: str  # short content digest of the target checkpoint ("" = not known)
    draft: str  # short sha256 of the draft's settings (`draft_settings_digest`)
    draft_weights: str  # short content digest of the draft checkpoint ("" = not known)
    tp: int
    dp: int
    tiers: tuple[int, ...]  # graph tiers; empty when graph capture is off
    verify_mode: str
    gamma: int
    policy: str  # "greedy" or "sample:temperature=…,top_p=…,top_k=…"

    def __post_init__(self) -> None:
        for name in ("backend", "device", "dtype", "model_geometry", "draft", "verify_mode", "policy"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise FingerprintError(f"{name} must be a non-empty string, got {value!r}")
        for name in WEIGHT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not _is_short_digest(value)):
                raise FingerprintError(f"{name} must be {_DIGEST_CHARS} lowercase hex digits (or \"\" when "
                                       f"the checkpoint was not present), got {value!r}")
        for name in ("tp", "dp", "gamma"):
            value = getattr(self, name)
            # bool is an int subclass; `true` for a rank count is a typo, not 1.
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FingerprintError(f"{name} must be an integer >= 1, got {value!r}")
        tiers = self.tiers
        if isinstance(tiers, list):
            tiers = tuple(tiers)
            object.__setattr__(self, "tiers", tiers)
        if not isinstance(tiers, tuple) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tiers):
            raise FingerprintError(f"tiers must be a list of positive integers, got {self.tiers!r}")
        if list(tiers) != sorted(set(tiers)):
            raise FingerprintError(f"tiers must be strictly increasing, got {list(tiers)}")
        if self.verify_mode not in _VERIFY_MODES:
            raise FingerprintError(f"verify_mode must be one of {', '.join(_VERIFY_MODES)}, got "
                                   f"{self.verify_mode!r}")

    def to_json(self) -> dict[str, Any]:
        """A JSON object with every field (tiers as a list)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["tiers"] = list(self.tiers)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Fingerprint:
        """Read `to_json` output; unknown or missing keys are errors that name them."""
        if not isinstance(data, Mapping):
            raise FingerprintError(f"a fingerprint must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in data if key not in names)
        missing = [name for name in names if name not in data]
        problems = []
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if missing:
            problems.append(f"missing keys {missing}")
        if problems:
            older = " (it was written by an older dspark, before checkpoints were identified by content)" \
                if set(missing) <= set(WEIGHT_FIELDS) and not unknown else ""
            raise FingerprintError(f"fingerprint has {' and '.join(problems)}{older}; a fingerprint has "
                                   f"exactly the keys {names}")
        values = dict(data)
        if not isinstance(values["tiers"], list):
            raise FingerprintError(f"tiers must be a list of positive integers, got {values['tiers']!r}")
        return cls(**values)

    def differences(self, other: Fingerprint, fields: Sequence[str]) -> list[str]:
        """One line per field in `fields` where `self` (what was measured) differs from `other`
        (the spec), e.g. "tiers: measured on (8, 16) but the spec has (8, 16, 24)"."""
        known = {f.name for f in dataclasses.fields(self)}
        out = []
        for name in fields:
            if name not in known:
                raise FingerprintError(f"{name!r} is not a fingerprint field; use one of {sorted(known)}")
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: measured on {_show(mine)} but the spec has {_show(theirs)}")
        return out


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "no graph tiers ()" if not value else repr(value)
    if value == "":
        return "unrecorded weights ''"
    return repr(value)


def _is_short_digest(value: str) -> bool:
    return len(value) == _DIGEST_CHARS and all(c in "0123456789abcdef" for c in value)


def short_digest(value: Any) -> str:
    """Short sha256 of `value`'s canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:_DIGEST_CHARS]


def geometry_digest(geometry: Any, family: str = "llama") -> str:
    """Digest of a model geometry (a spec `GeometrySpec` or a runtime `ModelGeometry`, head_dim set; a
    `Dsv4Geometry` for the dsv4 family) of a model `family`.

    Integers and floats are normalised so `rope_theta: 500000` in YAML and `500000.0` in generated
    code hash alike. The family and the config fields added with it (RoPE scaling, tied embeddings,
    biases) enter only where they differ from a plain untied Llama, so the digests of tables
    measured before they existed stay valid.
    """
    if isinstance(geometry, Dsv4Geometry):
        return _dsv4_digest(geometry)
    values: dict[str, Any] = {}
    for name in GEOMETRY_FIELDS:
        value = getattr(geometry, name)
        if value is None:
            raise FingerprintError(f"geometry {name} is not resolved; fingerprint a resolved geometry")
        values[name] = float(value) if name in _FLOAT_GEOMETRY else int(value)
    if family != ModelFamily.LLAMA:
        values["family"] = str(family)
    scaling = getattr(geometry, "rope_scaling", None)
    if scaling is not None:
        values["rope_scaling"] = {name: getattr(scaling, name) for name in ROPE_SCALING_FIELDS
                                  if getattr(scaling, name) is not None}
    for flag in _FLAG_GEOMETRY:
        if getattr(geometry, flag, False):
            values[flag] = True
    return short_digest(values)


def _dsv4_digest(geometry: Dsv4Geometry) -> str:
    """Every field of a DeepSeek-V4 geometry, normalised as the dense ones are, and the family. The fields
    with a default (the MoE, hyper-connections, grouped output projection and YaRN, added later) enter only
    where they differ from it, so the digests of tables measured before they existed stay valid."""
    values: dict[str, Any] = {"family": ModelFamily.DSV4.value}
    for field in dataclasses.fields(geometry):
        value = getattr(geometry, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        if field.name == "compress_ratios":
            values[field.name] = [int(ratio) for ratio in value]
        elif isinstance(value, str):
            values[field.name] = value
        else:
            is_float = isinstance(field.default, float) or field.name in _DSV4_FLOATS
            values[field.name] = float(value) if is_float else int(value)
    return short_digest(values)


def weights_identity(digest: str) -> str:
    """A checkpoint digest as fingerprints store it: its first 16 hex digits ("" stays "")."""
    if not digest:
        return ""
    short = digest[:_DIGEST_CHARS]
    if len(digest) < _DIGEST_CHARS or not _is_short_digest(short):
        raise FingerprintError(f"{digest!r} is not a checkpoint digest (hex sha256)")
    return short


DRAFT_SETTINGS = ("gamma", "confidence_head", "num_layers", "block_size", "target_layer_ids",
                  "markov_rank", "markov_head_type", "confidence_with_markov")


def draft_settings_digest(draft: Any) -> str:
    """Short sha256 of the draft's settings (a resolved spec `DraftSpec` or a runtime `DraftRef`): the
    drafts per step and the architecture that sets its step's work (layers, block, the target states
    read, the heads); its weights are identified separately. The Markov kind enters only with a
    Markov head, and the mask token not at all: it changes no shape and no cost."""
    settings: dict[str, Any] = {name: getattr(draft, name) for name in DRAFT_SETTINGS}
    settings["target_layer_ids"] = [int(i) for i in settings["target_layer_ids"] or ()]
    if not settings["markov_rank"]:
        settings.pop("markov_head_type")
    if draft.architecture not in (None, BLOCK_DRAFT):  # a block draft's digests predate the field
        settings["architecture"] = draft.architecture
    return short_digest(settings)


def _number(value: float) -> str:
    return repr(float(value))


def sampling_policy(temperature: float, top_p: float, top_k: int) -> str:
    """`greedy` at temperature 0 (top-p and top-k do not matter then), else the sampling parameters."""
    if float(temperature) == 0.0:
        return GREEDY
    return f"sample:temperature={_number(temperature)},top_p={_number(top_p)},top_k={int(top_k)}"


def backend_identity(kind: str, attention: str | None, family: str) -> str:
    """The backend as fingerprints store it: a table measured with FlashInfer's attention is not one
    measured with the project's Triton kernel, but the default attention for the model family keeps
    the bare kind."""
    if attention is None or attention == default_attention(kind, family):
        return kind
    return f"{kind}+{attention}"


def _build(*, backend: str, device: str, dtype: str, geometry: Any, family: str, model_digest: str,
           draft_weights_digest: str, draft: Any, tp: int, dp: int, tiers: Sequence[int], verify_mode: str,
           temperature: float, top_p: float, top_k: int) -> Fingerprint:
    return Fingerprint(
        backend=backend, device=device, dtype=dtype, model_geometry=geometry_digest(geometry, family),
        model_weights=weights_identity(model_digest),
        draft=draft_settings_digest(draft),
        draft_weights=weights_identity(draft_weights_digest),
        tp=tp, dp=dp, tiers=tuple(int(t) for t in tiers), verify_mode=str(verify_mode), gamma=draft.gamma,
        policy=sampling_policy(temperature, top_p, top_k))


def fingerprint_of_spec_parts(spec: DeploymentSpec, geometry: TargetGeometry, tiers: Sequence[int], *,
                              model_digest: str, draft_digest: str) -> Fingerprint:
    """The spec's fingerprint from its parts, for checks that run before a `ResolvedSpec` exists
    (`model_digest`, `draft_digest`: `checkpoint_digest` of each checkpoint, "" when absent)."""
    generation = spec.serving.generation
    return _build(
        backend=backend_identity(spec.backend.kind, spec.backend.attention, spec.model.family),
        device=spec.backend.device,
        dtype=spec.model.dtype, geometry=geometry, family=spec.model.family,
        model_digest=model_digest, draft_weights_digest=draft_digest, draft=spec.draft,
        tp=spec.parallelism.tp,
        dp=spec.parallelism.dp, tiers=tiers, verify_mode=spec.verify.mode,
        temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k)


def fingerprint_of_spec(resolved: ResolvedSpec) -> Fingerprint:
    """Compiler side: the fingerprint of the deployment a resolved spec describes."""
    return fingerprint_of_spec_parts(resolved.spec, resolved.geometry, resolved.tiers,
                                     model_digest=resolved.model_digest, draft_digest=resolved.draft_digest)


def fingerprint_of_deployment(deployment: DeploymentConfig, tiers: Sequence[int]) -> Fingerprint:
    """Runtime side: the fingerprint of a generated package (`tiers`: its graph_runner.TOKEN_TIERS).

    The checkpoint digests are those the compiler recorded in the package (`ModelRef.digest`,
    `DraftRef.digest`), i.e. of the checkpoints the package was compiled against.
    """
    serving = deployment.serving
    return _build(
        backend=backend_identity(deployment.backend, deployment.attention, deployment.model.family),
        device=deployment.device,
        dtype=deployment.model.dtype,
        geometry=deployment.model.geometry, family=deployment.model.family,
        model_digest=deployment.model.digest,
        draft_weights_digest=deployment.draft.digest, draft=deployment.draft,
        tp=deployment.parallel.tp,
        dp=deployment.parallel.dp, tiers=tiers, verify_mode=deployment.verify_mode,
        temperature=serving.temperature, top_p=serving.top_p, top_k=serving.top_k)
