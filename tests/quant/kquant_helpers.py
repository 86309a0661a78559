"""Test helper: GGUF tensors in every block type the K-quant kernels take, as stored bytes.

Types the ``gguf`` package can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized with its
own code; for the others (Q2_K..Q6_K, IQ4_XS) random valid blocks are built here: random
bytes, with the fp16 scale fields set to small finite values.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# Byte offsets of each random-block type's fp16 scales (d, and dmin where it has one).
HALF_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
               Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
ALL_TYPES = QUANTIZABLE + tuple(HALF_FIELDS)


def make_blocks(qtype: Q, rows: int, cols: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """uint8 ``[rows, row bytes]``: ``rows`` x ``cols`` weights stored as ``qtype``; ``scale``
    shrinks the weights (the fp16 scales of random blocks)."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05 * scale
        return quantize(weights, qtype)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS.get(qtype, (0,)):  # other types: d first, as IQ2_XS and most
        half = (rng.uniform(0.0005, 0.004, blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., off:off + 2] = half[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def reference_weight(blocks: np.ndarray, qtype: Q) -> torch.Tensor:
    """gguf's own dequantization of ``blocks``, fp32."""
    return torch.from_numpy(np.asarray(dequantize(blocks, qtype), dtype=np.float32).copy())


def activation_error_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """The largest |error| int8 activations (one scale per ``block`` inputs, round to nearest)
    can make in ``x @ w.T``: half a step per input, times |w|, summed; plus fp32 slack."""
    m, k = x.shape
    pad = (-k) % block
    xp = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(m, -1, block)
    step = xp.amax(dim=-1, keepdim=True) / 127.0
    half_step = (step / 2).expand_as(xp).reshape(m, -1)[:, :k]
    slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    return half_step @ w.abs().T + slack


def act_block(qtype: Q) -> int:
    """Inputs per activation scale: 32 for every type (kquant.h quantizes the activations as
    llama.cpp's q8_0 does, also for the super-block types)."""
    return 32
