"""`dspark-compile export-sglang`: the SGLang launch command that serves a spec's deployment there.

Only names found in SGLang's own source are printed (sgl-project/sglang):

- server flags, `python/sglang/srt/server_args.py` (a dataclass whose field `tp_size` is the flag
  `--tp-size`): `--model-path`, `--served-model-name`, `--dtype`, `--speculative-algorithm DSPARK`,
  `--speculative-draft-model-path`, `--speculative-dspark-block-size` (gamma),
  `--speculative-num-draft-tokens` (must equal gamma + 1), `--speculative-dspark-sps-table-path`
  (an sps-1d or additive table, `dspark_components/dspark_sps.py::load_sps_table_from_path`),
  `--speculative-dspark-confidence-sts-path`, `--speculative-dspark-align-verify-tokens-to-graph-tier`,
  `--tp-size`, `--dp-size`, `--enable-dp-attention`, `--max-running-requests`, `--max-total-tokens`,
  `--page-size`, `--chunked-prefill-size`, `--context-length`, `--cuda-graph-bs-decode`,
  `--cuda-graph-backend-decode disabled`, and for Ascend `--device npu --attention-backend ascend`;
- environment, `python/sglang/srt/environ.py` and `speculative/ragged_verify.py`:
  `SGLANG_RAGGED_VERIFY_MODE` (static | cap-accept | compact, our verify modes),
  `SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS` (comma-separated compact token tiers beyond
  capture batch size x N), `SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS` (confidence lag, >= 1).

Every leaf field of the spec is accounted for in a comment block after the command: the flag or
variable it became, or why SGLang has no equivalent (never an invented flag). `NO_SGLANG_EQUIVALENT`
holds the reasons; a field that is neither mapped nor listed there is still printed, as unknown.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from dspark.formats.hf_config import FAMILIES
from dspark.spec import ResolvedSpec, SpecError
from dspark.spec.checkpoints import CheckpointRef
from dspark.spec.errors import SpecIssue
from dspark.spec.external import resolve_path
from dspark.spec.introspect import leaf_values
from dspark.spec.tables import CalibrationFile, CostModelFile

LAUNCH = ("python", "-m", "sglang.launch_server")
SGLANG_COST_KINDS = ("sps-1d", "additive")  # the table kinds SGLang's loader reads
_REQUEST_PARAMETER = "SGLang has no server-wide default for it; send it as each request's sampling parameter"
_CHECKPOINT_CONFIG = "SGLang reads it from the checkpoint's config.json"
_DRAFT_CONFIG = "SGLang's DSpark worker reads it from the draft checkpoint's config.json"

# Fields that never become an SGLang setting, and why. Keys are dotted spec paths; a key ending in
# ".*" covers every field below that prefix.
NO_SGLANG_EQUIVALENT: dict[str, str] = {
    "model.family": _CHECKPOINT_CONFIG + " (its architectures entry)",
    "model.geometry": _CHECKPOINT_CONFIG,
    "model.geometry.*": _CHECKPOINT_CONFIG,
    "online_calibration": "SGLang keeps the temperatures it was launched with: it has no online refit",
    "online_calibration.*": "SGLang keeps the temperatures it was launched with: it has no online refit",
    "online_cost": "SGLang prices steps with the table it was launched with: it has no online refit",
    "online_cost.*": "SGLang prices steps with the table it was launched with: it has no online refit",
    "draft.architecture": "SGLang tells a DSpark block draft from a V4 checkpoint's stages by the draft "
                          "checkpoint's config.json",
    "draft.confidence_head": "SGLang reads the draft's heads from its checkpoint",
    "draft.load_format": "SGLang's --load-format applies to the target; its draft is always loaded "
                         "from the checkpoint",
    "draft.num_layers": _DRAFT_CONFIG,
    "draft.block_size": _DRAFT_CONFIG + " (block_size)",
    "draft.mask_token_id": _DRAFT_CONFIG,
    "draft.target_layer_ids": _DRAFT_CONFIG,
    "draft.markov_rank": _DRAFT_CONFIG,
    "draft.markov_head_type": _DRAFT_CONFIG,
    "draft.confidence_with_markov": _DRAFT_CONFIG + " (confidence_head_with_markov)",
    "parallelism.ep": "a dense model has no experts to shard; SGLang's --ep-size default (1) is right",
    "backend.device": "SGLang runs on the accelerator it finds; the device model is not a flag",
    "verify.min_verify_len": "SGLang's DSpark planner has no verify-length floor",
    "verify.max_verify_len": "SGLang's DSpark planner has no verify-length cap",
    "verify.survival_eps": "SGLang's DSpark planner has no survival threshold setting",
    "verify.allow_no_cost_model": "dspark's compile-time check; without "
                                  "--speculative-dspark-sps-table-path SGLang uses a flat table",
    "verify.off": "SGLang's DSpark speculates at every step; it has no state without speculation",
    "verify.off_margin": "SGLang's DSpark speculates at every step; it has no state without speculation",
    "verify.off_patience": "SGLang's DSpark speculates at every step; it has no state without speculation",
    "verify.probe_every": "SGLang's DSpark speculates at every step; it has no state without speculation",
    "cost_model.fingerprint": "dspark's compile-time staleness check; SGLang does not read it",
    "calibration.policy": "dspark's compile-time check that the calibration fits serving.generation",
    "serving.generation.max_new_tokens": _REQUEST_PARAMETER + " max_new_tokens",
    "serving.generation.temperature": _REQUEST_PARAMETER + " temperature",
    "serving.generation.top_p": _REQUEST_PARAMETER + " top_p",
    "serving.generation.top_k": _REQUEST_PARAMETER + " top_k",
    "serving.record_steps": "dspark's step recorder; SGLang has its own metrics instead",
}


# What `backend.attention` means for SGLang when it is not FlashInfer (which SGLang also runs).
ATTENTION_NOTES = {
    "torch": "no SGLang equivalent: dspark's batch-invariant CPU attention",
    "triton": "no SGLang equivalent: dspark's own Triton kernel; SGLang's default attention backend "
              "(no flag) is its own choice for the device",
    "fused_infer_attention": "--attention-backend ascend, set with backend.kind",
}


@dataclass(frozen=True)
class SglangLaunch:
    """An SGLang launch: environment, server flags (each with its values), notes and the field
    accounting (one `path = value: setting or reason` line per leaf field of the spec)."""

    env: tuple[tuple[str, str], ...]
    flags: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...]  # comment lines, without the leading "# "
    header: tuple[str, ...]
    fields: tuple[tuple[str, str], ...] = ()  # (dotted spec path = value, what SGLang does with it)

    def render(self) -> str:
        lines = [f"# {line}" for line in self.header]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in self.env]
        body = [" ".join(shlex.quote(part) for part in flag) for flag in self.flags]
        lines.append(" ".join(LAUNCH) + " \\")
        lines += [f"  {item} \\" for item in body[:-1]] + [f"  {body[-1]}"]
        lines += [f"# {note}" for note in self.notes]
        if self.fields:
            lines.append("# spec fields and their SGLang settings:")
            lines += [f"#   {field}: {setting}" for field, setting in self.fields]
        return "\n".join(lines) + "\n"


def shown_path(path: Path, cwd: Path) -> str:
    """Relative to `cwd` when below it (the command is usually run from the repository), else absolute."""
    absolute = Path(path).expanduser().resolve()
    try:
        return absolute.relative_to(cwd.resolve()).as_posix()
    except ValueError:
        return absolute.as_posix()


def _checkpoint_path(ref: CheckpointRef, what: str, cwd: Path, notes: list[str]) -> str:
    if ref.embedded is not None:
        notes.append(f"{what} {ref.raw}: dspark's embedded byte-level model, whose tokenizer is "
                     f"dspark_tokenizer.json rather than a Hugging Face tokenizer")
        return shown_path(ref.directory, cwd)
    if ref.raw.startswith("~") or Path(ref.raw).is_absolute():
        return ref.raw  # as written: it names a place on the serving machine, not on this one
    return shown_path(ref.directory, cwd)


class _Builder:
    """Collects flags and environment, remembering which spec fields each one carries."""

    def __init__(self) -> None:
        self.env: list[tuple[str, str]] = []
        self.flags: list[tuple[str, ...]] = []
        self.notes: list[str] = []
        self.mapped: dict[str, str] = {}

    def flag(self, fields: tuple[str, ...], *parts: str) -> None:
        self.flags.append(parts)
        for field in fields:
            self._record(field, " ".join(parts))

    def var(self, fields: tuple[str, ...], name: str, value: str) -> None:
        self.env.append((name, value))
        for field in fields:
            self._record(field, f"{name}={value}")

    def says(self, field: str, text: str) -> None:
        """The field's setting in words (a default that needs no flag, a condition)."""
        self._record(field, text)

    def _record(self, field: str, text: str) -> None:
        self.mapped[field] = f"{self.mapped[field]}, {text}" if field in self.mapped else text


