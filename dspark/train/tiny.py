"""Train the embedded tiny model pair (`embedded:tiny`) on the Python standard library's source.

The corpus is present on every machine that runs Python, so the pair can be retrained anywhere
without a network. The target is a byte-level Llama; the draft, in the published DSpark
architecture, is distilled from it by `dspark.train.draft` (what `dspark train-draft` runs) on the
target's own continuations of prompts from its training files.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.corpus import corpus_files
from dspark.runtime.models.checkpoint import save_target
from dspark.runtime.models.llama import LlamaConfig, LlamaForCausalLM
from dspark.runtime.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer
from dspark.train.draft import DraftTrainSettings, lr_at, train_draft
from dspark.train.prompts import train_prompts

# The embedded draft (`dspark/checkpoints/tiny/draft`): one layer reading five of the target's eight
# layers (never its last), a small share of the target's step as a released draft is (5 layers for
# Qwen3-8B's 36); the mask token is BOS (inside the vocabulary, whose embeddings the draft copies; a
# prompt holds BOS only at its start), an rnn Markov head, lm_head trained too.
TINY_DRAFT = DraftTrainSettings(steps=2000, num_layers=1, markov_rank=64, markov_head_type="rnn",
                                train_lm_head=True)


@dataclass(frozen=True)
class TrainSettings:
    # Step budgets (not wall-clock) keep a retrain reproducible on a busy machine; on two idle
    # cores they take about 17 and 10 minutes.
    target_steps: int = 1300
    seq_len: int = 512
    batch_size: int = 8
    # The target first trains on 256-byte windows (twice as many per step: faster to a low loss
    # on 2 cores), then on full `seq_len` windows so that it works at serving positions.
    target_short_seq_len: int = 256
    target_short_frac: float = 0.75
    target_lr: float = 3e-3
    eval_windows: int = 64
    seed: int = 0
    # bfloat16 autocast for the matmuls (about 3x faster on CPUs with AVX512-BF16); weights,
    # optimizer state and losses stay float32, and serving runs the weights in float32.
    bf16_autocast: bool = True
    draft_prompts: int = 768  # training-split prompts the target continues for the draft
    draft: DraftTrainSettings = TINY_DRAFT


TARGET_CONFIG = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=704,
                            num_layers=8, num_heads=8, num_kv_heads=2, head_dim=32,
                            max_position_embeddings=1024)


# -- corpus --------------------------------------------------------------------------------
def byte_stream(files: list[Path]) -> torch.Tensor:
    """All files as one token stream: BOS, the file's bytes, EOS."""
    parts = []
    for p in files:
        data = p.read_bytes()
        if not data:
            continue
        parts.append(torch.tensor([BOS_ID], dtype=torch.int16))
        parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        parts.append(torch.tensor([EOS_ID], dtype=torch.int16))
    return torch.cat(parts)


