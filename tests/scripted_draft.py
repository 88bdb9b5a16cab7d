"""A scripted draft for the lossless tests: it proposes the target's own greedy continuation, with a wrong
token injected at a slot a seeded RNG picks (or none), so that a run's verify steps accept every draft
length 0 … gamma, and the test can check the output is still the target's, token for token.

A draft with random (dummy) weights is almost never accepted, so a lossless test that pairs a target with
one only ever sees rejections at the first slot: it says nothing about a step that commits accepted drafts,
their KV and the draft context written for them. `ScriptedDraft` stands in for the runtime's draft through
the draft's own interface (`propose`, `propose_paged`; everything else — the context K/V of committed
positions, the configuration — is the wrapped draft's), and `StepLog` is a recorder (`Runtime.recorder`, what
`dspark run --record` installs) that keeps each step's record, whose `correct_len` is how many drafts the
verifier accepted for each request.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dspark.formats.step_records import StepRecord
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.stats import RunStats
from dspark.runtime.models.dspark_block_draft import BlockProposal

CONFIDENCE_LOGIT = 8.0  # sigmoid(8) ≈ 0.9997 where the draft is sure, sigmoid(-8) where it is not
DRAFT_LOGIT = 30.0  # the drafted token's logit, the others 0: a distribution that agrees with the drafts


class ScriptedDraft:
    """Wraps a draft model; `propose` returns the target's greedy continuation of each running request.

    `sequences[tuple(prompt)]` is the prompt followed by the target's greedy continuation, past any EOS, at
    least `max_new_tokens + gamma + 1` tokens beyond the prompt; `running()` lists the requests of the step
    being drafted, in the order the engine drafts them. Each proposal's wrong slot (gamma: every draft
    right) is dealt from a deck of 0 … gamma shuffled by a seeded RNG, so every gamma + 1 proposals in a
    row put the error at every slot once; `errors` counts them. The confidence the planner reads is high
    through the wrong slot and low after it. Greedy runs only: the wrong token is not what a sampler would
    draw from `logits`.
    """

    def __init__(self, draft: Any, sequences: Mapping[tuple[int, ...], Sequence[int]],
                 running: Callable[[], Sequence[Request]], vocab_size: int, seed: int = 0) -> None:
        self.draft = draft
        self.sequences = sequences
        self.running = running
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.deck: list[int] = []
        self.errors: Counter[int] = Counter()

    def __getattr__(self, name: str) -> Any:  # cfg, context_kv, …: the wrapped draft's
        return getattr(self.__dict__["draft"], name)

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_lens: torch.Tensor,
                pick: Any = None, gamma: int | None = None, keep_conf_inputs: bool = False) -> BlockProposal:
        assert pick is None, "scripted drafts are for greedy runs"
        # The wrapped draft still runs over its context cache: shapes, dtypes and the confidence inputs
        # are a real draft's; only what it proposes is scripted.
        proposal = self.draft.propose(anchor_ids, anchor_pos, ctx_kv, ctx_lens, pick, gamma,
                                      keep_conf_inputs=keep_conf_inputs)
        return self._scripted(proposal, anchor_ids, anchor_pos)

    def propose_paged(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, attention: Any,
                      pick: Any = None, gamma: int | None = None, keep_conf_inputs: bool = False
                      ) -> BlockProposal:
        assert pick is None, "scripted drafts are for greedy runs"
        proposal = self.draft.propose_paged(anchor_ids, anchor_pos, attention, pick, gamma,
                                            keep_conf_inputs=keep_conf_inputs)
        return self._scripted(proposal, anchor_ids, anchor_pos)

    def _scripted(self, proposal: BlockProposal, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor
                  ) -> BlockProposal:
        assert proposal.drafts is not None
        requests = self.running()
        num_reqs, width = proposal.drafts.shape
        assert len(requests) == num_reqs
        rows, wrongs = [], []
        for b, r in enumerate(requests):
            seq, pos = self.sequences[tuple(r.prompt)], int(anchor_pos[b])
            assert seq[pos] == int(anchor_ids[b]), "the step's root is not the target's greedy token"
            row = list(seq[pos + 1:pos + 1 + width])
            assert len(row) == width, "the scripted continuation is too short for this step"
            if not self.deck:
                self.deck = list(range(width + 1))
                self.rng.shuffle(self.deck)
            wrong = self.deck.pop()
            if wrong < width:
                row[wrong] = (row[wrong] + 1) % self.vocab_size  # not the target's greedy token
            self.errors[wrong] += 1
            rows.append(row)
            wrongs.append(wrong)
        drafts = torch.tensor(rows, dtype=proposal.drafts.dtype, device=proposal.drafts.device)
        logits = torch.zeros_like(proposal.logits)
        logits.scatter_(-1, drafts[..., None], DRAFT_LOGIT)
        # Sure of every draft up to the wrong one (a draft does not know its mistake), unsure of those after
        # it: a planner verifies through the wrong draft, which is rejected, and may cut the rows after it.
        slots = torch.arange(width, device=drafts.device)
        wrong_at = torch.tensor(wrongs, device=drafts.device)[:, None]
        conf = torch.where(slots <= wrong_at, CONFIDENCE_LOGIT, -CONFIDENCE_LOGIT).to(torch.float32)
        return dataclasses.replace(proposal, drafts=drafts, conf_logits=conf, logits=logits)


class StepLog:
    """A recorder keeping each decode step's record in memory (and no calibration samples)."""

    features = False  # no confidence-head inputs asked of the draft

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.sts = self
        self.steps = self

    def add(self, *_: Any) -> None:  # calibration samples: not kept
        pass

    def append(self, record: StepRecord) -> None:
        self.records.append(record)


