"""A model loaded for evaluation outside the scheduler (perplexity and the like).

The engine's public door for benchmarks that score text rather than serve requests: it loads
the weights as an :class:`~tokenmill.config.EngineConfig` says (on the device, dtype and
threads the platform picks, optionally quantized after loading) and gives the log-probability
of each token of a sequence given the ones before it. Benchmarks call this, never the runner
or the attention backends themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.config import EngineConfig
from tokenmill.model_loader import load_model
from tokenmill.quant import quantize_model
from tokenmill.quant.model import model_weight_bytes
from tokenmill.runner.platform import get_platform
from tokenmill.runner.scoring import PromptScorer
from tokenmill.tokenizer import Tokenizer


@dataclass
class EvalModel:
    """A tokenmill model (``forward(ids, positions, attn_meta)``, ``compute_logits``) and the
    attention backend it is scored with; the KV cache is allocated on first use."""

    model: nn.Module
    backend: AttentionBackend = field(default_factory=TorchAttentionBackend)
    tokenizer: Tokenizer | None = None
    path: str = ""
    # The weight-only quantization the weights were loaded with ("none", "int8", "int4").
    quantization: str = "none"
    _scorer: PromptScorer | None = field(default=None, repr=False)
    _capacity: int = field(default=0, repr=False)

    @classmethod
    def load(cls, config: EngineConfig, quantize_after_load: str | None = None,
             group_size: int = 32) -> EvalModel:
        """The model ``config`` names, on its platform. With ``quantize_after_load`` ("int8" or
        "int4"), float weights are loaded and then quantized in groups of ``group_size`` (the
        engine's own int4 option is groups of 32, from the file's blocks where it can)."""
        model_config = config.model
        if quantize_after_load is not None:
            model_config = dataclasses.replace(model_config, quantization="none")
        platform = get_platform(config.device.device)
        platform.set_num_threads(config.device.num_threads)
        loaded = load_model(model_config, platform.device,
                            platform.resolve_dtype(config.model.dtype))
        if quantize_after_load is not None:
            quantize_model(loaded.model, quantize_after_load, group_size)
        return cls(loaded.model, platform.attention_backend(), loaded.tokenizer, loaded.path,
                   loaded.quantization)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm stays float under every quantization)."""
        return self.model.model.norm.weight.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights as stored (quantized ones at their packed size)."""
        return model_weight_bytes(self.model)

    def token_logprobs(self, token_ids: Sequence[int], first_target: int = 1,
                       ) -> Iterator[torch.Tensor]:
        """The float32 log-probabilities of ``token_ids[first_target:]``, each given every
        token before it (``token_ids`` is one sequence from position 0), in chunks."""
        if len(token_ids) > self._capacity:
            # One KV cache for the longest sequence so far; shorter ones reuse it.
            self._scorer = PromptScorer(self.model, self.backend, len(token_ids), self.dtype,
                                        self.model.model.norm.weight.device)
            self._capacity = len(token_ids)
        assert self._scorer is not None
        return self._scorer.token_logprobs(token_ids, first_target)
