"""The verify mode, and the few facts of the vocabulary every layer shares (docs/vocabulary.md).

The spec reads `verify.mode` once into a `VerifyMode`; from then on code asks the mode what it
does (`plans`, `packs_rows`, ...) instead of comparing strings. No torch here: the compiler and the
runtime both import this module.
"""

from __future__ import annotations

from enum import Enum

# A deployment's draft: a DSpark block draft in its own checkpoint (DeepSpec's released layout), or the
# DSpark stages a DeepSeek-V4 checkpoint carries beside its target (`mtp.{i}`, in the target's checkpoint).
BLOCK_DRAFT = "dspark_block"
DSV4_STAGES = "dsv4_stages"
DRAFT_ARCHITECTURES = (BLOCK_DRAFT, DSV4_STAGES)


def num_draft_tokens(gamma: int) -> int:
    """N = gamma + 1: the rows one request puts into a full verify step (its root plus the drafts)."""
    return gamma + 1


class SpeculationOff(str, Enum):
    """Whether the planner may switch speculation off (`verify.off`).

    - `auto`: when the cost table prices a target-only decode step and it pays more than drafting and
      verifying, the planner decodes without speculation for a while (docs/planner.md, "Speculation off").
    - `never`: every decode step drafts and verifies.
    """

    AUTO = "auto"
    NEVER = "never"

    def __str__(self) -> str:
        return self.value


class VerifyMode(str, Enum):
    """How the target verifies the drafts of a step.

    - `static`: every request verifies all N rows and every draft may be accepted; no planner.
    - `cap-accept`: every request runs all N rows, but the planner's `verify_lens` cap acceptance.
    - `compact`: only the planned rows run, packed back to back (`qo_indptr = [0, cumsum(verify_lens)]`).
    """

    STATIC = "static"
    CAP_ACCEPT = "cap-accept"
    COMPACT = "compact"

    def __str__(self) -> str:
        return self.value

    @property
    def plans(self) -> bool:
        """Whether a planner chooses `verify_lens` from the draft's confidence (needs a confidence head)."""
        return self is not VerifyMode.STATIC

    @property
    def packs_rows(self) -> bool:
        """Whether a step runs only the planned rows (else the full `B x N` block)."""
        return self is VerifyMode.COMPACT

    @property
    def needs_cost_model(self) -> bool:
        """Whether the planner's budget is what saves work, so running without a cost model is suspect.

        cap-accept runs every row whatever the budget; only compact turns a smaller budget into a
        cheaper step.
        """
        return self is VerifyMode.COMPACT

    def rows_per_request(self, floor: int, cap: int, num_draft_tokens: int) -> tuple[int, int]:
        """Fewest and most rows one request can put into a step of this mode."""
        if self.packs_rows:
            return floor, cap
        return num_draft_tokens, num_draft_tokens
