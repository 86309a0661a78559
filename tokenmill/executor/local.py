"""The executor of a one-process engine: the whole model, in this process."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.distributed import unsharded
from tokenmill.executor.base import Executor
from tokenmill.model_loader import LoadedModel
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.platform import Platform


class LocalExecutor(Executor):
    """Runs the whole model in this process's ModelRunner; there is nobody else to wait for."""

    def __init__(self, config: EngineConfig, platform: Platform,
                 num_threads: int | None) -> None:
        super().__init__(config, platform, num_threads, num_ranks=1)

    def load_model(self, loaded: LoadedModel | None = None) -> LoadedModel:
        # Whole, even in a process that also runs a tensor-parallel engine (tests): models
        # read the rank count when they are built.
        with unsharded():
            return super().load_model(loaded)

    def wait_until_loaded(self) -> None:
        """Nothing to wait for: the one rank is this process."""

    def min_free_memory(self, local_free: int) -> int:
        return local_free

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, sched: SchedulerOutput,
                draft_probs: dict[str, torch.Tensor]) -> RunnerOutput:
        return self.runner.execute(sched, draft_probs)

    def launch(self, sched: SchedulerOutput,
               draft_probs: dict[str, torch.Tensor]) -> LaunchedStep:
        return self.runner.launch(sched, draft_probs)

    def close(self) -> None:
        """Nothing to stop: the runner goes with the engine."""
