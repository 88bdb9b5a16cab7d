"""Can any planner-side estimate of acceptance reach 0.9 of the oracle at T 0.8?

Under rejection sampling a draft x is accepted with probability min(1, p(x) / q(x)). The confidence head
reads the draft's hidden state before the sampler draws x, so at best it knows the expected acceptance
`sum_x min(p, q) = 1 - TV(p, q)`; a model that also reads the drawn token can know more, and only the
target knows p(x). This measures how far each kind of estimate gets, in three parts:

1. record two T 0.8 runs of a static sampled build (every row verified), one to fit and a disjoint one
   to score, keeping beside each request-step's record, per draft position: the drawn token's draft
   probability q(x), the draft distribution's largest probability and entropy, whether x is its
   argmax, x's Markov embedding (`markov_w1[x]`), the head's input hidden state, `1 - TV(p, q)` and
   `min(1, p/q)` (the run's verifier and confidence head are wrapped to read them);
2. per draft position fit on the first run, score on the second by AUC against the realized
   acceptance: Platt scaling of the confidence logit, a logistic model of the logit plus log q(x),
   one of the logit plus every drawn-token feature above and the hidden state (soft labels min(1, p/q),
   which are defined at every row because the static build verified every row), and a two-layer MLP
   over the same inputs;
3. replay the second run through `dspark.simulate` with each estimate as the planner's survival (no
   temperatures) and print adaptive-on / oracle beside two planners given what no head can know:
   `1 - TV` exactly (the ceiling of a head that reads only the draft's state) and min(1, p/q) exactly
   (`informed`).

It then asks the same of a different verifier, Gumbel-coupled sampling (the draft and the target take
the argmax of their log-probabilities plus the same Gumbel noise, so the committed tokens do not depend
on the draft at all): its acceptance and, with the draft's perturbed top-1 margin as a feature, its
adaptive-on / oracle (each position's noise drawn once from a seeded generator; acceptance is judged
position by position on the recorded drafts' prefixes, so this is an estimate).

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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dspark.measure.recording import RunRecorder
from dspark.runtime.engine import speculative
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.models import dspark_block_draft
from dspark.runtime.models.checkpoint import resolve_checkpoint
from dspark.runtime.models.dspark_block_loader import read_tensors
from dspark.runtime.package import load_package
from dspark.runtime.planner.calibration_metrics import roc_auc
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
from dspark.simulate.policies import AdaptivePolicy, InformedPolicy, OraclePolicy
from dspark.simulate.pricing import StepPricer
from dspark.simulate.sweep import simulate_concurrency
from dspark.simulate.trace import Trace, trace_from_steps

# Columns of `Recorded.columns`' last axis after the hidden state and the Markov embedding.
LOG_Q, LOG_Q_MAX, ENTROPY, IS_ARGMAX, ONE_MINUS_TV, ACCEPT_PROB, GUMBEL_ACCEPT, GUMBEL_MARGIN = range(8)
SCALARS = 8


@dataclasses.dataclass(frozen=True)
class Recorded:
    trace: Trace
    state: torch.Tensor  # float64 [n, gamma, hidden + markov_rank]: h_k and markov_w1[x_k]
    columns: np.ndarray  # float64 [n, gamma, SCALARS]


def record(package: Path, prompts_file: Path, count: int, max_new_tokens: int, seed: int) -> Recorded:
    """A recording of the static sampled build with every draft position's features, in trace order."""
    pkg = load_package(package)
    draft_dir = resolve_checkpoint(pkg.deployment.draft.checkpoint, "draft", pkg.directory)
    markov_w1 = read_tensors(draft_dir)["markov_head.markov_w1.weight"].double()
    hidden_size = pkg.deployment.model.geometry.hidden_size
    noise = torch.Generator().manual_seed(seed)
    verify, head_forward = speculative.rejection_accept, dspark_block_draft.ConfidenceHead.forward
    head_inputs: list[torch.Tensor] = []
    state, columns = [], []

    def reading_head(self, features):  # type: ignore[no-untyped-def]
        head_inputs.append(features.detach())
        return head_forward(self, features)

    def reading_verify(drafts, q_probs, p_probs, verify_lens, generator):  # type: ignore[no-untyped-def]
        out = verify(drafts, q_probs, p_probs, verify_lens, generator)
        q, p = q_probs.double(), p_probs[:, :drafts.shape[1]].double()
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=noise, dtype=torch.float64)
                                       .clamp_min(1e-300)))
        perturbed = (torch.log(q) + gumbel).topk(2, dim=-1)
        coupled = (torch.log(p) + gumbel).argmax(-1) == perturbed.indices[..., 0]
        columns.append(torch.stack([
            torch.log(q_x.clamp_min(1e-12)), torch.log(q.amax(-1)),
            -(q * torch.log(q.clamp_min(1e-300))).sum(-1), (q.argmax(-1) == drafts).double(),
            torch.minimum(p, q).sum(-1), out.accept_prob.double(), coupled.double(),
            (perturbed.values[..., 0] - perturbed.values[..., 1]).clamp(max=50.0)], dim=-1))
        state.append(torch.cat((head_inputs.pop()[..., :hidden_size].double(), markov_w1[drafts]), dim=-1))
        return out

    with tempfile.TemporaryDirectory() as scratch:
        recorder = RunRecorder(scratch, pkg.plan.gamma, "sampled", record_steps=10**7, shard_size=10**7)
        speculative.rejection_accept, dspark_block_draft.ConfidenceHead.forward = reading_verify, reading_head
        try:
            prompts = [pkg.tokenizer.encode(p) for p in json.loads(prompts_file.read_text())[:count]]
            Runtime(pkg, recorder=recorder).generate(prompts, max_new_tokens)
        finally:
            speculative.rejection_accept, dspark_block_draft.ConfidenceHead.forward = verify, head_forward
        steps = list(recorder.steps.records)  # numbered by the ring
    trace = trace_from_steps(steps, pkg.plan.gamma, "sampled", str(prompts_file))
    recorded = Recorded(trace, torch.cat(state), torch.cat(columns).numpy())
    if recorded.state.shape[0] != trace.size:
        raise RuntimeError(f"{trace.size} request-steps recorded for {recorded.state.shape[0]} verified")
    return recorded


