"""Model steps as an op program on the CPU, executed by the C++ loop in ``tokenmill/kernels/cpu``.

On the CPU a step of a small model is dominated by Python dispatch of the ~30 non-matmul ops
per layer, not by arithmetic. When the model loads, :mod:`tokenmill.runner.cpu_lowering` turns
its module tree into a list of typed ops (norms, projections, rotary + KV store, attention,
SiLU-and-mul, residual adds), and :class:`CpuProgram` runs a whole step of them in one call to
the C++ extension (``op_program.cpp``): the matmuls as ATen calls or the int kernels, the glue
in hand-written loops. It runs decode-only steps and steps with prompt chunks (prefill, mixed
with decodes or not; each op's glue then runs on OpenMP's threads beside PyTorch's dense
matmuls, and attention is the CPU backend's prefill kernel). A model with a block the lowering
does not know gets no program (:class:`UnsupportedModel`, at load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tokenmill import envs
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.cpu import load_extension
from tokenmill.lora.layers import LoRALinear, LoRAStep
from tokenmill.quant.head import QuantizedEmbedding, QuantizedHead
from tokenmill.quant.linear import Int8WeightOnlyLinear
from tokenmill.quant.model import float_matmul_layers, pin_row_kernels
from tokenmill.runner import cpu_lowering as ops
from tokenmill.runner.cpu_linear import UnsupportedModel
from tokenmill.runner.cpu_lowering import ProgramBuilder, lower_model
from tokenmill.runner.cpu_lowering_moe import Moe, build_moe  # registers its lowerings
from tokenmill.utils import release_freed_memory

logger = logging.getLogger(__name__)
# The torch.profiler range of one program step (benchmarks/step_profile.py reads it).
PROFILE_RANGE = "tokenmill::fused_decode_stack"

# "1" forces the program on, "0" off; unset means DEFAULT_ENABLED (tokenmill.envs).
ENV_FLAG = "TOKENMILL_FUSED_DECODE"
DEFAULT_ENABLED = True
# The same for steps with prefill chunks (when the program is on at all).
PREFILL_ENV_FLAG = "TOKENMILL_FUSED_PREFILL"
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def fused_cache_dtype_ok(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the program reads a KV cache in ``cache_dtype`` under activations in
    ``dtype``: the same dtype, or fp16 under fp32 (op_program.cpp's check_step). Other pairs
    run model.forward."""
    return cache_dtype == dtype or (cache_dtype == torch.float16 and dtype == torch.float32)


def _flag(name: str, explicit: bool | None) -> bool:
    if explicit is not None:
        return explicit
    value = getattr(envs, name)
    return DEFAULT_ENABLED if value is None else value


def fused_decode_enabled(explicit: bool | None = None) -> bool:
    """Whether to use the program: ``explicit`` if given, else $TOKENMILL_FUSED_DECODE."""
    return _flag(ENV_FLAG, explicit)


def fused_prefill_enabled(explicit: bool | None = None) -> bool:
    """Whether the program takes steps with prefill chunks too: ``explicit`` if given, else
    $TOKENMILL_FUSED_PREFILL."""
    return _flag(PREFILL_ENV_FLAG, explicit)


def _build(ext: object, b: ProgramBuilder) -> object:
    """The C++ Program of the lowered ops."""
    program = ext.Program()
    for buf in b.buffers:
        program.add_buffer(buf.width, buf.cls)
    assert b.io is not None  # set by the model's lowering
    program.set_io(*b.io)
    empty = torch.empty(0)
    for op in b.ops:
        if isinstance(op, ops.RmsNorm):
            program.add_rms_norm(op.src, op.dst, op.weight, op.eps)
        elif isinstance(op, ops.Add):
            program.add_add(op.dst, op.src)
        elif isinstance(op, ops.Linear):
            p = op.parts
            program.add_linear(op.src, op.dst, p.kind, p.tensors(), p.group_size,
                               p.row_dispatch())
        elif isinstance(op, ops.RopeStoreKV):
            program.add_rope_store_kv(
                op.src, op.dst, op.cache, op.heads, op.kv_heads, op.head_dim,
                empty if op.q_norm is None else op.q_norm,
                empty if op.k_norm is None else op.k_norm, op.eps, op.cos_half, op.sin_half)
        elif isinstance(op, ops.Attention):
            program.add_attention(op.src, op.dst, op.cache, op.heads, op.kv_heads,
                                  op.head_dim, op.scale, op.window)
        elif isinstance(op, ops.SiluMul):
            program.add_silu_mul(op.src, op.dst)
        elif isinstance(op, ops.GeluTanhMul):
            program.add_gelu_tanh_mul(op.src, op.dst)
        elif isinstance(op, ops.Scale):
            program.add_scale(op.dst, op.factor)
        elif isinstance(op, Moe):
            build_moe(program, op)
        else:
            raise TypeError(f"no C++ op for {type(op).__name__}")
    return program


