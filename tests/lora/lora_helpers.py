"""Test helper: a tiny random Llama folder and PEFT LoRA adapters of it, with PEFT's own
generations as the reference.

The adapters are made by PEFT itself (``get_peft_model`` with ``init_lora_weights=False``:
random ``A`` and ``B``, so the update is far from zero) and saved with ``save_pretrained``,
the folders users bring.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from hf_checkpoints import make_checkpoint, write_tokenizer  # noqa: E402

from tokenmill.lora_request import LoRARequest  # noqa: E402

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Prompts as token ids of the word-level tokenizer ("t5 t9 ..." in text).
PROMPTS = [[5, 9, 33, 100, 7, 250, 18, 4, 61, 3, 77, 200],
           [40, 41, 42, 43, 44, 45, 46],
           [1, 17, 17, 99, 120, 3, 8, 8, 8, 64, 32, 16, 128, 255, 6, 7, 19, 200, 11]]


@dataclass
class Base:
    """A saved tiny Llama folder (tokenizer included) and its Hugging Face model."""

    path: Path
    hf_model: nn.Module


def make_base(path: Path) -> Base:
    checkpoint = make_checkpoint("llama", path)
    write_tokenizer(path)
    return Base(path, checkpoint.hf_model)


def make_adapter(base: Base, path: Path, seed: int, **config: Any) -> Path:
    """A PEFT LoRA folder on ``base`` with random A and B; ``config``: LoraConfig fields
    (default: rank 8, alpha 16, every projection)."""
    peft = pytest.importorskip("peft")
    options = dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, init_lora_weights=False)
    options.update(config)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base.hf_model, peft.LoraConfig(**options))
    model.save_pretrained(str(path))
    model.unload()  # base.hf_model is the plain model again
    return path


def lora_request(adapters: dict[str, Path], name: str) -> LoRARequest:
    """The request of one of the ``adapters`` fixture's adapters (ids by name order)."""
    return LoRARequest(name, sorted(adapters).index(name) + 1, str(adapters[name]))


def peft_greedy(base: Base, adapter: Path | None, prompt: list[int], max_tokens: int
                ) -> list[int]:
    """PEFT's greedy tokens for ``prompt`` with ``adapter`` (None: the base model)."""
    peft = pytest.importorskip("peft")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            out = base.hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        else:
            model = peft.PeftModel.from_pretrained(base.hf_model, str(adapter))
            try:
                out = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
            finally:
                model.unload()
    return out[0, len(prompt):].tolist()


def peft_logits(base: Base, adapter: Path, prompt: list[int]) -> torch.Tensor:
    """PEFT's fp32 logits ``[len(prompt), vocab]`` of ``prompt`` with ``adapter``."""
    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(base.hf_model, str(adapter))
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt])).logits[0].float()
    finally:
        model.unload()
