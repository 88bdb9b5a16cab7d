"""Train the embedded tiny model pair (`embedded:tiny`) on the Python standard library's source.

The corpus is present on every machine that runs Python, so the pair can be retrained anywhere
without a network. The target is a byte-level Llama; the draft is distilled from it (KL to the
target's next-token distribution at every block position) and its confidence head is trained
with BCE against the soft target `1 - TV(q, p)`, weighted by position.
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
from dspark.runtime.models.checkpoint import save_draft, save_target
from dspark.runtime.models.dspark_draft import DraftConfig, DSparkDraft
from dspark.runtime.models.llama import LlamaConfig, LlamaForCausalLM
from dspark.runtime.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE


@dataclass(frozen=True)
class TrainSettings:
    # Step budgets (not wall-clock) keep a retrain reproducible on a busy machine; on two idle
    # cores they take about 10 and 9 minutes.
    target_steps: int = 1300
    draft_steps: int = 1200
    seq_len: int = 512
    batch_size: int = 8
    # The target first trains on 256-byte windows (twice as many per step: faster to a low loss
    # on 2 cores), then on full `seq_len` windows so that it works at serving positions.
    target_short_seq_len: int = 256
    target_short_frac: float = 0.75
    target_lr: float = 3e-3
    draft_lr: float = 2e-3
    gamma: int = 7
    anchors_per_seq: int = 64
    # On-policy distillation: half of each draft batch are the target's own greedy
    # continuations of data prompts — the text the draft will see when decoding.
    on_policy_sequences: int = 512
    on_policy_prompt_len: int = 256
    position_decay: float = 0.85
    confidence_weight: float = 0.5
    eval_windows: int = 64
    seed: int = 0
    # bfloat16 autocast for the matmuls (about 3x faster on CPUs with AVX512-BF16); weights,
    # optimizer state and losses stay float32, and serving runs the weights in float32.
    bf16_autocast: bool = True


TARGET_CONFIG = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=704,
                            num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                            max_position_embeddings=1024)


def draft_config(gamma: int) -> DraftConfig:
    return DraftConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=704, num_layers=1,
                       num_heads=8, num_kv_heads=2, head_dim=32, target_hidden_size=256,
                       gamma=gamma, markov_embedding_size=64, confidence_head=True,
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
def lr_at(frac: float, peak: float, warmup_frac: float = 0.03) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if frac < warmup_frac:
        return peak * frac / warmup_frac
    t = min((frac - warmup_frac) / (1 - warmup_frac), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


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


# -- draft ---------------------------------------------------------------------------------
def draft_targets(target: LlamaForCausalLM, tokens: torch.Tensor, anchors: torch.Tensor, gamma: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Target hidden `[b, L, d]` and target log-probs `[b, A, gamma, V]` at each draft position."""
    with torch.no_grad():
        hidden = target.forward_dense(tokens)
        logp = F.log_softmax(target.dense_logits(hidden), dim=-1)
        idx = anchors[..., None] + torch.arange(gamma)  # row T+k-1 predicts token T+k
        b, a, g = idx.shape
        picked = logp.gather(1, idx.reshape(b, -1, 1).expand(-1, -1, logp.shape[-1]))
    return hidden, picked.view(b, a, g, -1)


def draft_losses(draft: DSparkDraft, hidden: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor, target_logp: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL distillation loss, confidence BCE loss, greedy match mask `[b, A, gamma]`)."""
    logits, conf = draft.forward_train(hidden, tokens, anchors)
    logq = F.log_softmax(logits, dim=-1)
    p = target_logp.exp()
    kl = (p * (target_logp - logq)).sum(-1)
    overlap = 1 - 0.5 * (logq.detach().exp() - p).abs().sum(-1)  # 1 - TV(q, p)
    bce = F.binary_cross_entropy_with_logits(conf, overlap.clamp(0, 1), reduction="none")
    w = weights / weights.sum()
    match = logits.argmax(-1) == target_logp.argmax(-1)
    return (kl * w).sum(-1).mean(), (bce * w).sum(-1).mean(), match


def on_policy_sequences(target: LlamaForCausalLM, stream: torch.Tensor, s: TrainSettings,
                        gen: torch.Generator, log: Callable[[str], None]) -> torch.Tensor:
    """`[n, seq_len]` data prompts followed by the target's greedy (float32) continuations."""
    start = time.monotonic()
    prompts = next(batches(stream, s.on_policy_prompt_len - 1, s.on_policy_sequences, gen))
    out = torch.cat([target.greedy_continue(chunk, s.seq_len - s.on_policy_prompt_len)
                     for chunk in prompts.split(128)])
    log(f"[draft] {len(out)} on-policy sequences in {(time.monotonic() - start) / 60:.1f} min")
    return out


