"""What a measurement was taken on, so a table measured on one deployment is not used on another.

A cost table (`dspark profile`) or an STS calibration (`dspark calibrate`) is only valid for the
deployment it was measured on. Files carry a `Fingerprint` of that deployment; the compiler compares
it with the fingerprint of the spec being compiled and refuses a stale table.

Which fields matter depends on what the file measured:

- Cost tables (`COST_FIELDS`) time the verify step (and the draft step) on real hardware. The time
  depends on the backend and device, the dtype, the model's shapes, the draft (its own step time is
  in the table, and gamma sets N and so the rows per request), the per-rank shapes that tp and dp
  produce and the tier grid (a step is padded to its tier, so the tiers are where the cost jumps).
  The verify mode is recorded but not compared: `dspark profile` times ragged (B, M) steps, which
  only a compact build can run, and the same table prices the budget of a cap-accept build (as in
  SGLang). The sampling policy does not change the cost of a step either.
- Calibrations (`CALIBRATION_FIELDS`) map confidence logits to the probability that a draft is
  accepted. That depends on what the two models predict (the target, identified by its geometry,
  and the draft), on gamma (one temperature per position) and on the sampling policy: the labels
  are prefix matches under that policy, and greedy labels do not carry over to sampling. It does
  not depend on the hardware, the parallel layout, the tiers or the verify mode, so one
  calibration serves every build of the same model pair and policy.

`fingerprint_of_spec` (compiler side, from the resolved spec) and `fingerprint_of_deployment`
(runtime side, from a generated package's DEPLOYMENT and graph tiers) must agree for every spec;
both go through `_build`, so they differ only in where they read each value.

No torch and no pydantic here: the compiler and the runtime both import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspark.checkpoints import EMBEDDED_PREFIX
from dspark.modes import VerifyMode

if TYPE_CHECKING:
    from dspark.runtime.config import DeploymentConfig
    from dspark.spec.checkpoints import CheckpointRef
    from dspark.spec.models import DeploymentSpec, GeometrySpec
    from dspark.spec.resolved import ResolvedSpec

COST_FIELDS = ("backend", "device", "dtype", "model_geometry", "draft", "tp", "dp", "tiers", "gamma")
CALIBRATION_FIELDS = ("model_geometry", "draft", "gamma", "policy")

GEOMETRY_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps")
_FLOAT_GEOMETRY = ("rope_theta", "rms_norm_eps")
_DIGEST_CHARS = 16  # 64 bits: enough to tell deployments apart, short enough to read in an error
_VERIFY_MODES = tuple(mode.value for mode in VerifyMode)
GREEDY = "greedy"


class FingerprintError(ValueError):
    """A fingerprint is malformed; the message names the field and says what is wrong."""


@dataclass(frozen=True)
class Fingerprint:
    """The deployment a table was measured on (see the module docstring for what each field is for)."""

    backend: str
    device: str
    dtype: str
    model_geometry: str  # short sha256 of the target geometry's canonical JSON
    draft: str  # short sha256 of gamma, confidence head, Markov embedding size and the checkpoint
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
            raise FingerprintError(f"fingerprint has {' and '.join(problems)}; a fingerprint has exactly "
                                   f"the keys {names}")
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
    return repr(value)


def short_digest(value: Any) -> str:
    """Short sha256 of `value`'s canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:_DIGEST_CHARS]


def geometry_digest(geometry: Any) -> str:
    """Digest of a model geometry (a spec `GeometrySpec` or a runtime `ModelGeometry`, head_dim set).

    Integers and floats are normalised so `rope_theta: 500000` in YAML and `500000.0` in generated
    code hash alike.
    """
    values = {}
    for name in GEOMETRY_FIELDS:
        value = getattr(geometry, name)
        if value is None:
            raise FingerprintError(f"geometry {name} is not resolved; fingerprint a resolved geometry")
        values[name] = float(value) if name in _FLOAT_GEOMETRY else int(value)
    return short_digest(values)


