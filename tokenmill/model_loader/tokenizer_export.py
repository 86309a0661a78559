"""A Hugging Face tokenizer folder for any model tokenmill loads, GGUF files included.

Tools that measure a server (lm-evaluation-harness, aiperf, guidellm) count tokens with a
Hugging Face tokenizer they load by name from the Hub, which an offline machine cannot reach and
a GGUF file does not come with. `tokenmill tokenizer export MODEL DIR` writes the folder they
can load instead (``transformers.AutoTokenizer.from_pretrained(DIR)``): ``tokenizer.json`` (the
very tokenizer tokenmill runs, so the ids are the same), ``tokenizer_config.json`` with the chat
template and special tokens, ``special_tokens_map.json``, ``generation_config.json`` (the
end-of-generation ids) and a minimal ``config.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.model_loader.hf import load_hf_config
from tokenmill.tokenizer import Tokenizer

# config.json keys copied from the model's configuration when it has them.
CONFIG_KEYS = ("model_type", "architectures", "vocab_size", "max_position_embeddings",
               "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "bos_token_id", "eos_token_id", "tie_word_embeddings")


def load_for_export(model: str | None) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and configuration of a GGUF file or Hugging Face folder (default: the
    embedded model), without loading its weights."""
    path = model or embedded_model_path()
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path), load_hf_config(path)
    if os.path.isfile(path):
        gguf = load_gguf(path)
        return gguf.tokenizer, gguf.hf_config
    raise ValueError(f"model {path!r} is neither a GGUF file nor a Hugging Face folder")


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int | None) -> dict[str, Any]:
    """``tokenizer_config.json``'s content for ``tokenizer``: its class, special tokens, chat
    template and added tokens (also what the server's ``GET /tokenizer_info`` answers)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(tokenizer),
        "chat_template": tokenizer.chat_template,
        "model_max_length": model_max_length if isinstance(model_max_length, int) else 1_000_000,
        "clean_up_tokenization_spaces": False,
        # BOS (where the model wants one) comes from tokenizer.json's post-processor.
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t.content, "special": t.special,
                                          "lstrip": t.lstrip, "rstrip": t.rstrip,
                                          "normalized": t.normalized,
                                          "single_word": t.single_word}
                                 for i, t in sorted(added.items())},
    }
    if config["chat_template"] is None:
        del config["chat_template"]
    return config


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """``special_tokens_map.json``: the BOS and EOS tokens the tokenizer has."""
    return {name: tok for name, tok in (("bos_token", tokenizer.bos_token),
                                        ("eos_token", tokenizer.eos_token)) if tok}


def export_tokenizer(model: str | None, out_dir: str) -> list[str]:
    """Write the folder; the paths written."""
    tokenizer, hf_config = load_for_export(model)
    os.makedirs(out_dir, exist_ok=True)
    backend = tokenizer.backend
    config = tokenizer_config(tokenizer, hf_config.get("max_position_embeddings"))
    special = special_tokens(tokenizer)
    eos_ids = sorted(tokenizer.eos_token_ids)
    files = {
        "tokenizer_config.json": config,
        "special_tokens_map.json": special,
        "generation_config.json": {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None},
        "config.json": {k: hf_config[k] for k in CONFIG_KEYS if k in hf_config},
    }
    written = [os.path.join(out_dir, "tokenizer.json")]
    backend.save(written[0])
    for name, body in files.items():
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2, ensure_ascii=False)
            f.write("\n")
        written.append(path)
    return written
