"""Attention backends (each owns a paged KV cache and consumes one metadata container) and the
metadata containers the generated builders fill in."""