def draft_identity(checkpoint: str) -> str:
    """The draft checkpoint as fingerprints name it: `embedded:<name>`, else its directory's name.

    The stored path differs between the spec (relative to the spec file), the generated package
    (relative to the package) and machines (a copy under another root), while a table measured with
    the same checkpoint elsewhere is still valid; the directory name is what stays the same.
    """
    if checkpoint.startswith(EMBEDDED_PREFIX):
        return checkpoint
    return os.path.basename(os.path.normpath(os.path.expanduser(checkpoint)))


def draft_digest(*, gamma: int, confidence_head: bool, markov_embedding_size: int,
                 checkpoint: str) -> str:
    return short_digest({"gamma": int(gamma), "confidence_head": bool(confidence_head),
                         "markov_embedding_size": int(markov_embedding_size),
                         "checkpoint": draft_identity(checkpoint)})


def _number(value: float) -> str:
    return repr(float(value))


def sampling_policy(temperature: float, top_p: float, top_k: int) -> str:
    """`greedy` at temperature 0 (top-p and top-k do not matter then), else the sampling parameters."""
    if float(temperature) == 0.0:
        return GREEDY
    return f"sample:temperature={_number(temperature)},top_p={_number(top_p)},top_k={int(top_k)}"


def _build(*, backend: str, device: str, dtype: str, geometry: Any, draft_checkpoint: str, gamma: int,
           confidence_head: bool, markov_embedding_size: int, tp: int, dp: int,
           tiers: Sequence[int], verify_mode: str, temperature: float, top_p: float,
           top_k: int) -> Fingerprint:
    return Fingerprint(
        backend=backend, device=device, dtype=dtype, model_geometry=geometry_digest(geometry),
        draft=draft_digest(gamma=gamma, confidence_head=confidence_head,
                           markov_embedding_size=markov_embedding_size, checkpoint=draft_checkpoint),
        tp=tp, dp=dp, tiers=tuple(int(t) for t in tiers), verify_mode=str(verify_mode), gamma=gamma,
        policy=sampling_policy(temperature, top_p, top_k))


def spec_draft_checkpoint(ref: CheckpointRef) -> str:
    """A resolved spec checkpoint as `draft_identity` reads it (the directory, not the raw text)."""
    if ref.embedded is not None:
        return EMBEDDED_PREFIX + ref.embedded
    return str(ref.directory)


def fingerprint_of_spec_parts(spec: DeploymentSpec, geometry: GeometrySpec, draft_checkpoint: CheckpointRef,
                              tiers: Sequence[int]) -> Fingerprint:
    """The spec's fingerprint from its parts, for checks that run before a `ResolvedSpec` exists."""
    generation = spec.serving.generation
    return _build(
        backend=spec.backend.kind, device=spec.backend.device, dtype=spec.model.dtype, geometry=geometry,
        draft_checkpoint=spec_draft_checkpoint(draft_checkpoint), gamma=spec.draft.gamma,
        confidence_head=spec.draft.confidence_head,
        markov_embedding_size=spec.draft.markov_embedding_size, tp=spec.parallelism.tp,
        dp=spec.parallelism.dp, tiers=tiers, verify_mode=spec.verify.mode,
        temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k)


def fingerprint_of_spec(resolved: ResolvedSpec) -> Fingerprint:
    """Compiler side: the fingerprint of the deployment a resolved spec describes."""
    return fingerprint_of_spec_parts(resolved.spec, resolved.geometry, resolved.draft_checkpoint,
                                     resolved.tiers)


def fingerprint_of_deployment(deployment: DeploymentConfig, tiers: Sequence[int]) -> Fingerprint:
    """Runtime side: the fingerprint of a generated package (`tiers`: its graph_runner.TOKEN_TIERS)."""
    serving = deployment.serving
    return _build(
        backend=deployment.backend, device=deployment.device, dtype=deployment.model.dtype,
        geometry=deployment.model.geometry, draft_checkpoint=deployment.draft.checkpoint,
        gamma=deployment.draft.gamma, confidence_head=deployment.draft.confidence_head,
        markov_embedding_size=deployment.draft.markov_embedding_size, tp=deployment.parallel.tp,
        dp=deployment.parallel.dp, tiers=tiers, verify_mode=deployment.verify_mode,
        temperature=serving.temperature, top_p=serving.top_p, top_k=serving.top_k)
