"""STS shards: the one definition of the calibration samples a recording writes, with reader and writer.

A shard directory (`RUN/sts/` of `dspark run --record RUN`) holds
- `shard-NNNNN.pt`: `torch.save({"logits": float32 [n, gamma], "prefix_mask": bool [n, gamma]})`, the
  layout SGLang's recorder writes: per verified request-step the raw confidence logits and
  `prefix_mask[k] = k < correct_len` of the uncapped match; with `--record-features` also
  `"features": float16 [n, gamma, F]`, the confidence head's inputs. SGLang's mask may be 0/1 numbers,
  and its newer recorders add `"observed_mask"`, which must mark every position as checked;
- `meta.json`: the policy the labels belong to, the counts, why requests were skipped, the digest of
  the draft weights the features depend on, and the deployment's fingerprint.

`dspark calibrate`, `dspark cost-eval`, `dspark fit-confidence` and `dspark report` read shards through
this module only. It is the one module of `dspark.formats` that imports torch (docs/formats.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.atomic import atomic_write
from dspark.formats.json_io import (
    FormatError,
    errors_as,
    int_field,
    read_json_file,
    reject_unknown,
    require_object,
    typed_field,
    write_json_file,
)

SHARD_SUFFIX = ".pt"
META_FILE = "meta.json"
LOGITS_KEY = "logits"
PREFIX_MASK_KEY = "prefix_mask"
FEATURES_KEY = "features"
# Newer SGLang recorders add this when verify windows were capped: positions past the window were never
# checked, so their prefix_mask 0 is not a rejection.
OBSERVED_MASK_KEY = "observed_mask"
PARTIAL_VERIFY_REASON = ("compact steps that verified fewer than N rows of a request carry no label "
                         "for the unverified drafts; record with a cap-accept build (which runs every "
                         "row) for unbiased calibration data")


class ShardError(FormatError):
    """A shard or its meta.json is unusable; the message names the file and what is wrong."""


# ---------------------------------------------------------------------------------------- samples


def _check_prefix_rows(mask: np.ndarray, where: str) -> None:
    # A 1 right after a 0 means acceptance resumed past the first mismatch, which a prefix forbids.
    resumed = ~mask[:, :-1] & mask[:, 1:]
    if resumed.any():
        row = int(np.flatnonzero(resumed.any(axis=1))[0])
        pattern = "".join("1" if v else "0" for v in mask[row])
        raise ShardError(
            f"{where}: row {row} has prefix_mask {pattern}, a 1 after a 0; prefix_mask[k] must be "
            f"k < correct_len (ones, then zeros). Record it from the matching prefix length.")


def _check_finite_rows(logits: np.ndarray, where: str) -> None:
    finite = np.isfinite(logits)
    if not finite.all():
        row = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise ShardError(f"{where}: logits row {row} is not finite ({logits[row].tolist()}); "
                         f"drop the shard or re-record it")


@dataclass(frozen=True, eq=False)
class StsData:
    """Recorded `(logits, prefix_mask)` rows, one per verified request-step; arrays are read-only."""

    logits: np.ndarray  # [n, gamma] float64
    prefix_mask: np.ndarray  # [n, gamma] bool
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        logits = np.array(self.logits, dtype=np.float64, copy=True)
        mask = np.array(self.prefix_mask, copy=True)
        if logits.ndim != 2 or logits.shape[1] == 0:
            raise ShardError(f"StsData: logits must be [n, gamma] with gamma >= 1, got {logits.shape}")
        if mask.shape != logits.shape:
            raise ShardError(f"StsData: prefix_mask shape {mask.shape} differs from logits shape "
                             f"{logits.shape}")
        if mask.dtype != np.bool_:
            raise ShardError(f"StsData: prefix_mask must be a bool array, got dtype {mask.dtype}")
        _check_finite_rows(logits, "StsData")
        _check_prefix_rows(mask, "StsData")
        logits.setflags(write=False)
        mask.setflags(write=False)
        object.__setattr__(self, "logits", logits)
        object.__setattr__(self, "prefix_mask", mask)
        object.__setattr__(self, "sources", tuple(str(s) for s in self.sources))

    @property
    def num_samples(self) -> int:
        return int(self.logits.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])


# ------------------------------------------------------------------------------------------ reading


def shard_files(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[Path]:
    """The `.pt` files named (directories stand for the shards in them), each once, sorted by path."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ShardError("no shard paths given; pass .pt shard files or directories holding them")
    files: dict[Path, Path] = {}
    for given in map(Path, paths):
        if given.is_dir():
            found = sorted(p for p in given.iterdir() if p.suffix == SHARD_SUFFIX and p.is_file())
            if not found:
                raise ShardError(f"{given}: directory holds no {SHARD_SUFFIX} shards")
        elif given.is_file():
            found = [given]
        else:
            raise ShardError(f"{given}: no such shard file or directory")
        for path in found:
            # The same shard named twice (as a file and through its directory) must not count twice.
            files.setdefault(path.resolve(), path)
    return sorted(files.values(), key=str)


