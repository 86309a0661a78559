"""Random BERT checkpoints for the embedding tests, saved like Hugging Face saves them; what
the API's preparation sees of a chat engine."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def save_random_bert(folder: Path, tokenizer_from: str, *, masked_lm: bool = False,
                     seed: int = 0) -> Any:
    """A small random BERT saved as a Hugging Face folder (safetensors) with all-MiniLM's
    tokenizer; returns the transformers model (float32, eval) to compare with."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    torch.manual_seed(seed)
    # A wide init, so that a wrong layer shows in the outputs instead of vanishing.
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=128, type_vocab_size=2,
                        initializer_range=0.3, attn_implementation="eager")
    model = BertForMaskedLM(config) if masked_lm else BertModel(config)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(Path(tokenizer_from) / "tokenizer.json", folder / "tokenizer.json")
    return model.bert if masked_lm else model


class ChatModelFacts:
    """What the embeddings, score and rerank preparations (tokenmill/api/) see of an engine
    started for text generation."""

    task = "generate"
    cross_encoder = False
    vocab_size = 100
    max_model_len = 64
    embedding_size = 16
    tokenizer = None


def save_random_cross_encoder(folder: Path, tokenizer_from: str, *, seed: int = 0,
                              num_labels: int = 1) -> Any:
    """A small random BertForSequenceClassification (a reranker's shape: one label) saved as
    a Hugging Face folder with all-MiniLM's tokenizer; returns the transformers model."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=128, type_vocab_size=2,
                        initializer_range=0.3, num_labels=num_labels,
                        attn_implementation="eager")
    model = BertForSequenceClassification(config)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(Path(tokenizer_from) / "tokenizer.json", folder / "tokenizer.json")
    return model
