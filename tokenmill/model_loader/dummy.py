"""Random weights of the right shapes, for benchmarks of models we do not have on disk."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import create_model

# Big CPU matrices repeat one block of this many normal samples: drawing 8B independent values
# takes ~40 s on two cores, copying a block takes a few. Prime, so that the repeats do not line
# up with power-of-two row widths and rows still differ.
_POOL = 1_048_573


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: N(0, 0.02) matrices, ones for norms, zeros for biases.

    Values are drawn on each parameter's device and in its dtype, with no fp32 or host detour.
    On CPU, matrices larger than ~1M elements repeat a block of fresh samples (see ``_POOL``):
    the statistics are right, and these weights only serve shape-level benchmarks anyway.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            gen = generators.get(param.device)
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
                generators[param.device] = gen
            _fill_normal(param, 0.02, gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def _fill_normal(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    n = param.numel()
    if n <= _POOL or param.device.type != "cpu" or not param.is_contiguous():
        param.normal_(0.0, std, generator=gen)
        return
    pool = torch.empty(_POOL, dtype=param.dtype).normal_(0.0, std, generator=gen)
    flat = param.view(-1)
    for start in range(0, n, _POOL):
        end = min(start + _POOL, n)
        flat[start:end].copy_(pool[:end - start])


def build_dummy_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device | str,
                      seed: int = 0) -> nn.Module:
    """Create the model for ``arch`` directly on ``device`` in ``dtype`` with dummy weights."""
    model = create_model(arch, dtype, device)
    init_dummy_weights(model, seed=seed)
    return model.eval()
