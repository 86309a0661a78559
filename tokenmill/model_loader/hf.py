"""Hugging Face model folders: ``config.json`` and safetensors weights (single file or shards)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

_INDEX = "model.safetensors.index.json"


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of the model folder ``path``."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"model path {str(path)!r} is not a directory")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in model folder {str(path)!r}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path!r} does not hold a JSON object")
    return config


def safetensors_files(path: str | os.PathLike[str]) -> list[str]:
    """The weight files of ``path``: the shards named in the index, else every ``*.safetensors``."""
    index_path = os.path.join(path, _INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path!r} has no 'weight_map'")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise ValueError(f"shard {file!r} listed in {_INDEX} does not exist")
        return files
    files = sorted(os.path.join(path, name) for name in os.listdir(path)
                   if name.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in model folder {str(path)!r}")
    return files


def iter_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the folder, one at a time (on CPU)."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
