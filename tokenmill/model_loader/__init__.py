"""Pick the loader for a model path: a GGUF file, a Hugging Face folder, or dummy weights."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model_loader.dummy import init_dummy_weights
from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.model_loader.hf import iter_safetensors, load_hf_config
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: nn.Module
    arch: ArchConfig
    tokenizer: Tokenizer
    path: str


def resolve_model_path(model: str | None) -> str:
    """The path to load: the given one, or the embedded SmolLM2 GGUF when none is given."""
    return embedded_model_path() if model is None else model


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights as configured."""
    path = resolve_model_path(config.model)
    started = time.perf_counter()
    is_gguf = os.path.isfile(path) and (path.endswith(".gguf") or config.load_format == "gguf")
    if is_gguf:
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

    arch = ArchConfig.from_hf_dict(hf_config)
    model_cls = get_model_class([arch.architecture])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build parameters in the target dtype, no fp32 detour
    try:
        with torch.device(device):
            model = model_cls(arch)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    elif is_gguf and config.quantization != "none":
        # Linear layers come quantized from the file's blocks (Q4 ones exactly, for int4); only
        # the rest is loaded in float, so no float copy of those layers is ever filled in.
        # (Imported here: tokenmill.quant.gguf imports this package.)
        from tokenmill.quant.gguf import load_gguf_quantized

        load_gguf_quantized(model, gguf, config.quantization, device=device, dtype=dtype)
    else:
        model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights())
    if config.quantization != "none":
        from tokenmill.quant import quantize_model

        logger.info(quantize_model(model, config.quantization).describe())
    model.eval()
    logger.info("loaded %s (%s, %s) in %.1f s", path, arch.architecture, dtype,
                time.perf_counter() - started)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path)
