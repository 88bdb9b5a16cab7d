"""The compile graph's nodes: spec sections, the values derived from them, and emitted files.

Edges say what each node reads. They drive the Merkle hashes (a changed field changes exactly the
hashes downstream of its section) and `dspark-compile explain`, so a template may only use context
derived from the inputs its node declares here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dspark.compiler.context import attention_templates
from dspark.fingerprint import Fingerprint
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.spec import ResolvedSpec

SPEC_SECTIONS = ("name", "model", "draft", "parallelism", "backend", "verify", "graph",
                 "cost_model", "calibration", "serving")

# Every generated file's header names the deployment, its backend and verify mode.
HEADER_INPUTS = ("spec.name", "spec.backend", "spec.verify")

MANIFEST_FILE = "manifest.json"


TemplateChoice = Callable[[ResolvedSpec], Mapping[str, str]]
InputChoice = Callable[[ResolvedSpec], tuple[str, ...]]


@dataclass(frozen=True)
class DerivedNode:
    """A value computed from its inputs; with `templates`, also the files rendered from it.

    `templates(resolved)` maps each generated file to the template it is rendered from, which may
    depend on the backend (one template per backend and file kind). `family_inputs(resolved)` names
    what the templates of the spec's model family read beyond `inputs`.
    """

    id: str
    inputs: tuple[str, ...]
    value: Callable[[ResolvedSpec], Any]
    files: tuple[str, ...] = ()
    templates: TemplateChoice | None = None
    family_inputs: InputChoice | None = None

    def inputs_of(self, resolved: ResolvedSpec) -> tuple[str, ...]:
        """The nodes this one reads for `resolved`."""
        return self.inputs + (self.family_inputs(resolved) if self.family_inputs else ())


def section_value(resolved: ResolvedSpec, section: str) -> Any:
    spec = resolved.spec
    value = getattr(spec, section)
    dumped = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    # Tables read from files are part of the section: editing the file must change the hash.
    if section == "cost_model" and resolved.cost_model is not None:
        value = {"spec": dumped, "table": resolved.cost_model.model_dump(mode="json")}
        return _with_fingerprint(value, resolved.cost_model_fingerprint)
    if section == "calibration" and resolved.temperatures is not None:
        value = {"spec": dumped, "temperatures": list(resolved.temperatures)}
        return _with_fingerprint(value, resolved.calibration_fingerprint)
    return dumped


def _with_fingerprint(value: dict[str, Any], fingerprint: Fingerprint | None) -> dict[str, Any]:
    # The model dumps leave the file's fingerprint out (it never reaches generated code), but it
    # decides whether a build is stale, so it still belongs in the section's hash.
    return {**value, "fingerprint": fingerprint.to_json()} if fingerprint is not None else value


def section_fields(resolved: ResolvedSpec, section: str) -> tuple[str, ...]:
    """Dotted paths of the leaf fields a section contributes (lists count as one leaf)."""
    value = getattr(resolved.spec, section)
    dumped = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return tuple(_leaves(section, dumped))


def _leaves(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for key, item in value.items() for leaf in _leaves(f"{prefix}.{key}", item)]
    return [prefix]


def _geometry(resolved: ResolvedSpec) -> Any:
    geometry = resolved.geometry
    return asdict(geometry) if isinstance(geometry, Dsv4Geometry) else geometry.model_dump(mode="json")


def _parallel_plan(resolved: ResolvedSpec) -> Any:
    parallelism, geometry = resolved.spec.parallelism, resolved.geometry
    # DeepSeek-V4's one latent K=V head is read by every query head, so each rank keeps a copy.
    kv_heads = 1 if isinstance(geometry, Dsv4Geometry) else geometry.num_kv_heads // parallelism.tp
    return {**parallelism.model_dump(mode="json"),
            # as ParallelPlan.world_size: with DP attention the dp groups live inside the tp ranks
            "world_size": parallelism.tp if parallelism.dp_attention else parallelism.tp * parallelism.dp,
            "heads_per_rank": geometry.num_heads // parallelism.tp,
            "kv_heads_per_rank": kv_heads}


def _tier_grid(resolved: ResolvedSpec) -> Any:
    return {"num_draft_tokens": resolved.num_draft_tokens, "tiers": list(resolved.tiers)}


def planner_arguments(resolved: ResolvedSpec) -> dict[str, Any]:
    """The values the generated plan is configured with (its class follows from verify.mode)."""
    spec = resolved.spec
    arguments: dict[str, Any] = {"gamma": spec.draft.gamma, "temperatures": resolved.temperatures}
    if not spec.verify.mode.plans:
        return arguments
    verify = spec.verify
    return {
        **arguments,
        "mode": verify.mode.value,
        "min_verify_len": verify.min_verify_len,
        "max_verify_len": resolved.max_verify_len,
        "survival_eps": verify.survival_eps,
        "align_to_graph_tier": verify.align_to_graph_tier,
        "lag_steps": verify.lag_steps,
        # Without defaults: an absent optional draft term leaves no empty fields in the output.
        "cost_model": resolved.cost_model.model_dump(exclude_defaults=True) if resolved.cost_model else None,
        "token_tiers": resolved.tiers,
    }


def _planner(resolved: ResolvedSpec) -> Any:
    return _jsonable(planner_arguments(resolved))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


def _files_only(resolved: ResolvedSpec) -> Any:
    return None  # a file artifact is fully determined by its inputs and its templates


def _shared(name: str) -> TemplateChoice:
    return lambda resolved: {name: f"{name}.j2"}


def _attention_metadata(resolved: ResolvedSpec) -> Mapping[str, str]:
    """DeepSeek-V4's metadata builders are one template on every backend: they plan the same arrays,
    and only the attention that reads them differs."""
    folder = resolved.spec.model.family.template_folder
    if folder is not None:
        return {"attn_metadata.py": f"{folder}/attn_metadata.py.j2"}
    return {"attn_metadata.py": f"{attention_templates(resolved)}/attn_metadata.py.j2"}


def _graph_runner(resolved: ResolvedSpec) -> Mapping[str, str]:
    """Graph capture is CUDA's or Ascend's own mechanics; without it (and on the CPU, which pads
    to its tiers eagerly) every backend runs the same eager runner."""
    captures = resolved.spec.graph.enabled and resolved.spec.backend.kind != "cpu"
    return {"graph_runner.py": f"{attention_templates(resolved) if captures else 'eager'}/graph_runner.py.j2"}


def _dsv4_layout_inputs(resolved: ResolvedSpec) -> tuple[str, ...]:
    """A DeepSeek-V4 deployment's attention templates are its family's and read its cache layout, which
    follows from the model's geometry (N and the serving limits are read by every such node)."""
    return () if resolved.spec.model.family.dense else ("spec.model", "model_geometry")


