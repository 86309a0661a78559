"""LoRA on the engine's CUDA path: Triton attention, decode steps replayed from captured graphs
(which compute the base model only: a step with adapter rows runs model.forward), and
asynchronous scheduling. On a GPU the real thing; without one the kernels run in Triton's
interpreter and EagerReplay stands in for the graphs, as in
tests/engine/test_triton_engine_features.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import PROMPTS, Base, lora_request

from tokenmill import LLM, SamplingParams

pytest.importorskip("triton")
pytest.importorskip("peft")

from tokenmill.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.runner.cuda_graphs import EagerReplay  # noqa: E402

CUDA = torch.cuda.is_available()
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _cuda_path(base: Base) -> LLM:
    options = dict(dtype="float32", enable_lora=True, max_loras=2, max_num_seqs=4,
                   max_model_len=64, async_scheduling=True)
    if CUDA:
        return LLM(str(base.path), device="cuda", **options)
    llm = LLM(str(base.path), **options)
    runner = llm.engine.core.executor.runner
    runner.backend = TritonAttentionBackend(decode_partition_size=32)
    runner.cpu_program = None
    runner.capture_decode_graphs(4, llm.engine.core.max_model_len, capturer=EagerReplay())
    return llm


def test_graphs_for_the_base_model_only(lora_base: Base, adapters: dict[str, Path],
                                        references: dict[str | None, list[list[int]]]) -> None:
    llm = _cuda_path(lora_base)
    try:
        core = llm.engine.core
        assert core.async_scheduling and core.executor.runner.decode_graphs is not None
        graphs = core.executor.runner.decode_graphs
        replays: list[int] = []
        run = graphs.run

        def counted(*args: object) -> torch.Tensor:
            replays.append(args[0].shape[0])  # type: ignore[union-attr]
            return run(*args)

        graphs.run = counted
        base = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in base] == references[None]
        assert replays  # the base model's decode steps came from the graphs
        replays.clear()
        names = ["all", None, "patterns"]
        mixed = llm.generate(PROMPTS, GREEDY,
                             lora_request=[None if n is None else lora_request(adapters, n)
                                           for n in names])
        assert [o.outputs[0].token_ids for o in mixed] == [
            references[n][i] for i, n in enumerate(names)]
        # Decode steps with adapter rows ran model.forward; only steps of the base request
        # alone (after the others finished) may have replayed.
        assert all(n == 1 for n in replays)
    finally:
        llm.close()
