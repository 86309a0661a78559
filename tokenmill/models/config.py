"""The architecture numbers a model needs, read from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Rope types whose frequencies models/layers.py knows how to compute.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# Bidirectional encoders (the BERT family, models/bert.py): their checkpoints hold a BertModel,
# bare or under "bert." beside a task head that embeddings do not use; or, for the
# cross-encoders (rerankers), beside the one-label classification head that scores a pair.
CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining",
                                   *CROSS_ENCODER_ARCHITECTURES})
# Gemma 3 (models/gemma3.py): decoders whose sliding-window layers are implemented, so their
# context is not capped at the window; and the activation each decoder family's MLP takes.
SLIDING_WINDOW_ARCHITECTURES = frozenset({"Gemma3ForCausalLM", "GptOssForCausalLM"})
DECODER_ACTIVATIONS = {"Gemma3ForCausalLM": ("gelu_pytorch_tanh",)}


@dataclass(frozen=True)
class ArchConfig:
    """Shapes and constants of a decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) or
    of a bidirectional encoder (BERT: ``is_encoder``; no rope, GELU, LayerNorm, token types)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain rope, else the HF rope parameters (without rope_theta) incl. "rope_type".
    # Left out of the hash (a dict is unhashable); still compared.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Checkpoint dtype name as written in config.json ("bfloat16", "float32"...), if any.
    torch_dtype: str | None = None
    # Encoders only: LayerNorm epsilon and the number of token types (segment embeddings).
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    # Cross-encoders only: the classification head's outputs.
    num_labels: int = 0
    # Mixture of experts (models/moe.py; Qwen3-MoE, Mixtral). num_experts 0: every layer
    # dense. A layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th
    # layer (Qwen3-MoE's rule); norm_topk_prob renormalises the top-k routing weights; a
    # shared expert (0: none) runs on every token beside the routed ones.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Phi-3 / Phi-4 (models/phi3.py, models/rope_scaling.py): rope turns only the first
    # partial_rotary_factor of each head's dims (Phi-4-mini: 0.75); longrope's short and long
    # factors live in rope_scaling.
    partial_rotary_factor: float = 1.0

    # Gemma 3 (models/gemma3.py): the sliding window of the layers that have one and each
    # layer's type ("sliding_attention" / "full_attention"; empty: every layer full), the
    # local layers' rope base, the query scale's 1 / sqrt(query_pre_attn_scalar) (None:
    # 1 / sqrt(head_dim)) and the logits' tanh soft cap (None: none).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_base_freq: float = 10000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss (models/gpt_oss.py): its experts' clamped SwiGLU, ``(up + 1) * gate *
    # sigmoid(swiglu_alpha * gate)`` with gate clamped above and up on both sides at
    # swiglu_limit; its sliding and full layers alternate (sliding_window, layer_types above).
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.is_encoder:
            self._check_encoder()
            return
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        activations = DECODER_ACTIVATIONS.get(self.architecture, ("silu",))
        if self.hidden_act not in activations:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported for "
                             f"{self.architecture} (only {', '.join(map(repr, activations))})")
        self._check_layer_types()
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; "
                                 f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.num_experts:
            self._check_experts()
        self._check_rotary()

    def _check_rotary(self) -> None:
        # Partial rotary and longrope (Phi-3 / Phi-4): the rotated dims and their factors.
        factor = self.partial_rotary_factor
        if not 0.0 < factor <= 1.0 or self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and turn an even number "
                             f"of head_dim's {self.head_dim} dims, got {factor!r}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "yarn":
            factor = self.rope_scaling.get("factor")
            if not isinstance(factor, int | float) or factor < 1:
                raise ValueError(f"rope_scaling.factor must be a number >= 1 for yarn, got "
                                 f"{factor!r}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "longrope":
            for key in ("short_factor", "long_factor"):
                value = self.rope_scaling.get(key)
                if not isinstance(value, list | tuple) or len(value) != self.rotary_dim // 2:
                    raise ValueError(f"rope_scaling.{key} must list {self.rotary_dim // 2} "
                                     f"numbers (half the rotated dims), got {value!r}")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims rope turns: head_dim unless partial (Phi-4-mini)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_experts(self) -> None:
        # Mixture of experts: the numbers the router and the stacked experts are built from.
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts must be a non-negative integer, got "
                             f"{self.num_experts!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts "
                             f"({self.num_experts}), got {self.num_experts_per_tok!r}")
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be >= 0, got "
                             f"{self.shared_expert_intermediate_size!r}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a "
                             f"{self.num_hidden_layers}-layer model")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward is the experts' (Qwen3-MoE's rule, which
        makes every layer sparse for Mixtral's configs)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def _check_layer_types(self) -> None:
        # Gemma 3: a window per sliding layer, one type per layer.
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer, got "
                             f"{self.sliding_window!r}")
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers (num_hidden_layers)")
        bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (only 'sliding_attention', "
                             "'full_attention')")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window "
                             "is not set")

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def _check_encoder(self) -> None:
        # HF's "gelu" is the exact (erf) GELU; the tanh approximations would differ slightly.
        if self.hidden_act != "gelu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported for "
                             f"{self.architecture} (only 'gelu')")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("an encoder has as many key/value heads as attention heads")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        if self.is_cross_encoder:
            if self.num_labels != 1:
                raise ValueError(f"{self.architecture} with {self.num_labels} labels is not "
                                 "supported: a cross-encoder (reranker) scores a pair with one")
            if self.type_vocab_size < 2:
                raise ValueError(f"a cross-encoder needs two token types for a pair's two "
                                 f"texts, got type_vocab_size {self.type_vocab_size}")

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (embeddings only: no KV cache, no generation)."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def is_cross_encoder(self) -> bool:
        """An encoder with a one-label head that scores a pair of texts read together."""
        return self.architecture in CROSS_ENCODER_ARCHITECTURES

    @property
    def num_layers(self) -> int:
        """Number of decoder layers, i.e. of per-layer KV cache tensors."""
        return self.num_hidden_layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ArchConfig:
        """Build from a ``config.json`` dict in either the transformers-4 or -5 layout."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if d.get(name) is None:
                raise ValueError(f"config.json is missing {name!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or _div(d["hidden_size"], heads, "hidden_size")
        rope_source, sliding = d, {}
        if archs[0] == "GptOssForCausalLM":
            sliding = _gpt_oss_from_hf(d)
        elif archs[0] in SLIDING_WINDOW_ARCHITECTURES:
            rope_source, sliding = _sliding_from_hf(d)
        rope_theta, rope_scaling = _rope_from_hf(rope_source)
        encoder = archs[0] in ENCODER_ARCHITECTURES
        if encoder and d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not "
                             "supported (only 'absolute')")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=archs[0],
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=(d.get("max_position_embeddings", 2048) if sliding
                                     else _max_positions(d)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=(d.get("hidden_act") or d.get("hidden_activation")
                        or ("gelu" if encoder else "silu")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(d.get("type_vocab_size", 0)),
            num_labels=_num_labels(d),
            **sliding,
            partial_rotary_factor=_partial_rotary_factor(d),
            **_moe_from_hf(d),
        )


def _moe_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json: Qwen3-MoE names its expert count
    ``num_experts``, Mixtral (and transformers 5 for both) ``num_local_experts``; Mixtral's
    experts are ``intermediate_size`` wide, Qwen3-MoE's ``moe_intermediate_size``."""
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    if not experts:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=d.get("num_experts_per_tok") or 0,
        moe_intermediate_size=d.get("moe_intermediate_size") or d.get("intermediate_size"),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
        decoder_sparse_step=d.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
    )


