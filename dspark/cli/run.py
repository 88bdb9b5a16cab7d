"""`dspark run`: generate completions for prompts with a generated package and print them with stats."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from dspark.cli.common import (
    CliError,
    add_online_cost_args,
    load_package_or_fail,
    online_cost_of,
    read_prompts_file,
    require_positive,
    warn_if_dummy_weights,
)

DEFAULT_RECORD_STEPS = 100_000


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `run` to a `dspark` subparsers object; the parsed args carry their handler."""
    p = subparsers.add_parser(
        "run", help="generate completions for prompts with a generated package",
        description="Generate completions for one or more prompts with a compiled deployment and print "
                    "them, with tokens/s, tokens committed per decode step and acceptance by draft "
                    "position.")
    p.add_argument("package", type=Path, help="generated package directory, e.g. generated/tiny_cpu_static")
    add_run_args(p)
    p.set_defaults(handler=lambda args: run_package(args.package, args))
    return p


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of `run`, shared by `dspark run` and `python -m generated.<name> run`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompts-file", type=Path,
                     help="file of prompts: a JSON list of strings (.json), or one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate per prompt (default: the deployment's serving.max_new_tokens)")
    p.add_argument("--target-only", action="store_true",
                   help="decode with the target model alone, without speculation (the reference output)")
    p.add_argument("--compare-target-only", action="store_true",
                   help="then decode the same prompts target-only and print both speeds (and, greedy, "
                        "whether the outputs are identical, as they must be)")
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    p.add_argument("--record", type=Path, default=None, metavar="DIR",
                   help="write calibration shards (sts/), the step ring (steps.jsonl) and run.json "
                        "into DIR (default when the spec sets serving.record_steps: runs/<name>-<time>)")
    p.add_argument("--record-steps", type=int, default=None, metavar="N",
                   help="decode steps kept in the ring (default: the spec's serving.record_steps, "
                        f"or {DEFAULT_RECORD_STEPS} with --record)")
    p.add_argument("--record-features", action="store_true",
                   help="with --record, also store the confidence head's inputs in the shards, for "
                        "`dspark fit-confidence`")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 = greedy (default: the spec's serving.generation); "
                        "sampled drafts are verified by rejection sampling, which keeps the target's "
                        "distribution")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (default: the spec's serving.generation)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the k most likely tokens, 0 = all (default: the spec's "
                        "serving.generation)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--budget-fraction", type=float, default=None, metavar="F",
                   help="for experiments: verify this share (0 to 1) of the candidate drafts every step "
                        "instead of the cost model's budget (cap-accept and compact builds only)")
    p.add_argument("--online-calibration", action="store_true",
                   help="refit the planner's STS temperatures from the run's own verified drafts, off the "
                        "step path, and swap them in between steps (cap-accept and compact builds with a "
                        "confidence head; the spec's online_calibration settings, else their defaults; "
                        "a spec that turns it on needs no flag)")
    add_online_cost_args(p)



def check_run_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range options before any model is loaded."""
    require_positive("--max-new-tokens", args.max_new_tokens)
    require_positive("--record-steps", args.record_steps)
    if args.compare_target_only and args.target_only:
        raise CliError("--compare-target-only compares a speculative run with a target-only one; "
                       "leave out --target-only")
    if args.budget_fraction is not None and not 0 <= args.budget_fraction <= 1:
        raise CliError(f"--budget-fraction must be between 0 and 1, got {args.budget_fraction}")
    if args.temperature is not None and not args.temperature >= 0:
        raise CliError(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise CliError(f"--top-k must be 0 (off) or more, got {args.top_k}")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of `--prompt`, or of `--prompts-file` (a JSON list of strings, or one per line)."""
    return list(args.prompt) if args.prompt else read_prompts_file(args.prompts_file)


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
            raise CliError("--record-features needs --record DIR (or serving.record_steps in the spec)")
        return None
    directory = args.record or Path("runs") / f"{pkg.deployment.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    steps = args.record_steps or spec_steps or DEFAULT_RECORD_STEPS
    backbone = None
    if args.record_features:
        from dspark.measure.head_fit import backbone_digest, checkpoint_state
        from dspark.runtime.models.checkpoint import resolve_checkpoint

        if not pkg.deployment.draft.confidence_head:
            raise CliError("--record-features: this deployment's draft has no confidence head")
        draft_dir = resolve_checkpoint(pkg.deployment.draft.checkpoint, "draft", pkg.directory)
        try:
            backbone = backbone_digest(checkpoint_state(draft_dir))
        except ValueError as err:  # a draft directory without its weights
            raise CliError(f"--record-features: {err}") from None
    try:
        return RunRecorder(directory, pkg.plan.gamma, runtime.sampling.policy, steps,
                           features_backbone=backbone)
    except OSError as err:
        raise CliError(f"cannot write the recording into {directory}: {err.strerror or err}") from None


def run_info(runtime: Any, target_only: bool, stats: Any) -> dict[str, Any]:
    """What run.json says about the run: the deployment, the policy it decoded with, its stats."""
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


