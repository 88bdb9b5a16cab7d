"""`dspark train-draft`: distil a draft in the published DSpark architecture for any supported target.

The data is on-policy: each prompt is continued by the target itself, greedily or by sampling (a
`sampled_fraction` of them), which is the text the draft will draft at serving time. Every step
reads the target's hidden states at the draft's `target_layer_ids` and its logits on a batch of
those sequences, draws block anchors, and minimises the published loss (`dspark_loss`: 0.1·CE +
0.9·L1 + 1.0·confidence BCE against 1 − TV, slot weights exp(−k/4)). `embed_tokens` stays the
target's (frozen, as DeepSpec trains it), so the mask token's embedding is the target's too.

Training is resumable: the generated sequences and, every `save_every` steps, the draft, the
optimizer and the random streams are written under `OUT/.train/`; running the same command again
continues from there, with another `--steps` too (the learning-rate schedule then follows the new
total from the step reached; `training.json` lists every budget). The budget is a step count, so
the result does not depend on the machine's load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.checkpoints.dspark_block_config import MARKOV_HEAD_TYPES, BlockDraftConfig, default_layer_ids
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.dspark_block_loader import init_block_draft, save_block_draft
from dspark.runtime.models.families import TargetModel
from dspark.train.dspark_loss import block_labels, dspark_loss, sample_anchors

STATE_DIR = ".train"
SEQUENCES_FILE = "sequences.pt"
STATE_FILE = "state.pt"
REPORT_FILE = "training.json"


class DraftTrainingError(ValueError):
    """Settings or inputs a draft cannot be trained with (the message names the setting)."""


@dataclass(frozen=True)
class DraftTrainSettings:
    steps: int = 1500
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 64  # blocks drawn per sequence per step
    lr: float = 2e-3
    weight_decay: float = 0.01
    max_prompt_tokens: int = 256  # longer prompts are cut to their first tokens
    continuation_tokens: int = 320  # what the target generates after each prompt
    sampled_fraction: float = 0.25  # of the prompts, continued by sampling instead of greedily
    sample_temperature: float = 1.0
    eval_fraction: float = 0.05  # of the sequences, held out for the teacher-forced figures
    seed: int = 0
    save_every: int = 100
    # the draft's architecture (its sizes are the target's, as a released draft's config is a copy of
    # its target's: the compiler refuses a draft whose sizes differ)
    num_layers: int = 2
    block_size: int = 7
    target_layer_ids: tuple[int, ...] | None = None  # None: `default_layer_ids`
    mask_token_id: int | None = None  # None: the tokenizer's BOS
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    train_lm_head: bool = False  # DeepSpec keeps lm_head at the target's copy
    bf16_autocast: bool = True

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = None if self.target_layer_ids is None else list(self.target_layer_ids)
        return out


def draft_config(target: TargetModel, s: DraftTrainSettings, mask_token_id: int) -> BlockDraftConfig:
    tc = target.cfg
    ids = s.target_layer_ids or default_layer_ids(tc.num_layers)
    if s.markov_head_type not in MARKOV_HEAD_TYPES:
        raise DraftTrainingError(f"markov_head_type {s.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
    bad = [i for i in ids if not -1 <= i < tc.num_layers - 1]
    if bad or list(ids) != sorted(set(ids)):
        raise DraftTrainingError(f"target_layer_ids {list(ids)}: expected increasing ids in -1 .. "
                                 f"{tc.num_layers - 2} (the target has {tc.num_layers} layers; -1 is the "
                                 "embeddings, the final layer may not be read)")
    if not 0 <= mask_token_id < tc.vocab_size:
        raise DraftTrainingError(f"mask_token_id {mask_token_id} is outside the target's vocabulary "
                                 f"(0 .. {tc.vocab_size - 1}); the draft's embeddings are the target's")
    return BlockDraftConfig.for_target(
        tc, num_layers=s.num_layers, block_size=s.block_size, mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids), markov_rank=s.markov_rank,
        markov_head_type=s.markov_head_type if s.markov_rank > 0 else None, confidence_head=True,
        confidence_with_markov=s.markov_rank > 0)


# -- on-policy data ----------------------------------------------------------------------------
@dataclass
class Sequences:
    """Prompts with the target's continuations, right-padded: `tokens[n, S]`, `loss_mask[n, S]`
    (True on every real token up to and including a generated EOS) and `sampled[n]`."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    sampled: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)


