"""Predicted against measured step time at several context lengths: the deployment's own cost table against
a table with a context term (`dspark profile --context-len 128,512,900`), in one run.

Compiles the spec twice (its own `cost_model`, then `--table`), and for each context L decodes `--prompts`
held-out prompts of L - max_new_tokens / 2 tokens each (so the batch's mean context over the decode is about
L), recording every step. Prints, per table and context, the mean measured step time, the table's price of
the same steps (the draft's included; the measured step offset the planner adds on top left out) and their
ratio, the price the planner weighed (with the measured step offset, `docs/planner.md` "Step offset") and
its whole online prediction (the offset's slope times that price) against the same, and the table levelled
at the first context (below); `dspark report` on such a recording shows the same by context bucket ("Step
time by context length").

    .venv/bin/dspark profile generated/tiny_cpu_compact -o specs/tables/tiny_cpu_context --m-bin 16 \\
        --repeats 21 --context-len 128,512,900
    .venv/bin/python benchmarks/context_cost.py --table specs/tables/tiny_cpu_context/additive.json
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from dspark.compiler.api import build
from dspark.corpus import held_out_text
from dspark.measure.recording import RunRecorder
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.planner.step_offset import robust_line

REPO = Path(__file__).resolve().parents[1]


def prompts_of(pkg: object, count: int, tokens: int) -> list[list[int]]:
    """`count` windows of `tokens` tokens from the held-out text, one every few thousand tokens."""
    ids = pkg.tokenizer.encode("".join(held_out_text(1 << 22)))  # type: ignore[attr-defined]
    stride = max(tokens, (len(ids) - tokens) // count)
    if stride * (count - 1) + tokens > len(ids):
        raise SystemExit(f"the held-out text has {len(ids)} tokens: too few for {count} x {tokens}")
    return [ids[i * stride:i * stride + tokens] for i in range(count)]


@dataclass(frozen=True)
class Measured:
    """One context's drafted steps: measured seconds, the table's price (draft included), the price the
    planner weighed (with the measured step offset), and the mean context."""

    measured: np.ndarray
    table: np.ndarray
    priced: np.ndarray
    online: np.ndarray  # offset_slope * priced: the planner's whole prediction
    context: float


def level(first: Measured) -> tuple[float, float]:
    """measured ~ a * table + b over the first context's steps (Theil-Sen, as the step offset fits it;
    the ratio of medians where their prices hardly differ): the table's level on this machine's steps."""
    fit = robust_line(first.table, first.measured, 8)
    return fit if fit is not None else (float(np.median(first.measured) / np.median(first.table)), 0.0)


def measure(package: Path, contexts: list[int], count: int, max_new: int, work: Path) -> list[Measured]:
    """Every context's drafted steps."""
    pkg = load_package(package)
    runtime = Runtime(pkg)
    out = []
    try:
        runtime.generate(prompts_of(pkg, 2, 64), 8)  # warm: first calls allocate
        for length in contexts:
            recorder = RunRecorder(work / f"{package.name}_{length}", pkg.plan.gamma, runtime.sampling.policy,
                                   record_steps=1 << 20)
            runtime.recorder = recorder
            runtime.generate(prompts_of(pkg, count, length - max_new // 2), max_new)
            runtime.recorder = None
            steps = [s for s in recorder.steps.records if s.predicted_step_seconds is not None]
            out.append(Measured(np.array([s.step_seconds for s in steps]),
                                np.array([s.predicted_step_seconds - s.offset_seconds for s in steps]),
                                np.array([s.predicted_step_seconds for s in steps]),
                                np.array([s.offset_slope * s.predicted_step_seconds for s in steps]),
                                float(np.mean([s.context_len for s in steps]))))
    finally:
        runtime.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "tiny_cpu_compact.yaml")
    parser.add_argument("--table", type=Path, required=True, help="an additive table with a context term")
    parser.add_argument("--contexts", default="128,512,900")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    base = yaml.safe_load(args.spec.read_text())
    variants = {"own table": base.get("cost_model"),
                "context table": {"type": "additive", "file": str(args.table.resolve())}}
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, cost_model in variants.items():
            spec = {**base, "name": f"{base['name']}_{name.split()[0]}", "cost_model": cost_model}
            # Beside the original, so the spec's other relative paths still resolve.
            spec_path = args.spec.parent / f".context_cost_{name.split()[0]}.yaml"
            try:
                spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
                build(spec_path, Path(tmp) / name.split()[0])
            finally:
                spec_path.unlink(missing_ok=True)
            results[name] = measure(Path(tmp) / name.split()[0], contexts, args.prompts, args.max_new_tokens,
                                    Path(tmp))
    print(f"{base['name']}, {args.prompts} prompts x {args.max_new_tokens} new tokens per context; "
          "table = the cost table's price of the same steps (draft included, measured offset left out)")
    print(f"{'table':<14} {'context':>7} {'mean ctx':>8} {'steps':>6} {'measured ms':>11} {'table ms':>9} "
          f"{'table/measured':>14} {'priced/measured':>15} {'online/measured':>15} {'levelled/measured':>17}")
    for name, rows in results.items():
        a, b = level(rows[0])
        for length, m in zip(contexts, rows, strict=True):
            measured, table = float(m.measured.mean()), float(m.table.mean())
            print(f"{name:<14} {length:>7} {m.context:>8.0f} {m.measured.size:>6} {measured * 1e3:>11.2f} "
                  f"{table * 1e3:>9.2f} {table / measured:>14.3f} {float(m.priced.mean()) / measured:>15.3f} "
                  f"{float(m.online.mean()) / measured:>15.3f} {(a * table + b) / measured:>17.3f}")
    print(f"levelled = a * table + b, a and b fitted on the first context's steps alone (measured ~ a * "
          f"table + b, Theil-Sen): the level learnt at {contexts[0]} tokens, the context term predicting "
          "the rest")


if __name__ == "__main__":
    main()
