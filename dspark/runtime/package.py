"""Loading a generated deployment package (`generated/<name>/`) by its directory."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dspark.runtime.config import DeploymentConfig
from dspark.runtime.models.checkpoint import resolve_checkpoint
from dspark.runtime.tokenizer import (
    BYTE_TOKENIZER_FILE,
    HF_TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
)

MODULES = ("deployment", "planner_config", "attn_metadata", "graph_runner")


class PackageError(RuntimeError):
    pass


@dataclass(frozen=True)
class GeneratedPackage:
    directory: Path
    deployment: DeploymentConfig
    plan: Any
    attn_metadata: ModuleType
    graph_runner: ModuleType
    tokenizer: Tokenizer


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
    """Import the generated package at `directory` and collect its parts."""
    directory = Path(directory).resolve()
    missing = [m for m in MODULES if not (directory / f"{m}.py").is_file()]
    if not (directory / "__init__.py").is_file() or missing:
        raise PackageError(f"{directory} is not a generated dspark package (missing "
                           f"{missing or ['__init__.py']}); build one with `dspark-compile build SPEC`")
    name = f"_dspark_generated_{directory.name}_{abs(hash(str(directory))):x}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, directory / "__init__.py", submodule_search_locations=[str(directory)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    parts = {m: importlib.import_module(f"{name}.{m}") for m in MODULES}
    deployment = parts["deployment"].DEPLOYMENT
    return GeneratedPackage(
        directory=directory,
        deployment=deployment,
        plan=parts["planner_config"].PLAN,
        attn_metadata=parts["attn_metadata"],
        graph_runner=parts["graph_runner"],
        tokenizer=load_tokenizer(resolve_checkpoint(deployment.model.checkpoint, "target", directory)),
    )