@torch.no_grad()
def continue_prompts(target: TargetModel, prompts: torch.Tensor, steps: int, temperature: float | None,
                     generator: torch.Generator) -> torch.Tensor:
    """`[b, P + steps]`: same-length prompts and the target's continuations (greedy when
    `temperature` is None), with a dense KV cache."""
    cache: list[list[torch.Tensor]] = [[] for _ in range(target.cfg.num_layers)]
    hidden = target.forward_dense(prompts, cache)
    out = [prompts]
    for i in range(steps):
        logits = target.dense_logits(hidden[:, -1]).float()
        if temperature is None:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(prompts.device)
        out.append(nxt)
        if i + 1 < steps:
            hidden = target.forward_dense(nxt, cache, start=prompts.shape[1] + i)
    return torch.cat(out, dim=1)


def generate_sequences(target: TargetModel, prompts: list[list[int]], s: DraftTrainSettings,
                       eos_ids: frozenset[int], device: torch.device, log: Callable[[str], None],
                       chunk: int = 64) -> Sequences:
    """Every prompt (cut to `max_prompt_tokens`) continued by the target; prompts of one length are
    generated together. The loss mask ends after a generated EOS: what follows it is never served."""
    gen = torch.Generator().manual_seed(s.seed)
    order = torch.randperm(len(prompts), generator=gen).tolist()
    n_sampled = round(s.sampled_fraction * len(prompts))
    sampled = {i: rank < n_sampled for rank, i in enumerate(order)}
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((min(len(p), s.max_prompt_tokens), sampled[i]), []).append(i)
    rows: dict[int, torch.Tensor] = {}
    start = time.monotonic()
    bar = progress(len(prompts), "generating")
    for (length, is_sampled), members in sorted(groups.items()):
        for lo in range(0, len(members), chunk):
            idx = members[lo:lo + chunk]
            batch = torch.tensor([prompts[i][:length] for i in idx], device=device)
            with autocast(device, s.bf16_autocast):
                out = continue_prompts(target, batch, s.continuation_tokens,
                                       s.sample_temperature if is_sampled else None, gen)
            for i, row in zip(idx, out.cpu(), strict=True):
                rows[i] = row
            bar.update(len(idx))
    bar.close()
    width = max(len(r) for r in rows.values())
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, row in rows.items():
        tokens[i, :len(row)] = row
        real = len(row)
        plen = min(len(prompts[i]), s.max_prompt_tokens)
        stops = [j for j in range(plen, len(row)) if int(row[j]) in eos_ids]
        if stops:
            real = stops[0] + 1
        mask[i, :real] = True
    log(f"generated {len(prompts)} continuations ({n_sampled} sampled) in "
        f"{(time.monotonic() - start) / 60:.1f} min")
    return Sequences(tokens, mask, torch.tensor([sampled[i] for i in range(len(prompts))]))


# -- one step ----------------------------------------------------------------------------------
def autocast(device: torch.device, enabled: bool) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor
    ce: float
    l1: float
    confidence: float
    reach: torch.Tensor  # [gamma] greedy matches whose every earlier slot matched, summed
    blocks: int  # blocks counted in `reach`


