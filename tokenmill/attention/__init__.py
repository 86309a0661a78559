"""Attention backends over a paged KV cache, and the per-step metadata they read."""

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