def sglang_launch(resolved: ResolvedSpec, cwd: Path | None = None) -> SglangLaunch:
    """The launch; raises `SpecError` at model.family for a family SGLang would serve as another model."""
    _refuse_dsv4(resolved)
    cwd = Path.cwd() if cwd is None else cwd
    spec, n = resolved.spec, resolved.num_draft_tokens
    verify, serving, parallelism = spec.verify, spec.serving, spec.parallelism
    out = _Builder()
    out.var(("verify.mode",), "SGLANG_RAGGED_VERIFY_MODE", str(verify.mode))
    out.flag(("model.checkpoint",), "--model-path",
             _checkpoint_path(resolved.model_checkpoint, "model.checkpoint", cwd, out.notes))
    out.flag(("name",), "--served-model-name", spec.name)
    out.flag(("model.dtype",), "--dtype", spec.model.dtype)
    if spec.model.load_format == "dummy":
        out.flag(("model.load_format",), "--load-format", "dummy")
    else:
        out.says("model.load_format", "--load-format not given (SGLang's default: the checkpoint's weights)")
    out.flag((), "--speculative-algorithm", "DSPARK")
    out.flag(("draft.checkpoint",), "--speculative-draft-model-path",
             _checkpoint_path(resolved.draft_checkpoint, "draft.checkpoint", cwd, out.notes))
    out.flag(("draft.gamma",), "--speculative-dspark-block-size", str(spec.draft.gamma))
    out.flag(("draft.gamma",), "--speculative-num-draft-tokens", str(n))
    _cost_model(resolved, cwd, out)
    _calibration(resolved, cwd, out)
    _verify(resolved, out)
    out.flag(("parallelism.tp",), "--tp-size", str(parallelism.tp))
    out.flag(("parallelism.dp",), "--dp-size", str(parallelism.dp))
    if parallelism.dp_attention:
        out.flag(("parallelism.dp_attention",), "--enable-dp-attention")
    else:
        out.says("parallelism.dp_attention", "--enable-dp-attention not given (off)")
    out.flag(("serving.max_running_requests",), "--max-running-requests", str(serving.max_running_requests))
    out.flag(("serving.max_total_tokens",), "--max-total-tokens", str(serving.max_total_tokens))
    out.flag(("serving.page_size",), "--page-size", str(serving.page_size))
    out.flag(("serving.chunked_prefill_tokens",), "--chunked-prefill-size",
             str(serving.chunked_prefill_tokens))
    out.flag(("serving.max_context_len",), "--context-length", str(serving.max_context_len))
    _graph_flags(resolved, out)
    backend = spec.backend
    if backend.kind == "ascend":
        out.flag(("backend.kind",), "--device", "npu")
        out.flag(("backend.kind",), "--attention-backend", "ascend")
    elif backend.kind == "cpu":
        out.says("backend.kind", "no SGLang equivalent: SGLang's DSpark runs on CUDA or NPU devices only")
    else:
        out.says("backend.kind", "CUDA, SGLang's default device (no flag)")
    if spec.attention_impl == "flashinfer":
        out.flag(("backend.attention",), "--attention-backend", "flashinfer")
    else:
        out.says("backend.attention", ATTENTION_NOTES[spec.attention_impl])
    header = (f"SGLang launch for deployment {spec.name} (spec {resolved.display_path}), printed by "
              f"`dspark-compile export-sglang`.",
              *resolved.stale_tables)
    fields = tuple((f"{path} = {_value(value)}", out.mapped.get(path) or _unmapped(path))
                   for path, value in leaf_values(spec))
    return SglangLaunch(tuple(out.env), tuple(out.flags), tuple(out.notes), header, fields)