def design(run: Recorded, j: int, kind: str) -> torch.Tensor:
    """The inputs of model `kind` at draft position j, with a constant column last."""
    cols = [torch.from_numpy(run.trace.confidence[:, j].astype(np.float64))[:, None]]
    if kind == "z + log q":
        cols.append(torch.from_numpy(run.columns[:, j, LOG_Q:LOG_Q + 1]))
    elif kind in ("drawn token", "mlp"):
        cols += [torch.from_numpy(run.columns[:, j, LOG_Q:IS_ARGMAX + 1]), run.state[:, j]]
    return torch.cat([*cols, torch.ones(run.trace.size, 1, dtype=torch.float64)], dim=1)


def gumbel_design(run: Recorded, j: int, with_margin: bool) -> torch.Tensor:
    """The confidence logit (and the perturbed draft's log1p top-1 margin) at position j, constant last."""
    margin = [np.log1p(run.columns[:, j, GUMBEL_MARGIN])] if with_margin else []
    return torch.from_numpy(np.stack([run.trace.confidence[:, j].astype(np.float64), *margin,
                                      np.ones(run.trace.size)], axis=1))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float) -> Callable[[torch.Tensor], np.ndarray]:
    """Standardised L2 logistic regression (soft labels allowed) by L-BFGS; returns the logit map."""
    mean, std = x[:, :-1].mean(0), x[:, :-1].std(0).clamp_min(1e-6)

    def scaled(m: torch.Tensor) -> torch.Tensor:
        return torch.cat(((m[:, :-1] - mean) / std, m[:, -1:]), dim=1)

    xs = scaled(x)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w, y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda m: (scaled(m) @ w.detach()).numpy()