def block_step(draft: DSparkBlockDraft, target: TargetModel, tokens: torch.Tensor, loss_mask: torch.Tensor,
               anchors_per_seq: int, generator: torch.Generator, bf16: bool) -> StepOutput:
    """The published loss on one batch of sequences, with the greedy-match figures."""
    cfg = draft.cfg
    device = tokens.device
    anchors, keep = sample_anchors(loss_mask.cpu(), anchors_per_seq, generator)
    anchors, keep = anchors.to(device), keep.to(device)
    labels = block_labels(tokens, anchors, cfg.block_size, loss_mask, keep)
    with autocast(device, bf16):
        with torch.no_grad():
            last, feats = target.forward_dense_states(tokens, capture=cfg.layers_before_capture)
            assert feats is not None
            b, a, g = labels.target_positions.shape
            pos = labels.target_positions.reshape(b, -1)
            picked = last.gather(1, pos[..., None].expand(-1, -1, last.shape[-1]))
            target_logits = target.dense_logits(picked).float().view(b, a, g, -1)
        prop = draft.forward_blocks(feats, tokens, anchors)
        out = dspark_loss(prop.logits.float(), target_logits, labels.target_ids, labels.valid,
                          prop.conf_logits)
    match = (prop.logits.detach().argmax(-1) == target_logits.argmax(-1)) & labels.valid
    full = labels.valid.all(-1)  # blocks whose every slot is supervised
    reach = match[full].long().cumprod(-1).sum(0).float()
    return StepOutput(out.total, out.ce.item(), out.l1.item(), out.confidence.item(), reach.cpu(),
                      int(full.sum()))