def train_draft(s: TrainSettings, target: LlamaForCausalLM, stream: torch.Tensor,
                log: Callable[[str], None]) -> tuple[DSparkDraft, float]:
    torch.manual_seed(s.seed + 1)
    cfg = draft_config(s.gamma)
    draft = DSparkDraft(cfg)
    with torch.no_grad():  # start from the target's token spaces: much faster to converge
        draft.embed_tokens.weight[: cfg.vocab_size].copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.norm.weight.copy_(target.model.norm.weight)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=s.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(s.seed + 1)
    data = batches(stream, s.seq_len, s.batch_size - s.batch_size // 2, gen)
    policy = on_policy_sequences(target, stream, s, gen, log)
    weights = s.position_decay ** torch.arange(s.gamma, dtype=torch.float32)
    draft.train()

    def loss_fn() -> torch.Tensor:
        picked = torch.randint(0, len(policy), (s.batch_size // 2,), generator=gen)
        tokens = torch.cat((next(data)[:, :-1], policy[picked]))
        anchors = torch.randint(1, s.seq_len - s.gamma, (s.batch_size, s.anchors_per_seq), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast):
            hidden, target_logp = draft_targets(target, tokens, anchors, s.gamma)
            kl, bce, _ = draft_losses(draft, hidden.float(), tokens, anchors, target_logp.float(),
                                      weights)
        return kl + s.confidence_weight * bce

    minutes = train_loop(s.draft_steps, opt, s.draft_lr, loss_fn, log, "draft")
    draft.eval()
    return draft, minutes


@torch.no_grad()
def teacher_forced_acceptance(draft: DSparkDraft, target: LlamaForCausalLM, windows: torch.Tensor,
                              gamma: int) -> list[float]:
    """P(greedy prefix reaches draft k) on held-out text with the true context (a proxy only;
    `dspark run` measures acceptance on real decoding)."""
    gen = torch.Generator().manual_seed(1234)
    reach = torch.zeros(gamma)
    total = 0
    weights = torch.ones(gamma)
    for chunk in windows.split(8):
        tokens = chunk[:, :-1]
        anchors = torch.randint(1, tokens.shape[1] - gamma, (tokens.shape[0], 32), generator=gen)
        hidden, logp = draft_targets(target, tokens, anchors, gamma)
        _, _, match = draft_losses(draft, hidden, tokens, anchors, logp, weights)
        reach += match.long().cumprod(-1).flatten(0, 1).float().sum(0)
        total += match.shape[0] * match.shape[1]
    return (reach / total).tolist()


def train_tiny(out_dir: Path, s: TrainSettings, log: Callable[[str], None] = print) -> dict:
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
        f"in {target_minutes:.1f} min, "
        f"held-out {bpb:.3f} bits/byte")
    draft, draft_minutes = train_draft(s, target, stream, log)
    reach = teacher_forced_acceptance(draft, target, windows, s.gamma)
    log(f"draft: {sum(p.numel() for p in draft.parameters())} params, {s.draft_steps} steps "
        f"in {draft_minutes:.1f} min, "
        f"teacher-forced mean accepted {sum(reach):.2f} of {s.gamma}")

    report = {
        "corpus": "Python standard library *.py (held out: crc32(relpath) % 20 == 0)",
        "settings": s.__dict__,
        "target_params": sum(p.numel() for p in target.parameters()),
        "target_minutes": round(target_minutes, 2),
        "held_out_bits_per_byte": round(bpb, 4),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "draft_minutes": round(draft_minutes, 2),
        "teacher_forced_reach_by_position": [round(r, 4) for r in reach],
    }
    save_target(out_dir / "target", target)
    save_draft(out_dir / "draft", draft)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report
