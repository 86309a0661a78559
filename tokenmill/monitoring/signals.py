"""The per-request signals the drift monitor watches, read from a finished sequence's stats."""

from __future__ import annotations

from tokenmill.metrics.stats import FinishedRequestStats
from tokenmill.monitoring.scripts import prompt_script

# Signals whose values are numbers (binned at the reference's quantiles).
NUMERIC = ("prompt_tokens", "output_tokens", "mean_logprob")
# Signals whose values are categories.
CATEGORICAL = ("finish_reason", "stop_kind", "script")
SIGNALS = NUMERIC + CATEGORICAL
# The optional signal of an embedding model's view of the prompts (cosine distance of the
# windows' mean embeddings, not a PSI).
CENTROID = "prompt_embedding"

Signals = dict[str, float | str]


def stop_kind(finish_reason: str, stop_reason: int | str | None) -> str:
    """What ended a sequence: "eos", "stop_string", "stop_token", "max_tokens" (or the context
    limit), "abort", or another finish reason as it is."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop":
        if isinstance(stop_reason, str):
            return "stop_string"
        return "eos" if stop_reason is None else "stop_token"
    return finish_reason


def request_signals(f: FinishedRequestStats) -> Signals:
    """The signals of one finished sequence (mean_logprob left out when it has none)."""
    out: Signals = {
        "prompt_tokens": float(f.num_prompt_tokens),
        "output_tokens": float(f.num_generation_tokens),
        "finish_reason": f.finish_reason,
        "stop_kind": stop_kind(f.finish_reason, f.stop_reason),
        "script": prompt_script(f.prompt),
    }
    if f.mean_logprob is not None:
        out["mean_logprob"] = f.mean_logprob
    return out
