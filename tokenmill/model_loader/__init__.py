"""Pick the loader for a model path: a GGUF file, a Hugging Face folder, or dummy weights."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed import tp_size
from tokenmill.model_loader.dummy import init_dummy_weights
from tokenmill.model_loader.embedded_embedding import embedded_embedding_model_path
from tokenmill.model_loader.embedded_gemma3 import EMBEDDED_MODELS
from tokenmill.model_loader.gguf import GGUFModel, embedded_model_path, load_gguf
from tokenmill.model_loader.gguf_quantized import load_gguf_quantized
from tokenmill.model_loader.hf import iter_safetensors, load_hf_config
from tokenmill.model_loader.st_config import read_sentence_transformer
from tokenmill.models.config import ArchConfig
from tokenmill.models.pooler import PoolerConfig
from tokenmill.models.registry import create_model, get_model_class
from tokenmill.models.rope_scaling import serve_context
from tokenmill.presets import get_preset
from tokenmill.quant import quantize_model
from tokenmill.quant.model import KEEP_GGUF_TYPES
from tokenmill.quant.packing import dense_dtype
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: nn.Module
    arch: ArchConfig
    tokenizer: Tokenizer
    path: str
    # The weight-only quantization applied ("none", "int8", "int4", or "gguf": the GGUF file's
    # own block types kept), with "auto" resolved.
    quantization: str = "none"
    # How embeddings are pooled (see resolve_pooler), and the longest input the folder's
    # sentence-transformers config allows (None: no such limit).
    pooler: PoolerConfig = PoolerConfig("last")
    max_seq_length: int | None = None


def resolve_model_path(model: str | None, task: str = "auto") -> str:
    """The path to load: the given one (an embedded model's name such as "gemma3-270m": its
    file, assembled on first use; a model named on the Hugging Face hub: its files in the
    local cache, downloaded first if need be), else the embedded all-MiniLM-L6-v2 folder
    for task "embed" and the embedded SmolLM2 GGUF otherwise."""
    if model is not None:
        if os.path.exists(model):
            return model
        if model in EMBEDDED_MODELS:  # a name of a model shipped on PyPI ("gemma3-270m")
            return EMBEDDED_MODELS[model]()
        from tokenmill.hub.download import resolve_model
        from tokenmill.hub.refs import parse_hub_ref

        return resolve_model(model) if parse_hub_ref(model) is not None else model
    return embedded_embedding_model_path() if task == "embed" else embedded_model_path()


def resolve_pooler(config: ModelConfig, arch: ArchConfig,
                   folder: str | None) -> tuple[PoolerConfig, int | None]:
    """The pooling of the model's embeddings and its sentence-transformers length limit:
    ``config.pooling`` if given, else what the folder's sentence-transformers files say, else
    "cls" for encoders and "last" for decoders; normalised unless those files leave the
    Normalize module out. A cross-encoder's head reads the [CLS] state, not normalised."""
    info = read_sentence_transformer(folder) if folder is not None else None
    length = info.max_seq_length if info is not None else None
    if arch.is_cross_encoder:
        if config.pooling not in (None, "cls"):
            raise ValueError(f"pooling {config.pooling!r} does not apply to a cross-encoder, "
                             "whose head reads the [CLS] token's state")
        return PoolerConfig("cls", normalize=False), length
    if info is not None and config.pooling is None:
        return info.pooler, length
    normalize = info.pooler.normalize if info is not None else True
    default = "cls" if arch.is_encoder else "last"
    return PoolerConfig(config.pooling or default, normalize), length


# GGUF block types under quantization="auto": a file of Q4_0/Q4_1 layers only becomes int4
# groups of 32 exactly; any other quantized type keeps every layer's own blocks
# (KEEP_GGUF_TYPES: tokenmill.quant.kquant), or int8 per channel where the layers are cut into
# tensor-parallel shards (the blocks are not cut).
_GGUF_INT4 = frozenset({"Q4_0", "Q4_1"})
_GGUF_FLOAT = frozenset({"F32", "F16", "BF16", "F64"})


def encoder_bf16_matmuls(config: ModelConfig, model: nn.Module, dtype: torch.dtype,
                         device: torch.device, method: str) -> bool:
    """Whether an encoder's projections should run in bf16 around its fp32 model
    (``use_bf16_matmuls``): with dtype "auto" on a CPU that multiplies bf16 natively
    (AVX512-BF16 or AMX), for an unquantized model. There bf16 matmuls run ~4x fp32's rate,
    and all-MiniLM-L6-v2's embeddings stay within 1e-4 cosine of fp32
    (benchmarks/results/embed-avx512bf16-cpu.json). ``dtype="float32"`` keeps every product in fp32."""
    return (config.dtype == "auto" and dtype == torch.float32 and device.type == "cpu"
            and method == "none" and hasattr(model, "use_bf16_matmuls")
            and dense_dtype("cpu") == torch.bfloat16)


