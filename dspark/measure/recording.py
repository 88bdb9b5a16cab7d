"""What a run records for calibration and reports: STS shards, a bounded ring of step records.

A record directory (`dspark run … --record DIR`) holds
- `run.json`: the deployment, mode, policy, lag, tiers and the run's counts;
- `steps.jsonl`: the last `record_steps` decode steps (B, budget, rows, tier, predicted tau and
  step time, committed tokens, measured step time, and per request verify_len / correct_len /
  commit_len / confidence / survival);
- `sts/shard-*.pt` + `sts/meta.json`: per verified request the raw confidence logits and
  `prefix_mask[k] = k < correct_len` under greedy matching, the layout SGLang's recorder writes;
  with `--record-features` also `features[n, gamma, F]`, the confidence head's inputs, which
  `dspark fit-confidence` refits the head on (meta.json names the draft backbone they came from).

Labels exist only where every draft was verified: a compact step that verified fewer than N rows
of a request does not know whether the later drafts would have matched, so such requests are
skipped (and counted, with the reason) rather than recorded with made-up labels.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark.atomic import atomic_write

FEATURES_KEY = "features"
RUN_FORMAT = "dspark-run"
RUN_VERSION = 1
PARTIAL_VERIFY_REASON = ("compact steps that verified fewer than N rows of a request carry no label "
                         "for the unverified drafts; record with a cap-accept build (which runs every "
                         "row) for unbiased calibration data")


class StsRecorder:
    """Buffers `(logits, prefix_mask)` rows and writes them in shards of `shard_size` rows."""

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
        self._columns: dict[str, list[torch.Tensor]] = {key: [] for key in self._keys()}
        self._buffered = 0

    @property
    def features(self) -> bool:
        return self.features_backbone is not None

    def _keys(self) -> tuple[str, ...]:
        return ("logits", "prefix_mask", FEATURES_KEY) if self.features else ("logits", "prefix_mask")

    def add(self, logits: torch.Tensor, correct_len: torch.Tensor, fully_verified: torch.Tensor,
            features: torch.Tensor | None = None) -> None:
        """Record the fully verified requests of a step: raw logits `[B, gamma]`, greedy
        `correct_len [B]` (the uncapped matching prefix), `fully_verified [B]` bool, and the
        confidence head's inputs `[B, gamma, F]` when this recorder stores features."""
        if self.features and features is None:
            raise ValueError("this recorder stores features; pass the confidence head's inputs")
        keep = fully_verified.bool()
        self.skipped_requests += int((~keep).sum())
        if not bool(keep.any()):
            return
        logits = logits[keep].detach().float().cpu()
        lens = correct_len[keep].long().cpu()
        rows = {"logits": logits, "prefix_mask": torch.arange(self.gamma)[None, :] < lens[:, None]}
        if self.features:
            assert features is not None
            # float16 halves the disk use; the head's inputs are RMS-normed states and embeddings.
            rows[FEATURES_KEY] = features[keep.to(features.device)].detach().to(torch.float16).cpu()
        for key, value in rows.items():
            self._columns[key].append(value)
        self._buffered += logits.shape[0]
        self.num_samples += logits.shape[0]
        while self._buffered >= self.shard_size:
            self._write_shard(self.shard_size)

    def _write_shard(self, rows: int) -> None:
        columns = {key: torch.cat(parts) for key, parts in self._columns.items()}
        shard = {key: value[:rows].contiguous() for key, value in columns.items()}
        path = self.directory / f"shard-{self.num_shards:05d}.pt"
        atomic_write(path, lambda tmp: torch.save(shard, tmp))
        self.num_shards += 1
        self._columns = {key: [value[rows:]] for key, value in columns.items()}
        self._buffered -= rows

    def close(self, fingerprint: dict[str, Any] | None = None) -> None:
        """Flush the last partial shard and write `meta.json`."""
        if self._buffered:
            self._write_shard(self._buffered)
        meta = {"policy": self.policy, "num_samples": self.num_samples, "num_shards": self.num_shards,
                "skipped_requests": self.skipped_requests,
                "skip_reason": PARTIAL_VERIFY_REASON if self.skipped_requests else None}
        if self.features:
            meta[FEATURES_KEY] = {"draft_backbone": self.features_backbone}
        if fingerprint is not None:
            meta["fingerprint"] = fingerprint
        atomic_write(self.directory / "meta.json",
                      lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))


@dataclass
class StepRing:
    """The last `capacity` decode steps, as JSON-ready dicts."""

    capacity: int
    records: deque[dict[str, Any]] = field(default_factory=deque)
    total: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"record_steps must be >= 1 to record, got {self.capacity}")
        self.records = deque(maxlen=self.capacity)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append({"step": self.total, **record})
        self.total += 1

    def write(self, path: Path) -> None:
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records)
        atomic_write(path, lambda tmp: tmp.write_text(lines))


class RunRecorder:
    """Everything one `dspark run --record DIR` writes; `close` is safe to call once."""

    def __init__(self, directory: str | Path, gamma: int, policy: str, record_steps: int,
                 shard_size: int = 4096, features_backbone: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sts = StsRecorder(self.directory / "sts", gamma, policy, shard_size, features_backbone)
        self.steps = StepRing(record_steps)
        self._closed = False

    def close(self, run_info: dict[str, Any]) -> None:
        if self._closed:
            return
        self._closed = True
        fingerprint = run_info.get("fingerprint")
        self.sts.close(fingerprint)
        self.steps.write(self.directory / "steps.jsonl")
        info = {"format": RUN_FORMAT, "version": RUN_VERSION, **run_info,
                "recorded_steps": len(self.steps.records), "total_steps": self.steps.total}
        atomic_write(self.directory / "run.json",
                      lambda tmp: tmp.write_text(json.dumps(info, indent=2) + "\n"))