def _refuse_dsv4(resolved: ResolvedSpec) -> None:
    if resolved.spec.model.family.exports_to_sglang:
        return
    raise SpecError([SpecIssue(
        ("model", "family"),
        f"export-sglang does not cover the {resolved.spec.model.family} family: SGLang's DeepSeek-V4 launch "
        "(its DSpark stages, expert-parallel, MoE and quantised-kernel flags) is not mapped, so the launch "
        "would describe another deployment",
        f"export-sglang prints launches for the dense families ({', '.join(FAMILIES)})",
        resolved.location_of("model.family"))])


def _cost_model(resolved: ResolvedSpec, cwd: Path, out: _Builder) -> None:
    spec = resolved.spec
    cost = spec.cost_model
    if isinstance(cost, CostModelFile) and cost.type in SGLANG_COST_KINDS:
        out.flag(("cost_model.file", "cost_model.type"), "--speculative-dspark-sps-table-path",
                 shown_path(resolve_path(cost.file, resolved.source.parent), cwd))
        table = resolved.cost_model
        if table is not None and getattr(table, "draft_bs_probes", ()):
            out.notes.append("the cost table's draft term (draft_bs_probes, draft_seconds) is not read "
                             "by SGLang, whose sps-1d and additive tables have no draft fields")
        if table is not None and getattr(table, "context_lens", ()):
            out.notes.append("the cost table's context term (context_len, context_lens, context_*) is not "
                             "read by SGLang, which prices every step at the table's own context")
        if table is not None and getattr(table, "bias_seconds", 1.0) <= 0:
            out.notes.append("SGLang rejects an additive table with bias_seconds <= 0; re-fit it")
        return
    if cost is None:
        out.says("cost_model", "--speculative-dspark-sps-table-path not given (a flat table)")
        if spec.verify.mode.plans:
            out.notes.append("no cost_model (verify.allow_no_cost_model): without "
                             "--speculative-dspark-sps-table-path SGLang uses a flat table and verifies "
                             "every row")
        return
    where = f"file {cost.file}" if isinstance(cost, CostModelFile) else "inline"
    if cost.type in SGLANG_COST_KINDS:
        reason = (f"no SGLang equivalent for an inline table: write the {cost.type} table to a JSON file "
                  f"and pass it with --speculative-dspark-sps-table-path")
    else:
        reason = (f"no SGLang equivalent: SGLang reads sps-1d and additive tables only, not "
                  f"{cost.type} ({where})")
    for path, _ in leaf_values(cost, "cost_model"):
        if path != "cost_model.fingerprint":
            out.says(path, reason)


