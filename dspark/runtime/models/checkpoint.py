"""Checkpoint loading and saving: Hugging Face layout (config.json + safetensors), for every target
family in `dspark.runtime.models.families`.

`embedded:<name>` refers to a pair shipped inside dspark (`dspark/checkpoints/<name>/`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.checkpoints import EMBEDDED_PREFIX, embedded_root
from dspark.checkpoints.dspark_block_config import BlockDraftConfigError
from dspark.families import ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_dspark_config import dsv4_dspark_config
from dspark.formats.dsv4_hf_config import dsv4_geometry, fp8_block
from dspark.formats.hf_config import ConfigFieldError, family_of_config
from dspark.modes import DSV4_STAGES
from dspark.runtime.config import DeploymentConfig, ModelGeometry
from dspark.runtime.families.dsv4.dspark_stages import Dsv4DSparkStages, load_dsv4_dspark, stage_draft_config
from dspark.runtime.families.dsv4.weights import Dsv4WeightsError, load_dsv4_weights
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.dspark_block_loader import BlockDraftCheckpointError, load_block_draft
from dspark.runtime.models.dummy import DRAFT_SEED, dummy_draft, dummy_target
from dspark.runtime.models.families import ServingTarget, TargetModel, build_target
from dspark.runtime.tokenizer import BOS_ID, BYTE_TOKENIZER_FILE, EOS_ID, VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not match its config (the message says which and what to do)."""


def resolve_checkpoint(ref: str, role: str, base_dir: Path | None = None) -> Path:
    """Directory of a checkpoint reference; `role` is `target` or `draft` for embedded pairs."""
    if ref.startswith(EMBEDDED_PREFIX):
        path = embedded_root() / ref[len(EMBEDDED_PREFIX):] / role
    else:
        path = Path(ref)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{role} checkpoint {ref!r}: no config.json in {path}; point the spec's "
            f"{'model' if role == 'target' else 'draft'}.checkpoint at a directory holding "
            "config.json and *.safetensors, then recompile")
    return path


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    return state


def _load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path,
               tied: tuple[str, ...] = ()) -> None:
    # A tied weight is the tensor it aliases: transformers leaves it out of the checkpoint, and where
    # a checkpoint has it anyway transformers ties it over, so the aliased tensor's values win here too.
    state = {k: v for k, v in state.items() if k not in tied}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied]
    # HF checkpoints may carry buffers such as rotary inv_freq that this model recomputes.
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def target_config(path: Path, family: str | None = None) -> tuple[ModelFamily, ModelGeometry | Dsv4Geometry]:
    """(family, model config) of the target checkpoint at `path`; `family` None: the one its
    config.json's model_type names. A config value dspark does not implement is a `CheckpointError`."""
    cfg = read_config(path)
    try:
        if family is None:  # an unknown model_type is refused by the dense reader, which lists them all
            family = ModelFamily.of_model_type(cfg.get("model_type", "llama")) or family_of_config(cfg).name
        family = ModelFamily(family)
        if family.dense:
            return family, ModelGeometry.from_hf(cfg, family)
        return family, dsv4_geometry(cfg)
    except ConfigFieldError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}; {exc.hint}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} does not describe a {family} model: {exc}; use the "
                              "config.json written with the checkpoint") from None


def load_target(ref: str, dtype: str = "float32", base_dir: Path | None = None,
                family: str | None = None, backend: str = "cpu") -> TargetModel:
    """The target checkpoint `ref` of `family` (None: the family its config.json names), as it computes on
    `backend` (a DeepSeek-V4 indexer scores int8 on Ascend, `Dsv4Geometry.for_backend`)."""
    path = resolve_checkpoint(ref, "target", base_dir)
    family, cfg = target_config(path, family)
    if isinstance(cfg, Dsv4Geometry):
        cfg = cfg.for_backend(backend)
    model = build_target(family, cfg)
    if family.dense:
        _load_into(model, _load_state(path), path, model.tied_weights)
    else:
        try:
            block = fp8_block(read_config(path))
            # where the backend has the kernels a format stays quantised: W8A8 on Ascend, FP8 on CUDA
            load_dsv4_weights(model.model, _load_state(path), block,  # type: ignore[arg-type]
                              keep_w8a8=backend == "ascend", keep_fp8=backend == "cuda")
        except Dsv4WeightsError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    return model.to(DTYPES[dtype]).eval()


def target_embeddings(target: ServingTarget) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole (unsharded) target's input embeddings and LM head weight."""
    if isinstance(target.cfg, Dsv4Geometry):
        return target.model.embed.detach(), target.model.head.detach()  # type: ignore[attr-defined]
    return target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()  # type: ignore[attr-defined]