@dataclass(frozen=True)
class ScriptedRun:
    outputs: list[list[int]]
    stats: RunStats
    accepted: Counter[int]  # request-steps by the number of drafts the verifier accepted
    errors: Counter[int]  # proposals by their wrong slot (gamma: none)


def target_sequences(rt: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int
                     ) -> dict[tuple[int, ...], list[int]]:
    """Each prompt followed by the target's reference greedy continuation (its dense, unpaged forward),
    long enough for every draft slot of the last step."""
    horizon = max_new_tokens + rt.plan.gamma + 1
    greedy = rt.target.greedy_continue
    return {tuple(p): greedy(torch.tensor([list(p)], device=rt.device), horizon)[0].tolist() for p in prompts}


def generate_scripted(rt: Runtime, prompts: list[list[int]], max_new_tokens: int,
                      sequences: Mapping[tuple[int, ...], Sequence[int]] | None = None,
                      seed: int = 0) -> ScriptedRun:
    """`rt.generate(prompts, max_new_tokens)` with the scripted draft in place of the runtime's, and what
    the verifier accepted at every request-step. `sequences` defaults to `target_sequences`."""
    if sequences is None:
        sequences = target_sequences(rt, prompts, max_new_tokens)
    real, recorder = rt.models.draft, rt.recorder
    scripted = ScriptedDraft(real, sequences, lambda: rt.scheduler.running, rt.target.cfg.vocab_size, seed)
    log = StepLog()
    rt.models.draft, rt.recorder = scripted, log  # type: ignore[assignment]
    try:
        outputs, stats = rt.generate(prompts, max_new_tokens)
    finally:
        rt.models.draft, rt.recorder = real, recorder
    accepted = Counter(r.correct_len for record in log.records for r in record.requests)
    assert sum(accepted.values()) == stats.request_steps  # every request-step was recorded
    return ScriptedRun(outputs, stats, accepted, scripted.errors)


def assert_every_length(run: ScriptedRun, gamma: int) -> None:
    """The verifier accepted every draft length 0 … gamma, and rejected a draft at every slot (an accepted
    length below gamma can be a cut row; a rejection is a verified draft that was not accepted)."""
    assert set(run.accepted) == set(range(gamma + 1)), f"accepted lengths {dict(run.accepted)}"
    stats = run.stats
    assert all(a < v for a, v in zip(stats.drafts_accepted, stats.drafts_verified, strict=True)), (
        f"accepted {stats.drafts_accepted} of verified {stats.drafts_verified} by slot")
