"""What a run records for calibration and reports (`dspark run … --record DIR`).

A record directory holds
- `run.json`: the deployment, mode, policy, lag, tiers and the run's counts (`dspark.formats.run_info`);
- `steps.jsonl`: the last `record_steps` decode steps (`dspark.formats.step_records`);
- `sts/shard-*.pt` + `sts/meta.json`: per verified request the raw confidence logits and the prefix
  mask of the uncapped match, with `--record-features` also the confidence head's inputs
  (`dspark.formats.sts_shards`).

Labels exist only where every draft was verified: a compact step that verified fewer than N rows
of a request does not know whether the later drafts would have matched, so such requests are
skipped (and counted, with the reason) rather than recorded with made-up labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.formats.run_info import RUN_FORMAT, RUN_VERSION, RunInfo, write_run_info
from dspark.formats.step_records import StepRing
from dspark.formats.sts_shards import StsShardWriter

STEPS_FILE = "steps.jsonl"
STS_DIR = "sts"


class RunRecorder:
    """Everything one recording run writes; the engine feeds `sts` and `steps`, `close` writes the rest."""

    def __init__(self, directory: str | Path, gamma: int, policy: str, record_steps: int,
                 shard_size: int = 4096, features_backbone: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sts = StsShardWriter(self.directory / STS_DIR, gamma, policy, shard_size, features_backbone)
        self.steps = StepRing(record_steps)
        self._closed = False

    def close(self, run_info: Mapping[str, Any]) -> RunInfo | None:
        """Flush the shards, write `steps.jsonl` and `run.json` (from `run_info`: the deployment, verify
        mode, backend, device, gamma, lag_steps, policy, tiers, target_only, fingerprint and stats).
        Safe to call more than once; only the first call writes, and returns what went into run.json."""
        if self._closed:
            return None
        self._closed = True
        self.sts.close(run_info.get("fingerprint"))
        self.steps.write(self.directory / STEPS_FILE)
        info = RunInfo.from_json({"format": RUN_FORMAT, "version": RUN_VERSION, **run_info,
                                  "recorded_steps": len(self.steps.records), "total_steps": self.steps.total},
                                 "run_info")
        write_run_info(self.directory, info)
        return info
