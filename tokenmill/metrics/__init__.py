"""Engine statistics as plain data, and the loggers that consume them."""

from tokenmill.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    StatLogger,
    StatsCollector,
    StepConsumer,
    StepStats,
)

__all__ = ["FinishedRequestStats", "IterationStats", "StatLogger", "StatsCollector",
           "StepConsumer", "StepStats"]
