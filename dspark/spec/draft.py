"""Resolve the spec's `draft` section: the draft's architecture from its checkpoint's config.json
(the released DSpark layout, read strictly by `dspark.checkpoints.dspark_block_config`) or, where
the checkpoint is not read (a dummy draft, or one not on this machine), from the spec's fields and
their defaults; then `gamma` (default: the block size) and the checks against the target.

The result is the spec with every draft field filled in, so the rest of the compiler reads one
complete `DraftSpec` whatever the source was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.checkpoints.dspark_block_config import BlockDraftConfig, BlockDraftConfigError, default_layer_ids
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_dspark_config import Dsv4DSparkConfig, dsv4_dspark_config, has_dspark_stages
from dspark.formats.dsv4_hf_config import dsv4_geometry
from dspark.formats.hf_config import ConfigFieldError
from dspark.modes import BLOCK_DRAFT, DSV4_STAGES
from dspark.spec.errors import SpecIssue
from dspark.spec.models import DeploymentSpec, DraftSpec, TargetGeometry

DEFAULT_BLOCK_SIZE = 7
DEFAULT_MARKOV_RANK = 64
DEFAULT_MARKOV_HEAD = "vanilla"
# The architecture fields a spec may state, by their config.json counterpart in BlockDraftConfig.
ARCHITECTURE_FIELDS = {
    "num_layers": "num_layers", "block_size": "block_size", "mask_token_id": "mask_token_id",
    "target_layer_ids": "target_layer_ids", "markov_rank": "markov_rank",
    "markov_head_type": "markov_head_type", "confidence_head": "confidence_head",
    "confidence_with_markov": "confidence_with_markov",
}


def _from_checkpoint(draft: DraftSpec, cfg: BlockDraftConfig | dict[str, Any], where: str
                     ) -> tuple[dict[str, Any], list[SpecIssue]]:
    issues = []
    values: dict[str, Any] = {}
    for field, attr in ARCHITECTURE_FIELDS.items():
        theirs = cfg[attr] if isinstance(cfg, dict) else getattr(cfg, attr)
        mine = getattr(draft, field)
        if mine is not None and mine != theirs:
            issues.append(SpecIssue(("draft", field), f"{field} is {_show(mine)} here but {_show(theirs)} in "
                                    f"{where}", f"remove draft.{field} (it is read from the checkpoint) or "
                                    "point draft.checkpoint at a draft that has it"))
        values[field] = theirs
    return values, issues


def _stage_values(cfg: Dsv4DSparkConfig) -> dict[str, Any]:
    """A V4 checkpoint's DSpark stages in the draft section's fields (their Markov head is vanilla, their
    confidence head reads it)."""
    return {"num_layers": cfg.stages, "block_size": cfg.block_size, "mask_token_id": cfg.noise_token_id,
            "target_layer_ids": cfg.target_layer_ids, "markov_rank": cfg.markov_rank,
            "markov_head_type": "vanilla", "confidence_head": True, "confidence_with_markov": True}


def _from_stages(draft: DraftSpec, config: dict[str, Any], where: str, geometry: TargetGeometry | None
                 ) -> tuple[dict[str, Any], list[SpecIssue]]:
    """The DSpark stages a DeepSeek-V4 checkpoint carries, drafting for the target they were trained with."""
    def refuse(problem: str, hint: str) -> tuple[dict[str, Any], list[SpecIssue]]:
        return _from_spec(draft, geometry)[0], [SpecIssue(("draft", "checkpoint"), problem, hint)]

    if not isinstance(geometry, Dsv4Geometry):
        return refuse(f"{where} is a DeepSeek-V4 checkpoint's DSpark stages, which draft only for their own "
                      "target", "set model.family: dsv4 with that checkpoint, or use a DSpark block draft")
    try:
        theirs = dsv4_geometry(config)
        cfg = dsv4_dspark_config(config, theirs)
    except ConfigFieldError as exc:
        return refuse(f"{where}: {exc}", exc.hint)
    if theirs.for_backend("cpu") != geometry.for_backend("cpu"):
        return refuse(f"the DSpark stages in {where} belong to another DeepSeek-V4 model (its geometry "
                      "differs from the target's)", "point draft.checkpoint at the target's own checkpoint "
                      "(model.checkpoint)")
    return _from_checkpoint(draft, _stage_values(cfg), where)


def _dummy_stage_issues(values: dict[str, Any], geometry: TargetGeometry | None) -> list[SpecIssue]:
    """A dummy draft of V4 stages: the settings the stages have (a vanilla Markov head read by the confidence
    head), for a DeepSeek-V4 target."""
    issues = []
    if geometry is not None and not isinstance(geometry, Dsv4Geometry):
        issues.append(SpecIssue(("draft", "architecture"),
                                "dsv4_stages are a DeepSeek-V4 checkpoint's draft",
                                "use architecture: dspark_block, or model.family: dsv4"))
    heads = (values["markov_rank"] > 0, values["markov_head_type"] == "vanilla", values["confidence_head"],
             values["confidence_with_markov"])
    if not all(heads):
        issues.append(SpecIssue(("draft", "architecture"), "dsv4_stages have a vanilla Markov head "
                                "(markov_rank > 0) and a confidence head that reads it",
                                "remove markov_head_type / confidence_head / confidence_with_markov, and "
                                "give markov_rank > 0"))
    return issues


def _from_spec(draft: DraftSpec, geometry: TargetGeometry | None) -> tuple[dict[str, Any], list[SpecIssue]]:
    issues = []
    rank = DEFAULT_MARKOV_RANK if draft.markov_rank is None else draft.markov_rank
    kind = draft.markov_head_type
    if rank == 0 and kind is not None:
        issues.append(SpecIssue(("draft", "markov_head_type"),
                                f"{kind} names a Markov head, but markov_rank is 0",
                                "remove markov_head_type, or give markov_rank > 0"))
    kind = (kind or DEFAULT_MARKOV_HEAD) if rank > 0 else None
    head = True if draft.confidence_head is None else draft.confidence_head
    with_markov = draft.confidence_with_markov
    if with_markov and not (head and rank > 0):
        issues.append(SpecIssue(("draft", "confidence_with_markov"),
                                "true needs both a confidence head and a Markov head (markov_rank > 0)",
                                "set confidence_with_markov: false, or give the draft both heads"))
    layer_ids = draft.target_layer_ids
    if layer_ids is None and geometry is not None:
        layer_ids = default_layer_ids(geometry.num_layers)
    values = {
        "num_layers": draft.num_layers or 1,
        "block_size": draft.block_size or DEFAULT_BLOCK_SIZE,
        "mask_token_id": (draft.mask_token_id if draft.mask_token_id is not None
                          else geometry.vocab_size - 1 if geometry is not None else None),
        "target_layer_ids": layer_ids, "markov_rank": rank, "markov_head_type": kind,
        "confidence_head": head,
        "confidence_with_markov": (head and rank > 0) if with_markov is None else with_markov,
    }
    return values, issues


def _target_issues(values: dict[str, Any], geometry: TargetGeometry, cfg: BlockDraftConfig | None
                   ) -> list[SpecIssue]:
    """What must agree between the draft and the target, wherever the draft's settings came from."""
    issues = []
    at = ("draft", "checkpoint") if cfg is not None else None
    if cfg is not None:
        # A released draft's config is a copy of its target's with the draft's fields added, and the
        # runtime builds the draft from the target's sizes: any that differ is a draft for another model.
        for name, theirs, mine in (("vocab_size", cfg.vocab_size, geometry.vocab_size),
                                   ("hidden_size", cfg.hidden_size, geometry.hidden_size),
                                   ("num_target_layers", cfg.num_target_layers, geometry.num_layers),
                                   ("intermediate_size", cfg.intermediate_size, geometry.intermediate_size),
                                   ("num_attention_heads", cfg.num_heads, geometry.num_heads),
                                   ("num_key_value_heads", cfg.num_kv_heads, geometry.num_kv_heads),
                                   ("head_dim", cfg.head_dim, geometry.head_dim),
                                   ("rms_norm_eps", cfg.rms_norm_eps, geometry.rms_norm_eps),
                                   ("rope_theta", cfg.rope_theta, geometry.rope_theta),
                                   ("attention_bias", cfg.attention_bias, geometry.attention_bias)):
            if theirs != mine:
                issues.append(SpecIssue(("draft", "checkpoint"),
                                        f"the draft's {name} is {theirs} (its config.json) but the target "
                                        f"model has {mine}",
                                        "use a draft trained for this target model (dspark train-draft "
                                        "trains one)"))
    ids = values["target_layer_ids"]
    last = geometry.num_layers - 1
    bad = [i for i in ids or () if not -1 <= i < last]
    if not ids or bad or list(ids) != sorted(set(ids)):
        issues.append(SpecIssue(at or ("draft", "target_layer_ids"),
                                f"target_layer_ids {list(ids or ())} must be increasing ids in -1 .. "
                                f"{last - 1} (-1: the embeddings; the target's final layer {last} may not "
                                "be read)", "list target layers the draft reads, e.g. "
                                f"{list(default_layer_ids(geometry.num_layers))}"))
    mask = values["mask_token_id"]
    if not 0 <= mask < geometry.vocab_size:
        issues.append(SpecIssue(at or ("draft", "mask_token_id"),
                                f"mask_token_id {mask} is outside the target's vocabulary (vocab_size "
                                f"{geometry.vocab_size}); the draft's embeddings are the target's",
                                "use a token id below vocab_size that prompts never contain"))
    return issues