class CpuProgram:
    """``model.forward`` in one C++ call: decode-only steps, and (``prefill``) any other step
    of whole or chunked prompts, decodes beside them or not.

    Holds references to the model's own parameter tensors, so in-place weight updates are seen;
    replacing modules (e.g. quantizing) after construction needs a new CpuProgram.
    """

    def __init__(self, model: nn.Module, prefill: bool | None = None) -> None:
        lowered = lower_model(model)
        dtype = lowered.dtype
        if dtype not in _SUPPORTED_DTYPES:
            raise UnsupportedModel(f"activation dtype {dtype} (fp32 and bf16 only)")
        norms = [op.weight for op in lowered.ops if isinstance(op, ops.RmsNorm)]
        if any(t.device.type != "cpu" for t in [*norms, *(lowered.rope or ())]):
            raise UnsupportedModel("the op program runs on the CPU only")
        self.model = model
        self.dtype = dtype
        # The lowered ops, in order (what each step computes).
        self.ops: tuple[ops.Op, ...] = tuple(lowered.ops)
        self._checked_caches: tuple[int, int, int, int] | None = None
        ext = load_extension()
        self.program = _build(ext, lowered)
        # The token embeddings and the logits straight from the C++ kernels where the model's
        # table and head are int8 (the embedded model's Q8_0 table, tied): model's own
        # modules otherwise.
        lookup = getattr(lowered.embed, "direct_lookup", None)
        self._embed = (lookup() if lookup is not None else None) or lowered.embed
        self._head = _direct_head(lowered.head)
        # The int4 layers have just packed their q8 tiles, the head its output tiles: hand
        # the temporaries back to the OS.
        release_freed_memory()
        # Steps with prefill chunks too: where the extension has a prefill kernel for every
        # attention's head size (else those steps run model.forward).
        head_dims = {op.head_dim for op in self.ops if isinstance(op, ops.Attention)}
        self.prefill = (fused_prefill_enabled(prefill)
                        and all(ext.prefill_head_size_supported(d) for d in head_dims))
        # Whether LoRA slots are attached (attach_lora): steps with adapter rows run here too.
        self.lora = False

    def supports(self, input_ids: torch.Tensor, attn_meta: AttentionMetadata) -> bool:
        """Whether the program computes this step: decode-only ones, and with ``prefill``
        any other, on caches it reads."""
        if not (attn_meta.num_seqs > 0 and input_ids.shape[0] == sum(attn_meta.query_lens_cpu)
                and self._caches_ok(attn_meta.kv_caches)):
            return False
        return attn_meta.decode_only or self.prefill

    def _caches_ok(self, caches: list[torch.Tensor]) -> bool:
        """Whether the program reads these KV caches; checked once per list of caches (the
        runner keeps one for its life), not at every step."""
        if not caches:
            return False
        # The list and its first and last tensors' storage: a list made again (new caches)
        # is checked again.
        key = (id(caches), len(caches), caches[0].data_ptr(), caches[-1].data_ptr())
        if self._checked_caches != key:
            if not all(fused_cache_dtype_ok(c.dtype, self.dtype) and c.is_contiguous()
                       for c in caches):
                return False
            self._checked_caches = key
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits(hidden)``: the same fp32 logits, with a quantized int8 head
        straight from its kernel."""
        if self._head is None:
            return self.model.compute_logits(hidden)
        return self._head(hidden)

    def attach_lora(self, layers: list[dict[str, LoRALinear]]) -> None:
        """Compute LoRA updates too: ``layers`` are each decoder layer's LoRA layers by
        projection name (``LoRAManager.layers``), whose slots the program reads in place. Each
        wraps a projection the program computes, found by its module."""
        by_module = {id(op.module): i for i, op in enumerate(self.ops)
                     if isinstance(op, ops.Linear)}
        for wrapped in layers:
            for name, lora in wrapped.items():
                op = by_module.get(id(lora.base))
                if op is None:
                    raise ValueError(f"LoRA on {name}: a projection the CPU program does not "
                                     "compute")
                self.program.set_lora(op, lora.lora_a, lora.lora_b)
        self.lora = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata, lora: LoRAStep | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]``, as ``model.forward`` returns them.
        ``lora``: the step's LoRA rows (see :meth:`attach_lora`)."""
        hidden = self._embed(input_ids)
        chunks: list[int] = []
        if not attn_meta.decode_only:
            start = 0
            for i, (n, total) in enumerate(zip(attn_meta.query_lens_cpu, attn_meta.seq_lens_cpu,
                                               strict=True)):
                chunks += (start, n, total, i)
                start += n
        args = (hidden, positions, attn_meta.kv_caches, attn_meta.slot_mapping,
                attn_meta.seq_lens, attn_meta.block_tables.contiguous(), attn_meta.max_seq_len,
                chunks, None if lora is None else lora.row_slots)
        if not torch._C._autograd._profiler_enabled():  # the range costs ~4 us a step
            return self.program.forward(*args)
        # A named range for torch.profiler: the program's own C++ work (attention, norms,
        # rotary) is no ATen op and would otherwise show as time outside every op.
        with torch.profiler.record_function(PROFILE_RANGE):
            return self.program.forward(*args)


