"""The CPU's attention backend: the PyTorch backend with prefill chunks attended by the C++
extension's causal kernel (``tokenmill/kernels/cpu/prefill_attention.h``).

SDPA's CPU flash kernel took 3.4 ms a layer on a 500-token prompt of the embedded model (a
third of the prompt's time); the extension's kernel reads the chunks' keys and values from the
paged cache once per (sequence, KV head) and runs the online softmax in registers. Decode rows
keep the PyTorch path (the fused decode stack has its own kernel for decode-only steps), and
so do the chunks of a sliding-window layer (Gemma 3's local layers) and of a layer with
attention sinks (gpt-oss).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from tokenmill.attention.backend import TorchAttentionBackend, _StepPlan
from tokenmill.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# (activations, cache) dtypes the kernel takes: fp32 over an fp32 or fp16 cache, bf16 over bf16.
SUPPORTED_DTYPES = {(torch.float32, torch.float32), (torch.float32, torch.float16),
                    (torch.bfloat16, torch.bfloat16)}


class CpuAttentionBackend(TorchAttentionBackend):
    """Prefill chunks through the extension's kernel where it applies (CPU tensors, a head size
    it has a kernel for, supported dtypes), the PyTorch path otherwise."""

    name = "cpu"

    def __init__(self, ext: ModuleType) -> None:
        self._ext = ext

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, plan: _StepPlan, scale: float,
                 out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        # The extension's kernel is causal over the whole context and has no sinks: a
        # sliding-window layer's chunks take the PyTorch path, whose masks hide the keys out
        # of the window, and so do a layer's with attention sinks (gpt-oss).
        if (plan.window is not None or sinks is not None or not self._applies(q, kv_cache)
                or not self._tables_fit(meta)):
            super()._prefill(q, k, v, kv_cache, meta, plan, scale, out, sinks)
            return
        if plan.prefill_chunks is None:
            plan.prefill_chunks = [x for s in plan.prefill
                                   for x in (s.start, s.end - s.start, s.seq_len, s.index)]
        self._ext.prefill_attention(q, kv_cache, meta.block_tables, plan.prefill_chunks, scale,
                                    out)

    def _applies(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and (q.dtype, kv_cache.dtype) in SUPPORTED_DTYPES
                and self._ext.prefill_head_size_supported(q.shape[-1])
                and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]
                and kv_cache.is_contiguous())

    @staticmethod
    def _tables_fit(meta: AttentionMetadata) -> bool:
        return meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()


def cpu_attention_backend() -> TorchAttentionBackend:
    """The CPU backend with the extension's prefill kernel, or the plain PyTorch one where the
    extension cannot be built (a warning says why)."""
    from tokenmill.kernels.cpu import extension_or_none

    ext = extension_or_none()
    return TorchAttentionBackend() if ext is None else CpuAttentionBackend(ext)