def _calibration(resolved: ResolvedSpec, cwd: Path, out: _Builder) -> None:
    calibration = resolved.spec.calibration
    if isinstance(calibration, CalibrationFile):
        out.flag(("calibration.file",), "--speculative-dspark-confidence-sts-path",
                 shown_path(resolve_path(calibration.file, resolved.source.parent), cwd))
    elif calibration is None:
        out.says("calibration", "--speculative-dspark-confidence-sts-path not given (raw confidence)")
    else:
        out.says("calibration.temperatures",
                 "no SGLang equivalent for inline temperatures: write them to a JSON file "
                 "{\"temperatures\": [...]} and pass it with --speculative-dspark-confidence-sts-path")
    if resolved.calibration_policy is not None:
        out.notes.append(f"the calibration was fitted for the sampling policy {resolved.calibration_policy}")


def _verify(resolved: ResolvedSpec, out: _Builder) -> None:
    verify = resolved.spec.verify
    if verify.align_to_graph_tier:
        out.flag(("verify.align_to_graph_tier",), "--speculative-dspark-align-verify-tokens-to-graph-tier")
    else:
        out.says("verify.align_to_graph_tier",
                 "--speculative-dspark-align-verify-tokens-to-graph-tier not given (off)")
    if not verify.mode.plans:
        out.says("verify.lag_steps", "no SGLang equivalent in static mode: there is no planner to lag")
        return
    # SGLang clamps the lag to >= 1 (default 2): it never plans with this step's own confidence.
    lag = max(verify.lag_steps, 1)
    out.var(("verify.lag_steps",), "SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS", str(lag))
    if verify.lag_steps == 0:
        out.notes.append("verify.lag_steps=0 has no SGLang equivalent: SGLang's confidence lag is at "
                         "least 1 step, so it is set to 1")