def _stage_target_issues(values: dict[str, Any], geometry: Dsv4Geometry) -> list[SpecIssue]:
    """V4 stages read the residual after any target layer (the last included) and embed the noise token with
    the target's table."""
    issues = []
    ids = list(values["target_layer_ids"])
    if not ids or ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < geometry.n_layers:
        issues.append(SpecIssue(("draft", "target_layer_ids"), f"{ids} must be increasing target layer "
                                f"ids in 0..{geometry.n_layers - 1}",
                                "list the target layers the stages read"))
    if not 0 <= values["mask_token_id"] < geometry.vocab_size:
        issues.append(SpecIssue(("draft", "mask_token_id"), f"{values['mask_token_id']} is outside the "
                                f"target's vocabulary ({geometry.vocab_size})",
                                "use a token id below vocab_size"))
    return issues


def resolve_draft(spec: DeploymentSpec, config: dict[str, Any] | None, config_path: Path | None,
                  geometry: TargetGeometry | None) -> tuple[DeploymentSpec, list[SpecIssue]]:
    """The spec with its draft section complete, and what is wrong with it."""
    draft = spec.draft
    cfg = None
    architecture = draft.architecture or BLOCK_DRAFT
    where = str(config_path) if config_path else "the draft's config.json"
    if config is None or draft.load_format == "dummy":
        values, issues = _from_spec(draft, geometry)
        if architecture == DSV4_STAGES:
            issues += _dummy_stage_issues(values, geometry)
    elif has_dspark_stages(config):  # the checkpoint's settings supersede the spec's
        values, issues = _from_stages(draft, config, where, geometry)
        architecture = DSV4_STAGES
    else:
        architecture = BLOCK_DRAFT
        try:
            cfg = BlockDraftConfig.from_hf(config, where)
            values, issues = _from_checkpoint(draft, cfg, where)
        except BlockDraftConfigError as exc:
            # the spec's own values stand in, so the other rules can still run and report
            values = _from_spec(draft, geometry)[0]
            issues = [SpecIssue(("draft", "checkpoint"), str(exc),
                                "use a DSpark draft checkpoint in the released layout (config.json as "
                                "DeepSpec writes it; `dspark train-draft` writes one)")]
    if draft.architecture not in (None, architecture):
        held = ("a DeepSeek-V4 checkpoint's DSpark stages" if architecture == DSV4_STAGES
                else "a DSpark block draft")
        issues.append(SpecIssue(("draft", "architecture"),
                                f"is {draft.architecture}, but {where} holds {held}",
                                "remove draft.architecture (it is read from the checkpoint)"))
    if geometry is not None and values["target_layer_ids"] is not None and architecture == BLOCK_DRAFT:
        issues += _target_issues(values, geometry, cfg)
    elif isinstance(geometry, Dsv4Geometry) and values["target_layer_ids"] is not None:
        issues += _stage_target_issues(values, geometry)
    gamma = draft.gamma or values["block_size"]
    if gamma > values["block_size"]:
        issues.append(SpecIssue(("draft", "gamma"),
                                f"gamma {gamma} is above the draft's block_size {values['block_size']}: "
                                "slots past the block were never trained",
                                f"set draft.gamma to at most {values['block_size']}, or leave it out"))
    if values["target_layer_ids"] is not None:
        values["target_layer_ids"] = tuple(values["target_layer_ids"])
    filled = draft.model_copy(update={"gamma": gamma, "architecture": architecture, **values})
    return spec.model_copy(update={"draft": filled}), issues


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else repr(value)