def _entry(resolved: ResolvedSpec) -> Mapping[str, str]:
    return {"__init__.py": "__init__.py.j2", "__main__.py": "__main__.py.j2"}


DERIVED: tuple[DerivedNode, ...] = (
    DerivedNode("model_geometry", ("spec.model",), _geometry),
    DerivedNode("parallel_plan", ("spec.parallelism", "model_geometry"), _parallel_plan),
    DerivedNode("tier_grid", ("spec.graph", "spec.draft"), _tier_grid),
    DerivedNode("deployment",
                (*HEADER_INPUTS, "spec.model", "spec.draft", "spec.serving", "model_geometry",
                 "parallel_plan", "tier_grid"),
                _files_only, ("deployment.py",), _shared("deployment.py")),
    DerivedNode("planner_config",
                (*HEADER_INPUTS, "spec.draft", "spec.cost_model", "spec.calibration", "tier_grid"),
                _planner, ("planner_config.py",), _shared("planner_config.py")),
    DerivedNode("backend_metadata", (*HEADER_INPUTS, "spec.draft", "spec.serving"),
                _files_only, ("attn_metadata.py",), _attention_metadata, _dsv4_layout_inputs),
    DerivedNode("graph_capture",
                (*HEADER_INPUTS, "spec.draft", "spec.graph", "spec.serving", "tier_grid"),
                _files_only, ("graph_runner.py",), _graph_runner, _dsv4_layout_inputs),
    DerivedNode("runtime_entry", (*HEADER_INPUTS, "spec.graph"), _files_only, ("__init__.py", "__main__.py"),
                _entry),
)

FILE_NODES = tuple(node.id for node in DERIVED if node.files)
