"""dspark.formats stands alone: no runtime, measurement, report or spec code, and no torch but the shards'."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_FREE = ("cost_tables", "sts_calibration", "step_records", "run_info", "profile", "json_io", "fields",
              "hf_config", "dsv4_config", "dsv4_hf_config", "dsv4_dspark_config")


def test_the_formats_import_neither_torch_nor_the_packages_that_use_them() -> None:
    code = ("import sys\n"
            + "".join(f"import dspark.formats.{name}\n" for name in TORCH_FREE)
            + "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
              "(['dspark', 'runtime'], ['dspark', 'measure'], ['dspark', 'report'], ['dspark', 'spec']))\n"
              "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