def _sep_token_id(tokenizer: Tokenizer, path: str) -> int:
    """The id of the [SEP] token that ends a cross-encoder's first text."""
    sep = tokenizer.backend.token_to_id("[SEP]")
    if sep is None:
        raise ValueError(f"{path!r}: a cross-encoder's tokenizer needs a [SEP] token between "
                         "the two texts of a pair")
    return sep


def resolve_quantization(requested: str, gguf: GGUFModel | None, device: torch.device) -> str:
    """The method ``requested`` means here: itself unless "auto", which on the CPU follows the
    decoder's GGUF block types (none where most of its weights are float; int4 where its
    quantized ones are all Q4_0/Q4_1; else each layer's own types, KEEP_GGUF_TYPES) and is
    "none" otherwise."""
    if requested != "auto":
        return requested
    if gguf is None or device.type != "cpu":
        return "none"
    kinds = [gguf.raw_tensor(n).qtype.name for n in gguf.tensor_names()
             if n.startswith("model.layers.") and n.endswith(".weight")]
    quantized = [k for k in kinds if k not in _GGUF_FLOAT]
    if 2 * len(quantized) <= len(kinds):
        return "none"
    if all(k in _GGUF_INT4 for k in quantized):
        return "int4"
    return KEEP_GGUF_TYPES if tp_size() == 1 else "int8"


def log_model_summary(path: str, gguf: GGUFModel | None) -> None:
    """The start log's line of what the model is (`tokenmill info`'s summary: family, total
    and active parameters, how each part is stored, KV bytes per token), from the headers."""
    from tokenmill.model_loader.info import summarize, summarize_gguf

    try:
        summary = summarize_gguf(gguf) if gguf is not None else summarize(path)
    except (ValueError, OSError) as e:  # a file the loader took but the summary cannot read
        logger.warning("no model summary for %s: %s", path, e)
        return
    logger.info("%s", summary.one_line())


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights as configured."""
    path = resolve_model_path(config.model, config.task)
    started = time.perf_counter()
    is_gguf = os.path.isfile(path) and (path.endswith(".gguf") or config.load_format == "gguf")
    is_preset = config.load_format == "dummy" and not os.path.exists(path)
    if is_preset:
        # A named architecture with random weights; the embedded model's tokenizer stands in.
        hf_config = get_preset(path)
        tokenizer = load_gguf(embedded_model_path()).tokenizer
    elif is_gguf:
        gguf = load_gguf(path)
        hf_config, tokenizer = gguf.hf_config, gguf.tokenizer
        weights = gguf.tensors
    elif os.path.isdir(path):
        hf_config = load_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        # Some tokenizer.json files pad or cut every input to a fixed length (all-MiniLM's to
        # 128): the engine wants each text's own tokens, and decides on length limits itself.
        tokenizer.backend.no_padding()
        tokenizer.backend.no_truncation()

        def weights():  # type: ignore[no-redef]
            return iter_safetensors(path)
    else:
        raise ValueError(f"model {path!r} is neither a .gguf file nor a Hugging Face folder")

    method = resolve_quantization(config.quantization, gguf if is_gguf else None,
                                  torch.device(device))
    if hf_config.get("architectures"):
        # An unsupported model is named so, with the supported ones, before its fields are
        # checked against the supported families' rules (an activation, a rope type).
        get_model_class(hf_config["architectures"])
    # Longrope's factors follow the context served (models/rope_scaling.py).
    arch = serve_context(ArchConfig.from_hf_dict(hf_config), config.max_model_len)
    pooler, max_seq_length = resolve_pooler(config, arch, path if os.path.isdir(path) else None)
    model = create_model(arch, dtype, device)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    elif (is_gguf and method in ("int8", "int4", KEEP_GGUF_TYPES)
          and torch.device(device).type == "cpu"
          and tp_size() == 1):
        # Linear layers come quantized from the file's blocks (Q4 ones exactly, for int4); only
        # the rest is loaded in float, so no float copy of those layers is ever filled in.
        # On GPUs the layers are loaded in float and quantized below, in the GPU's layouts;
        # under tensor parallelism too (the file's blocks are not cut to the shards).
        load_gguf_quantized(model, gguf, method, device=device, dtype=dtype)
    else:
        model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights())
    if arch.is_cross_encoder:
        model.sep_token_id = _sep_token_id(tokenizer, path)
    if method != "none":
        logger.info(quantize_model(model, method).describe())
    bf16_matmuls = encoder_bf16_matmuls(config, model, dtype, torch.device(device), method)
    if bf16_matmuls:
        model.use_bf16_matmuls()  # type: ignore[operator]
    model.eval()
    logger.info("loaded %s (%s, %s%s) in %.1f s", path, arch.architecture, dtype,
                ", bf16 matmuls" if bf16_matmuls else "", time.perf_counter() - started)
    log_model_summary(path, gguf if is_gguf else None)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path,
                       quantization=method, pooler=pooler, max_seq_length=max_seq_length)
