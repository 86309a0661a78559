"""Batch inference over OpenAI Batch API files: ``run_batch`` on one engine, ``run_batch_ray``
on Ray Data actors. Both resume a killed job from its results file.

The job's modules are imported on first use, so that registering `tokenmill batch` on the
command line does not import them (nor tokenmill/api/ and its schemas) for every other command.
"""

from __future__ import annotations

from typing import Any

# Requests queued in one engine at once: a few times max_num_seqs, so that a finished request's
# place in the running batch is taken at the next step.
DEFAULT_MAX_IN_FLIGHT = 256

__all__ = ["BatchStats", "run_batch", "run_batch_ray", "DEFAULT_MAX_IN_FLIGHT"]


def __getattr__(name: str) -> Any:
    if name in ("BatchStats", "run_batch"):
        from tokenmill.batch import job

        return getattr(job, name)
    if name == "run_batch_ray":
        from tokenmill.batch.ray_job import run_batch_ray

        return run_batch_ray
    raise AttributeError(f"module 'tokenmill.batch' has no attribute {name!r}")
