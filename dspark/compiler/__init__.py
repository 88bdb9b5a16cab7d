"""The dspark compiler: resolved spec → content-hashed compile graph → generated package."""

from dspark.compiler.api import build, compile_spec, default_package_dir
from dspark.compiler.emit import CompiledPackage, render_package
from dspark.compiler.errors import CompileError

__all__ = ["CompileError", "CompiledPackage", "build", "compile_spec", "default_package_dir",
           "render_package"]
