"""tokenmill: an LLM inference engine and server.

The offline API::

    from tokenmill import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from tokenmill.utils import default_thread_policy

default_thread_policy()  # before anything imports torch

# ruff: noqa: E402
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

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "ClassificationResult", "PoolingParams", "EmbeddingRequestOutput",
           "ScoringRequestOutput", "ScoringOutput", "LoRARequest", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
