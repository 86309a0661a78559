"""tokenmill: an LLM inference engine and server.

The offline API::

    from tokenmill import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from typing import TYPE_CHECKING

# The public names, imported on first use (PEP 562): `import tokenmill.cli` for `tokenmill
# --help` must not pay for torch, which the engine's modules import.
_EXPORTS = {
    "LLM": "tokenmill.engine.llm", "LoRARequest": "tokenmill.lora",
    "BeamSearchOutput": "tokenmill.outputs", "BeamSearchSequence": "tokenmill.outputs",
    "ClassificationResult": "tokenmill.outputs", "CompletionOutput": "tokenmill.outputs",
    "EmbeddingRequestOutput": "tokenmill.outputs", "RequestMetrics": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs", "ScoringOutput": "tokenmill.outputs",
    "ScoringRequestOutput": "tokenmill.outputs", "BeamSearchParams": "tokenmill.sampling_params",
    "PoolingParams": "tokenmill.sampling_params", "SamplingParams": "tokenmill.sampling_params",
}

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.lora import LoRARequest
    from tokenmill.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        ClassificationResult,
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestMetrics,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from tokenmill.sampling_params import BeamSearchParams, PoolingParams, SamplingParams


def __getattr__(name: str) -> object:
    """Import a public name's module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "ClassificationResult", "PoolingParams", "EmbeddingRequestOutput",
           "ScoringRequestOutput", "ScoringOutput", "LoRARequest", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