def fit_mlp(fit: Recorded, score: Recorded) -> np.ndarray:
    """A two-layer MLP over every position's inputs (position one-hot beside them), soft labels, early
    stopped on a tenth of the fit rows; returns its logits on the scoring run `[n, gamma]`."""
    gamma = fit.trace.gamma

    def inputs(run: Recorded) -> torch.Tensor:
        per_pos = torch.stack([design(run, j, "mlp")[:, :-1] for j in range(gamma)], dim=1)
        pos = torch.eye(gamma, dtype=torch.float64).expand(run.trace.size, gamma, gamma)
        return torch.cat((per_pos, pos), dim=-1).float()

    x_fit, x_score = inputs(fit), inputs(score)
    mean, std = x_fit.flatten(0, 1).mean(0), x_fit.flatten(0, 1).std(0).clamp_min(1e-4)
    x_fit, x_score = (x_fit - mean) / std, (x_score - mean) / std
    y = torch.from_numpy(fit.columns[:, :, ACCEPT_PROB]).float()
    torch.manual_seed(0)
    order = torch.randperm(fit.trace.size)
    held, train = order[: fit.trace.size // 10], order[fit.trace.size // 10:]
    net = torch.nn.Sequential(torch.nn.Linear(x_fit.shape[-1], 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                              torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    best, best_state = float("inf"), None
    for _ in range(60):
        for idx in train[torch.randperm(len(train))].split(256):
            opt.zero_grad()
            loss(net(x_fit[idx]).squeeze(-1), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            held_loss = loss(net(x_fit[held]).squeeze(-1), y[held]).item()
        if held_loss < best:
            best, best_state = held_loss, {k: v.clone() for k, v in net.state_dict().items()}
    assert best_state is not None
    net.load_state_dict(best_state)
    with torch.no_grad():
        return net(x_score).squeeze(-1).double().numpy()


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

    fit = record(args.static_package, args.fit_prompts, args.fit_count, args.max_new_tokens, seed=1)
    score = record(args.static_package, args.score_prompts, args.score_count, args.max_new_tokens, seed=2)
    gamma = fit.trace.gamma
    kinds = ("platt z", "z + log q", "drawn token")
    logits = {name: np.zeros((score.trace.size, gamma)) for name in (*kinds, "mlp", "gumbel z", "gumbel z+m")}
    logits["mlp"] = fit_mlp(fit, score)
    g_fit = np.cumprod(fit.columns[:, :, GUMBEL_ACCEPT] > 0.5, axis=1).sum(1)
    g_score = np.cumprod(score.columns[:, :, GUMBEL_ACCEPT] > 0.5, axis=1).sum(1)
    print(f"fit on {fit.trace.size} request-steps, scored on {score.trace.size}")
    print("AUC against the realized acceptance of draft j given the drafts before it")
    print(f"{'pos':>4} {'n':>6} {'platt z':>8} {'z+log q':>8} {'drawn':>8} {'mlp':>8} {'1 - TV':>8} "
          f"{'true p':>8} | {'gumbel z':>8} {'z+margin':>8}")
    for j in range(gamma):
        reached = score.trace.raw_correct_len >= j
        label = score.trace.raw_correct_len[reached] > j
        soft = torch.from_numpy(fit.columns[:, j, ACCEPT_PROB])
        for name in kinds:
            # Soft labels are defined at every row of a static recording; Platt and log q fit the
            # realized acceptance of the rows that reached j, as the head's own fit does.
            if name == "drawn token":
                model = fit_logistic(design(fit, j, name), soft, l2=1e-3)
            else:
                rows = fit.trace.raw_correct_len >= j
                y = torch.from_numpy((fit.trace.raw_correct_len[rows] > j).astype(np.float64))
                model = fit_logistic(design(fit, j, name)[torch.from_numpy(rows)], y, l2=1e-4)
            logits[name][:, j] = model(design(score, j, name))
        aucs = [roc_auc(logits[name][reached, j], label) for name in (*kinds, "mlp")]
        aucs += [roc_auc(score.columns[reached, j, col], label) for col in (ONE_MINUS_TV, ACCEPT_PROB)]
        g_rows, g_reached = g_fit >= j, g_score >= j
        g_label = score.columns[g_reached, j, GUMBEL_ACCEPT] > 0.5
        g_y = torch.from_numpy(fit.columns[g_rows, j, GUMBEL_ACCEPT])
        for name, with_margin in (("gumbel z", False), ("gumbel z+m", True)):
            model = fit_logistic(gumbel_design(fit, j, with_margin)[torch.from_numpy(g_rows)], g_y, l2=1e-4)
            logits[name][:, j] = model(gumbel_design(score, j, with_margin))
            aucs.append(roc_auc(logits[name][g_reached, j], g_label))
        print(f"{j + 1:>4} {int(reached.sum()):>6} " + " ".join(f"{a:>8.3f}" for a in aucs[:6]) + " | "
              + " ".join(f"{a:>8.3f}" for a in aucs[6:]))
    print("mean acceptance per position (1 - TV, i.e. rejection sampling's, vs Gumbel coupling's), "
          "given the recorded drafts before it:")
    print("  1 - TV  " + " ".join(f"{v:.3f}" for v in score.columns[:, :, ONE_MINUS_TV].mean(0)))
    print("  coupled " + " ".join(f"{v:.3f}" for v in score.columns[:, :, GUMBEL_ACCEPT].mean(0)))

    plan: AdaptiveVerifyPlan = load_package(args.compact_package).plan
    plan = plan.with_overrides(speculation_off="never")
    if args.cost_model is not None:
        plan = plan.with_overrides(cost_model=json.loads(args.cost_model.read_text()))
    pricer = StepPricer(plan.table)
    uncalibrated = plan.with_overrides(temperatures=None)
    oracle = OraclePolicy(plan.num_draft_tokens)
    gumbel_trace = dataclasses.replace(
        score.trace, raw_correct_len=g_score.astype(score.trace.raw_correct_len.dtype), accept_prob=None)
    tv_trace = dataclasses.replace(score.trace,
                                   accept_prob=score.columns[:, :, ONE_MINUS_TV].astype(np.float32))
    table = args.cost_model or "the package table"
    print(f"\nadaptive-on / oracle ({table}; 1000 steps per concurrency, seed 0); "
          "gumbel: its own trace and oracle, and tokens/s over rejection sampling's adaptive")
    print(f"{'c':>5} {'STS':>7} {'platt z':>8} {'z+log q':>8} {'drawn':>8} {'mlp':>8} {'1 - TV':>8} "
          f"{'informed':>9} | {'gumbel z':>8} {'z+margin':>8} {'tok/s':>6}")
    for c in (int(v) for v in args.concurrency.split(",")):
        adaptive, informed, best = simulate_concurrency(
            score.trace, [AdaptivePolicy(plan), InformedPolicy(uncalibrated), oracle], pricer, c, 1000, 0)
        (tv,) = simulate_concurrency(tv_trace, [InformedPolicy(uncalibrated)], pricer, c, 1000, 0)
        rates = [adaptive.tokens_per_s]
        for name in (*kinds, "mlp"):
            trace = dataclasses.replace(score.trace, confidence=logits[name].astype(np.float32))
            rates.append(simulate_concurrency(trace, [AdaptivePolicy(uncalibrated)], pricer, c, 1000, 0)[0]
                         .tokens_per_s)
        rates += [tv.tokens_per_s, informed.tokens_per_s]
        gumbel = []
        for name in ("gumbel z", "gumbel z+m"):
            trace = dataclasses.replace(gumbel_trace, confidence=logits[name].astype(np.float32))
            run, g_best = simulate_concurrency(trace, [AdaptivePolicy(uncalibrated), oracle], pricer, c,
                                               1000, 0)
            gumbel.append((run.tokens_per_s / g_best.tokens_per_s, run.tokens_per_s))
        print(f"{c:>5} {rates[0] / best.tokens_per_s:>7.3f} "
              + " ".join(f"{r / best.tokens_per_s:>8.3f}" for r in rates[1:-1])
              + f" {rates[-1] / best.tokens_per_s:>9.3f} | {gumbel[0][0]:>8.3f} {gumbel[1][0]:>8.3f} "
              f"{gumbel[1][1] / adaptive.tokens_per_s:>6.3f}")


if __name__ == "__main__":
    main()
