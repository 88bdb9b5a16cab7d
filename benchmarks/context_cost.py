"""Predicted against measured step time at several context lengths: the deployment's own cost table against
a table with a context term (`dspark profile --context-len 128,512,900`), and with `--online-cost` each of
them refitted online to the steps it serves (docs/planner.md, "Online cost refit"), in one run.

Compiles the spec with its own `cost_model` (and with `--table`, when given), and for each context L decodes
`--prompts` held-out prompts of L - max_new_tokens / 2 tokens each (so the batch's mean context over the
decode is about L), recording every step. An online variant first decodes as many other prompts of that
context unrecorded (the refit learns from them, as it would from the traffic before), then the recorded
ones with the refit still running; its "table" is the live refitted table's price of each step.

Prints, per table and context, the mean measured step time, the table's price of the same steps (the
draft's included; the measured step offset the planner adds on top left out) and their ratio, the price
the planner weighed (with the measured step offset, `docs/planner.md` "Step offset") and its whole online
prediction (the offset's slope times that price) against the same, and the table levelled at the first
context (below); `dspark report` on such a recording shows the same by context bucket ("Step time by
context length").

    .venv/bin/python benchmarks/context_cost.py --online-cost   # the spec's own table, compiled and refitted
    .venv/bin/python benchmarks/context_cost.py --table DIR/additive.json   # beside another table, e.g. one
        # profiled with `dspark profile generated/tiny_cpu_compact -o DIR --context-len 128,512,900`
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
from dspark.runtime.config import OnlineCostSettings
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
    refits: int  # online cost refits swapped in by the end of this context (0: the compiled table)


def level(first: Measured) -> tuple[float, float]:
    """measured ~ a * table + b over the first context's steps (Theil-Sen, as the step offset fits it;
    the ratio of medians where their prices hardly differ): the table's level on this machine's steps."""
    fit = robust_line(first.table, first.measured, 8)
    return fit if fit is not None else (float(np.median(first.measured) / np.median(first.table)), 0.0)


def measure(package: Path, contexts: list[int], count: int, max_new: int, work: Path,
            online: OnlineCostSettings | None = None) -> list[Measured]:
    """Every context's drafted steps (with `online`, the cost table refitted as the steps come)."""
    pkg = load_package(package)
    runtime = Runtime(pkg, online_cost=online)
    refit = runtime.speculative.cost_refit
    out = []
    try:
        runtime.generate(prompts_of(pkg, 2, 64), 8)  # warm: first calls allocate
        for length in contexts:
            if online is not None:  # what the refit learns this context from: other prompts of its length
                runtime.generate(prompts_of(pkg, count + 1, length - max_new // 2), max_new)
            recorder = RunRecorder(work / f"{package.name}_{length}_{online is not None}", pkg.plan.gamma,
                                   runtime.sampling.policy, record_steps=1 << 20)
            runtime.recorder = recorder
            runtime.generate(prompts_of(pkg, count, length - max_new // 2), max_new)
            runtime.recorder = None
            steps = [s for s in recorder.steps.records if s.predicted_step_seconds is not None]
            out.append(Measured(np.array([s.step_seconds for s in steps]),
                                np.array([s.predicted_step_seconds - s.offset_seconds for s in steps]),
                                np.array([s.predicted_step_seconds for s in steps]),
                                np.array([s.offset_slope * s.predicted_step_seconds for s in steps]),
                                float(np.mean([s.context_len for s in steps])),
                                0 if refit is None else refit.refits))
    finally:
        runtime.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "tiny_cpu_compact.yaml")
    parser.add_argument("--table", type=Path, default=None,
                        help="an additive table with a context term, measured beside the spec's own")
    parser.add_argument("--contexts", default="128,512,900")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--online-cost", action="store_true",
                        help="also measure each table refitted online (an unrecorded learning pass per "
                             "context)")
    parser.add_argument("--refit-every", type=int, default=16,
                        help="with --online-cost: decode steps between refits (default 16: a context's pass "
                             "is a few dozen steps)")
    parser.add_argument("--window", type=int, default=512, help="with --online-cost: steps the refit reads")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    base = yaml.safe_load(args.spec.read_text())
    tables = {"own": base.get("cost_model")}
    if args.table is not None:
        tables["context"] = {"type": "additive", "file": str(args.table.resolve())}
    online = None
    if args.online_cost:
        online = OnlineCostSettings(window=args.window, refit_every=args.refit_every)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, cost_model in tables.items():
            spec = {**base, "name": f"{base['name']}_{name}", "cost_model": cost_model}
            # Beside the original, so the spec's other relative paths still resolve.
            spec_path = args.spec.parent / f".context_cost_{name}.yaml"
            try:
                spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
                build(spec_path, Path(tmp) / name)
            finally:
                spec_path.unlink(missing_ok=True)
            results[f"{name} table"] = measure(Path(tmp) / name, contexts, args.prompts, args.max_new_tokens,
                                               Path(tmp))
            if online is not None:
                results[f"{name} + online"] = measure(Path(tmp) / name, contexts, args.prompts,
                                                      args.max_new_tokens, Path(tmp), online)
    print(f"{base['name']}, {args.prompts} prompts x {args.max_new_tokens} new tokens per context; "
          "table = the cost table's price of the same steps (draft included, measured offset left out)")
    print(f"{'table':<16} {'context':>7} {'mean ctx':>8} {'steps':>6} {'measured ms':>11} {'table ms':>9} "
          f"{'table/measured':>14} {'priced/measured':>15} {'online/measured':>15} {'levelled/measured':>17} "
          f"{'refits':>6}")
    for name, rows in results.items():
        a, b = level(rows[0])
        for length, m in zip(contexts, rows, strict=True):
            measured, table = float(m.measured.mean()), float(m.table.mean())
            print(f"{name:<16} {length:>7} {m.context:>8.0f} {m.measured.size:>6} {measured * 1e3:>11.2f} "
                  f"{table * 1e3:>9.2f} {table / measured:>14.3f} {float(m.priced.mean()) / measured:>15.3f} "
                  f"{float(m.online.mean()) / measured:>15.3f} {(a * table + b) / measured:>17.3f} "
                  f"{m.refits:>6}")
    print(f"levelled = a * table + b, a and b fitted on the first context's steps alone (measured ~ a * "
          f"table + b, Theil-Sen): the level learnt at {contexts[0]} tokens, the context term predicting "
          "the rest; online = offset_slope * priced, the planner's whole prediction; a '+ online' table is "
          "the live refitted table (refits: swapped in by the end of that context)")


if __name__ == "__main__":
    main()
