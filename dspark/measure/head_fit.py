"""Refit the draft's confidence head on what serving recorded (`dspark fit-confidence`).

The confidence head (`confidence_head.proj`, the published DSpark draft's) is one Linear layer over
`[hidden_k ; markov_w1[prev_k]]` (or `hidden_k` alone without `confidence_head_with_markov`). Training
fits it teacher-forced, against whatever acceptance event the trainer chose; at serving time the
drafts are the draft's own and the event is the deployment's policy (a greedy prefix match, or the
rejection sampler's acceptance). Per-position temperatures (STS) can rescale each position's
logits but cannot change the shape of the reliability curve, so when the head was fitted for
another event the calibrated survival stays off. Refitting the Linear layer on the recorded
inputs and labels of served steps fixes the shape; STS on a fresh recording then fine-tunes it.

The fit minimises the binary cross-entropy of every position's cumulative survival
`S_k = prod_{j<=k} sigmoid(z_j)` against `prefix_mask[k]` (the quantity the planner ranks rows by
and that the ECE targets measure), plus an L2 pull towards the head being replaced, by
full-batch L-BFGS: deterministic for a given recording. A held-out share of the request-steps is
kept out of the fit and reported before and after.

The features depend on every draft weight except the head's own, so shards carry a digest of
those weights and the refit refuses a draft they were not recorded with.

The refit keeps the head's inputs: the published architecture's head reads nothing else, and a
checkpoint with a wider head would not load in DeepSpec or SGLang.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark.checkpoints.dspark_block_config import BlockDraftConfig, BlockDraftConfigError
from dspark.formats.sts_shards import (
    read_shard,
    read_sts_meta,
    shard_arrays,
    shard_features,
    shard_files,
)
from dspark.measure.scores import survival
from dspark.runtime.models.dspark_block_loader import INDEX_FILE, BlockDraftCheckpointError, read_tensors
from dspark.runtime.planner.calibration_metrics import brier, ece, roc_auc
from dspark.runtime.planner.sts import CalibrationError

HEAD_PREFIX = "confidence_head."  # every tensor of the head; the backbone digest leaves them out
WEIGHT, BIAS = HEAD_PREFIX + "proj.weight", HEAD_PREFIX + "proj.bias"
FIT_FILE = "confidence_fit.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def backbone_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 (16 hex digits) over every tensor but the confidence head's: name, dtype, shape, bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        if name.startswith(HEAD_PREFIX):
            continue
        tensor = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()[:16]


def checkpoint_state(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a DSpark draft checkpoint in the released layout (one file or shards)."""
    if not (directory / CONFIG_FILE).is_file():
        raise CalibrationError(f"{directory}: not a draft checkpoint (needs config.json and *.safetensors)")
    try:
        BlockDraftConfig.from_file(directory)
        state = read_tensors(directory)
    except (BlockDraftConfigError, BlockDraftCheckpointError) as err:
        raise CalibrationError(f"{err}; fit-confidence refits a DSpark draft in the released "
                               "layout") from None
    missing = [k for k in (WEIGHT, BIAS) if k not in state]
    if missing:
        raise CalibrationError(f"{directory}: the draft has no confidence head ({', '.join(missing)} "
                               f"missing); train one with confidence_head: true first")
    return state


@dataclass(frozen=True)
class FeatureData:
    features: torch.Tensor  # [n, gamma, F] float32
    prefix_mask: torch.Tensor  # [n, gamma] bool
    backbone: str
    policy: str | None
    sources: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return int(self.features.shape[0])


def _features_meta(directory: Path) -> tuple[str, str | None]:
    """The draft backbone and policy the features beside these shards were recorded with."""
    meta = read_sts_meta(directory)
    if meta is None:
        raise CalibrationError(f"{directory}: no meta.json beside the shards; record them with "
                               f"`dspark run --record DIR --record-features`")
    if meta.features_backbone is None:
        raise CalibrationError(f"{directory / 'meta.json'}: the run did not record features; record it "
                               f"again with `dspark run --record DIR --record-features`")
    return meta.features_backbone, meta.policy


