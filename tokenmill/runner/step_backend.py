"""How a step's hidden states are computed: one step backend per engine, picked at start.

The platform (``Platform.step_backend``) picks the engine's backend once: the CPU program
(the model's op program run by one C++ loop, ``tokenmill.runner.cpu_program``), captured CUDA
decode graphs (``tokenmill.runner.cuda_graphs``), the deterministic CPU program, or
``model.forward`` itself. Each answers :meth:`StepBackend.supports` for a step; the runner
gives a step the backend supports to it and any other to :class:`EagerBackend`. Which steps
are which is decided by ``supports`` before the step runs, never by catching an error: an
error inside a backend's forward reaches the caller.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.lora.layers import LoRAStep
from tokenmill.quant.linear import StepKindMarks
from tokenmill.runner.cpu_program import CpuProgram
from tokenmill.runner.cuda_graphs import DecodeGraphs


@dataclass(frozen=True)
class ModelStep:
    """One step's model inputs: the flat tokens, their positions, the attention metadata and
    which rows run which LoRA adapter (None: no row runs one)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    lora: LoRAStep | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def model_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``model.compute_logits``; on CUDA the logits stay in the head's dtype: the greedy
    kernel reads them so, the sampler and the drafts' verification widen them to fp32
    themselves (at batch 256 and a 128K vocabulary the fp32 copy wrote 131 MB a step)."""
    return model.compute_logits(hidden, float32=not hidden.is_cuda)


class StepBackend(abc.ABC):
    """A way to compute a step's final-normed hidden states ``[T, hidden]``."""

    name: str

    @abc.abstractmethod
    def supports(self, step: ModelStep) -> bool:
        """Whether :meth:`forward` computes this step (else the runner runs it eagerly)."""

    @abc.abstractmethod
    def forward(self, step: ModelStep) -> torch.Tensor:
        """The step's hidden states, as ``model.forward`` returns them."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits`` of rows of hidden states this engine computed."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up log: which steps this backend takes, which go eager."""


class EagerBackend(StepBackend):
    """``model.forward``: every step, and the steps the engine's backend does not support."""

    name = "eager"

    def __init__(self, model: nn.Module, marks_decode_steps: bool = True) -> None:
        self.model = model
        # Decoders tell their int4 layers a decode-only step (the activations' bits the C++
        # program uses for such a step); an encoder's steps never were marked.
        self.marks = StepKindMarks(model) if marks_decode_steps else None

    def supports(self, step: ModelStep) -> bool:
        return True

    def forward(self, step: ModelStep) -> torch.Tensor:
        if self.marks is not None:
            self.marks.mark(step.attn_meta.decode_only)
        return self.model(step.input_ids, step.positions, step.attn_meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return model_logits(self.model, hidden)

    def describe(self) -> str:
        return "eager (model.forward): every step"


class CudaGraphBackend(StepBackend):
    """Captured CUDA graphs of decode-only steps (:class:`DecodeGraphs`): steps of the
    captured batch sizes and contexts without LoRA rows (the graphs compute the base model
    only); logits through the model's head."""

    name = "cuda_graphs"

    def __init__(self, model: nn.Module, graphs: DecodeGraphs) -> None:
        self.model = model
        self.graphs = graphs

    def supports(self, step: ModelStep) -> bool:
        return step.lora is None and self.graphs.supports(step.num_tokens, step.attn_meta)

    def forward(self, step: ModelStep) -> torch.Tensor:
        return self.graphs.run(step.input_ids, step.positions, step.attn_meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return model_logits(self.model, hidden)

    def describe(self) -> str:
        g = self.graphs
        return (f"cuda graphs: decode-only steps of up to {g.max_batch_size} sequences "
                f"(batch sizes {g.sizes}) and contexts up to {g.max_seq_len} tokens; "
                "eager: other steps, and steps with LoRA rows")


class CpuProgramBackend(StepBackend):
    """The model's op program in one C++ call on the CPU (``program``: what
    ``make_cpu_program`` returns): decode-only steps, steps with prompt chunks where it
    prefills, steps with LoRA rows once adapters are attached; its logits too."""

    name = "cpu_program"

    def __init__(self, program: CpuProgram) -> None:
        self.program = program

    def supports(self, step: ModelStep) -> bool:
        return ((step.lora is None or self.program.lora)
                and self.program.supports(step.input_ids, step.attn_meta))

    def forward(self, step: ModelStep) -> torch.Tensor:
        return self.program.forward(step.input_ids, step.positions, step.attn_meta, step.lora)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # An int8 head straight from its kernel, else model.compute_logits (fp32 logits).
        return self.program.logits(hidden)

    def describe(self) -> str:
        eager = ["steps on KV caches it cannot read"]
        if not self.program.prefill:
            eager.insert(0, "steps with prompt tokens")
        if not self.program.lora:
            eager.append("steps with LoRA rows before adapters are attached")
        taken = "decode and prefill steps" if self.program.prefill else "decode-only steps"
        return f"cpu program: {taken}; eager: {', '.join(eager)}"


class InvariantCpuProgramBackend(CpuProgramBackend):
    """The deterministic engine's CPU program: it takes every step, as ``model.forward``
    rounds a row differently and an eager step would make a row depend on its step again.
    A step it cannot compute is an error, never an eager step."""

    name = "cpu_program_invariant"

    def supports(self, step: ModelStep) -> bool:
        return True

    def forward(self, step: ModelStep) -> torch.Tensor:
        program = self.program
        if step.lora is not None or not program.supports(step.input_ids, step.attn_meta):
            meta = step.attn_meta
            caches = {str(c.dtype).removeprefix("torch.") for c in meta.kv_caches}
            raise RuntimeError(
                f"deterministic: the CPU program cannot run this step ({step.num_tokens} "
                f"tokens of {meta.num_seqs} sequences, decode-only {meta.decode_only}, LoRA "
                f"rows {step.lora is not None}, KV caches {sorted(caches) or 'none'}); "
                "model.forward would round its rows differently, so the step is refused")
        return program.forward(step.input_ids, step.positions, step.attn_meta)

    def describe(self) -> str:
        return "cpu program (deterministic): every step; a step it cannot run is an error"
