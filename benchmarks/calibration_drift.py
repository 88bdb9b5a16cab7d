"""Online calibration under drift: in-distribution traffic, then code the pair never saw, served through one
runtime with online calibration on (docs/planner.md, "Online calibration").

Three phases through the same runtime, each a batch of prompts stepped to completion:
  1. in distribution: held-out standard-library prompts (`dspark.corpus.held_out_prompts`);
  2. out of distribution, served: part 0 of `dspark.corpus.out_of_distribution_prompts` (other packages'
     sources and installed distributions' descriptions, in turn; `--out-of-distribution` picks one of them,
     or torch's C++ headers);
  3. out of distribution, scored: part 1 (no text in common with part 2).
It prints when drift was detected (labelled request-steps into the phase), then, on phase 3's labels, the
per-position cumulative ECE of the compiled temperatures, of the live calibration as it stood after phase 2
(frozen: phase 3 does not score what it fitted itself), and of the best temperatures fitted on phase 3's own
labels (the oracle), with what perfectly calibrated labels of the live survival measure on as many rows (the
noise floor) and of temperatures and map refitted on all of phase 2 (what a refit at its end would swap in);
phase 1's labels scored the same way; and each phase's tau bias, mean(committed - predicted) /
mean(committed), as served (the live calibration refitting as it goes).

    .venv/bin/python benchmarks/calibration_drift.py generated/tiny_cpu_cap_accept
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.corpus import (
    distribution_prose,
    header_prompts,
    held_out_prompts,
    out_of_distribution_prompts,
    package_prompts,
)
from dspark.measure.recording import RunRecorder
from dspark.runtime.config import OnlineCalibrationSettings
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.planner.calibration_metrics import binned_eces
from dspark.runtime.planner.online_calibration import LiveCalibration, step_labels, windowed_ece
from dspark.runtime.planner.sts import cumulative_survival, default_grid, fit_temperatures
from dspark.runtime.planner.survival_map import fit_survival_map

NOISE_DRAWS = 200
SOURCES = {"mixed": out_of_distribution_prompts, "code": package_prompts, "prose": distribution_prose,
           "headers": header_prompts}


@dataclass
class Phase:
    name: str
    logits: np.ndarray  # [n, gamma] every labelled request-step's confidence logits
    labels: np.ndarray
    known: np.ndarray
    requests: np.ndarray  # [n] which request each row is (slot and generation as one number)
    committed: int
    predicted: float
    drift_at: int | None  # labelled request-steps into the phase when drift was detected (None: not)
    calibration: LiveCalibration  # the live calibration at the phase's end

    @property
    def tau_bias(self) -> float:
        return (self.committed - self.predicted) / self.committed


def serve(runtime: Runtime, prompts: list[str], max_new: int, name: str, work: str) -> Phase:
    """Step `prompts` to completion, recording every step; see the module docstring."""
    online = runtime.speculative.online
    gamma = runtime.plan.gamma
    recorder = RunRecorder(f"{work}/{name}", gamma, runtime.sampling.policy, record_steps=1 << 30)
    runtime.recorder = recorder
    start, drift_at = online.samples, online.drift_at
    for text in prompts:
        runtime.enqueue(runtime.new_request(runtime.package.tokenizer.encode(text), max_new))
    detected = None
    while runtime.has_work:
        runtime.step()
        if detected is None and online.drift_at != drift_at:
            detected = online.drift_at - start
    runtime.recorder = None
    rows = [(r.confidence, r.raw_correct_len, r.verify_len, (r.slot << 32) + r.generation)
            for s in recorder.steps.records for r in s.requests if r.confidence is not None]
    logits = np.array([c for c, _, _, _ in rows], dtype=np.float64)
    labels, known = step_labels([raw for _, raw, _, _ in rows], [v for _, _, v, _ in rows], gamma)
    planned = [s for s in recorder.steps.records if s.tau is not None]
    requests = np.array([q for _, _, _, q in rows], dtype=np.int64)
    return Phase(name, logits, labels, known, requests, sum(s.committed for s in planned),
                 sum(float(s.tau) for s in planned), detected, online.calibration)


def noise_floor(phase: Phase, calibration: LiveCalibration, num_bins: int, seed: int) -> list[float]:
    """Per position, the median ECE labels drawn from the survival itself measure on the phase's rows."""
    s = calibration.survival(phase.logits)
    gen = np.random.default_rng(seed)
    out = []
    for k in range(s.shape[1]):
        p = s[phase.known[:, k], k]
        out.append(float(np.median(binned_eces(p, gen.random((NOISE_DRAWS, p.shape[0])) < p, num_bins))))
    return out


def row(label: str, values: list[float | None] | tuple[float | None, ...], fmt: str = "{:.3f}") -> str:
    cells = " ".join(f"{'-' if v is None else fmt.format(v):>7}" for v in values)
    return f"  {label:<34}{cells}"


