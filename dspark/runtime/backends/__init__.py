"""Attention backends: each owns a paged KV cache and consumes one metadata container."""