def load_feature_shards(paths: Sequence[str | os.PathLike[str]]) -> FeatureData:
    """Recorder shards with features (validated like `dspark calibrate`'s), from one draft backbone
    and one policy; each shard is read once."""
    files = shard_files(paths)
    metas = {p.parent: _features_meta(p.parent) for p in files}
    backbones = {backbone for backbone, _ in metas.values()}
    policies = {policy for _, policy in metas.values()}
    if len(backbones) > 1 or len(policies) > 1:
        raise CalibrationError(
            "the shards were recorded with different drafts or policies ("
            + "; ".join(f"{d}: backbone {backbone}, policy {policy}"
                        for d, (backbone, policy) in metas.items())
            + "); fit each draft and policy separately")
    parts, masks = [], []
    gamma: int | None = None
    for path in files:
        payload = read_shard(path)
        _, mask = shard_arrays(payload, path, gamma)  # validates logits / prefix_mask and prefix rows
        n, gamma = mask.shape
        parts.append(shard_features(payload, path, n, gamma))
        masks.append(torch.from_numpy(mask))
    if len({p.shape[-1] for p in parts}) > 1:
        raise CalibrationError("the shards hold features of different widths; fit one draft at a time")
    features = torch.cat(parts)
    if features.shape[0] == 0:
        raise CalibrationError(f"{', '.join(map(str, files))}: the shards hold no rows")
    if not bool(torch.isfinite(features).all()):
        raise CalibrationError("the shards hold non-finite features (float16 overflow?); the draft's "
                               "head inputs must be finite")
    return FeatureData(features, torch.cat(masks), backbones.pop(), policies.pop(),
                       tuple(str(p) for p in files))


@dataclass(frozen=True)
class HeadFitSettings:
    holdout_fraction: float = 0.2  # request-steps kept out of the fit for the report
    l2: float = 1e-4  # pull towards the head being replaced, per weight, relative to the mean loss
    max_iter: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.holdout_fraction < 1.0:
            raise CalibrationError(f"holdout fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.l2 < 0.0:
            raise CalibrationError(f"l2 must be >= 0, got {self.l2}")
        if self.max_iter < 1:
            raise CalibrationError(f"max iterations must be >= 1, got {self.max_iter}")


def _cumulative_bce(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    log_s = torch.nn.functional.logsigmoid(z).cumsum(-1)
    log_not_s = torch.log((-torch.expm1(log_s)).clamp_min(1e-12))  # log(1 - S), stable near S = 1
    return -(mask * log_s + (~mask) * log_not_s).sum(-1).mean()


def _metrics(z: torch.Tensor, mask: torch.Tensor) -> dict[str, list[Any]]:
    s = survival(z.double().numpy())
    m = mask.numpy()
    gamma = m.shape[1]
    return {"ece": [round(ece(s[:, k], m[:, k]), 4) for k in range(gamma)],
            "brier": [round(brier(s[:, k], m[:, k]), 4) for k in range(gamma)],
            "auc": [None if (a := roc_auc(s[:, k], m[:, k])) is None else round(a, 4) for k in range(gamma)]}


@dataclass(frozen=True)
class HeadFit:
    weight: torch.Tensor  # [1, F]
    bias: torch.Tensor  # [1]
    num_fit: int
    num_holdout: int
    loss_before: float
    loss_after: float
    holdout_before: dict[str, list[Any]]
    holdout_after: dict[str, list[Any]]


def fit_confidence_head(data: FeatureData, weight: torch.Tensor, bias: torch.Tensor,
                        settings: HeadFitSettings = HeadFitSettings()) -> HeadFit:
    """Fit `sigmoid`-survival BCE over the fit split; report the held-out split before and after."""
    n = data.num_samples
    n_hold = int(round(n * settings.holdout_fraction))
    if n_hold < 1 or n - n_hold < 1:
        raise CalibrationError(f"{n} request-steps are too few to hold out {settings.holdout_fraction:.0%}; "
                               f"record more")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed))
    hold, fit = order[:n_hold], order[n_hold:]
    x, y = data.features[fit], data.prefix_mask[fit]
    w0 = weight.detach().float().reshape(-1)
    if w0.numel() != x.shape[-1]:
        raise CalibrationError(f"the features have width {x.shape[-1]} but the draft's head takes "
                               f"{w0.numel()} inputs; record with this draft")
    b0 = bias.detach().float().reshape(1)
    params = torch.cat((w0, b0)).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=settings.max_iter, history_size=20,
                            tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe")
    anchor = torch.cat((w0, b0))

    def loss_of(p: torch.Tensor) -> torch.Tensor:
        z = x @ p[:-1] + p[-1]
        return _cumulative_bce(z, y) + settings.l2 * (p[:-1] - anchor[:-1]).square().sum()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(params)
        loss.backward()
        return loss

    with torch.no_grad():
        loss_before = float(loss_of(params))
    opt.step(closure)
    p = params.detach()
    with torch.no_grad():
        loss_after = float(loss_of(p))
    xh, yh = data.features[hold], data.prefix_mask[hold]
    with torch.no_grad():
        before = _metrics(xh @ w0 + b0, yh)
        after = _metrics(xh @ p[:-1] + p[-1], yh)
    return HeadFit(p[:-1].reshape(1, -1), p[-1:].clone(), len(fit), n_hold, loss_before, loss_after,
                   before, after)


