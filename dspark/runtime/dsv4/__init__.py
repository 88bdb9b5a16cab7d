"""DeepSeek-V4 runtime support: the per-step metadata of a verify step (static or compact) in the
forms the CUDA and Ascend backends read (`verify_metadata`). Importing this package imports torch."""

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
    "Dsv4MetadataError",
    "Dsv4PageTables",
    "Dsv4StepArrays",
    "Dsv4StepConfig",
    "Dsv4VerifyMetadata",
    "plan_dsv4_verify",
]
