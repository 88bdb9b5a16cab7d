"""Values every rule derives from a validated spec the same way: N, the verify-length range, tiers."""

from __future__ import annotations

from dspark.spec.models import DeploymentSpec


def num_draft_tokens(spec: DeploymentSpec) -> int:
    """N = gamma + 1: the root row plus the drafts."""
    return spec.draft.gamma + 1


def resolved_max_verify_len(spec: DeploymentSpec) -> int:
    return spec.verify.max_verify_len or num_draft_tokens(spec)


def tier_grid(spec: DeploymentSpec) -> tuple[int, ...]:
    """Token counts captured as graphs; empty when graph capture is off."""
    if not spec.graph.enabled:
        return ()
    if spec.graph.token_tiers:
        return spec.graph.token_tiers
    n = num_draft_tokens(spec)
    return tuple(bs * n for bs in spec.graph.capture_batch_sizes)


def draft_batch_tiers(spec: DeploymentSpec) -> tuple[int, ...]:
    """Batch sizes the draft step is captured at where it runs in graphs (CUDA): powers of two up to the
    largest batch, and the largest batch itself; a step of B requests replays the smallest tier >= B."""
    largest = spec.serving.max_running_requests
    return tuple(sorted({1 << k for k in range(largest.bit_length()) if 1 << k < largest} | {largest}))


def draft_graphs(spec: DeploymentSpec) -> bool:
    """Whether the draft step runs in captured graphs: on CUDA with graph capture on (the draft's block
    attends through the Triton kernel there, whatever the target's attention)."""
    return spec.graph.enabled and spec.backend.kind == "cuda"


def verify_len_range(spec: DeploymentSpec) -> tuple[int, int]:
    """Fewest and most rows one request can put into a step in the configured mode."""
    return spec.verify.mode.rows_per_request(max(spec.verify.min_verify_len, 1),
                                             resolved_max_verify_len(spec), num_draft_tokens(spec))
