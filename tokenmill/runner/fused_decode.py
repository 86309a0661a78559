"""Model steps through the C++ layer stack in ``tokenmill/kernels/cpu``.

On the CPU a decode step of a small model is dominated by Python dispatch of the ~30 non-matmul
ops per layer, not by arithmetic. :class:`FusedDecoder` runs the whole layer stack in one call
to a C++ extension (built once with ``torch.utils.cpp_extension.load`` and cached on disk) that
issues the matmuls as ATen calls and does the glue in hand-written loops. It covers what
``LlamaForCausalLM.forward`` does for decode-only steps, and for steps with prompt chunks
(prefill, mixed with decodes or not; each layer's glue then runs on OpenMP's threads beside
PyTorch's dense matmuls, and attention is the CPU backend's prefill kernel); the runner keeps
``model.forward`` for models and steps the stack does not cover.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill import envs
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.cpu import load_extension
from tokenmill.lora.layers import LoRALinear, LoRAStep
from tokenmill.models import layers
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.quant.head import QuantizedMatrix
from tokenmill.quant.kernel_choice import cpu_kernels, decode_only_step
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.model import float_matmul_layers, pin_row_kernels
from tokenmill.quant.packing import dense_dtype, release_freed_memory

logger = logging.getLogger(__name__)
# The torch.profiler range of one fused decode step (benchmarks/step_profile.py reads it).
PROFILE_RANGE = "tokenmill::fused_decode_stack"

# "1" forces the fused path on, "0" off; unset means DEFAULT_ENABLED (tokenmill.envs).
ENV_FLAG = "TOKENMILL_FUSED_DECODE"
DEFAULT_ENABLED = True
# The same for steps with prefill chunks (when the fused path is on at all).
PREFILL_ENV_FLAG = "TOKENMILL_FUSED_PREFILL"

# The projections of a layer in the order DecoderStack.set_lora takes their LoRA slots.
_LORA_ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Linear kinds, as in fused_decode.cpp.
KIND_FLOAT, KIND_INT8, KIND_INT4 = 0, 1, 2
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def fused_cache_dtype_ok(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the C++ stack reads a KV cache in ``cache_dtype`` under activations in
    ``dtype``: the same dtype, or fp16 under fp32 (fused_decode.cpp's check_step). Other
    pairs run model.forward."""
    return cache_dtype == dtype or (cache_dtype == torch.float16 and dtype == torch.float32)


class UnsupportedModel(ValueError):
    """The model has a part the fused stack does not reproduce exactly."""


def _flag(name: str, explicit: bool | None) -> bool:
    if explicit is not None:
        return explicit
    value = getattr(envs, name)
    return DEFAULT_ENABLED if value is None else value


def fused_decode_enabled(explicit: bool | None = None) -> bool:
    """Whether to use the fused path: ``explicit`` if given, else $TOKENMILL_FUSED_DECODE."""
    return _flag(ENV_FLAG, explicit)


def fused_prefill_enabled(explicit: bool | None = None) -> bool:
    """Whether the fused path takes steps with prefill chunks too: ``explicit`` if given, else
    $TOKENMILL_FUSED_PREFILL."""
    return _flag(PREFILL_ENV_FLAG, explicit)


@dataclass(frozen=True)
class LinearParts:
    """One projection as the C++ side takes it: kind tag, tensors, int4 group size."""

    kind: int
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

    def row_dispatch(self) -> list[int]:
        """The C++ LinearSpec's row-count routing, in add_layer's order."""
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
        return LinearParts(KIND_FLOAT, module.weight, module.bias)
    quant = _quant_parts(module)
    if quant is None:
        raise UnsupportedModel(f"no fused form for {type(module).__name__}")
    return quant


def _quant_parts(module: nn.Module) -> LinearParts | None:
    """Parts of tokenmill.quant's weight-only modules, or None for any other module."""
    if type(module) not in (Int8WeightOnlyLinear, Int4WeightOnlyLinear):
        return None
    own = cpu_kernels() is not None
    dense = {"dense_min_rows": int(module.dense_min_rows),
             "dense_bf16": dense_dtype("cpu") == torch.bfloat16}
    if type(module) is Int8WeightOnlyLinear:
        return LinearParts(KIND_INT8, module.weight, module.bias, module.scales, **dense,
                           own_kernel=int(own),
                           own_min_rows=int(module.own_min_rows),
                           act_bits=module.activation_bits() if own else 0,
                           decode_act_bits=module.activation_bits(True) if own else 0)
    if type(module) is Int4WeightOnlyLinear:
        return LinearParts(KIND_INT4, module.weight, module.bias, module.scales_and_zeros,
                           int(module.group_size), **dense,
                           dense_block_n=module.dense_block_n(),
                           own_kernel=module.cpu_block_n() if own else 0,
                           own_min_rows=int(module.own_min_rows),
                           act_bits=module.activation_bits() if own else 0,
                           decode_act_bits=module.activation_bits(True) if own else 0,
                           q8_tiles=module.q8_tiles() if own and module.int_activations()
                           else None)
    return None


