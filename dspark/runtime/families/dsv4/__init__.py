"""DeepSeek-V4's runtime home: the model and its parts, the serving target, verify metadata, caches and the
backends' layers, sharding and expert parallelism, the DSpark stages (docs/dsv4.md, "The pieces"). The package
exports the verify metadata and the CPU paged forward; importing it imports torch."""

from dspark.runtime.families.dsv4.cpu_paged import (
    Dsv4LayerCache,
    Dsv4LayerTrace,
    Dsv4PagedCaches,
    Dsv4PagedError,
    forward_verify,
    prefill,
    run_step,
)
from dspark.runtime.families.dsv4.verify_metadata import (
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
