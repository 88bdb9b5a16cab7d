"""`dspark-compile export-sglang`: the SGLang launch command that serves a spec's deployment there.

Only names found in SGLang's own source are printed (sgl-project/sglang):

- server flags, `python/sglang/srt/server_args.py` (a dataclass whose field `tp_size` is the flag
  `--tp-size`): `--model-path`, `--dtype`, `--speculative-algorithm DSPARK`,
  `--speculative-draft-model-path`, `--speculative-dspark-block-size` (gamma),
  `--speculative-num-draft-tokens` (must equal gamma + 1), `--speculative-dspark-sps-table-path`
  (an sps-1d or additive table, `dspark_components/dspark_sps.py::load_sps_table_from_path`),
  `--speculative-dspark-confidence-sts-path`, `--speculative-dspark-align-verify-tokens-to-graph-tier`,
  `--tp-size`, `--dp-size`, `--enable-dp-attention`, `--max-running-requests`, `--max-total-tokens`,
  `--page-size`, `--context-length`, `--cuda-graph-bs-decode`, `--cuda-graph-backend-decode disabled`,
  and for Ascend `--device npu --attention-backend ascend`;
- environment, `python/sglang/srt/environ.py` and `speculative/ragged_verify.py`:
  `SGLANG_RAGGED_VERIFY_MODE` (static | cap-accept | compact, our verify modes),
  `SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS` (comma-separated compact token tiers beyond
  capture batch size x N), `SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS` (confidence lag, >= 1).

A setting with no SGLang equivalent is printed as a `# no SGLang flag found for: …` comment rather
than as an invented flag.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from dspark.spec import ResolvedSpec
from dspark.spec.checkpoints import CheckpointRef
from dspark.spec.external import resolve_path
from dspark.spec.tables import CalibrationFile, CostModelFile

LAUNCH = ("python", "-m", "sglang.launch_server")
SGLANG_COST_KINDS = ("sps-1d", "additive")  # the table kinds SGLang's loader reads


@dataclass(frozen=True)
class SglangLaunch:
    """An SGLang launch: environment, server flags (each with its values) and unmapped settings."""

    env: tuple[tuple[str, str], ...]
    flags: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...]  # comment lines, without the leading "# "
    header: tuple[str, ...]

    def render(self) -> str:
        lines = [f"# {line}" for line in self.header]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in self.env]
        body = [" ".join(shlex.quote(part) for part in flag) for flag in self.flags]
        lines.append(" ".join(LAUNCH) + " \\")
        lines += [f"  {item} \\" for item in body[:-1]] + [f"  {body[-1]}"]
        lines += [f"# {note}" for note in self.notes]
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


def sglang_launch(resolved: ResolvedSpec, cwd: Path | None = None) -> SglangLaunch:
    cwd = Path.cwd() if cwd is None else cwd
    spec, n = resolved.spec, resolved.num_draft_tokens
    verify, serving, parallelism = spec.verify, spec.serving, spec.parallelism
    spec_dir = resolved.source.parent
    notes: list[str] = []
    unmapped: list[str] = []
    env: list[tuple[str, str]] = [("SGLANG_RAGGED_VERIFY_MODE", verify.mode)]
    flags: list[tuple[str, ...]] = [
        ("--model-path", _checkpoint_path(resolved.model_checkpoint, "model.checkpoint", cwd, notes)),
        ("--dtype", spec.model.dtype),
        ("--speculative-algorithm", "DSPARK"),
        ("--speculative-draft-model-path",
         _checkpoint_path(resolved.draft_checkpoint, "draft.checkpoint", cwd, notes)),
        ("--speculative-dspark-block-size", str(spec.draft.gamma)),
        ("--speculative-num-draft-tokens", str(n)),
    ]

    cost = spec.cost_model
    if isinstance(cost, CostModelFile) and cost.type in SGLANG_COST_KINDS:
        flags.append(("--speculative-dspark-sps-table-path",
                      shown_path(resolve_path(cost.file, spec_dir), cwd)))
        table = resolved.cost_model
        if table is not None and getattr(table, "draft_bs_probes", ()):
            notes.append("the cost table's draft term (draft_bs_probes, draft_seconds) is not read by "
                         "SGLang, whose sps-1d and additive tables have no draft fields")
        if table is not None and getattr(table, "bias_seconds", 1.0) <= 0:
            notes.append("SGLang rejects an additive table with bias_seconds <= 0; re-fit it")
    elif cost is not None:
        where = f"file {cost.file}" if isinstance(cost, CostModelFile) else "inline"
        if cost.type in SGLANG_COST_KINDS:
            unmapped.append(f"cost_model ({where}): write the table to a JSON file and pass it with "
                            f"--speculative-dspark-sps-table-path")
        else:
            unmapped.append(f"cost_model.type={cost.type} ({where}): SGLang reads sps-1d and additive "
                            f"tables only")
    elif verify.mode.plans:
        notes.append("no cost_model (verify.allow_no_cost_model): without "
                     "--speculative-dspark-sps-table-path SGLang uses a flat table and verifies every row")

    calibration = spec.calibration
    if isinstance(calibration, CalibrationFile):
        flags.append(("--speculative-dspark-confidence-sts-path",
                      shown_path(resolve_path(calibration.file, spec_dir), cwd)))
    elif calibration is not None:
        unmapped.append("calibration (inline temperatures): write them to a JSON file "
                        "{\"temperatures\": [...]} and pass it with "
                        "--speculative-dspark-confidence-sts-path")
    if resolved.calibration_policy is not None:
        notes.append(f"the calibration was fitted for the sampling policy {resolved.calibration_policy}")

    if verify.align_to_graph_tier:
        flags.append(("--speculative-dspark-align-verify-tokens-to-graph-tier",))
    if verify.mode.plans:
        # SGLang clamps the lag to >= 1 (default 2): it never plans with this step's own confidence.
        lag = max(verify.lag_steps, 1)
        env.append(("SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS", str(lag)))
        if verify.lag_steps == 0:
            notes.append("verify.lag_steps=0 has no SGLang equivalent: SGLang's confidence lag is at "
                         "least 1 step, so it is set to 1")
        unmapped += [f"verify.min_verify_len={verify.min_verify_len}",
                     f"verify.max_verify_len={resolved.max_verify_len}",
                     f"verify.survival_eps={verify.survival_eps}"]

    flags += [("--tp-size", str(parallelism.tp)), ("--dp-size", str(parallelism.dp))]
    if parallelism.dp_attention:
        flags.append(("--enable-dp-attention",))
    flags += [("--max-running-requests", str(serving.max_running_requests)),
              ("--max-total-tokens", str(serving.max_total_tokens)),
              ("--page-size", str(serving.page_size)),
              ("--context-length", str(serving.max_context_len))]
    _graph_flags(resolved, flags, env, notes)

    backend = spec.backend
    if backend.kind == "ascend":
        flags += [("--device", "npu"), ("--attention-backend", "ascend")]
    elif backend.kind == "cpu":
        notes.append("backend.kind=cpu has no SGLang equivalent: SGLang's DSpark runs on CUDA or "
                     "NPU devices only")
    unmapped.append(f"backend.device={backend.device}")
    generation = serving.generation
    unmapped.append(f"serving.generation (temperature={generation.temperature}, "
                    f"top_p={generation.top_p}, top_k={generation.top_k}, "
                    f"max_new_tokens={generation.max_new_tokens}): send these as each request's "
                    f"sampling parameters")

    header = (f"SGLang launch for deployment {spec.name} (spec {resolved.display_path}), printed by "
              f"`dspark-compile export-sglang`.",
              *resolved.stale_tables)
    notes += [f"no SGLang flag found for: {item}" for item in unmapped]
    return SglangLaunch(tuple(env), tuple(flags), tuple(notes), header)


def _graph_flags(resolved: ResolvedSpec, flags: list[tuple[str, ...]], env: list[tuple[str, str]],
                 notes: list[str]) -> None:
    """Graph capture: SGLang captures decode batch sizes; a verify step's token tier is a batch size
    times N, and compact mode adds SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS below the largest."""
    if not resolved.tiers:
        flags.append(("--cuda-graph-backend-decode", "disabled"))
        return
    n, tiers = resolved.num_draft_tokens, resolved.tiers
    batch_sizes = sorted({tier // n for tier in tiers if tier % n == 0})
    if resolved.spec.verify.mode.packs_rows:
        largest = batch_sizes[-1] * n if batch_sizes else 0
        extra = [tier for tier in tiers if tier % n and tier < largest]
        dropped = [tier for tier in tiers if tier % n and tier > largest]
        if extra:
            env.append(("SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS", ",".join(map(str, extra))))
    else:
        dropped = [tier for tier in tiers if tier % n]
    if dropped:
        notes.append(f"graph tiers {dropped} cannot be expressed in SGLang: its largest tier is the "
                     f"largest captured batch size x N = {n}")
    if batch_sizes:
        flags.append(("--cuda-graph-bs-decode", *map(str, batch_sizes)))
