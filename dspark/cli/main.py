"""`dspark`: run or profile a generated deployment package, and train the embedded model pair."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_run_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompts-file", type=Path,
                     help="file of prompts: a JSON list of strings, or one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per prompt (default: the spec's serving.generation)")
    p.add_argument("--target-only", action="store_true",
                   help="decode with the target alone (the lossless reference)")
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    p.add_argument("--record", type=Path, default=None, metavar="DIR",
                   help="write calibration shards (sts/), the step ring (steps.jsonl) and run.json "
                        "into DIR (default when the spec sets serving.record_steps: runs/<name>-<time>)")
    p.add_argument("--record-steps", type=int, default=None, metavar="N",
                   help="decode steps kept in the ring (default: the spec's serving.record_steps, "
                        "or 100000 with --record)")
    p.add_argument("--record-features", action="store_true",
                   help="with --record, also store the confidence head's inputs in the shards, for "
                        "`dspark fit-confidence`")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the spec's serving.generation; 0 = greedy); "
                        "sampled drafts are verified by rejection sampling, which keeps the target's "
                        "distribution")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the spec's)")
    p.add_argument("--top-k", type=int, default=None, help="top-k, 0 = off (default: the spec's)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--budget-fraction", type=float, default=None, metavar="F",
                   help="experiments: verify this share (0..1) of the candidate drafts every step "
                        "instead of the cost model's budget (cap-accept and compact only)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the deployment name)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def serve_package(package_dir: Path, args: argparse.Namespace) -> int:
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import PackageError, load_package

    try:
        pkg = load_package(package_dir)
        runtime = Runtime(pkg, seed=args.seed)
    except (PackageError, RequestError, ValueError) as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    from dspark.runtime.serve.server import serve

    serve(runtime, args.host, args.port, args.model_name, args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a generated package on prompts")
    run.add_argument("package", type=Path, help="generated package directory, e.g. generated/tiny_cpu_static")
    add_run_args(run)
    prof = sub.add_parser("profile", help="measure verify step times and fit the planner's cost tables")
    prof.add_argument("package", type=Path,
                      help="a compact generated package, e.g. generated/tiny_cpu_compact")
    prof.add_argument("-o", "--out", type=Path, required=True,
                      help="directory for sps_1d.json, additive.json and profile.json")
    prof.add_argument("--batch-sizes", type=_int_list, default=None,
                      help="comma-separated B values (default: powers of two up to max_running_requests)")
    prof.add_argument("--grid-density", type=int, default=8, help="row counts per B in the (B, M) grid")
    prof.add_argument("--repeats", type=int, default=5, help="timed steps per point (the median is kept)")
    prof.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    prof.add_argument("--m-bin", type=int, default=64, help="M bin width of the additive fit")
    prof.add_argument("--context-len", type=int, default=128, help="cached tokens per request")
    prof.add_argument("--no-draft-time", action="store_true",
                      help="leave the draft's step time out of the tables (by default it is measured "
                           "per batch size and the planner adds it to the verify time)")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    from dspark.cli.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)
    from dspark.cli.report import add_report_parser

    add_report_parser(sub)
    from dspark.cli.cost_eval import add_cost_eval_parser

    add_cost_eval_parser(sub)
    from dspark.cli.fit_confidence import add_fit_confidence_parser

    add_fit_confidence_parser(sub)
    serve = sub.add_parser("serve", help="serve a generated package over HTTP (OpenAI /v1/completions)")
    serve.add_argument("package", type=Path, help="generated package directory")
    add_serve_args(serve)
    from dspark.cli.bench import add_bench_parser

    add_bench_parser(sub)
    train = sub.add_parser("train-tiny", help="train the embedded tiny target + draft pair")
    train.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    train.add_argument("--target-steps", type=int, default=None, help="default 1300 (~10 min)")
    train.add_argument("--draft-steps", type=int, default=None, help="default 1200 (~9 min)")
    train.add_argument("--seed", type=int, default=0)
    return parser


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _median_seconds(measure: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        measure()
    return statistics.median(measure() for _ in range(repeats))


def profile_package(args: argparse.Namespace) -> int:
    from dspark.fingerprint import fingerprint_of_deployment
    from dspark.measure.cost_fit import fit_tier_table
    from dspark.measure.profiler import (
        ProfilePlan,
        fit_profile,
        format_fit_report,
        rows_around,
        run_profile,
        write_tables,
    )
    from dspark.measure.step_timer import ProfileError, VerifyStepTimer
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import PackageError, load_package

    try:
        pkg = load_package(args.package)
        runtime = Runtime(pkg)
        timer = VerifyStepTimer(runtime, context_len=args.context_len)
        tiers = runtime.tiers
        plan = ProfilePlan(batch_sizes=timer.batch_sizes(args.batch_sizes),
                           num_draft_tokens=timer.cap, min_verify_len=timer.floor,
                           grid_density=args.grid_density, repeats=args.repeats, warmup=args.warmup,
                           m_bin=args.m_bin, max_rows=tiers[-1] if tiers else None,
                           extra_rows=rows_around(tiers))
    except (PackageError, RequestError, ProfileError, ValueError) as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    dep = pkg.deployment
    meta = {"deployment": dep.name, "backend": dep.backend, "device": dep.device,
            "dtype": dep.model.dtype, "verify_mode": dep.verify_mode, "tiers": ",".join(map(str, tiers)),
            "context_len": str(args.context_len)}
    result = run_profile(timer, plan, progress=not args.no_progress, meta=meta)
    sps, fit = fit_profile(result)
    print(format_fit_report(result, sps, fit), end="")
    additive = fit.table
    if not args.no_draft_time:
        probes = plan.batch_sizes
        draft = tuple(_median_seconds(lambda b=b: timer.draft_seconds(b), args.warmup, args.repeats)
                      for b in probes)
        sps = dataclasses.replace(sps, draft_bs_probes=probes, draft_seconds=draft)
        additive = dataclasses.replace(additive, draft_bs_probes=probes, draft_seconds=draft)
        print("\ndraft step (added to the verify time by the planner)\n" + "  ".join(
            f"B={b}:{s * 1e3:.4f}" for b, s in zip(probes, draft, strict=True)) + "  (ms)")
    tier = None
    if tiers:  # graph replay: a step costs its tier, which the tier table keeps exact
        try:
            tier_fit = fit_tier_table(result, tiers)
        except ValueError as err:  # e.g. batch sizes too small to reach the largest tier
            print(f"\ntier table not written: {err}")
        else:
            tier = tier_fit.table
            print(f"\ntier table: RMS {tier_fit.rms_seconds * 1e3:.4f} ms   R² {tier_fit.r_squared:.5f}"
                  + "".join(f"\n  note: {note}" for note in tier_fit.notes))
            if not args.no_draft_time:
                tier = dataclasses.replace(tier, draft_bs_probes=probes, draft_seconds=draft)
    fingerprint = fingerprint_of_deployment(dep, tiers).to_json()
    for name, path in write_tables(args.out, sps, additive, result, tier, fingerprint).items():
        print(f"wrote {name}: {path}")
    return 0


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    text = args.prompts_file.read_text(encoding="utf-8")
    if args.prompts_file.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise SystemExit(f"{args.prompts_file}: expected a JSON list of strings")
        return data
    return [line for line in text.splitlines() if line.strip()]


def sampling_of(pkg: Any, args: argparse.Namespace) -> Any:
    """The spec's serving.generation policy, with any of it overridden on the command line."""
    from dspark.runtime.sampling import SamplingParams

    s = pkg.deployment.serving
    return SamplingParams(s.temperature if args.temperature is None else args.temperature,
                          s.top_p if args.top_p is None else args.top_p,
                          s.top_k if args.top_k is None else args.top_k)


