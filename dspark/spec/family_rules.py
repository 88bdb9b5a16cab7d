"""Rules that depend on the model family: the backends and attention implementations a family runs on,
and what dspark's DeepSeek-V4 (dsv4) model can load.

Each rule blames the field to change and says what to write instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from dspark.backends import family_attention
from dspark.families import DSV4_ATTENTION
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.spec.errors import SpecIssue
from dspark.spec.facts import SpecFacts


def check_family_attention(facts: SpecFacts) -> Iterator[SpecIssue]:
    backend, family = facts.spec.backend, facts.spec.model.family
    runs = family_attention(backend.kind, family)
    if backend.attention is None or not runs or backend.attention in runs:
        return  # left out, it is the family's default; a backend without any is check_dsv4_backend's
    what = ("DeepSeek-V4's compressed sparse attention (model.family dsv4)"
            if backend.attention in DSV4_ATTENTION else "the dense families' paged attention")
    others = f" or set it to {', '.join(runs[1:])}" if len(runs) > 1 else ""
    yield SpecIssue(("backend", "attention"),
                    f"{backend.attention} runs {what}, not model.family {family}",
                    f"leave backend.attention out for {family}'s {runs[0]} on {backend.kind}{others}")


# The compress ratios Ascend's DSV4 operators take (`npu_sparse_attn_sharedkv`'s cmp_ratio; the lightning
# indexer runs on ratio 4): DeepSeek-V4's own.
ASCEND_DSV4_RATIOS = {"csa_ratio": 4, "hca_ratio": 128}


def check_dsv4_ascend_ratios(facts: SpecFacts) -> Iterator[SpecIssue]:
    geometry = facts.geometry
    if facts.spec.backend.kind != "ascend" or not isinstance(geometry, Dsv4Geometry):
        return
    for name, ratio in ASCEND_DSV4_RATIOS.items():
        if getattr(geometry, name) != ratio:
            yield SpecIssue(("model", "geometry", name),
                            f"{name} is {getattr(geometry, name)}, but the Ascend DSV4 operators take "
                            f"compress ratio {ratio} there (npu_sparse_attn_sharedkv takes 4 or 128)",
                            f"use {name}: {ratio} on backend.kind ascend, or run this geometry on the cpu "
                            "backend")
