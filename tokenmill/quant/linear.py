"""Quantized replacements for ``nn.Linear``: weight-only int8 / int4 (fp8 is in ``fp8.py``).

Few rows (decode) run weight-only kernels, which read 1 or 0.5 byte per weight instead of 4
and beat the fp32 matmul about 2x: on the CPU tokenmill's own from 2 rows (``kernel_choice``,
C++ in ``tokenmill/kernels/cpu/quant_gemm.h``), PyTorch's for one row and where that extension cannot
be built. Many rows (prefill) are compute-bound, where those kernels lose to a bf16 matmul;
there the weight is dequantized to bf16 on the fly for one dense matmul (see
benchmarks/results/quant-kernels-cpu.md for the measurements behind ``dense_min_rows``).
Which path a call takes is decided in ``kernel_choice``. Every path takes activations in
bf16; the result comes back in the input's dtype, the bias added before that cast.

On CUDA the same modules call PyTorch's CUDA kernels: ``_weight_int8pack_mm`` for int8 (dense
bf16 where this build lacks it) and tinygemm's ``_weight_int4pack_mm`` for int4, which needs
its own packing (:class:`Int4TinyGemmLinear`).

``tokenmill.runner.cpu_linear`` reads these modules' tensors (``weight``, ``bias``,
``scales`` / ``scales_and_zeros``, ``group_size``) and repeats the small-batch path in C++.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant import kernel_choice
from tokenmill.quant.packing import (
    KERNEL_DTYPE,
    Int4Groups,
    dense_dtype,
    dequantize_int4_t,
    dequantize_int8,
    int4_block_n,
    int4_scales_and_zeros,
    pack_int4,
    pack_int4_q8,
    pack_int8_q16_tiles,
    q8_layout_fits,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int4_blocks,
    unpack_int4_rows,
)


class _WeightOnlyLinear(nn.Module):
    """What the int8 and int4 modules share: shapes, bias, the row-count dispatch."""

    # With the fp32 kernels (USE_INT_ACTIVATIONS off): one row is memory- and decode-bound,
    # and PyTorch's kernels were as fast or faster there in the model on an AVX2 EPYC (int4
    # ~15%, the int8 head ~30%); from two rows on, decoding the weights once for all rows wins
    # (benchmarks/results/quant-kernels-avx2-cpu.md). The integer-activation kernels win from
    # one row (own_min_rows).
    OWN_MIN_ROWS = 2

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dense_min_rows: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Rows from which forward() dequantizes for one dense matmul (bf16, or fp32 on CPUs
        # without native bf16: see dense_dtype); tests move it.
        self.dense_min_rows = dense_min_rows
        # Rows from which the CPU int path takes tokenmill's own kernel (cpu_kernels) rather
        # than PyTorch's; 1 once pinned (pin_row_kernels), so that every row count computes
        # alike.
        self.own_min_rows = self.OWN_MIN_ROWS
        # fp32 in and out through tokenmill's CPU kernels at every row count, instead of bf16:
        # set for output heads (wrap_head), whose bf16 logits (steps of 0.125 around 20) tied
        # the embedded model's two best first tokens of "What is the capital of France?".
        self.fp32_io = False
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        ext = None
        own_min_rows = 1 if self.fp32_io else self.own_min_rows
        if (x2.device.type == "cpu" and own_min_rows <= rows < self.dense_min_rows):
            ext = kernel_choice.cpu_kernels()
        if ext is not None and self._own_kernel_applies():
            # bf16 activations, as PyTorch's kernels take them (unless fp32_io). The kernels
            # take fp32 too, but unrounded activations into every layer changed the embedded
            # model's greedy answers (same perplexity; "What is the capital of France?" lost
            # its "Paris"): kept as before.
            y = self._own_kernel(ext, x2.float() if self.fp32_io else x2.to(KERNEL_DTYPE))
        else:
            xb = x2.to(KERNEL_DTYPE)
            if rows >= self.dense_min_rows:
                y = self._dense(x2 if self.fp32_io else xb)
            elif x2.device.type == "cpu":
                y = self._kernel(xb)
            else:
                y = self._cuda_kernel(xb)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """PyTorch's weight-only kernel on bf16 activations."""
        raise NotImplementedError

    def _own_kernel_applies(self) -> bool:
        """Whether tokenmill's CPU kernel reads this module's weight layout."""
        return True

    def int_activations(self) -> bool:
        """Whether tokenmill's CPU kernel for this layer quantizes the activations to integers
        (``USE_INT_ACTIVATIONS``, tokenmill/kernels/cpu/int_dot.h) rather than widening them to
        fp32."""
        return kernel_choice.USE_INT_ACTIVATIONS and self.weight.device.type == "cpu"

    def activation_bits(self, decode_only: bool = False) -> int:
        """The bits of those integer activations (in a prompt step, or a decode-only one); 0
        where the layer has none."""
        return 16 if self.int_activations() else 0

    @property
    def own_min_rows(self) -> int:
        """Rows from which the CPU path takes tokenmill's own kernel rather than PyTorch's:
        1 where that kernel runs on integer activations (it is ahead at one row too)."""
        return 1 if self.int_activations() else self._own_min_rows

    @own_min_rows.setter
    def own_min_rows(self, rows: int) -> None:
        self._own_min_rows = rows

    def _own_kernel(self, ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
        """tokenmill's CPU kernel (``kernel_choice.cpu_kernels()``), fp32 or bf16 in and out."""
        raise NotImplementedError

    def _cuda_kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """``_kernel`` on a GPU, or the dense path where this build has no such kernel."""
        if type(self) not in kernel_choice.MISSING_CUDA_KERNELS:
            try:
                return self._kernel(xb)
            except NotImplementedError:
                kernel_choice.MISSING_CUDA_KERNELS.add(type(self))
        return self._dense(xb)

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` this module computes with, in fp32."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ (weight * scales[:, None]).T + bias`` with int8 weights, one scale per row.

    ``weight`` is int8 ``[out, in]``, ``scales`` bf16 ``[out]``.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dense_min_rows: int | None = None) -> None:
        out_features, in_features = weight.shape
        if dense_min_rows is None:
            dense_min_rows = kernel_choice.default_dense_min_rows("int8", weight.numel(),
                                                                  weight.device.type)
        super().__init__(in_features, out_features, bias, dense_min_rows)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        # Output heads (wrap_head) also keep the weight in output tiles
        # (pack_int8_q16_tiles), packed on the first call of INT8_TILES_MIN_ROWS rows or more:
        # a head computes one row per sequence of a batch.
        self.row_tiles = False
        self._tiles: torch.Tensor | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
        """Quantize a float weight ``[out, in]`` (symmetric, per output channel)."""
        q, scales = quantize_int8(weight)
        return cls(q, scales, bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(xb, self.weight, self.scales)

    def _own_kernel(self, ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if self.int_activations():
            return self._q16_kernel(ext, x)
        return ext.int8_linear(x, self.weight, self.scales)

    def _q16_kernel(self, ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
        """The int8 x int16 kernel: in output tiles for a head's batch of rows, else plain
        (the same bits)."""
        if self.row_tiles and x.shape[0] >= kernel_choice.INT8_TILES_MIN_ROWS:
            return ext.int8_q16_tiles_linear(x, self.q16_tiles(), self.scales, self.out_features)
        return ext.int8_q16_linear(x, self.weight, self.scales)

    def direct_rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``forward`` of an output head (fp32 in and out, integer activations, no bias) on
        2-D fp32 rows, as a callable that goes straight to the C++ kernel below the dense
        cut-over; None where forward would take another route. For the fused decoder's
        logits: forward's own checks and conversions cost ~0.13 ms of a ~5 ms decode step on
        a 2-core Xeon, run right after the step has streamed the weights through the caches,
        where the kernel's own dispatch costs a few microseconds. Same bits as forward."""
        ext = kernel_choice.cpu_kernels()
        if (ext is None or not self.fp32_io or not self.int_activations()
                or self.bias is not None):
            return None

        def rows_kernel(x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] >= self.dense_min_rows:
                return self(x)
            return self._q16_kernel(ext, x)

        return rows_kernel

    def prepare_row_tiles(self) -> None:
        """Pack the output tiles now where batches of rows will read them (an output head on
        tokenmill's integer kernels) rather than in the first batched step, which would wait
        for it (~35 ms for the embedded model's head) and free the packing's temporaries in
        the middle of serving, where they stay in the heap."""
        if self.row_tiles and self.int_activations() and kernel_choice.cpu_kernels() is not None:
            self.q16_tiles()

    def q16_tiles(self) -> torch.Tensor:
        """The weight in output tiles (``pack_int8_q16_tiles``), packed on first use."""
        if self._tiles is None:
            self._tiles = pack_int8_q16_tiles(self.weight)
        return self._tiles

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        dtype = dense_dtype(xb.device.type)
        return F.linear(xb.to(dtype), dequantize_int8(self.weight, self.scales, dtype))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.weight, self.scales, torch.float32)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup) in ``dtype``."""
        flat = ids.reshape(-1)
        rows = dequantize_int8(self.weight[flat], self.scales[flat], dtype)
        return rows.view(*ids.shape, self.in_features)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ w.T + bias`` with ``w = (q - 8) * scale + zero`` per group of input columns.

    ``weight`` holds the nibbles packed by ``_convert_weight_to_int4pack_for_cpu``;
    ``scales_and_zeros`` is bf16 ``[in // group_size, out, 2]``.
    """

    def __init__(self, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 out_features: int, bias: torch.Tensor | None,
                 dense_min_rows: int | None = None) -> None:
        in_features = scales_and_zeros.shape[0] * group_size
        # Dense decoding reads the packed layout: only where it is a known one, and whole
        # blocks of rows make it a handful of views.
        block_n = int4_block_n()
        # The q8 tiles are unpacked from it once, whole blocks or not (PyTorch packs rows in
        # blocks of 64 on AVX-512 CPUs: a 96-row layer still takes the integer kernel).
        q8_fits = (block_n is not None and weight.dtype == torch.uint8
                   and q8_layout_fits(out_features, in_features, group_size))
        if dense_min_rows is None:
            dense_min_rows = kernel_choice.default_dense_min_rows(
                "int4", out_features * in_features, weight.device.type, int8_tiles=q8_fits)
        super().__init__(in_features, out_features, bias, dense_min_rows)
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self._can_decode = block_n is not None and out_features % block_n == 0
        self._q8_fits = q8_fits
        # Activation bits in decode-only steps (pin_row_kernels sets the prompts' bits).
        self.decode_act_bits = kernel_choice.INT4_DECODE_ACT_BITS
        # Whether the step being computed is decode-only: told by the step backend before
        # each step, from the step's AttentionMetadata (StepKindMarks).
        self.decode_only = False
        self._q8: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_groups(cls, groups: Int4Groups, bias: torch.Tensor | None) -> Int4WeightOnlyLinear:
        """Pack 4-bit weights in the plain layout (see :class:`Int4Groups`)."""
        packed, scales_and_zeros = pack_int4(groups)
        return cls(packed, scales_and_zeros, groups.group_size, groups.q.shape[0], bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int = 32) -> Int4WeightOnlyLinear:
        """Quantize a float weight ``[out, in]`` (asymmetric min/max per group)."""
        return cls.from_groups(quantize_int4(weight, group_size), bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.weight, self.group_size,
                                                          self.scales_and_zeros)

    def _own_kernel_applies(self) -> bool:
        return self.int_activations() or self.cpu_block_n() > 0

    def _own_kernel(self, ext: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if self.int_activations():
            packed, scales = self.q8_tiles()  # type: ignore[misc]
            return ext.int4_q8_linear(x, packed, scales, self.group_size,
                                      self.activation_bits(self.decode_only))
        return ext.int4_linear(x, self.weight, self.scales_and_zeros, self.group_size,
                               self.cpu_block_n())

    def int_activations(self) -> bool:
        # Not for fp32 heads with int8 activations: ~0.5% of noise on the logits.
        return ((not self.fp32_io or kernel_choice.INT4_ACT_BITS == 16)
                and self.q8_tiles() is not None)

    def activation_bits(self, decode_only: bool = False) -> int:
        """The bits in a prompt step, or in a decode-only one (fp32 heads: the prompt's)."""
        if not self.int_activations():
            return 0
        if decode_only and not self.fp32_io:
            return self.decode_act_bits
        return kernel_choice.INT4_ACT_BITS

    def q8_tiles(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight in the layout of the int4 x int8 kernel (``pack_int4_q8``), packed on
        first use and kept beside the PyTorch packing (which the dense path decodes); None
        where that kernel does not apply (``USE_INT_ACTIVATIONS`` off, a GPU, a shape it cannot
        tile, an unknown packing)."""
        if not (self._q8_fits and super().int_activations()):
            return None
        if self._q8 is None:
            unpack = unpack_int4_blocks if self._can_decode else unpack_int4
            q = unpack(self.weight, self.out_features, self.in_features)
            self._q8 = pack_int4_q8(q, self.scales_and_zeros)
        return self._q8

    def dense_block_n(self) -> int:
        """The block width in which the dense path decodes this weight's packing; 0 where it
        cannot and PyTorch's int4 kernel computes every row count instead."""
        return int4_block_n() or 0 if self._can_decode else 0

    def cpu_block_n(self) -> int:
        """The output-block width of this weight's packing that tokenmill's own int4 kernel
        reads, or 0 where it cannot (an unknown layout, a partial last block, a GPU)."""
        block_n = int4_block_n()
        if (self.weight.device.type != "cpu" or block_n is None
                or self.out_features % block_n or self.weight.dtype != torch.uint8):
            return 0
        return block_n

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        if not self._can_decode:
            return self._kernel(xb)
        ext = kernel_choice.cpu_kernels() if self.weight.device.type == "cpu" else None
        if ext is not None:  # one pass in C++, the same bits as PyTorch's ops below
            w_t = ext.dequantize_int4_t(self.weight, self.scales_and_zeros, self.group_size,
                                        self.out_features, self.in_features, int4_block_n())
        else:
            w_t = dequantize_int4_t(self.weight, self.scales_and_zeros, self.group_size,
                                    self.out_features, self.in_features)
        dtype = dense_dtype(xb.device.type)
        return xb.to(dtype) @ w_t.to(dtype)

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values ``[out, in]`` (uint8 in [0, 15])."""
        return unpack_int4(self.weight, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        q = self.nibbles().float().view(self.out_features, -1, g) - 8.0
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
        w = q * sz[..., 0:1] + sz[..., 1:2]
        return w.view(self.out_features, self.in_features)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup) in ``dtype``."""
        flat = ids.reshape(-1)
        q = unpack_int4_rows(self.weight, self.out_features, self.in_features, flat)
        sz = self.scales_and_zeros[:, flat].transpose(0, 1).float()  # [R, groups, 2]
        q = q.float().view(flat.shape[0], -1, self.group_size) - 8.0
        rows = (q * sz[..., 0:1] + sz[..., 1:2]).view(flat.shape[0], self.in_features)
        return rows.to(dtype).view(*ids.shape, self.in_features)


class Int4TinyGemmLinear(_WeightOnlyLinear):
    """int4 on CUDA: tinygemm's ``_weight_int4pack_mm`` with the same arithmetic as
    :class:`Int4WeightOnlyLinear` (``w = (q - 8) * scale + zero`` per group), in its own
    packed layout (``_convert_weight_to_int4pack``, CUDA only). The kernel serves every batch
    size: there is no dense fallback to dequantize from an opaque layout.
    """

    INNER_K_TILES = 8

    def __init__(self, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 out_features: int, bias: torch.Tensor | None) -> None:
        in_features = scales_and_zeros.shape[0] * group_size
        super().__init__(in_features, out_features, bias, dense_min_rows=kernel_choice.NEVER_DENSE)
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int = 32) -> Int4TinyGemmLinear:
        """Quantize a CUDA float weight ``[out, in]`` (asymmetric min/max per group)."""
        return cls.from_groups(quantize_int4(weight, group_size), bias)

    @classmethod
    def from_groups(cls, groups: Int4Groups, bias: torch.Tensor | None) -> Int4TinyGemmLinear:
        n, k = groups.q.shape
        if k % (cls.INNER_K_TILES * 16):
            raise ValueError(f"in_features {k} is not a multiple of {cls.INNER_K_TILES * 16} "
                             "(tinygemm's int4 tiles)")
        q = groups.q.to(torch.uint8)
        # Two nibbles a byte, the even column in the high half: the layout the op unpacks.
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, cls.INNER_K_TILES)
        return cls(packed, int4_scales_and_zeros(groups), groups.group_size, n, bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(xb, self.weight, self.group_size,
                                                  self.scales_and_zeros)

    _cuda_kernel = _kernel
    _dense = _kernel

    def dequantize(self) -> torch.Tensor:
        # The packed layout is the kernel's business: multiply the identity through it.
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.weight.device)
        return self._kernel(eye).float().t().contiguous()


class StepKindMarks:
    """A model's int4 layers, whose integer activations take their own bits in decode-only
    steps (``decode_act_bits``): the step backend tells them each step's kind from its
    ``AttentionMetadata.decode_only`` before running it (the C++ op program tells its own
    linears from its own step)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]

    def mark(self, decode_only: bool) -> None:
        """The coming step is decode-only (``decode_only``) or has prompt tokens."""
        for layer in self.layers:
            layer.decode_only = decode_only
