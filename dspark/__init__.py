"""dspark: a declarative compiler for DSpark adaptive-verify speculative decoding deployments."""

__version__ = "0.1.0"
