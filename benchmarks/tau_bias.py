"""How far the planner's predicted tau is from the tokens a step actually committed.

Compiles variants of one spec (lag 0 and lag 2; the deployment's own cost table and a costly-rows
table that makes the budget cut rows; and an uncalibrated cap-accept build), runs each on the
same held-out prompts with `--record`, and prints `mean(actual − tau) / mean(actual)` per run from
the recorded steps (`dspark report` on the run directories draws the same figures by B and tier).

    .venv/bin/python benchmarks/tau_bias.py --prompts-file runs/prompts_eval.json -o runs/tau
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from dspark.cli.main import main as dspark_main
from dspark.compiler.api import build
from dspark.formats.run_info import read_run_info
from dspark.formats.step_records import read_steps

REPO = Path(__file__).resolve().parents[1]
# A table whose row cost dwarfs its overhead: the budget then verifies about half the drafts.
COSTLY_ROWS = {"type": "additive", "bias_seconds": 0.01, "bs_probes": [1, 32],
               "alpha_seconds": [0.0, 0.0], "m_probes": [1, 256], "theta_seconds": [0.0, 0.15]}
UNCALIBRATED = {"temperatures": [1.0] * 7}


def variants(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    verify = spec.get("verify", {})
    return {
        "lag0": {},
        "lag2": {"verify": {**verify, "lag_steps": 2}},
        "costly_lag0": {"cost_model": COSTLY_ROWS},
        "costly_lag2": {"cost_model": COSTLY_ROWS, "verify": {**verify, "lag_steps": 2}},
        "uncalibrated_cap_accept": {"verify": {**verify, "mode": "cap-accept"},
                                    "calibration": UNCALIBRATED},
    }


def relative_bias(run_dir: Path) -> tuple[float, float, int]:
    """(mean(actual − tau) / mean(actual), verify rows per request-step, steps) of a recorded run."""
    steps = read_steps(run_dir / "steps.jsonl", read_run_info(run_dir).gamma)
    planned = [s for s in steps if s.tau is not None]
    if not planned:
        raise SystemExit(f"{run_dir}: no step has a predicted tau (a static run plans nothing)")
    actual = sum(s.committed for s in planned)
    tau = sum(s.tau for s in planned if s.tau is not None)
    rows = sum(s.planned_rows for s in planned) / sum(s.num_reqs for s in planned)
    return (actual - tau) / actual, rows, len(planned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "tiny_cpu_compact.yaml")
    parser.add_argument("--prompts-file", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-o", "--out", type=Path, required=True, help="directory for the run records")
    args = parser.parse_args()
    base = yaml.safe_load(args.spec.read_text())
    print(f"{'run':<26} {'lag':>3} {'rows/request-step':>17} {'steps':>6} "
          f"{'mean(actual-tau)/mean(actual)':>30}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, override in variants(base).items():
            spec = {**base, **override, "name": f"{base['name']}_{name}"}
            # Beside the original, so the spec's relative table paths still resolve.
            spec_path = args.spec.parent / f".tau_bias_{name}.yaml"
            try:
                spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
                package = Path(tmp) / name
                build(spec_path, package)
            finally:
                spec_path.unlink(missing_ok=True)
            run_dir = args.out / name
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the completions
                code = dspark_main(["run", str(package), "--prompts-file", str(args.prompts_file),
                                    "--max-new-tokens", str(args.max_new_tokens), "--record", str(run_dir)])
            if code:
                raise SystemExit(f"{name}: dspark run failed with {code}")
            bias, rows, count = relative_bias(run_dir)
            lag = spec.get("verify", {}).get("lag_steps", 0)
            print(f"{name:<26} {lag:>3} {rows:>17.2f} {count:>6} {bias:>+29.2%}", flush=True)


if __name__ == "__main__":
    main()