def load_draft(ref: str, dtype: str = "float32", base_dir: Path | None = None,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> DSparkBlockDraft:
    """The DSpark draft checkpoint `ref` (released layout); a checkpoint without its own copies of
    the embeddings and LM head takes `shared` (the target's, as DeepSpec's frozen copies are)."""
    path = resolve_checkpoint(ref, "draft", base_dir)
    try:
        return load_block_draft(path, DTYPES[dtype], shared)
    except (BlockDraftConfigError, BlockDraftCheckpointError) as exc:
        raise CheckpointError(f"{exc}; use a DSpark draft checkpoint in the released layout (dspark "
                              "train-draft writes one)") from None


def load_target_model(deployment: DeploymentConfig, base_dir: Path, device: torch.device) -> ServingTarget:
    """The deployment's target on `device`: its checkpoint, or dummy weights where the spec asks for them
    (`load_format: dummy`)."""
    model = deployment.model
    if model.load_format == "dummy":
        geometry = model.geometry
        if isinstance(geometry, Dsv4Geometry):
            geometry = geometry.for_backend(deployment.backend)
        return dummy_target(geometry, DTYPES[model.dtype], device, model.family)
    return load_target(model.checkpoint, model.dtype, base_dir, model.family, deployment.backend).to(device)


def load_stage_draft(deployment: DeploymentConfig, base_dir: Path,
                     shared: tuple[torch.Tensor, torch.Tensor]) -> Dsv4DSparkStages:
    """The DSpark stages of the DeepSeek-V4 checkpoint the deployment's draft names (usually the target's
    own), over the target's whole embeddings and LM head `shared`; a checkpoint whose stages' settings differ
    from the compiled ones is refused. A dummy draft: seeded random stages of the compiled settings, the
    target's expert counts."""
    model, draft = deployment.model, deployment.draft
    geometry = model.geometry
    assert isinstance(geometry, Dsv4Geometry)
    compiled = stage_draft_config(geometry, draft)
    if draft.load_format == "dummy":
        stages = Dsv4DSparkStages(compiled, *shared)
        stages.init_random_(DRAFT_SEED)
        return stages.to(DTYPES[model.dtype]).eval()
    path = resolve_checkpoint(draft.checkpoint, "draft", base_dir)
    config = read_config(path)
    try:
        cfg = dsv4_dspark_config(config, geometry)
    except ConfigFieldError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}; {exc.hint}") from None
    settings = ("block_size", "noise_token_id", "target_layer_ids", "markov_rank", "stages")
    differ = [f"{name} {getattr(cfg, name)!r} (compiled {getattr(compiled, name)!r})" for name in settings
              if getattr(cfg, name) != getattr(compiled, name)]
    if differ:
        raise CheckpointError(f"{path}: the DSpark stages do not fit this deployment: {', '.join(differ)}; "
                              "recompile the spec against this checkpoint")
    stages = Dsv4DSparkStages(cfg, *shared)
    try:
        load_dsv4_dspark(stages, _load_state(path), fp8_block(config))
    except Dsv4WeightsError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return stages.to(DTYPES[model.dtype]).eval()


def load_draft_model(deployment: DeploymentConfig, base_dir: Path, device: torch.device,
                     shared: tuple[torch.Tensor, torch.Tensor] | None) -> DSparkBlockDraft | Dsv4DSparkStages:
    """The deployment's draft on `device` (a checkpoint without its own embeddings and LM head takes
    `shared`, the target's whole ones; the V4 stages always do)."""
    model, draft = deployment.model, deployment.draft
    if draft.architecture == DSV4_STAGES:
        if shared is None:
            raise CheckpointError("a DeepSeek-V4 checkpoint's DSpark stages draft over the target's "
                                  "embeddings and LM head, which were not handed over")
        return load_stage_draft(deployment, base_dir, shared).to(device)
    if draft.load_format == "dummy":
        return dummy_draft(model.geometry, draft, DTYPES[model.dtype], device)
    return load_draft(draft.checkpoint, model.dtype, base_dir, shared).to(device)


def _save(path: Path, module: torch.nn.Module, config: dict, tied: tuple[str, ...] = ()) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items() if k not in tied}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_target(path: Path, model: TargetModel, family: str = "llama") -> None:
    _save(path, model, model.cfg.to_hf(family), model.tied_weights)
    tok = {"type": "byte", "bos_id": BOS_ID, "eos_id": EOS_ID, "vocab_size": VOCAB_SIZE}
    (path / BYTE_TOKENIZER_FILE).write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")