def refit(phase: Phase, settings: OnlineCalibrationSettings, survival_map: bool = True) -> LiveCalibration:
    """Temperatures (and the survival map) fitted on all of a phase's labels, as the online refit fits."""
    grid = default_grid(settings.grid_points, settings.t_min, settings.t_max)
    temps = fit_temperatures(phase.logits, phase.labels, grid, settings.num_bins, known=phase.known)
    if not survival_map or not settings.map_bins:
        return LiveCalibration(temps)
    return LiveCalibration(temps, fit_survival_map(cumulative_survival(phase.logits, temps), phase.labels,
                                                   phase.known, settings.map_bins, settings.min_known))


def score(phase: Phase, compiled: LiveCalibration, live: LiveCalibration, settings: OnlineCalibrationSettings,
          served: Phase | None = None) -> dict[str, list[float]]:
    bins = settings.num_bins
    oracle = refit(phase, settings, survival_map=False)
    rows = [("compiled", compiled), ("live", live), ("oracle", oracle)]
    if served is not None:  # what a refit at the served part's end would have swapped in
        rows.append(("refit on all served", refit(served, settings)))
    ece = {name: list(windowed_ece(phase.logits, phase.labels, phase.known, calibration, bins))
           for name, calibration in rows}
    gamma = len(compiled.temperatures)
    print(f"{phase.name}: {phase.logits.shape[0]} labelled request-steps; cumulative ECE by draft position "
          f"(live: {'temperatures and survival map' if live.survival_map else 'temperatures'}; oracle: the "
          "best temperatures for these labels)")
    print(f"  {'':<34}" + " ".join(f"{k + 1:>7}" for k in range(gamma)) + "     mean")
    for name, calibration in rows:
        print(row(f"T {name}", calibration.temperatures, "{:.2f}"))
    floor = noise_floor(phase, live, bins, seed=1)
    for name, _ in rows:
        print(row(f"ECE {name}", ece[name]) + f"  {np.mean(ece[name]):.3f}")
    gap = [a - b for a, b in zip(ece["live"], ece["oracle"], strict=True)]
    print(row("ECE live - oracle", gap, "{:+.3f}"))
    print(row("calibrated labels' ECE (median)", floor) + f"  {np.mean(floor):.3f}")
    print(f"  mean ECE live / compiled: {np.mean(ece['live']) / np.mean(ece['compiled']):.2f}; "
          f"worst live - oracle: {max(gap):+.3f}")
    return ece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("package")
    parser.add_argument("--in-distribution", type=int, default=240, help="phase 1 prompts (default 240)")
    parser.add_argument("--serve", type=int, default=720,
                        help="phase 2 prompts (default 720; the prose has some 650 a part)")
    parser.add_argument("--score", type=int, default=1440,
                        help="phase 3 prompts (default 1440: some 20,000 request-steps, where perfectly "
                             "calibrated labels measure 0.005-0.011; fewer where a source runs out)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out-of-distribution", choices=sorted(SOURCES), default="mixed",
                        help="phases 2 and 3: other packages' code, installed distributions' prose, torch's "
                             "C++ headers, or code and prose in turn (default)")
    parser.add_argument("--save-rows", type=Path, default=None,
                        help="also write every phase's logits, labels, known masks and request ids here "
                             "(.npz)")
    args = parser.parse_args()
    pkg = load_package(args.package)
    if pkg.plan.temperatures is None:
        raise SystemExit(f"{args.package}: the deployment has no calibration to compare with")
    compiled = LiveCalibration(tuple(pkg.plan.temperatures), pkg.plan.survival_map)
    settings = pkg.deployment.online_calibration or OnlineCalibrationSettings()
    runtime = Runtime(pkg, online_calibration=settings)
    source = SOURCES[args.out_of_distribution]
    serve_prompts = source(args.serve, 0)
    score_prompts = [p for p in source(args.score + args.serve, 1) if p not in serve_prompts]
    try:
        with tempfile.TemporaryDirectory() as work:
            phases = [serve(runtime, prompts, args.max_new_tokens, name, work) for name, prompts in (
                ("in distribution", held_out_prompts(args.in_distribution)),
                ("out of distribution, served", serve_prompts),
                ("out of distribution, scored", score_prompts[:args.score]))]
    finally:
        runtime.close()
    ident, served, scored = phases
    if args.save_rows is not None:
        np.savez(args.save_rows, compiled=np.array(compiled.temperatures),
                 **{f"{key}_{field}": getattr(p, field) for key, p in zip(("id", "served", "scored"), phases,
                                                                          strict=True)
                    for field in ("logits", "labels", "known", "requests")})
    print(f"{pkg.deployment.name}, {args.max_new_tokens} new tokens a prompt, out of distribution: "
          f"{args.out_of_distribution}; online calibration {settings}")
    for p in phases:
        drift = "no drift" if p.drift_at is None else f"drift detected {p.drift_at} request-steps in"
        print(f"{p.name}: {p.logits.shape[0]} labelled request-steps, {drift}, tau bias as served "
              f"{p.tau_bias:+.2%}; live T after: {', '.join(f'{t:.2f}' for t in p.calibration.temperatures)}")
    print()
    score(ident, compiled, ident.calibration, settings)
    print()
    score(scored, compiled, served.calibration, settings, served)


if __name__ == "__main__":
    main()