def batches(stream: torch.Tensor, seq_len: int, batch_size: int,
            gen: torch.Generator) -> Iterator[torch.Tensor]:
    while True:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
        yield torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    step = max((len(stream) - seq_len - 1) // count, 1)
    return torch.stack([stream[i * step:i * step + seq_len + 1] for i in range(count)]).long()


# -- schedule ------------------------------------------------------------------------------
def train_loop(total_steps: int, opt: torch.optim.Optimizer, peak_lr: float,
               loss_fn: Callable[[], torch.Tensor], log: Callable[[str], None], name: str) -> float:
    """`total_steps` optimizer steps on `loss_fn()` (scheduled LR, clipped grads); returns minutes."""
    params = [p for group in opt.param_groups for p in group["params"]]
    start = time.monotonic()
    ema = None
    for i in range(total_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i / total_steps, peak_lr)
        loss_t = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss = loss_t.item()
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if (i + 1) % 25 == 0:
            log(f"[{name}] step {i + 1:5d}/{total_steps}  {(time.monotonic() - start) / 60:5.2f} min"
                f"  loss {ema:.4f}")
    return (time.monotonic() - start) / 60


# -- target --------------------------------------------------------------------------------
@torch.no_grad()
def bits_per_byte(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross entropy in bits over byte targets (BOS/EOS targets excluded)."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(8):
        logits = model.dense_logits(model.forward_dense(chunk[:, :-1]))
        target = chunk[:, 1:]
        nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        keep = target.flatten() < 256
        total += nll[keep].sum().item()
        count += int(keep.sum())
    return total / count / math.log(2)


def train_target(s: TrainSettings, stream: torch.Tensor, log: Callable[[str], None]
                 ) -> tuple[LlamaForCausalLM, float]:
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(TARGET_CONFIG)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data.mul_(1 / math.sqrt(2 * TARGET_CONFIG.num_layers))
    opt = torch.optim.AdamW(model.parameters(), lr=s.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(s.seed)
    short_batch = s.batch_size * s.seq_len // s.target_short_seq_len  # same tokens per step
    short = batches(stream, s.target_short_seq_len, short_batch, gen)
    full = batches(stream, s.seq_len, s.batch_size, gen)
    short_steps = int(s.target_steps * s.target_short_frac)
    step = 0
    model.train()

    def loss_fn() -> torch.Tensor:
        nonlocal step
        batch = next(short if step < short_steps else full)
        step += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast):
            logits = model.dense_logits(model.forward_dense(batch[:, :-1]))
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    minutes = train_loop(s.target_steps, opt, s.target_lr, loss_fn, log, "target")
    model.eval()
    return model, minutes


def train_tiny(out_dir: Path, s: TrainSettings, log: Callable[[str], None] = print) -> dict:
    """Train the target, then its draft with `dspark train-draft`'s training on prompts from the
    target's training files; writes `target/`, `draft/` (with the draft's own `training.json`),
    `train_prompts.json` and `training.json` under `out_dir`."""
    torch.set_num_threads(os.cpu_count() or 1)
    train_files, held_files = corpus_files()
    stream = byte_stream(train_files)
    held = byte_stream(held_files)
    windows = eval_windows(held, s.seq_len, s.eval_windows)
    log(f"corpus: {len(train_files)} train files ({len(stream)} bytes), "
        f"{len(held_files)} held-out files ({len(held)} bytes)")

    target, target_minutes = train_target(s, stream, log)
    bpb = bits_per_byte(target, windows)
    log(f"target: {sum(p.numel() for p in target.parameters())} params, {s.target_steps} steps "
        f"in {target_minutes:.1f} min, held-out {bpb:.3f} bits/byte")
    save_target(out_dir / "target", target)

    prompts = train_prompts(s.draft_prompts, seed=s.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    tok = ByteTokenizer()
    draft_report = train_draft(
        target, [tok.encode(p) for p in prompts], out_dir / "draft", s.draft, frozenset({EOS_ID}), BOS_ID,
        torch.device("cpu"), log,
        provenance={"command": tiny_draft_command(out_dir, s.draft)})
    report = {
        "corpus": "Python standard library *.py (held out: crc32(relpath) % 20 == 0)",
        "settings": {k: v for k, v in s.__dict__.items() if k != "draft"},
        "target_params": sum(p.numel() for p in target.parameters()),
        "target_minutes": round(target_minutes, 2),
        "held_out_bits_per_byte": round(bpb, 4),
        "draft": draft_report,
    }
    (out_dir / "training.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def tiny_draft_command(out_dir: Path, d: DraftTrainSettings) -> str:
    """The `dspark train-draft` command that trains the same draft against the saved target."""
    return (f"dspark train-draft --target {out_dir / 'target'} --prompts {out_dir / 'train_prompts.json'} "
            f"-o {out_dir / 'draft'} --steps {d.steps} --layers {d.num_layers} "
            f"--markov-rank {d.markov_rank} --markov-head-type {d.markov_head_type}"
            + (" --train-lm-head" if d.train_lm_head else "") + f" --seed {d.seed}")
