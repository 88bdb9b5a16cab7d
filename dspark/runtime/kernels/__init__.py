"""Device kernels of a verify step: ragged layout, paged attention, greedy acceptance, packing to and
from fixed stride.

Every kernel has a torch reference (any device, no host sync) and a Triton implementation; the
public functions take Triton for CUDA tensors when it is installed and the reference otherwise,
and accept `impl="torch" | "triton"` to force one (tests run the Triton kernels on CPU under
`TRITON_INTERPRET=1`). Sizes that shape outputs or launch grids are Python ints from the caller,
so nothing here waits on the device and every kernel can be captured in a CUDA graph.
"""

from dspark.runtime.kernels.accept import AcceptResult, greedy_accept
from dspark.runtime.kernels.dispatch import HAS_TRITON, Impl
from dspark.runtime.kernels.scatter import pack_rows, scatter_rows
from dspark.runtime.kernels.verify_rows import VerifyRows, build_verify_rows

__all__ = ["HAS_TRITON", "AcceptResult", "Impl", "VerifyRows", "build_verify_rows", "greedy_accept",
           "pack_rows", "scatter_rows"]