def flush_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a stopped recording still flushes its last shard and writes
    meta.json and run.json (the `finally` around the run)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def run_package(package_dir: Path, args: argparse.Namespace) -> int:
    """Generate, print, and record when asked. Raises `CliError` for anything the user can fix."""
    from dspark.runtime.distributed.launch import LaunchError
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.planner.online_calibration import OnlineCalibrationSettings

    check_run_args(args)
    prompts = read_prompts(args)
    pkg = load_package_or_fail(package_dir)
    if args.budget_fraction is not None and not pkg.deployment.verify_mode.plans:
        raise CliError(f"--budget-fraction needs a cap-accept or compact build; {package_dir} verifies "
                       "every draft (static mode has no planner)")
    # every engine of the launch (one per DP rank under DP attention) runs with these
    options = {"forced_budget_fraction": args.budget_fraction, "sampling": sampling_of(pkg, args),
               "seed": args.seed,
               "online_calibration": (pkg.deployment.online_calibration or OnlineCalibrationSettings())
               if args.online_calibration else pkg.deployment.online_calibration,
               "online_cost": online_cost_of(pkg, args.online_cost)}
    try:
        if follows(pkg, **options):  # another rank of a torchrun launch ran rank 0's steps
            return 0
    except LaunchError as err:
        raise CliError(str(err)) from None
    warn_if_dummy_weights(pkg)
    max_new = args.max_new_tokens or pkg.deployment.serving.max_new_tokens
    try:
        runtime = Runtime(pkg, **options)
    except (RequestError, LaunchError, ValueError) as err:  # ValueError: a checkpoint that does not load
        raise CliError(str(err)) from None
    try:
        return _run(runtime, pkg, prompts, max_new, args)
    finally:
        runtime.close()


def _run(runtime: Any, pkg: Any, prompts: list[str], max_new: int, args: argparse.Namespace) -> int:
    try:
        requests = [pkg.tokenizer.encode(p) for p in prompts]
    except ValueError as err:  # a prompt the tokenizer cannot encode
        raise CliError(str(err)) from None
    if args.compare_target_only:  # both timed runs start warm (first calls allocate and build tables)
        for target_only in (False, True):
            _generate(runtime, requests[:1], min(4, max_new), target_only)
    recorder = runtime.recorder = open_recorder(runtime, args)
    if recorder is not None:
        flush_on_sigterm()
    stats = None
    try:
        outputs, stats = _generate(runtime, requests, max_new, args.target_only)
    finally:
        if recorder is not None:  # flush what was recorded even when the run failed
            recorder.close(run_info(runtime, args.target_only, stats))
    reference = None
    if args.compare_target_only:
        runtime.recorder = None  # the recording (if any) is of the speculative run alone
        reference = Reference(*_generate(runtime, requests, max_new, True), greedy=runtime.sampling.greedy)
    print_run(pkg, prompts, outputs, stats, args, reference)
    return 0


def _generate(runtime: Any, requests: list[list[int]], max_new: int, target_only: bool) -> Any:
    from dspark.runtime.engine.requests import RequestError

    try:
        return runtime.generate(requests, max_new, target_only=target_only)
    except RequestError as err:  # a prompt over the context length or the KV pool
        raise CliError(str(err).replace("max_new_tokens", "--max-new-tokens")) from None


@dataclasses.dataclass(frozen=True)
class Reference:
    """The target-only run of the same prompts (`--compare-target-only`)."""

    outputs: list[list[int]]
    stats: Any
    greedy: bool  # greedy outputs must be identical; sampled ones are draws of the same distribution

    def to_json(self, stats: Any, outputs: list[list[int]]) -> dict[str, Any]:
        """Beside the speculative run's `stats` and `outputs`: this run's stats and the two ratios."""
        def rate(s: Any, seconds: float) -> float:
            return s.generated_tokens / max(seconds, 1e-9)

        return {"stats": self.stats.to_json(), "identical": outputs == self.outputs if self.greedy else None,
                "speedup": round(rate(stats, stats.wall_seconds)
                                 / rate(self.stats, self.stats.wall_seconds), 3),
                "decode_speedup": round(rate(stats, stats.decode_seconds)
                                        / rate(self.stats, self.stats.decode_seconds), 3)}


def print_run(pkg: Any, prompts: list[str], outputs: list[list[int]], stats: Any,
              args: argparse.Namespace, reference: Reference | None = None) -> None:
    texts = [pkg.tokenizer.decode(o) for o in outputs]
    summary = stats.to_json()
    if args.json:
        out = {"deployment": pkg.deployment.name, "target_only": args.target_only,
               "completions": [{"prompt": p, "token_ids": o, "text": t}
                               for p, o, t in zip(prompts, outputs, texts, strict=True)],
               "stats": summary}
        if reference is not None:
            out["target_only_reference"] = reference.to_json(stats, outputs)
        json.dump(out, sys.stdout, indent=2)
        print()
        return
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
    if reference is not None:
        ref = reference.to_json(stats, outputs)
        same = {True: "identical", False: "DIFFERENT (a defect: greedy output must equal target-only)",
                None: "sampled, so not compared token for token"}[ref["identical"]]
        print(f"[{pkg.deployment.name} · target-only] {ref['stats']['generated_tokens']} tokens in "
              f"{ref['stats']['wall_seconds']:.2f} s = {ref['stats']['tokens_per_second']:.1f} tokens/s · "
              f"outputs {same}")
        print(f"speculative / target-only: {ref['speedup']:.2f}x tokens/s, {ref['decode_speedup']:.2f}x "
              f"decode tokens/s (prefill left out)")