def open_recorder(runtime: Any, args: argparse.Namespace) -> Any:
    """The run's recorder, or None when neither the spec nor `--record` asks for one."""
    from dspark.measure.recording import RunRecorder

    pkg = runtime.package
    spec_steps = pkg.deployment.serving.record_steps
    if args.record is None and not spec_steps:
        if args.record_features:
            raise ValueError("--record-features needs --record DIR (or serving.record_steps in the spec)")
        return None
    directory = args.record or Path("runs") / f"{pkg.deployment.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    steps = args.record_steps or spec_steps or 100_000
    backbone = None
    if args.record_features:
        from dspark.measure.confidence_fit import backbone_digest, checkpoint_state
        from dspark.runtime.models.checkpoint import resolve_checkpoint

        if not pkg.deployment.draft.confidence_head:
            raise ValueError("--record-features: this draft has no confidence head")
        draft_dir = resolve_checkpoint(pkg.deployment.draft.checkpoint, "draft", pkg.directory)
        backbone = backbone_digest(checkpoint_state(draft_dir))
    return RunRecorder(directory, pkg.plan.gamma, runtime.sampling.policy, steps,
                       features_backbone=backbone)


def run_info(runtime: Any, target_only: bool, stats: Any) -> dict[str, Any]:
    from dspark.fingerprint import fingerprint_of_deployment

    dep = runtime.deployment
    # The labels describe the policy the run decoded with, whatever the spec's defaults say.
    policy = runtime.sampling.policy
    fingerprint = dataclasses.replace(fingerprint_of_deployment(dep, runtime.tiers), policy=policy)
    return {"deployment": dep.name, "verify_mode": dep.verify_mode, "backend": dep.backend,
            "device": dep.device, "gamma": runtime.plan.gamma, "lag_steps": runtime.plan.lag_steps,
            "policy": policy, "tiers": list(runtime.tiers), "target_only": target_only,
            "fingerprint": fingerprint.to_json(),
            "stats": stats.to_json() if stats is not None else None}