def read_shard(path: Path) -> Mapping[str, Any]:
    """A shard's dict as `torch.load` gives it (checked to be a dict, nothing more)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for corrupt or foreign files
        raise ShardError(f"{path}: cannot read the shard with torch.load(weights_only=True): "
                         f"{type(err).__name__}: {err}") from None
    if not isinstance(payload, Mapping):
        raise ShardError(f"{path}: holds a {type(payload).__name__}; expected the recorder's dict "
                         f"{{'logits': Tensor[n, gamma], 'prefix_mask': Tensor[n, gamma]}}")
    return payload


def _tensor_to_mask(tensor: torch.Tensor, path: Path) -> np.ndarray:
    if tensor.dtype == torch.bool:
        return tensor.numpy().copy()
    integers = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    if not (tensor.is_floating_point() or tensor.dtype in integers):
        raise ShardError(f"{path}: prefix_mask has dtype {tensor.dtype}; expected bool (or 0/1 numbers)")
    values = tensor.to(torch.float64).numpy()
    exact = (values == 0.0) | (values == 1.0)
    if not exact.all():
        row = int(np.flatnonzero(~exact.all(axis=1))[0])
        raise ShardError(f"{path}: prefix_mask row {row} is {values[row].tolist()}; every entry must "
                         f"be 0 or 1 (bool k < correct_len)")
    return values == 1.0


def _check_observed(payload: Mapping[str, Any], shape: tuple[int, ...], path: Path) -> None:
    observed = payload.get(OBSERVED_MASK_KEY)
    if observed is None:
        return
    if not isinstance(observed, torch.Tensor) or tuple(observed.shape) != shape:
        raise ShardError(f"{path}: observed_mask must be a tensor shaped like logits")
    if not bool((observed != 0).all()):
        row = int(torch.nonzero((observed == 0).any(dim=1))[0, 0])
        raise ShardError(
            f"{path}: observed_mask row {row} marks positions the capped verify window never checked; "
            f"their prefix_mask 0 is not a rejection and would bias the fit. Record calibration data "
            f"with every draft verified (static mode or a full verify window).")


def shard_arrays(payload: Mapping[str, Any], path: Path, gamma: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 logits and bool prefix masks of a read shard (`gamma`: the earlier shards')."""
    for key in (LOGITS_KEY, PREFIX_MASK_KEY):
        if key not in payload:
            raise ShardError(f"{path}: missing key {key!r} (found {sorted(map(str, payload))}); "
                             f"a shard must hold both 'logits' and 'prefix_mask'")
        if not isinstance(payload[key], torch.Tensor):
            raise ShardError(f"{path}: {key!r} is a {type(payload[key]).__name__}, expected a tensor")
    logits_t, mask_t = payload[LOGITS_KEY], payload[PREFIX_MASK_KEY]
    if logits_t.dim() != 2 or logits_t.shape[1] == 0:
        raise ShardError(f"{path}: logits have shape {tuple(logits_t.shape)}; expected [n, gamma] with "
                         f"gamma >= 1")
    if tuple(mask_t.shape) != tuple(logits_t.shape):
        raise ShardError(f"{path}: prefix_mask shape {tuple(mask_t.shape)} differs from logits shape "
                         f"{tuple(logits_t.shape)}; both must be [n, gamma]")
    if gamma is not None and logits_t.shape[1] != gamma:
        raise ShardError(f"{path}: gamma {logits_t.shape[1]} differs from the earlier shards' gamma "
                         f"{gamma}; use shards of one draft configuration together")
    if not logits_t.is_floating_point():
        raise ShardError(f"{path}: logits have dtype {logits_t.dtype}; expected float confidence logits")
    logits = logits_t.to(torch.float64).numpy().copy()
    _check_finite_rows(logits, str(path))
    mask = _tensor_to_mask(mask_t, path)
    _check_prefix_rows(mask, str(path))
    _check_observed(payload, tuple(logits_t.shape), path)
    return logits, mask


