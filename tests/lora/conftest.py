"""Fixtures of the LoRA tests: a tiny random Llama and PEFT adapters of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_helpers import PROMPTS, Base, make_adapter, make_base, peft_greedy  # noqa: E402


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    return make_base(tmp_path_factory.mktemp("lora_base"))


@pytest.fixture(scope="session")
def adapters(lora_base: Base, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four adapters that differ in what PEFT lets one choose."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_adapter(lora_base, root / "all", seed=1),
        # PEFT's default targets for Llama: q and v only.
        "qv": make_adapter(lora_base, root / "qv", seed=2, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"]),
        # rsLoRA, ranks and alphas per module, some layers only.
        "patterns": make_adapter(lora_base, root / "patterns", seed=3, r=8, lora_alpha=32,
                                 use_rslora=True, rank_pattern={"down_proj": 4},
                                 alpha_pattern={"o_proj": 3}, layers_to_transform=[1]),
        "mlp": make_adapter(lora_base, root / "mlp", seed=4, r=16, lora_alpha=16,
                            target_modules=["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="session")
def references(lora_base: Base, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens (8 at most) of every prompt, per adapter (None: the base model)."""
    return {name: [peft_greedy(lora_base, None if name is None else adapters[name], p, 8)
                   for p in PROMPTS]
            for name in [None, *sorted(adapters)]}