def _graph_flags(resolved: ResolvedSpec, out: _Builder) -> None:
    """Graph capture: SGLang captures decode batch sizes; a verify step's token tier is a batch size
    times N, and compact mode adds SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS below the largest."""
    graph = resolved.spec.graph
    fields = ("graph.enabled", "graph.token_tiers" if graph.token_tiers else "graph.capture_batch_sizes")
    if not resolved.tiers:
        out.flag(("graph.enabled",), "--cuda-graph-backend-decode", "disabled")
        for field in ("graph.capture_batch_sizes", "graph.token_tiers"):
            out.says(field, "none captured (graph capture is off)")
        return
    out.says("graph.enabled", "graphs captured (SGLang's default)")
    n, tiers = resolved.num_draft_tokens, resolved.tiers
    batch_sizes = sorted({tier // n for tier in tiers if tier % n == 0})
    if resolved.spec.verify.mode.packs_rows:
        largest = batch_sizes[-1] * n if batch_sizes else 0
        extra = [tier for tier in tiers if tier % n and tier < largest]
        dropped = [tier for tier in tiers if tier % n and tier > largest]
        if extra:
            out.var(fields[1:], "SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS", ",".join(map(str, extra)))
    else:
        dropped = [tier for tier in tiers if tier % n]
    if dropped:
        out.notes.append(f"graph tiers {dropped} cannot be expressed in SGLang: its largest tier is the "
                         f"largest captured batch size x N = {n}")
    if batch_sizes:
        out.flag(fields, "--cuda-graph-bs-decode", *map(str, batch_sizes))
    unused = "graph.capture_batch_sizes" if graph.token_tiers else "graph.token_tiers"
    out.says(unused, f"not given: the tiers come from {fields[1]}")


def _unmapped(path: str) -> str:
    reason = NO_SGLANG_EQUIVALENT.get(path)
    if reason is None:
        reason = next((text for key, text in NO_SGLANG_EQUIVALENT.items()
                       if key.endswith(".*") and path.startswith(key[:-1])), None)
    return f"no SGLang equivalent: {reason}" if reason else "no SGLang flag known for this field"


def _value(value: Any, limit: int = 60) -> str:
    if isinstance(value, Enum):
        value = value.value
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