def _flush_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a stopped recording still flushes its last shard and writes
    meta.json and run.json (the `finally` around the run)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def run_package(package_dir: Path, args: argparse.Namespace) -> int:
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import PackageError, load_package

    try:
        pkg = load_package(package_dir)
        runtime = Runtime(pkg, forced_budget_fraction=args.budget_fraction,
                          sampling=sampling_of(pkg, args), seed=args.seed)
        recorder = runtime.recorder = open_recorder(runtime, args)
        if recorder is not None:
            _flush_on_sigterm()
        prompts = read_prompts(args)
        max_new = args.max_new_tokens or pkg.deployment.serving.max_new_tokens
        stats = None
        try:
            outputs, stats = runtime.generate([pkg.tokenizer.encode(p) for p in prompts], max_new,
                                              target_only=args.target_only)
        finally:
            if recorder is not None:  # flush what was recorded even when the run failed
                recorder.close(run_info(runtime, args.target_only, stats))
    except (PackageError, RequestError, ValueError) as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    texts = [pkg.tokenizer.decode(o) for o in outputs]
    summary = stats.to_json()
    if args.json:
        json.dump({"deployment": pkg.deployment.name, "target_only": args.target_only,
                   "completions": [{"prompt": p, "token_ids": o, "text": t}
                                   for p, o, t in zip(prompts, outputs, texts, strict=True)],
                   "stats": summary}, sys.stdout, indent=2)
        print()
        return 0
    for p, t in zip(prompts, texts, strict=True):
        shown = f"\033[1m{t}\033[0m" if sys.stdout.isatty() else t  # completion in bold
        print(f"--- prompt: {p!r}\n{p}{shown}")
    mode = "target-only" if args.target_only else pkg.deployment.verify_mode
    print(f"\n[{pkg.deployment.name} · {mode}] {summary['generated_tokens']} tokens in "
          f"{summary['wall_seconds']:.2f} s = {summary['tokens_per_second']:.1f} tokens/s · "
          f"{summary['steps']} steps · mean commit_len {summary['mean_commit_len']:.2f} per request-step")
    if summary["mean_predicted_tau_per_step"] is not None and not args.target_only:
        per = max(stats.request_steps, 1)
        print(f"verify rows per request-step: {summary['verify_rows'] / per:.2f} run, "
              f"{summary['planned_rows'] / per:.2f} planned, "
              f"{summary['padding_rows'] / per:.2f} tier padding · per step: "
              f"predicted tau {summary['mean_predicted_tau_per_step']:.2f}, committed "
              f"{summary['mean_committed_per_planned_step']:.2f}")
    if not args.target_only:
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in summary["acceptance_by_position"])
        print(f"acceptance by draft position: {acc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return run_package(args.package, args)
    if args.command == "profile":
        return profile_package(args)
    if args.command == "cost-eval":
        from dspark.cli.cost_eval import run_cost_eval

        return run_cost_eval(args)
    if args.command == "report":
        from dspark.cli.report import run_report

        return run_report(args)
    if args.command == "serve":
        return serve_package(args.package, args)
    if args.command == "bench":
        from dspark.cli.bench import run_bench

        return run_bench(args)
    if args.command == "fit-confidence":
        from dspark.cli.fit_confidence import run_fit_confidence

        return run_fit_confidence(args)
    if args.command == "calibrate":
        from dspark.cli.calibrate import run_calibrate

        return run_calibrate(args)
    from dspark.train.tiny import TrainSettings, train_tiny

    budgets = {k: v for k, v in (("target_steps", args.target_steps),
                                 ("draft_steps", args.draft_steps)) if v is not None}
    report = train_tiny(args.out, TrainSettings(seed=args.seed, **budgets))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
