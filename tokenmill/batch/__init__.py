"""Batch inference over OpenAI Batch API files: ``run_batch`` on one engine, ``run_batch_ray``
on Ray Data actors. Both resume a killed job from its results file."""

from tokenmill.batch.job import BatchStats, run_batch
from tokenmill.batch.ray_job import run_batch_ray

__all__ = ["BatchStats", "run_batch", "run_batch_ray"]
