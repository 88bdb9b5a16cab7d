"""The contract between a generated package (`generated/<name>/`) and the engine.

A generated package's `__init__.py` exports `PARTS`, a `PackageParts` naming exactly what the
engine uses from it: the deployment, the verify plan, the attention backend, the extend-step
metadata builder and the verify runner. `load_package` imports a package by its directory and adds
its tokenizer; nothing else of a package is read (docs/architecture.md, "The generated package").
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.config import DeploymentConfig
from dspark.runtime.engine.forward import DraftGraphs
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import ExtendLayout, StepShape, VerifyLayout
from dspark.runtime.models.checkpoint import CheckpointError, resolve_checkpoint
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.planner.verify_plan import VerifyPlan
from dspark.runtime.tokenizer import (
    BYTE_TOKENIZER_FILE,
    HF_TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
)


class PackageError(RuntimeError):
    pass


class AttentionFactory(Protocol):
    """The generated `AttentionBackend` class: one backend over the target's paged KV cache."""

    def __call__(self, cache: PagedKVCache, page_size: int, num_heads: int,
                 scale: float) -> AttentionBackend: ...


class VerifyRunner(Protocol):
    """Plans a verify step's layout once, then runs its target forward (eagerly or by graph replay)."""

    shape: StepShape

    def plan(self, run_lens: tuple[int, ...], verify_lens: tuple[int, ...], prefix_lens: list[int],
             page_table: torch.Tensor, slots: list[int], tier: int | None = None) -> VerifyLayout:
        """The step's layout; `slots` are the requests' slots in the runtime's pool. `tier` forces the
        tier (under DP attention, the DP-global one); by default the smallest that holds the rows."""
        ...

    def run(self, layout: VerifyLayout, input_ids: torch.Tensor) -> torch.Tensor: ...

    def run_states(self, layout: VerifyLayout, input_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run` plus the target states at the runner's `capture` layer counts (the draft's context)."""
        ...


class VerifyRunnerFactory(Protocol):
    """The generated `VerifyRunner` class (capturing its graphs, where it has any, when built);
    `capture` lists the target states a verify step also returns (decoder-layer counts, 0: the
    embeddings), the draft's `layers_before_capture`."""

    def __call__(self, target: ServingTarget, attn: AttentionBackend, capture: tuple[int, ...] = ()
                 ) -> VerifyRunner: ...


class DraftRunnerFactory(Protocol):
    """The generated `DraftRunner` class of a deployment whose draft step runs in graphs (capturing them
    when built), over the draft and the paged attention its block reads the draft's cache through."""

    def __call__(self, draft: DSparkBlockDraft, attn: Any) -> DraftGraphs: ...


@dataclass(frozen=True)
class PackageParts:
    """What a generated package exports as `PARTS`."""

    deployment: DeploymentConfig
    plan: VerifyPlan
    attention_backend: AttentionFactory
    build_extend_metadata: Callable[[ExtendLayout], AttentionMetadata]
    verify_runner: VerifyRunnerFactory
    draft_runner: DraftRunnerFactory | None = None  # None: the draft step runs eagerly


@dataclass(frozen=True)
class GeneratedPackage:
    """A loaded generated package: its parts, where it lives, and its checkpoint's tokenizer."""

    directory: Path
    parts: PackageParts
    tokenizer: Tokenizer

    @property
    def deployment(self) -> DeploymentConfig:
        return self.parts.deployment

    @property
    def plan(self) -> VerifyPlan:
        return self.parts.plan


def load_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """The checkpoint's tokenizer: `dspark_tokenizer.json` names the byte-level one, else the Hugging
    Face `tokenizer.json` (a `TokenizerError` says what is wrong with it)."""
    marker = checkpoint_dir / BYTE_TOKENIZER_FILE
    if marker.is_file():
        kind = json.loads(marker.read_text()).get("type")
        if kind != "byte":
            raise PackageError(f"{marker}: unknown tokenizer type {kind!r}; this runtime knows \"byte\"")
        return ByteTokenizer()
    if (checkpoint_dir / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer.from_dir(checkpoint_dir)
    raise PackageError(f"{checkpoint_dir}: no tokenizer; expected {HF_TOKENIZER_FILE} (Hugging Face) or "
                       f"{BYTE_TOKENIZER_FILE} (dspark's byte-level tokenizer) beside config.json")


def load_package(directory: str | Path) -> GeneratedPackage:
    """Import the generated package at `directory` and read its `PARTS`."""
    directory = Path(directory).resolve()
    if not (directory / "__init__.py").is_file() or not (directory / "deployment.py").is_file():
        raise PackageError(f"{directory} is not a generated dspark package (no __init__.py and "
                           "deployment.py); build one with `dspark-compile build SPEC`")
    name = f"_dspark_generated_{directory.name}_{abs(hash(str(directory))):x}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, directory / "__init__.py", submodule_search_locations=[str(directory)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    parts = getattr(sys.modules[name], "PARTS", None)
    if not isinstance(parts, PackageParts):
        raise PackageError(f"{directory}/__init__.py does not export PARTS (a PackageParts); it was "
                           "generated by another dspark version: build it again with `dspark-compile build`")
    return GeneratedPackage(directory, parts, _package_tokenizer(parts.deployment, directory))


def _package_tokenizer(deployment: DeploymentConfig, directory: Path) -> Tokenizer:
    """The target checkpoint's tokenizer; a dummy model whose checkpoint is not on this machine
    decodes bytes (the compiler checked its vocabulary holds them)."""
    try:
        checkpoint = resolve_checkpoint(deployment.model.checkpoint, "target", directory)
    except CheckpointError:
        if deployment.model.load_format != "dummy":
            raise
        return ByteTokenizer()
    return load_tokenizer(checkpoint)