def _num_labels(d: dict[str, Any]) -> int:
    """A classification head's outputs: ``id2label``'s entries (transformers writes it),
    else ``num_labels``; 0 for none."""
    labels = d.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(d.get("num_labels") or 0)


def _div(a: int, b: int, field: str) -> int:
    if not b or a % b:
        raise ValueError(f"{field} ({a}) must be divisible by num_attention_heads ({b})")
    return a // b


def _sliding_from_hf(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's config.json: (a dict whose rope keys are the global layers' rope, for
    :func:`_rope_from_hf`; the sliding-window fields). Reads transformers 5's per-layer-type
    ``rope_parameters`` and 4's ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``;
    the layer types from ``layer_types``, else every ``sliding_window_pattern``-th layer full."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 has none)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal LM only)")
    params = d.get("rope_parameters")
    rope_source, local = d, d.get("rope_local_base_freq", 10000.0)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        rope_source = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
        rope_source["rope_parameters"] = params["full_attention"]
        local = (params.get("sliding_attention") or {}).get("rope_theta", local)
    layers = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not types:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    scalar = d.get("query_pre_attn_scalar")
    return rope_source, dict(
        sliding_window=d.get("sliding_window"), layer_types=tuple(types),
        rope_local_base_freq=float(local),
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        final_logit_softcapping=d.get("final_logit_softcapping"))