def _check_structure(model: nn.Module) -> None:
    """UnsupportedModel unless every block is the stock one whose math the C++ side repeats."""
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        raise UnsupportedModel(f"{type(model).__name__} is not a stock Llama-family model")
    stock = [(model.model, layers.DecoderModel), (model.rotary, layers.RotaryEmbedding),
             (model.model.norm, layers.RMSNorm)]
    for layer in model.model.layers:
        stock += [(layer, layers.DecoderLayer), (layer.self_attn, layers.Attention),
                  (layer.mlp, layers.GatedMLP), (layer.input_layernorm, layers.RMSNorm),
                  (layer.post_attention_layernorm, layers.RMSNorm)]
        if layer.self_attn.qk_norm:
            stock += [(layer.self_attn.q_norm, layers.RMSNorm),
                      (layer.self_attn.k_norm, layers.RMSNorm)]
    for module, cls in stock:
        if type(module).forward is not cls.forward:
            raise UnsupportedModel(f"{type(module).__name__} overrides {cls.__name__}.forward")
    eps = {m.eps for m, cls in stock if cls is layers.RMSNorm}
    if len(eps) != 1:
        raise UnsupportedModel(f"RMSNorms with different eps {sorted(eps)}")


class FusedDecoder:
    """``model.forward`` in one C++ call: decode-only steps, and (``prefill``) any other step
    of whole or chunked prompts, decodes beside them or not.

    Holds references to the model's own parameter tensors, so in-place weight updates are seen;
    replacing modules (e.g. quantizing) after construction needs a new FusedDecoder.
    """

    def __init__(self, model: nn.Module, prefill: bool | None = None) -> None:
        _check_structure(model)
        dtype = model.model.norm.weight.dtype
        if dtype not in _SUPPORTED_DTYPES:
            raise UnsupportedModel(f"activation dtype {dtype} (fp32 and bf16 only)")
        if model.model.norm.weight.device.type != "cpu":
            raise UnsupportedModel("the fused decode stack runs on the CPU only")
        self.model = model
        self.dtype = dtype
        self._checked_caches: tuple[int, int, int, int] | None = None
        ext = load_extension()
        self.stack = self._build_stack(model, dtype, ext)
        # The token embeddings and the logits straight from the C++ kernels where the model's
        # table and head are int8 (the embedded model's Q8_0 table, tied): model's own
        # modules otherwise.
        lookup = getattr(model.model.embed_tokens, "direct_lookup", None)
        self._embed = (lookup() if lookup is not None else None) or model.model.embed_tokens
        self._head = _direct_head(model)
        # The int4 layers have just packed their q8 tiles, the head its output tiles: hand
        # the temporaries back to the OS.
        release_freed_memory()
        # Steps with prefill chunks too: where the extension has a prefill kernel for the
        # head size (else those steps run model.forward).
        self.prefill = (fused_prefill_enabled(prefill)
                        and ext.prefill_head_size_supported(model.config.head_dim))
        # Whether LoRA slots are attached (attach_lora): steps with adapter rows run here too.
        self.lora = False

    def _build_stack(self, model: nn.Module, dtype: torch.dtype, ext: object) -> object:
        c = model.config
        stack = ext.DecoderStack(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                 c.intermediate_size, float(model.model.norm.eps),
                                 model.model.norm.weight,
                                 # model.to(bf16) rounds the tables too; float() is exact then.
                                 model.rotary.cos_half.float().contiguous(),
                                 model.rotary.sin_half.float().contiguous())
        empty = torch.empty(0)
        for layer in model.model.layers:
            attn = layer.self_attn
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     attn.q_norm.weight if attn.qk_norm else empty,
                     attn.k_norm.weight if attn.qk_norm else empty]
            if any(n.numel() and n.dtype != dtype for n in norms):
                raise UnsupportedModel("norm weights in a different dtype than activations")
            parts = [linear_parts(m, dtype) for m in
                     (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            stack.add_layer(norms, [p.kind for p in parts], [p.tensors() for p in parts],
                            [p.group_size for p in parts], [p.row_dispatch() for p in parts])
        return stack

    def supports(self, input_ids: torch.Tensor, attn_meta: AttentionMetadata) -> bool:
        """Whether the fused stack computes this step: decode-only ones, and with ``prefill``
        any other, on caches it reads."""
        if not (attn_meta.num_seqs > 0 and input_ids.shape[0] == sum(attn_meta.query_lens_cpu)
                and self._caches_ok(attn_meta.kv_caches)):
            return False
        return attn_meta.decode_only or self.prefill

    def _caches_ok(self, caches: list[torch.Tensor]) -> bool:
        """Whether the stack reads these KV caches; checked once per list of caches (the
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
        projection name (``LoRAManager.layers``), whose slots the stack reads in place."""
        for i, wrapped in enumerate(layers):
            self.stack.set_lora(i, [t for name in _LORA_ORDER
                                    for t in (wrapped[name].lora_a, wrapped[name].lora_b)])
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
            return self.stack.forward(*args)
        # A named range for torch.profiler: the stack's own C++ work (attention, norms, rotary)
        # is no ATen op and would otherwise show as time outside every op.
        with torch.profiler.record_function(PROFILE_RANGE):
            return self.stack.forward(*args)


def _direct_head(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The int8 output head's kernel as one callable (``direct_rows_kernel``), where the model
    computes its logits as LlamaForCausalLM does on one rank; None elsewhere. Such a head also
    packs its output tiles now (``prepare_row_tiles``), with the rest of the model."""
    if (type(model).compute_logits is not LlamaForCausalLM.compute_logits
            or model.tp_size != 1):
        return None
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    weight = getattr(head, "weight", None)
    if not isinstance(weight, QuantizedMatrix) or not isinstance(weight.linear,
                                                                 Int8WeightOnlyLinear):
        return None
    weight.linear.prepare_row_tiles()
    return weight.linear.direct_rows_kernel()


def make_fused_decoder(model: nn.Module, device: torch.device,
                       enabled: bool | None = None) -> FusedDecoder | None:
    """A FusedDecoder for ``model``, or None (with one warning) when it cannot have one."""
    if not fused_decode_enabled(enabled) or device.type != "cpu":
        return None
    try:
        return FusedDecoder(model)
    except UnsupportedModel as e:
        logger.info("fused decode off: %s", e)
    except Exception as e:  # a failed compile must never take the engine down
        logger.warning("fused decode off, the C++ extension failed to build or load: %s", e)
    return None


def make_invariant_decoder(model: nn.Module, device: torch.device) -> FusedDecoder:
    """The FusedDecoder of a deterministic runner, which runs every step (each token laid out
    as a one-token sequence, see ``FlatBatch.add(split=True)``).

    A token's row then goes through the same code whatever shares its step: int kernels at
    every row count (:func:`~tokenmill.quant.model.pin_row_kernels`), attention of one query
    over its own context, glue loops per row. ValueError where the stack cannot run the model;
    a failed build raises too, as falling back would silently drop the guarantee.
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
        return FusedDecoder(model)
    except UnsupportedModel as e:
        raise ValueError(f"deterministic needs the fused CPU layer stack, which cannot run "
                         f"this model: {e}") from None


def forward_step(model: nn.Module, fused: FusedDecoder | None, input_ids: torch.Tensor,
                 positions: torch.Tensor, attn_meta: AttentionMetadata,
                 lora: LoRAStep | None = None) -> tuple[torch.Tensor, FusedDecoder | None]:
    """Hidden states of one step: ``fused`` for a decode-only step it supports, else
    ``model.forward``. Also returns the fused decoder to use from now on: None once it failed
    (running the step again eagerly is safe: it rewrites the same KV slots). ``lora``: the
    step's LoRA rows (see FusedDecoder.forward); a stack without LoRA slots leaves such a
    step to ``model.forward``."""
    if (fused is not None and (lora is None or fused.lora)
            and fused.supports(input_ids, attn_meta)):
        try:
            return fused.forward(input_ids, positions, attn_meta, lora), fused
        except RuntimeError as e:
            logger.warning("fused decode failed; using model.forward from now on: %s", e)
            fused = None
    with decode_only_step(attn_meta.decode_only):  # the int4 layers' activations, as fused
        return model(input_ids, positions, attn_meta), fused
