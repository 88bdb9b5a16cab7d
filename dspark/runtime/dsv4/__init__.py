"""DeepSeek-V4 runtime support: the per-step metadata of a verify step (static or compact) in the
forms the CUDA and Ascend backends read (`verify_metadata`), and the paged multi-request verify forward on the
CPU that runs from it (`paged`). Importing this package imports torch."""

from dspark.runtime.dsv4.paged import (
    Dsv4LayerCache,
    Dsv4LayerTrace,
    Dsv4PagedCaches,
    Dsv4PagedError,
    forward_verify,
    prefill,
    run_step,
)
from dspark.runtime.dsv4.verify_metadata import (
    Dsv4CompressedArrays,
    Dsv4CompressedPlan,
    Dsv4MetadataError,
    Dsv4PageTables,
    Dsv4StepArrays,
    Dsv4StepConfig,
    Dsv4VerifyMetadata,
    plan_dsv4_verify,
)

__all__ = [
    "Dsv4CompressedArrays",
    "Dsv4CompressedPlan",
    "Dsv4LayerCache",
    "Dsv4LayerTrace",
    "Dsv4MetadataError",
    "Dsv4PageTables",
    "Dsv4PagedCaches",
    "Dsv4PagedError",
    "Dsv4StepArrays",
    "Dsv4StepConfig",
    "Dsv4VerifyMetadata",
    "forward_verify",
    "plan_dsv4_verify",
    "prefill",
    "run_step",
]