def shard_features(payload: Mapping[str, Any], path: Path, num_samples: int, gamma: int) -> torch.Tensor:
    """The confidence head's inputs `[n, gamma, F]` of a read shard, as float32."""
    feats = payload.get(FEATURES_KEY)
    if not isinstance(feats, torch.Tensor) or feats.dim() != 3 \
            or tuple(feats.shape[:2]) != (num_samples, gamma) or not feats.is_floating_point():
        shape = tuple(feats.shape) if isinstance(feats, torch.Tensor) else None
        raise ShardError(f"{path}: {FEATURES_KEY!r} must be a float tensor [n, gamma, F] = "
                         f"[{num_samples}, {gamma}, F], got {shape}")
    return feats.float()


def read_shards(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> StsData:
    """Shards (files, or directories whose `.pt` files are read), validated, concatenated in path order."""
    logits: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    files = shard_files(paths)
    gamma: int | None = None
    for path in files:
        z, m = shard_arrays(read_shard(path), path, gamma)
        gamma = z.shape[1]
        logits.append(z)
        masks.append(m)
    data = StsData(np.concatenate(logits), np.concatenate(masks), tuple(str(p) for p in files))
    if data.num_samples == 0:
        raise ShardError(f"{', '.join(data.sources)}: the shards hold no rows")
    return data


# ------------------------------------------------------------------------------------------ writing


def _save(path: Path, columns: Mapping[str, torch.Tensor]) -> Path:
    payload = dict(columns)
    return atomic_write(path, lambda tmp: torch.save(payload, tmp))


def write_shard(path: str | os.PathLike[str], logits: Any, prefix_mask: Any,
                features: torch.Tensor | None = None) -> Path:
    """Write one shard in the recorder's layout (float32 logits, bool mask, float16 features), atomically."""
    data = StsData(np.asarray(logits), np.asarray(prefix_mask))
    columns = {LOGITS_KEY: torch.from_numpy(data.logits.astype(np.float32)),
               PREFIX_MASK_KEY: torch.from_numpy(data.prefix_mask.copy())}
    if features is not None:
        if tuple(features.shape[:2]) != data.logits.shape:
            raise ShardError(f"{path}: features {tuple(features.shape)} do not match logits "
                             f"{data.logits.shape}")
        columns[FEATURES_KEY] = features.to(torch.float16)
    return _save(Path(path), columns)


# ---------------------------------------------------------------------------------------- meta.json


@dataclass(frozen=True)
class StsMeta:
    """`meta.json` of a shard directory: what the labels mean and what was left out."""

    policy: str | None  # the sampling policy whose acceptance events the labels are
    num_samples: int | None = None
    num_shards: int | None = None
    skipped_requests: int = 0  # request-steps recorded without a label (not every draft verified)
    skip_reason: str | None = None
    features_backbone: str | None = None  # digest of the draft weights the features depend on
    fingerprint: Mapping[str, Any] | None = None  # the deployment the shards were recorded on

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy, "num_samples": self.num_samples,
                               "num_shards": self.num_shards, "skipped_requests": self.skipped_requests,
                               "skip_reason": self.skip_reason}
        if self.features_backbone is not None:
            out[FEATURES_KEY] = {"draft_backbone": self.features_backbone}
        if self.fingerprint is not None:
            out["fingerprint"] = dict(self.fingerprint)
        return out

    @classmethod
    @errors_as(ShardError)
    def from_json(cls, data: Any, where: str) -> StsMeta:
        data = require_object(data, where, "a shard directory's meta.json")
        reject_unknown(data, ("policy", "num_samples", "num_shards", "skipped_requests", "skip_reason",
                              FEATURES_KEY, "fingerprint"), where)
        features = typed_field(data, FEATURES_KEY, (dict,), where, nullable=True)
        backbone = None
        if features is not None:
            backbone = typed_field(features, "draft_backbone", (str,), f"{where}: {FEATURES_KEY}")
        return cls(policy=typed_field(data, "policy", (str,), where, nullable=True),
                   num_samples=int_field(data, "num_samples", where, nullable=True),
                   num_shards=int_field(data, "num_shards", where, nullable=True),
                   skipped_requests=int_field(data, "skipped_requests", where, nullable=True) or 0,
                   skip_reason=typed_field(data, "skip_reason", (str,), where, nullable=True),
                   features_backbone=backbone,
                   fingerprint=typed_field(data, "fingerprint", (dict,), where, nullable=True))


