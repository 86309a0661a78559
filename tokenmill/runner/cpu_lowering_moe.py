"""The mixture-of-experts blocks (:mod:`tokenmill.models.moe`) lowered to the op program: a
sparse layer's feed-forward becomes one generic ``moe`` op (``moe_kernels.h``) whose router and
experts are the program's ordinary linear kinds, so float, int8 and int4 experts all run there.

Importing this module registers the lowerings (:mod:`tokenmill.runner.cpu_program` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.moe import silu_gate
from tokenmill.models.moe import MoEDecoderLayer, Router, SparseMoeBlock, StackedExperts
from tokenmill.quant.experts import QuantizedExperts
from tokenmill.runner.cpu_linear import KIND_FLOAT, LinearParts, UnsupportedModel, linear_parts
from tokenmill.runner.cpu_lowering import IO, Add, ProgramBuilder, lowering


@dataclass(frozen=True, eq=False)
class Moe:
    """dst = the experts' weighted sum for src: ``router`` gives one logit per expert; each
    token's top ``top_k`` of their softmax (renormalised to sum to one where ``renormalize``)
    pick the experts whose ``gate_up`` ([gate | up]), SiLU-and-mul and ``down`` it runs."""

    src: int
    dst: int
    router: LinearParts
    top_k: int
    renormalize: bool
    gate_up: tuple[LinearParts, ...]
    down: tuple[LinearParts, ...]


@lowering(MoEDecoderLayer, "forward")
def _lower_moe_decoder_layer(layer: MoEDecoderLayer, b: ProgramBuilder, path: str,
                             h: int) -> int:
    # The pre-norm layer of DecoderLayer's lowering, with whatever feed-forward make_mlp built.
    x = b.lower(layer.input_layernorm, f"{path}.input_layernorm", h)
    b.ops.append(Add(h, b.lower(layer.self_attn, f"{path}.self_attn", x)))
    x = b.lower(layer.post_attention_layernorm, f"{path}.post_attention_layernorm", h)
    b.ops.append(Add(h, b.lower(layer.mlp, f"{path}.mlp", x)))
    return h


def _float_parts(weight: torch.Tensor, dtype: torch.dtype, path: str) -> LinearParts:
    if weight.dtype != dtype:
        raise UnsupportedModel(f"{path}: weight in {weight.dtype}, activations in {dtype}")
    return LinearParts(KIND_FLOAT, weight.shape[0], weight, None)


def _experts(experts: torch.nn.Module, dtype: torch.dtype, path: str
             ) -> tuple[tuple[LinearParts, ...], tuple[LinearParts, ...]]:
    """Each expert's (gate_up, down) linears, as stacked float slices or quantized modules."""
    if type(experts) is StackedExperts:
        n = experts.num_experts
        return (tuple(_float_parts(experts.w13[e], dtype, f"{path}.w13") for e in range(n)),
                tuple(_float_parts(experts.w2[e], dtype, f"{path}.w2") for e in range(n)))
    if type(experts) is QuantizedExperts:
        if experts.b13 is not None or experts.b2 is not None or experts.activation is not silu_gate:
            raise UnsupportedModel(f"{path}: experts with biases or another gating than SiLU's")
        return (tuple(linear_parts(m, dtype) for m in experts.gate_up),
                tuple(linear_parts(m, dtype) for m in experts.down))
    # A subclass computes more (gpt-oss's biases and clamped SwiGLU): not this op.
    raise UnsupportedModel(f"{path}: experts of type {type(experts).__name__} have no CPU "
                           "program lowering")


@lowering(SparseMoeBlock, "forward")
def _lower_sparse_moe(block: SparseMoeBlock, b: ProgramBuilder, path: str, src: int) -> int:
    gate = block.gate
    if type(gate) is not Router:
        raise UnsupportedModel(f"{path}.gate: a router of type {type(gate).__name__} has no "
                               "CPU program lowering")
    gate_up, down = _experts(block.experts, b.dtype, f"{path}.experts")
    num_experts = gate.weight.shape[0]
    if len(gate_up) != num_experts:
        raise UnsupportedModel(f"{path}: {len(gate_up)} experts under a router of "
                               f"{num_experts}")
    width = b.buffers[src].width
    dst = b.buffer("moe", width, IO)
    b.ops.append(Moe(src, dst, _float_parts(gate.weight, b.dtype, f"{path}.gate"),
                     int(gate.top_k), bool(gate.renormalize), gate_up, down))
    return dst


def build_moe(program: object, op: Moe) -> None:
    """Add ``op`` to the C++ ``program``: the router, then each expert in order."""
    r = op.router
    index = program.add_moe(op.src, op.dst, op.top_k, op.renormalize, r.kind, r.tensors(),
                            r.group_size, r.row_dispatch())
    for gu, d in zip(op.gate_up, op.down, strict=True):
        program.add_moe_expert(index, gu.kind, gu.tensors(), gu.group_size, gu.row_dispatch(),
                               d.kind, d.tensors(), d.group_size, d.row_dispatch())

