"""The FP8 block-scaled linear (`dspark.runtime.families.dsv4.fp8_linear`): the Triton kernel against its
torch reference under the Triton interpreter on the CPU, in fp32. Run as a script it sets `TRITON_INTERPRET`
before importing the kernel, in a fresh process (tests/test_dsv4_fp8.py starts it). Prints one JSON object:
check name -> "ok" or the failure's traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from dspark.runtime.families.dsv4.fp8_linear import fp8_block_linear, fp8_block_linear_torch  # noqa: E402
from tests.dsv4_quant_common import quantise_fp8  # noqa: E402
from tests.interp_runner import run_checks  # noqa: E402

# (rows, out, in, block): partial tiles and partial scale blocks on every side, and the published 128 x 128
CASES = [(5, 40, 48, (8, 16)), (17, 33, 70, (16, 16)), (3, 130, 140, (128, 128)), (1, 16, 32, (32, 32))]


def check_kernel_matches_reference() -> None:
    for i, (m, n, k, block) in enumerate(CASES):
        gen = torch.Generator().manual_seed(i)
        codes, scales = quantise_fp8(torch.randn(n, k, generator=gen), block, ue8m0=i % 2 == 1)
        x = torch.randn(m, k, generator=gen)
        got = fp8_block_linear(x, codes, scales, block, impl="triton")
        want = fp8_block_linear_torch(x, codes, scales, block)
        where = (m, n, k, block)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda s, c=where: f"{c}: {s}")


def check_every_code_decodes_as_torch_decodes_it() -> None:
    # all 254 finite e4m3fn codes (0x7f and 0xff are NaN), read back through an identity input
    finite = [c for c in range(256) if c & 0x7F != 0x7F]
    codes = torch.tensor(finite, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight = codes[None, :]  # [1, 254]
    scales = torch.ones(1, 2)
    got = fp8_block_linear(torch.eye(254), weight, scales, (128, 128), impl="triton")[:, 0]
    assert torch.equal(got, codes.to(torch.float32)), (got - codes.float()).abs().max()


CHECKS: dict[str, Callable[[], None]] = {
    "kernel_matches_reference": check_kernel_matches_reference,
    "every_code_decodes": check_every_code_decodes_as_torch_decodes_it,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS))