@errors_as(ShardError)
def read_sts_meta(directory: str | os.PathLike[str]) -> StsMeta | None:
    """The `meta.json` of a shard directory, or None when there is none (shards from elsewhere)."""
    path = Path(directory) / META_FILE
    if not path.exists():
        return None
    return StsMeta.from_json(read_json_file(path, "STS meta", "re-record the run", ShardError), str(path))


class StsShardWriter:
    """Buffers `(logits, prefix_mask[, features])` rows of a recording run and writes them in shards of
    `shard_size` rows (`shard-00000.pt`, …); `close` flushes the rest and writes `meta.json`."""

    def __init__(self, directory: Path, gamma: int, policy: str, shard_size: int = 4096,
                 features_backbone: str | None = None) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.directory = directory
        self.gamma = gamma
        self.policy = policy
        self.shard_size = shard_size
        # Digest of the draft weights the features depend on (everything but the head itself);
        # None when features are not recorded.
        self.features_backbone = features_backbone
        self.num_samples = 0
        self.skipped_requests = 0
        self.num_shards = 0
        keys = (LOGITS_KEY, PREFIX_MASK_KEY, FEATURES_KEY) if self.features else (LOGITS_KEY, PREFIX_MASK_KEY)
        self._columns: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
        self._buffered = 0

    @property
    def features(self) -> bool:
        return self.features_backbone is not None

    def add(self, logits: torch.Tensor, correct_len: torch.Tensor, fully_verified: torch.Tensor,
            features: torch.Tensor | None = None) -> None:
        """Record the fully verified requests of a step: raw logits `[B, gamma]`, the uncapped matching
        prefix `correct_len [B]`, `fully_verified [B]` bool, and the confidence head's inputs
        `[B, gamma, F]` when this writer stores features."""
        if self.features and features is None:
            raise ValueError("this recorder stores features; pass the confidence head's inputs")
        keep = fully_verified.bool()
        self.skipped_requests += int((~keep).sum())
        if not bool(keep.any()):
            return
        kept = logits[keep].detach().float().cpu()
        lens = correct_len[keep].long().cpu()
        rows = {LOGITS_KEY: kept, PREFIX_MASK_KEY: torch.arange(self.gamma)[None, :] < lens[:, None]}
        if features is not None and self.features:
            # float16 halves the disk use; the head's inputs are RMS-normed states and embeddings.
            rows[FEATURES_KEY] = features[keep.to(features.device)].detach().to(torch.float16).cpu()
        for key, value in rows.items():
            self._columns[key].append(value)
        self._buffered += kept.shape[0]
        self.num_samples += kept.shape[0]
        while self._buffered >= self.shard_size:
            self._write_shard(self.shard_size)

    def _write_shard(self, rows: int) -> None:
        columns = {key: torch.cat(parts) for key, parts in self._columns.items()}
        _save(self.directory / f"shard-{self.num_shards:05d}{SHARD_SUFFIX}",
              {key: value[:rows].contiguous() for key, value in columns.items()})
        self.num_shards += 1
        self._columns = {key: [value[rows:]] for key, value in columns.items()}
        self._buffered -= rows

    def close(self, fingerprint: Mapping[str, Any] | None = None) -> StsMeta:
        """Flush the last partial shard and write `meta.json`; returns what it wrote."""
        if self._buffered:
            self._write_shard(self._buffered)
        meta = StsMeta(policy=self.policy, num_samples=self.num_samples, num_shards=self.num_shards,
                       skipped_requests=self.skipped_requests,
                       skip_reason=PARTIAL_VERIFY_REASON if self.skipped_requests else None,
                       features_backbone=self.features_backbone, fingerprint=fingerprint)
        write_json_file(self.directory / META_FILE, meta.to_json())
        return meta
