"""The decoder-only causal LM every dense family is built on: construction from an ArchConfig
and a family's AttentionOptions, KV-cache geometry, forward, logits and Hugging Face weight
loading. A family module (llama.py, qwen2.py, qwen3.py) only says its attention options."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed import tensor_model_parallel_all_gather, tp_rank, tp_size
from tokenmill.models.config import ArchConfig
from tokenmill.models.layers import (
    AttentionOptions,
    DecoderLayer,
    DecoderModel,
    Linear,
    RotaryEmbedding,
)
from tokenmill.models.linear import linear
from tokenmill.models.parallel import VocabShard, check_all_loaded, copy_rank_slice

# Checkpoint tensors that live in one fused parameter here: (fused module, HF module, shard).
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint entries that are derived data, not weights.
IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
# Row-parallel layers: each rank holds a slice of their input columns; their bias is on rank 0.
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows ``[start, start + rows)`` of ``param`` (all of it
    for start None), filled with this rank's slice along ``split_dim`` (None: the whole
    tensor), which is ``full_size`` long in the checkpoint."""

    param: nn.Parameter
    start: int | None
    rows: int
    split_dim: int | None = None
    full_size: int = 0


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over a flat batch of tokens and a paged KV cache, built from
    the shared blocks of :mod:`tokenmill.models.layers`.

    A family subclasses it and says :meth:`attention_options`. Parameters start uninitialized; fill them with :meth:`load_weights` (Hugging Face names) or
    ``tokenmill.model_loader.dummy.init_dummy_weights``.
    """

    # The layer type of the stack (None: layers.DecoderLayer); a family whose layers differ
    # in more than attention options says its own (models/moe.py's MoEDecoderLayer).
    layer_cls: type[DecoderLayer] | None = None
    # Whether the family's loading reorders q/k rows for partial rotary (models/phi3.py,
    # models/rope_scaling.py); a family that does not refuses a partial_rotary_factor.
    partial_rotary = False

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        if config.rotary_dim != config.head_dim and not self.partial_rotary:
            raise ValueError(f"partial_rotary_factor {config.partial_rotary_factor} is not "
                             f"supported for {config.architecture} (only Phi3ForCausalLM)")
        self.config = config
        self.model = DecoderModel(config, self.attention_options(config), self.layer_cls)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, config.rotary_dim)
        # Tied models reuse the embedding matrix, so no vocab x hidden copy is allocated.
        # Under tensor parallelism each rank holds a slice of the vocabulary (VocabShard).
        self.tp_size = tp_size()
        self.tp_rank = tp_rank()
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, VocabShard.of(config.vocab_size).rows,
                                    bias=False))
        # Inference only: no autograd bookkeeping even outside torch.inference_mode().
        self.requires_grad_(False)
        self.bind_head()

    def bind_head(self) -> None:
        """Choose the logits' product from the head now in place: a quantized head's or tied
        table's own kernel (its ``logits``), else None: the product with the float weight of
        ``lm_head`` or, tied, of the embedding table. Called at construction and by the
        quantization pass when it replaces the head (``quant.model.replace_module``). (No
        bound method of the model itself is kept on it: that reference cycle would keep an
        unloaded model alive until a garbage collection, and never under gc.freeze.)"""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self._head_product: Callable[[torch.Tensor], torch.Tensor] | None = getattr(
            head, "logits", None)

    def _float_head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the float weight of ``lm_head`` or, tied, of the embedding table (read
        at the call: a family may put its own embedding module in place after construction)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        """Which biases and norms this family's attention block has (each family says it)."""
        raise NotImplementedError(f"{cls.__name__} does not say its attention options")

    # KV cache geometry, so the runner can size the cache from the model alone.
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank's cache (all of them without tensor parallelism)."""
        return self.config.num_key_value_heads // self.tp_size

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flattened tokens of every sequence in the step."""
        cos, sin = self.rotary.cos_sin(positions, self.model.norm.weight.dtype)
        return self.model(input_ids, cos, sin, attn_meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """``[N, vocab]`` fp32 logits of the given hidden states (every rank gets them all);
        with ``float32`` False, in the head's dtype (the GPU's greedy kernel reads them so:
        no fp32 copy of the step's logits)."""
        product = self._head_product
        logits = self._float_head_product(hidden) if product is None else product(hidden)
        if self.tp_size > 1:
            vocab = self.config.vocab_size
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., :vocab].contiguous()
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors into the (fused) parameters.

        Raises ValueError naming the tensor when one is unexpected, has the wrong shape, or is
        missing once ``weights`` is exhausted.
        """
        targets = self._hf_targets()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied: the embedding already holds it
                if self.tp_rank > 0 and name.endswith(tuple(f"{m}.bias" for m in ROW_PARALLEL)):
                    continue  # added once, by rank 0
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"unexpected tensor {name!r} in checkpoint for "
                                     f"{self.config.architecture}")
                dst = (target.param if target.start is None
                       else target.param.narrow(0, target.start, target.rows))
                expected = list(dst.shape)
                if target.split_dim is not None:
                    expected[target.split_dim] = target.full_size
                if list(tensor.shape) != expected:
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(expected)}")
                copy_rank_slice(dst, tensor, target.split_dim, self.tp_rank)
                loaded.add(name)
        check_all_loaded(targets, loaded)

    def _hf_targets(self) -> dict[str, _Target]:
        """HF tensor name -> where this rank's part of it goes."""
        c = self.config
        tp = self.tp_size
        q_rows = c.num_attention_heads * c.head_dim // tp
        kv_rows = c.num_key_value_heads * c.head_dim // tp
        inter = c.intermediate_size // tp
        shard_rows = {"qkv_proj": (q_rows, kv_rows, kv_rows), "gate_up_proj": (inter, inter)}
        targets: dict[str, _Target] = {}
        for name, param in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module in shard_rows:  # column-parallel parts of a fused parameter
                sizes = shard_rows[module]
                for fused, hf_module, shard in STACKED_PARAMS:
                    if fused == module:
                        targets[f"{parent}.{hf_module}.{leaf}"] = _Target(
                            param, sum(sizes[:shard]), sizes[shard], 0, sizes[shard] * tp)
            elif module in VOCAB_PARALLEL:
                targets[name] = _Target(param, None, param.shape[0], 0, c.vocab_size)
            elif module in ROW_PARALLEL and leaf == "weight":
                targets[name] = _Target(param, None, param.shape[0], 1, param.shape[1] * tp)
            else:
                targets[name] = _Target(param, None, param.shape[0])
        return targets