def same_run(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether saved settings describe the run `current` continues: every setting but the step
    budget (a resumed run may train longer or shorter; the schedule follows the new total)."""
    return all(saved.get(k) == v for k, v in current.items() if k != "steps")


def lr_at(frac: float, peak: float, warmup_frac: float = 0.03) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if frac < warmup_frac:
        return peak * frac / warmup_frac
    t = min((frac - warmup_frac) / (1 - warmup_frac), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def progress(total: int, desc: str, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=None)  # None: off where stderr is not a terminal


# -- the run -----------------------------------------------------------------------------------
def save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def teacher_forced_reach(draft: DSparkBlockDraft, target: TargetModel, seqs: Sequences, s: DraftTrainSettings,
                         device: torch.device) -> list[float]:
    """P(the greedy draft prefix reaches slot k) on held-out sequences with the true context; a
    proxy: `dspark run` measures acceptance on real decoding."""
    draft.eval()
    gen = torch.Generator().manual_seed(s.seed + 7)
    reach = torch.zeros(draft.cfg.block_size)
    blocks = 0
    for lo in range(0, len(seqs), s.batch_size):
        out = block_step(draft, target, seqs.tokens[lo:lo + s.batch_size].to(device),
                         seqs.loss_mask[lo:lo + s.batch_size].to(device), s.anchors_per_seq, gen,
                         s.bf16_autocast)
        reach += out.reach
        blocks += out.blocks
    return (reach / max(blocks, 1)).tolist()


def train_draft(target: TargetModel, prompts: list[list[int]], out_dir: Path, s: DraftTrainSettings,
                eos_ids: frozenset[int], mask_token_id: int, device: torch.device,
                log: Callable[[str], None] = print, provenance: dict[str, Any] | None = None,
                stop_after: int | None = None) -> dict[str, Any] | None:
    """Train (or resume training) a draft for `target` on `prompts` (token ids) and write it to
    `out_dir` in the released layout, with `training.json`; returns that report. With `stop_after`
    the run saves its state and returns None once it reaches that step (a later call resumes)."""
    if not prompts:
        raise DraftTrainingError("no prompts to continue")
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    cfg = draft_config(target, s, mask_token_id)
    state_dir = out_dir / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    target = target.to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)

    seq_file = state_dir / SEQUENCES_FILE
    if seq_file.is_file():
        saved = torch.load(seq_file)
        seqs = Sequences(saved["tokens"], saved["loss_mask"], saved["sampled"])
        log(f"resuming with the {len(seqs)} sequences in {seq_file}")
    else:
        seqs = generate_sequences(target, prompts, s, eos_ids, device, log)
        save_atomic(dataclasses.asdict(seqs), seq_file)
    n_eval = max(1, round(s.eval_fraction * len(seqs))) if len(seqs) > 1 else 0
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(s.seed + 3))
    held, train_idx = perm[:n_eval], perm[n_eval:]
    held_seqs = Sequences(seqs.tokens[held], seqs.loss_mask[held], seqs.sampled[held])

    embed = target.model.embed_tokens.weight  # type: ignore[attr-defined]
    draft = init_block_draft(cfg, seed=s.seed,
                             target_embeddings=(embed.detach().float().cpu().clone(),
                                                target.lm_head.weight.detach().float().cpu().clone()))
    draft = draft.to(device).train()
    draft.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(s.train_lm_head)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed + 1)
    step, minutes_before = 0, 0.0
    budgets: list[dict[str, int]] = []  # each run's step budget and the step it started from
    state_file = state_dir / STATE_FILE
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        if not same_run(state["settings"], s.to_json()) or state["config"] != cfg.to_hf():
            raise DraftTrainingError(f"{state_file} was written by a run with other settings; pass another "
                                     "-o directory, or delete it to start over")
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, minutes_before = state["step"], state["minutes"]
        budgets = state.get("budgets", [{"from_step": 0, "steps": state["settings"]["steps"]}])
        if step > s.steps:
            raise DraftTrainingError(f"{state_file} is at step {step}, past --steps {s.steps}; pass a "
                                     "larger --steps to train on")
        log(f"resuming at step {step} of {s.steps}")
    if not budgets or budgets[-1]["steps"] != s.steps:
        budgets.append({"from_step": step, "steps": s.steps})

    start = time.monotonic()
    bar = progress(s.steps, "training", initial=step)
    ema: float | None = None
    while step < s.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step / s.steps, s.lr)
        pick = train_idx[torch.randint(0, len(train_idx), (s.batch_size,), generator=gen)]
        out = block_step(draft, target, seqs.tokens[pick].to(device), seqs.loss_mask[pick].to(device),
                         s.anchors_per_seq, gen, s.bf16_autocast)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        loss = out.loss.item()
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        accepted = float(out.reach.sum()) / max(out.blocks, 1)
        bar.set_postfix(loss=f"{ema:.3f}", l1=f"{out.l1:.3f}", reach=f"{accepted:.2f}")
        bar.update(1)
        if step % 50 == 0 and bar.disable:
            log(f"step {step}/{s.steps} {(minutes_before + (time.monotonic() - start) / 60):.1f} min "
                f"loss {ema:.4f} l1 {out.l1:.3f} teacher-forced reach {accepted:.2f}")
        stopping = stop_after is not None and step >= stop_after and step < s.steps
        if step % s.save_every == 0 or step == s.steps or stopping:
            save_atomic({"step": step, "draft": draft.state_dict(), "optimizer": opt.state_dict(),
                         "generator": gen.get_state(), "settings": s.to_json(), "config": cfg.to_hf(),
                         "budgets": budgets,
                         "minutes": minutes_before + (time.monotonic() - start) / 60}, state_file)
        if stopping:
            bar.close()
            return None
    bar.close()
    minutes = minutes_before + (time.monotonic() - start) / 60
    draft = draft.eval()
    reach = teacher_forced_reach(draft, target, held_seqs, s, device) if n_eval else []
    save_block_draft(out_dir, draft.cpu())
    report = {
        "settings": s.to_json(),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "trained_params": sum(p.numel() for p in params),
        "sequences": len(seqs), "held_out_sequences": n_eval,
        "sampled_sequences": int(seqs.sampled.sum()),
        "train_minutes": round(minutes, 2), "device": str(device), "step_budgets": budgets,
        "held_out_teacher_forced_reach_by_slot": [round(r, 4) for r in reach],
        "held_out_teacher_forced_mean_accepted": round(sum(reach), 3),
    } | (provenance or {})
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    log(f"draft: {report['draft_params']} params ({report['trained_params']} trained), {s.steps} steps in "
        f"{minutes:.1f} min; held-out teacher-forced mean accepted {sum(reach):.2f} of {cfg.block_size}")
    return report