def format_head_fit(fit: HeadFit) -> str:
    lines = [f"confidence head refit on {fit.num_fit} request-steps "
             f"(cumulative-survival BCE {fit.loss_before:.4f} -> {fit.loss_after:.4f}); "
             f"held out {fit.num_holdout}:",
             f"{'pos':>4} {'ECE before':>11} {'ECE after':>10} {'Brier before':>13} {'Brier after':>12} "
             f"{'AUC before':>11} {'AUC after':>10}"]
    b, a = fit.holdout_before, fit.holdout_after
    for k in range(len(b["ece"])):
        auc_b = "-" if b["auc"][k] is None else f"{b['auc'][k]:.4f}"
        auc_a = "-" if a["auc"][k] is None else f"{a['auc'][k]:.4f}"
        lines.append(f"{k + 1:>4} {b['ece'][k]:>11.4f} {a['ece'][k]:>10.4f} {b['brier'][k]:>13.4f} "
                     f"{a['brier'][k]:>12.4f} {auc_b:>11} {auc_a:>10}")
    return "\n".join(lines) + "\n"


def write_refit_checkpoint(source: Path, state: dict[str, torch.Tensor], out: Path, fit: HeadFit,
                           data: FeatureData, settings: HeadFitSettings, config: Mapping[str, Any]) -> Path:
    """A copy of the `source` draft (whose tensors are `state`) with the refitted head and
    `confidence_fit.json` (provenance), moved into place whole: `out` must not exist yet."""
    if out.exists():
        raise CalibrationError(f"{out} already exists; choose a new directory for the refitted draft "
                               f"(its name is the draft's identity in fingerprints)")
    if out.resolve() == source.resolve():
        raise CalibrationError("the output must be a new directory, not the source draft")
    state = dict(state)
    dtype = state[WEIGHT].dtype
    state[WEIGHT] = fit.weight.to(dtype).contiguous()
    state[BIAS] = fit.bias.to(dtype).contiguous()
    provenance = {
        "source_draft": str(source), "draft_backbone": data.backbone, "policy": data.policy,
        "shards": list(data.sources), "num_fit": fit.num_fit, "num_holdout": fit.num_holdout,
        "settings": {"holdout_fraction": settings.holdout_fraction, "l2": settings.l2,
                     "max_iter": settings.max_iter, "seed": settings.seed},
        "loss_before": round(fit.loss_before, 6), "loss_after": round(fit.loss_after, 6),
        "holdout_before": fit.holdout_before, "holdout_after": fit.holdout_after,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".staging-{out.name}-"))
    try:
        for item in source.iterdir():
            # the weights are rewritten as one file, so the source's shards and index stay behind
            if item.is_file() and item.name not in (FIT_FILE, CONFIG_FILE, INDEX_FILE) \
                    and not item.name.endswith(".safetensors"):
                shutil.copy2(item, staging / item.name)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / FIT_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        os.chmod(staging, 0o755)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def refit_draft(shards: Sequence[Path], source: Path, out: Path,
                settings: HeadFitSettings = HeadFitSettings()) -> tuple[HeadFit, Path]:
    """Load, check the backbone, fit, write: the whole `dspark fit-confidence`."""
    state = checkpoint_state(source)
    try:
        config = json.loads((source / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{source / CONFIG_FILE}: not valid JSON ({err})") from None
    data = load_feature_shards(shards)
    digest = backbone_digest(state)
    if digest != data.backbone:
        raise CalibrationError(f"the shards' features were recorded with draft backbone {data.backbone}, "
                               f"but {source} has {digest}; record with this draft checkpoint")
    fit = fit_confidence_head(data, state[WEIGHT].float(), state[BIAS], settings)
    return fit, write_refit_checkpoint(source, state, out, fit, data, settings, config)
