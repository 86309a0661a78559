"""Which kernel a quantized layer runs (``tokenmill.quant.linear``): the environment switches
(tokenmill's C++ kernels or PyTorch's, integer activations and their bits), the row counts from which a layer computes dense, and the CUDA
kernels this PyTorch build lacks.

The switches come from the environment (``tokenmill.envs``) when first asked for, then stay
here: the modules read them through this module at every call, so a benchmark or a test may
set them while the process runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from tokenmill import envs
from tokenmill.kernels.cpu import extension_or_none
from tokenmill.quant.packing import cpu_has_amx, dense_dtype


def cpu_kernels() -> ModuleType | None:
    """tokenmill's C++ int4 / int8 matmuls (``tokenmill/kernels/cpu/quant_gemm.h``), or None where the
    extension cannot be built: then PyTorch's weight-only kernels compute instead.

    PyTorch's int4 CPU kernel decodes the weights again for every few rows, so a 32-row decode
    step costs ~14x a 1-row one on an AVX2 CPU; ours decodes each tile once per call. Both
    take bf16 activations and give each row the same bits whatever the row count.
    """
    return extension_or_none() if setting("USE_CPU_KERNELS") else None


# The switches, each a module attribute read from its variable (tokenmill.envs) on first use,
# not when this module is imported (setting / __getattr__):
# - USE_CPU_KERNELS ($TOKENMILL_CPU_INT_KERNELS): False sends the CPU int layers to PyTorch's
#   kernels (benchmarks compare the two).
# - USE_INT_ACTIVATIONS ($TOKENMILL_INT_ACTIVATIONS): tokenmill's CPU kernels quantize the
#   activations and multiply in integers (tokenmill/kernels/cpu/int_dot.h): int4 layers with int16 or
#   int8 activations in blocks of 32 (one scale each), int8 layers with int16 activations (one
#   scale a row), and the products run on integer dot instructions: ~2.5-4x the fp32 kernels
#   at one row on an AVX2 EPYC (benchmarks/results/quant-kernels-avx2-cpu.md). int16 steps are
#   ~1/32767 of a block's largest value, far finer than the bf16 rounding every quantized
#   layer's input gets anyway. False keeps the fp32 kernels (bf16 activations widened exactly).
# - INT4_ACT_BITS / INT4_DECODE_ACT_BITS ($TOKENMILL_INT4_ACT_BITS, 16, and
#   $TOKENMILL_INT4_DECODE_ACT_BITS, 8): int4 layers' activation bits in steps with prompt
#   tokens and in decode-only steps. Decoding takes int8 (llama.cpp's Q4_1 x Q8_1): with
#   AVX512-VNNI the kernel then runs two weight tiles a register, and the int4 matmuls of a
#   32-sequence decode step ran 1.7x faster on a Zen 5 (a whole step 26.6 -> 22.2 ms). Prompts
#   keep int16: int8 at every step measured +0.15% perplexity (14.763 vs 14.741 on the
#   10.5k-token text) but moved the thin margins of some first tokens (0.14 nats for the
#   embedded model's "The" of "The capital of France is Paris."), and the first token of an
#   answer is the prompt step's. Under --deterministic both are the prompt's (pin_row_kernels):
#   a row's bits must not depend on the step it is in.
_FROM_ENV = {"USE_CPU_KERNELS": "TOKENMILL_CPU_INT_KERNELS",
             "USE_INT_ACTIVATIONS": "TOKENMILL_INT_ACTIVATIONS",
             "INT4_ACT_BITS": "TOKENMILL_INT4_ACT_BITS",
             "INT4_DECODE_ACT_BITS": "TOKENMILL_INT4_DECODE_ACT_BITS"}


def setting(name: str) -> Any:
    """The switch ``name`` (USE_CPU_KERNELS, USE_INT_ACTIVATIONS, INT4_ACT_BITS,
    INT4_DECODE_ACT_BITS): as set here, else read from its environment variable and kept."""
    if name not in globals():
        globals()[name] = getattr(envs, _FROM_ENV[name])
    return globals()[name]


def __getattr__(name: str) -> Any:
    """``kernel_choice.USE_CPU_KERNELS`` and the other switches, read on first use."""
    if name in _FROM_ENV:
        return setting(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Rows from which the dense bf16 path wins where AMX runs it, measured on SmolLM2-135M's shapes
# (see benchmarks/results/quant-kernels-cpu.md). Dequantizing a weight that does not fit in cache
# (the 576 x 49152 head) costs several times more per element, which moves the crossover.
INT8_DENSE_MIN_ROWS = 48
INT4_DENSE_MIN_ROWS = 96
LARGE_WEIGHT_NUMEL = 1 << 23
INT8_LARGE_DENSE_MIN_ROWS = 256
INT4_LARGE_DENSE_MIN_ROWS = 512
# Where the dense path is slower, tokenmill's own int kernels (from 2 rows) beat it up to a few
# hundred rows: where it is fp32 (CPUs without native bf16, see dense_dtype; ~4x the cost per
# row, measured on an AVX2 EPYC, benchmarks/results/quant-kernels-cpu.md), and where it is bf16
# on AVX512-BF16 without AMX (a Zen 5: the int4 kernel won up to ~300-500 rows by shape, int8 up
# to ~100; benchmarks/results/quant-kernels-zen5-cpu.md). (Large weights keep their thresholds
# above.)
INT8_SLOW_DENSE_MIN_ROWS = 96
INT4_SLOW_DENSE_MIN_ROWS = 384
# ... except where prompts, too, run int4 layers on int8 activations ($TOKENMILL_INT4_ACT_BITS=8)
# with two weight tiles a 512-bit register (AVX512-VNNI: int4_int8_tile_pairs): those beat
# decoding the weight for a bf16 matmul at every row count (a Zen 5, the embedded model's 120
# int4 matmuls at 512 rows: 124 ms against 181).
# A dense_min_rows no step reaches: the module runs its int kernel at every row count.
NEVER_DENSE = 1 << 62
# Rows from which an int8 output head takes the output-tiled kernel (int8_q16_tiles_linear,
# the same bits): on a Zen 5 the 576 x 49152 head at 32 rows 5.7 -> 3.8 ms, at 4 rows 0.82 ->
# 0.66 ms, but at 1 and 2 rows slower (0.44 -> 0.55 ms, reading the weight from memory)
# (benchmarks/head_tiles.py, benchmarks/results/head-tiles-zen5-cpu.json).
INT8_TILES_MIN_ROWS = 4


def default_dense_min_rows(method: str, numel: int, device_type: str,
                           int8_tiles: bool = False) -> int:
    """Rows from which an ``int8`` / ``int4`` layer of ``numel`` weights computes dense;
    ``int8_tiles``: an int4 layer whose weight the int8-activation kernel can read."""
    if numel > LARGE_WEIGHT_NUMEL:
        return INT8_LARGE_DENSE_MIN_ROWS if method == "int8" else INT4_LARGE_DENSE_MIN_ROWS
    slow_dense = dense_dtype(device_type) == torch.float32 or (
        device_type == "cpu" and not cpu_has_amx())
    ext = cpu_kernels() if slow_dense else None
    if ext is not None:
        if (method == "int4" and int8_tiles and setting("INT4_ACT_BITS") == 8
                and setting("USE_INT_ACTIVATIONS")
                and ext.int4_int8_tile_pairs()):
            return NEVER_DENSE
        return INT8_SLOW_DENSE_MIN_ROWS if method == "int8" else INT4_SLOW_DENSE_MIN_ROWS
    return INT8_DENSE_MIN_ROWS if method == "int8" else INT4_DENSE_MIN_ROWS

# The module classes whose ``_kernel`` this PyTorch build lacks on CUDA, learned from the first
# call that raised NotImplementedError. It is a fact about the build, not about one layer, so
# one layer's failure sends every layer of its class to the dense path from then on.
MISSING_CUDA_KERNELS: set[type[nn.Module]] = set()
