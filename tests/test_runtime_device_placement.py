"""Device placement without a device: every tensor the decode loop creates must be placed on
the device of its inputs, or a CUDA/NPU deployment fails at its first step.

A CPU run with the default device set to `meta` makes any tensor created without an explicit
device a meta tensor, and mixing it with the real ones raises, so the CPU catches what would
otherwise only show on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import compile_variant
from .test_runtime_modes import COSTLY_ROWS

VARIANTS: dict[str, dict[str, Any]] = {
    "static_tiers": {"graph": {"enabled": True, "capture_batch_sizes": [1, 2, 3]}},
    "cap_accept_lag": {"verify": {"mode": "cap-accept", "lag_steps": 1}, "cost_model": COSTLY_ROWS},
    "compact_tiers": {"verify": {"mode": "compact", "align_to_graph_tier": True}, "cost_model": COSTLY_ROWS,
                      "graph": {"enabled": True, "token_tiers": [8, 16, 32]}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_loop_creates_no_tensor_on_the_default_device(tmp_path, variant: str) -> None:
    overrides = {**VARIANTS[variant], "serving": {"max_running_requests": 3}}
    runtime = Runtime(load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml", overrides, variant)))
    prompts = [runtime.package.tokenizer.encode(p) for p in ["def main(argv):\n", "import os\n", "x"]]
    expected, _ = runtime.generate(prompts, 16, target_only=True)
    torch.set_default_device("meta")
    try:
        speculative, _ = runtime.generate(prompts, 16)
        target_only, _ = runtime.generate(prompts, 16, target_only=True)
    finally:
        torch.set_default_device(None)
    assert speculative == target_only == expected


def test_sampling_creates_no_tensor_on_the_default_device(tmp_path) -> None:
    from dspark.runtime.sampling import SamplingParams

    overrides = {**VARIANTS["compact_tiers"], "serving": {"max_running_requests": 3}}
    pkg = load_package(compile_variant(tmp_path, "tiny_cpu_static.yaml", overrides, "sampled_placement"))
    runtime = Runtime(pkg, sampling=SamplingParams(0.8, top_p=0.9, top_k=20), seed=0)
    prompts = [pkg.tokenizer.encode(p) for p in ["def main(argv):\n", "import os\n", "x"]]
    torch.set_default_device("meta")
    try:
        speculative, stats = runtime.generate(prompts, 16)
        target_only, _ = runtime.generate(prompts, 16, target_only=True)
    finally:
        torch.set_default_device(None)
    assert all(len(o) == 16 for o in speculative + target_only) and stats.steps > 0
