"""`dspark train-draft`: distil a DSpark draft (the published architecture) for a target checkpoint."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from dspark.cli.common import CliError, read_prompts_file, require_positive


def add_train_draft_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft", help="distil a DSpark draft for a target checkpoint",
        description="Train a draft in the published DSpark architecture (block drafting, Markov and "
                    "confidence heads; the released checkpoints' layout) for TARGET: the target "
                    "continues every prompt itself (greedily, a share by sampling), and the draft "
                    "learns those continuations with the published loss. Resumable: run the same "
                    "command again after an interruption. Uses the GPU when one is visible.")
    p.add_argument("--target", required=True,
                   help="target checkpoint: a directory with config.json, *.safetensors and a tokenizer, "
                        "or embedded:tiny")
    p.add_argument("--prompts", type=Path, required=True,
                   help="prompts to continue: a .json list of strings, or one prompt per line")
    p.add_argument("-o", "--out", type=Path, required=True, help="directory for the draft checkpoint")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1500)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--anchors", type=int, default=None, help="blocks per sequence per step (default 64)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    p.add_argument("--continuation-tokens", type=int, default=None,
                   help="tokens the target generates after each prompt (default 320)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompts are cut to this many tokens (default 256)")
    p.add_argument("--sampled-fraction", type=float, default=None,
                   help="share of prompts continued by sampling instead of greedily (default 0.25)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--layers", type=int, default=None, help="draft decoder layers (default 2)")
    p.add_argument("--block-size", type=int, default=None, help="draft slots per block = gamma (default 7)")
    p.add_argument("--target-layer-ids", default=None,
                   help="comma-separated target layers the draft reads (default: up to five spread over "
                        "the target; never its final layer)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the block's mask token, inside the target's vocabulary (default: the BOS id)")
    p.add_argument("--markov-rank", type=int, default=None, help="Markov head rank, 0 for none (default 64)")
    p.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default=None,
                   help="Markov head kind (default vanilla)")
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the draft's lm_head too (DeepSpec keeps it at the target's copy)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU when one is visible, else the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_train_draft)
    return p


def settings_from_args(args: argparse.Namespace) -> Any:
    from dspark.train.draft import DraftTrainSettings

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--anchors", args.anchors), ("--continuation-tokens", args.continuation_tokens),
                        ("--max-prompt-tokens", args.max_prompt_tokens), ("--layers", args.layers),
                        ("--block-size", args.block_size)):
        require_positive(flag, value)
    if args.sampled_fraction is not None and not 0 <= args.sampled_fraction <= 1:
        raise CliError(f"--sampled-fraction must be within 0..1, got {args.sampled_fraction}")
    if args.temperature is not None and args.temperature <= 0:
        raise CliError(f"--temperature must be positive, got {args.temperature}")
    if args.markov_rank is not None and args.markov_rank < 0:
        raise CliError(f"--markov-rank must be 0 or more, got {args.markov_rank}")
    layer_ids = None
    if args.target_layer_ids is not None:
        try:
            layer_ids = tuple(int(x) for x in args.target_layer_ids.split(","))
        except ValueError:
            raise CliError(f"--target-layer-ids: expected comma-separated integers, got "
                           f"{args.target_layer_ids!r}") from None
    given = {"steps": args.steps, "batch_size": args.batch_size, "anchors_per_seq": args.anchors,
             "lr": args.lr, "continuation_tokens": args.continuation_tokens,
             "max_prompt_tokens": args.max_prompt_tokens, "sampled_fraction": args.sampled_fraction,
             "sample_temperature": args.temperature, "num_layers": args.layers, "block_size": args.block_size,
             "target_layer_ids": layer_ids, "mask_token_id": args.mask_token_id,
             "markov_rank": args.markov_rank, "markov_head_type": args.markov_head_type}
    return DraftTrainSettings(seed=args.seed, train_lm_head=args.train_lm_head,
                              **{k: v for k, v in given.items() if v is not None})


def command_line(args: argparse.Namespace) -> str:
    """The command, with every option that was given (recorded in training.json)."""
    words = ["dspark", "train-draft", "--target", args.target, "--prompts", str(args.prompts),
             "-o", str(args.out)]
    for name, value in sorted(vars(args).items()):
        if name in ("target", "prompts", "out", "handler", "command") or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def run_train_draft(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"-o {args.out} is a file; pass a directory for the draft checkpoint")
    prompt_texts = read_prompts_file(args.prompts)
    settings = settings_from_args(args)
    import torch

    from dspark.runtime.models.checkpoint import CheckpointError, load_target, resolve_checkpoint
    from dspark.runtime.package import PackageError, load_tokenizer
    from dspark.train.draft import DraftTrainingError, train_draft

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no GPU is visible; use --device cpu")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        path = resolve_checkpoint(args.target, "target")
        target = load_target(args.target)
        tokenizer = load_tokenizer(path)
    except (CheckpointError, PackageError, ValueError) as err:
        raise CliError(f"--target {args.target}: {err}") from None
    mask = settings.mask_token_id if settings.mask_token_id is not None else tokenizer.bos_id
    if mask is None:
        raise CliError("--mask-token-id: the target's tokenizer has no BOS token to use as the mask token; "
                       "pass a token id inside its vocabulary that prompts never contain")
    prompts = [tokenizer.encode(text) for text in prompt_texts]
    command = command_line(args)
    try:
        report = train_draft(target, prompts, args.out, settings, tokenizer.eos_ids, mask, device,
                             log=lambda line: print(line, file=sys.stderr),
                             provenance={"target": args.target, "prompts": str(args.prompts),
                                         "command": command})
    except DraftTrainingError as err:
        raise CliError(str(err)) from None
    assert report is not None
    print(json.dumps(report, indent=2))
    return 0
