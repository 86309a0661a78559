"""The projections of a CPU op program: which kernel route each linear module takes, as the
C++ side (``tokenmill/kernels/cpu/linear_spec.h``) takes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models import layers
from tokenmill.quant.kernel_choice import cpu_kernels
from tokenmill.quant.kquant import KQuantLinear
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.packing import dense_dtype

# Linear kinds, as in linear_spec.h.
KIND_FLOAT, KIND_INT8, KIND_INT4, KIND_KQUANT = 0, 1, 2, 3


class UnsupportedModel(ValueError):
    """The model has a part the CPU op program does not reproduce exactly."""


@dataclass(frozen=True)
class LinearParts:
    """One projection as the C++ side takes it: kind tag, tensors, int4 group size."""

    kind: int
    out: int  # output features
    weight: torch.Tensor
    bias: torch.Tensor | None
    scales: torch.Tensor | None = None
    group_size: int = 0
    # > 0 where the module computes with tokenmill's own int kernel (for int4 the packing's
    # block width), 0 where with PyTorch's: the C++ side must take the same one.
    own_kernel: int = 0
    own_min_rows: int = 1  # rows from which it does
    # Rows from which the module dequantizes for one dense matmul, in bf16 (else fp32), for
    # int4 decoding PyTorch's packing in blocks of dense_block_n outputs (0: PyTorch's kernel
    # instead, as the module does where it cannot decode): the C++ side takes the same route.
    dense_min_rows: int = 1 << 62
    dense_bf16: bool = True
    dense_block_n: int = 0
    # > 0: the own kernel runs on integer activations of this many bits, in steps with prompt
    # tokens and in decode-only ones (see _WeightOnlyLinear.activation_bits); for int4 it
    # reads the weight in q8 tiles (Int4WeightOnlyLinear.q8_tiles).
    act_bits: int = 0
    decode_act_bits: int = 0
    q8_tiles: tuple[torch.Tensor, torch.Tensor] | None = None

    def out_features(self) -> int:
        """The projection's outputs: the program's buffer width for them."""
        return self.out

    def row_dispatch(self) -> list[int]:
        """The C++ LinearSpec's row-count routing, in Program.add_linear's order."""
        return [self.own_kernel, self.own_min_rows, self.act_bits, self.dense_min_rows,
                int(self.dense_bf16), self.dense_block_n, self.decode_act_bits]

    def tensors(self) -> list[torch.Tensor]:
        empty = torch.empty(0)
        q8 = self.q8_tiles or (empty, empty)
        return [self.weight, empty if self.bias is None else self.bias,
                empty if self.scales is None else self.scales, *q8]


def linear_parts(module: nn.Module, dtype: torch.dtype) -> LinearParts:
    """The kind and tensors of a projection module; UnsupportedModel for unknown modules."""
    # (layers.Linear's product is F.linear's wherever this stack runs: off CUDA.)
    if isinstance(module, nn.Linear) and type(module).forward in (nn.Linear.forward,
                                                                  layers.Linear.forward):
        if module.weight.dtype != dtype:
            raise UnsupportedModel(f"linear weight is {module.weight.dtype}, activations {dtype}")
        return LinearParts(KIND_FLOAT, module.out_features, module.weight, module.bias)
    quant = _quant_parts(module)
    if quant is None:
        raise UnsupportedModel(f"no CPU program form for a projection of type "
                               f"{type(module).__name__}")
    return quant


def _quant_parts(module: nn.Module) -> LinearParts | None:
    """Parts of tokenmill.quant's weight-only modules, or None for any other module."""
    if type(module) is KQuantLinear:
        # The GGUF blocks and their segment table (in the scales' place); KQuantLinear takes
        # its kernel below dense_min_rows, the dense matmul from there, as the C++ side does.
        return LinearParts(KIND_KQUANT, module.out_features, module.weight, module.bias,
                           module.segments, dense_min_rows=int(module.dense_min_rows),
                           dense_bf16=dense_dtype("cpu") == torch.bfloat16, own_kernel=1)
    if type(module) not in (Int8WeightOnlyLinear, Int4WeightOnlyLinear):
        return None
    own = cpu_kernels() is not None
    dense = {"dense_min_rows": int(module.dense_min_rows),
             "dense_bf16": dense_dtype("cpu") == torch.bfloat16}
    if type(module) is Int8WeightOnlyLinear:
        return LinearParts(KIND_INT8, module.out_features, module.weight, module.bias,
                           module.scales, **dense,
                           own_kernel=int(own),
                           own_min_rows=int(module.own_min_rows),
                           act_bits=module.activation_bits() if own else 0,
                           decode_act_bits=module.activation_bits(True) if own else 0)
    if type(module) is Int4WeightOnlyLinear:
        return LinearParts(KIND_INT4, module.out_features, module.weight, module.bias,
                           module.scales_and_zeros, int(module.group_size), **dense,
                           dense_block_n=module.dense_block_n(),
                           own_kernel=module.cpu_block_n() if own else 0,
                           own_min_rows=int(module.own_min_rows),
                           act_bits=module.activation_bits() if own else 0,
                           decode_act_bits=module.activation_bits(True) if own else 0,
                           q8_tiles=module.q8_tiles() if own and module.int_activations()
                           else None)
    return None
