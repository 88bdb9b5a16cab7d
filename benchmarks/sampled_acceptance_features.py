"""Would the sampled draft token's own probability q(x) rank drafts better than the confidence head?

Under rejection sampling a draft x is accepted with probability min(1, p(x) / q(x)). The confidence head
reads the draft's hidden state, not the token the sampler then drew, so a planner that knew q(x) might
rank the drafts better. This measures how much better, in two parts:

1. record two T 0.8 runs of a static sampled build (every row verified), one to fit and a disjoint one
   to score, keeping beside each request-step's record the draft probability q of every drafted token
   (the run's verifier is wrapped to read it off the proposal);
2. per draft position, fit on the first run a logistic model of "draft j accepted, given drafts before it
   were" on the raw confidence logit alone (Platt scaling) and on the logit plus log q(x); score each
   on the second run by AUC (against the true acceptance probability's AUC), then replay the second run
   through `dspark.simulate` with each model's logits as the planner's survival (no temperatures) and
   print adaptive-on / oracle beside informed / oracle (the planner on the true probabilities).

    .venv/bin/python benchmarks/sampled_acceptance_features.py runs/remeasure/pkgs/tiny_cpu_static_sampled \\
        generated/tiny_cpu_compact_sampled --fit-prompts runs/prompts_cal2.json --fit-count 300 \\
        --score-prompts runs/remeasure/prompts_sim.json

The static sampled build is `benchmarks/remeasure_embedded.sh` phase 4's; the fit prompts come from
`benchmarks/held_out_prompts.py --phases 2,10` and the scoring prompts are the simulation trace's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from dspark.measure.calibration_metrics import roc_auc
from dspark.measure.recording import RunRecorder
from dspark.runtime.engine import speculative
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
from dspark.simulate.policies import AdaptivePolicy, InformedPolicy, OraclePolicy
from dspark.simulate.pricing import StepPricer
from dspark.simulate.sweep import simulate_concurrency
from dspark.simulate.trace import Trace, trace_from_steps


@dataclasses.dataclass(frozen=True)
class Recorded:
    trace: Trace
    log_q: np.ndarray  # [n, gamma]: log q(x) of each drafted token


def record(package: Path, prompts_file: Path, count: int, max_new_tokens: int) -> Recorded:
    """A recording of the static sampled build with every draft's q(x), in the trace's row order."""
    original = speculative.rejection_accept
    drawn: list[list[list[float]]] = []

    def reading_q(drafts, q_probs, p_probs, verify_lens, generator):  # type: ignore[no-untyped-def]
        drawn.append(q_probs.gather(-1, drafts[..., None]).squeeze(-1).tolist())
        return original(drafts, q_probs, p_probs, verify_lens, generator)

    pkg = load_package(package)
    with tempfile.TemporaryDirectory() as scratch:
        recorder = RunRecorder(scratch, pkg.plan.gamma, "sampled", record_steps=10**7, shard_size=10**7)
        speculative.rejection_accept = reading_q
        try:
            prompts = [pkg.tokenizer.encode(p) for p in json.loads(prompts_file.read_text())[:count]]
            Runtime(pkg, recorder=recorder).generate(prompts, max_new_tokens)
        finally:
            speculative.rejection_accept = original
        steps = list(recorder.steps.records)  # numbered by the ring
    if len(steps) != len(drawn):
        raise RuntimeError(f"{len(steps)} step records for {len(drawn)} verified steps")
    trace = trace_from_steps(steps, pkg.plan.gamma, "sampled", str(prompts_file))
    log_q = np.log(np.clip(np.array([q for step in drawn for q in step]), 1e-9, 1.0))
    return Recorded(trace, log_q)


def features(run: Recorded, j: int, with_q: bool) -> np.ndarray:
    cols = [run.trace.confidence[:, j].astype(np.float64)]
    if with_q:
        cols.append(run.log_q[:, j])
    return np.stack([*cols, np.ones(run.trace.size)], axis=1)


def fit_logistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w, yt) + 1e-4 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("static_package", type=Path, help="a static build of the sampled deployment")
    parser.add_argument("compact_package", type=Path, help="its compact build: the plan and table simulated")
    parser.add_argument("--fit-prompts", type=Path, required=True)
    parser.add_argument("--fit-count", type=int, default=300)
    parser.add_argument("--score-prompts", type=Path, required=True)
    parser.add_argument("--score-count", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--cost-model", type=Path, help="a table to price the replay (default: the plan's)")
    args = parser.parse_args()

    fit = record(args.static_package, args.fit_prompts, args.fit_count, args.max_new_tokens)
    score = record(args.static_package, args.score_prompts, args.score_count, args.max_new_tokens)
    if score.trace.accept_prob is None:
        raise RuntimeError("the scoring recording has no accept_prob")
    gamma = fit.trace.gamma
    logits = {name: np.zeros((score.trace.size, gamma)) for name in ("platt z", "z + log q")}
    print(f"fit on {fit.trace.size} request-steps, scored on {score.trace.size}")
    print(f"{'pos':>4} {'n':>6} {'AUC z':>7} {'AUC z+log q':>12} {'AUC true p':>11}")
    for j in range(gamma):
        fit_rows, score_rows = fit.trace.raw_correct_len >= j, score.trace.raw_correct_len >= j
        fit_label = (fit.trace.raw_correct_len[fit_rows] > j).astype(np.float64)
        label = score.trace.raw_correct_len[score_rows] > j
        line = f"{j + 1:>4} {int(score_rows.sum()):>6}"
        for name, with_q in (("platt z", False), ("z + log q", True)):
            w = fit_logistic(features(fit, j, with_q)[fit_rows], fit_label)
            logits[name][:, j] = features(score, j, with_q) @ w
            line += f" {roc_auc(logits[name][score_rows, j], label):>{7 if not with_q else 12}.3f}"
        print(line + f" {roc_auc(score.trace.accept_prob[score_rows, j], label):>11.3f}")

    plan: AdaptiveVerifyPlan = load_package(args.compact_package).plan
    plan = plan.with_overrides(speculation_off="never")
    if args.cost_model is not None:
        plan = plan.with_overrides(cost_model=json.loads(args.cost_model.read_text()))
    pricer = StepPricer(plan.table)
    uncalibrated = plan.with_overrides(temperatures=None)
    table = args.cost_model or "the package table"
    print(f"\nadaptive-on / oracle ({table}; 1000 steps per concurrency, seed 0)")
    print(f"{'c':>5} {'STS':>7} {'platt z':>8} {'z+log q':>8} {'informed':>9}")
    for c in (int(v) for v in args.concurrency.split(",")):
        rates = []
        for conf, p in ((score.trace.confidence, plan), (logits["platt z"], uncalibrated),
                        (logits["z + log q"], uncalibrated)):
            trace = dataclasses.replace(score.trace, confidence=conf.astype(np.float32))
            adaptive, informed, oracle = simulate_concurrency(
                trace, [AdaptivePolicy(p), InformedPolicy(p), OraclePolicy(plan.num_draft_tokens)], pricer, c,
                1000, 0)
            rates.append(adaptive.tokens_per_s / oracle.tokens_per_s)
        print(f"{c:>5} {rates[0]:>7.3f} {rates[1]:>8.3f} {rates[2]:>8.3f} "
              f"{informed.tokens_per_s / oracle.tokens_per_s:>9.3f}")


if __name__ == "__main__":
    main()
