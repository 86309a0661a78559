"""Streaming inference: records from stdin or a Redis Stream, answered in micro-batches as they
arrive, each acknowledged only after its result is written (at-least-once)."""

from tokenmill.stream.records import PromptTemplate, Record, StreamResult
from tokenmill.stream.runner import StreamRunner

__all__ = ["PromptTemplate", "Record", "StreamResult", "StreamRunner"]