def _gpt_oss_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's config.json: its sliding window, the layer types (``layer_types``, else
    sliding and full alternating from a sliding layer 0, as transformers fills them) and the
    experts' SwiGLU constants."""
    types = d.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(d["num_hidden_layers"])]
    return dict(sliding_window=d.get("sliding_window"), layer_types=tuple(types),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from ``rope_theta``/``rope_scaling`` (v4) or ``rope_parameters`` (v5)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        # Mixed attention types keep one rope dict per layer type; none of our families do.
        raise ValueError("rope_parameters per layer type are not supported")
    if isinstance(params, dict):
        scaling = dict(params)
        theta = scaling.pop("rope_theta", d.get("rope_theta", 10000.0))
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    # v4 configs of older models spell the key "type".
    rope_type = scaling.pop("type", None)
    rope_type = scaling.get("rope_type", rope_type) or "default"
    scaling.pop("partial_rotary_factor", None)  # transformers 5 keeps it here: a field of ours
    if rope_type == "su":  # the first Phi-3 configs' name for longrope
        rope_type = "longrope"
    scaling["rope_type"] = rope_type
    if rope_type == "default":
        return float(theta), None
    if rope_type == "longrope":
        _longrope_from_hf(d, scaling)
    if rope_type == "yarn":
        _yarn_from_hf(d, scaling)
    return float(theta), scaling


def _yarn_from_hf(d: dict[str, Any], scaling: dict[str, Any]) -> None:
    """YaRN's pretraining context (in rope_scaling, else beside it, else the model's) and its
    default ``factor`` (the context's growth), as transformers' _compute_yarn_parameters."""
    max_pos = d.get("max_position_embeddings", 2048)
    original = (scaling.get("original_max_position_embeddings")
                or d.get("original_max_position_embeddings") or max_pos)
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = max_pos / int(original)


def _longrope_from_hf(d: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Phi-3 keeps the pretraining context beside rope_scaling, and transformers takes that one
    first; the default ``factor`` is the context's growth (before any sliding-window cap)."""
    original = d.get("original_max_position_embeddings") or scaling.get(
        "original_max_position_embeddings") or d.get("max_position_embeddings", 2048)
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = d.get("max_position_embeddings", 2048) / int(original)


def _partial_rotary_factor(d: dict[str, Any]) -> float:
    """``partial_rotary_factor`` at the top (transformers 4) or in rope_parameters (5)."""
    params = d.get("rope_parameters")
    value = d.get("partial_rotary_factor")
    if value is None and isinstance(params, dict):
        value = params.get("partial_rotary_factor")
    return 1.0 if value is None else float(value)


def _max_positions(d: dict[str, Any]) -> int:
    """Longest usable context: capped at the sliding window, which we do not implement.

    Within the window, sliding-window attention equals full attention, so capping the context
    keeps Mistral-v0.1-style and sliding Qwen2 configs exact instead of silently wrong.
    """
    max_pos = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    sliding = d.get("use_sliding_window", True)
    layer_types = d.get("layer_types")
    if layer_types is not None:
        sliding = "sliding_attention" in layer_types
    if window and sliding:
        return min(max_pos, window)
    return max_pos
