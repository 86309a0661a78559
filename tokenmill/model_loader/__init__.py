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
from tokenmill.model_loader.gguf import GGUFModel, embedded_model_path, load_gguf
from tokenmill.model_loader.gguf_quantized import load_gguf_quantized
from tokenmill.model_loader.hf import iter_safetensors, load_hf_config
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import create_model
from tokenmill.presets import get_preset
from tokenmill.quant import quantize_model
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: nn.Module
    arch: ArchConfig
    tokenizer: Tokenizer
    path: str
    # The weight-only quantization applied ("none", "int8", "int4"), with "auto" resolved.
    quantization: str = "none"


def resolve_model_path(model: str | None) -> str:
    """The path to load: the given one, or the embedded SmolLM2 GGUF when none is given."""
    return embedded_model_path() if model is None else model


# GGUF block types by the weight-only method that keeps them compact under quantization="auto":
# Q4_0/Q4_1 blocks become int4 groups of 32 exactly; the wider ones lose nothing that matters at
# int8 per channel (see tokenmill.model_loader.gguf_quantized).
_GGUF_INT4 = frozenset({"Q4_0", "Q4_1"})
_GGUF_INT8 = frozenset({"Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})


def resolve_quantization(requested: str, gguf: GGUFModel | None, device: torch.device) -> str:
    """The method ``requested`` means here: itself unless "auto", which follows the layers' GGUF
    block type on the CPU (by the majority of the decoder's weights) and is "none" otherwise."""
    if requested != "auto":
        return requested
    if gguf is None or device.type != "cpu":
        return "none"
    kinds = [gguf.raw_tensor(n).qtype.name for n in gguf.tensor_names()
             if n.startswith("model.layers.") and n.endswith(".weight")]
    int4 = sum(k in _GGUF_INT4 for k in kinds)
    int8 = sum(k in _GGUF_INT8 for k in kinds)
    if 2 * max(int4, int8) <= len(kinds):
        return "none"
    return "int4" if int4 >= int8 else "int8"


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights as configured."""
    path = resolve_model_path(config.model)
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

        def weights():  # type: ignore[no-redef]
            return iter_safetensors(path)
    else:
        raise ValueError(f"model {path!r} is neither a .gguf file nor a Hugging Face folder")

    method = resolve_quantization(config.quantization, gguf if is_gguf else None,
                                  torch.device(device))
    arch = ArchConfig.from_hf_dict(hf_config)
    model = create_model(arch, dtype, device)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    elif (is_gguf and method in ("int8", "int4") and torch.device(device).type == "cpu"
          and tp_size() == 1):
        # Linear layers come quantized from the file's blocks (Q4 ones exactly, for int4); only
        # the rest is loaded in float, so no float copy of those layers is ever filled in.
        # On GPUs the layers are loaded in float and quantized below, in the GPU's layouts;
        # under tensor parallelism too (the file's blocks are not cut to the shards).
        load_gguf_quantized(model, gguf, method, device=device, dtype=dtype)
    else:
        model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights())
    if method != "none":
        logger.info(quantize_model(model, method).describe())
    model.eval()
    logger.info("loaded %s (%s, %s) in %.1f s", path, arch.architecture, dtype,
                time.perf_counter() - started)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path,
                       quantization=method)