def _direct_head(head: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The int8 output head's kernel as one callable (``direct_rows_kernel``), where the
    model's logits are the plain product of ``head`` (the lowering says so) and its weight is
    an int8 quantized matrix; None elsewhere. Such a head also packs its output tiles now
    (``prepare_row_tiles``), with the rest of the model."""
    matrix = head.matrix if isinstance(head, QuantizedHead | QuantizedEmbedding) else None
    if not isinstance(matrix, Int8WeightOnlyLinear):
        return None
    matrix.prepare_row_tiles()
    return matrix.direct_rows_kernel()


def make_cpu_program(model: nn.Module, device: torch.device,
                     enabled: bool | None = None) -> CpuProgram | None:
    """A CpuProgram for ``model``, or None (with one log line) when it cannot have one."""
    if not fused_decode_enabled(enabled) or device.type != "cpu":
        return None
    try:
        return CpuProgram(model)
    except UnsupportedModel as e:
        logger.info("CPU op program off: %s", e)
    except Exception as e:  # a failed compile must never take the engine down
        logger.warning("CPU op program off, the C++ extension failed to build or load: %s", e)
    return None


def make_invariant_program(model: nn.Module, device: torch.device) -> CpuProgram:
    """The CpuProgram of a deterministic runner, which runs every step (each token laid out
    as a one-token sequence, see ``FlatBatch.add(split=True)``).

    A token's row then goes through the same code whatever shares its step: int kernels at
    every row count (:func:`~tokenmill.quant.model.pin_row_kernels`), attention of one query
    over its own context, glue loops per row. ValueError where the program cannot run the
    model; a failed build raises too, as falling back would silently drop the guarantee.
    """
    if device.type != "cpu":
        raise ValueError(f"deterministic runs on the CPU only, the model is on {device}")
    floats = float_matmul_layers(model)
    if floats:
        # MKL's fp32 GEMM takes other code paths for 1, 2-3 and 4+ rows (each rounds alike
        # within its range, measured on torch 2.13): only the int kernels hold at every size.
        raise ValueError(f"deterministic needs int8 or int4 weights (--quantization int8 or "
                         f"int4; auto on a Q4/Q8 GGUF file): {len(floats)} layers compute in "
                         f"float ({', '.join(floats[:3])}...), whose matmuls round a token "
                         "differently with the number of tokens beside it")
    pin_row_kernels(model)
    try:
        return CpuProgram(model)
    except UnsupportedModel as e:
        raise ValueError(f"deterministic needs the CPU op program, which cannot run this "
                         f"model: {e}") from None

