"""Records in, results out: what a stream job reads, how it builds a prompt, what it writes."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass
class Record:
    """One input record.

    ``fields`` is None when the record could not be read (``error`` says why); such a record
    is answered with its error and acknowledged, so it cannot block the stream.
    """

    id: str  # the stdin line number, or the Redis entry id
    fields: dict[str, Any] | None
    received: float  # time.monotonic() when this process read it
    # Seconds the record waited in its source before this process read it, where known.
    source_wait_s: float | None = None
    error: str | None = None


class PromptTemplate:
    """``str.format`` with a record's fields: ``"Classify: {text}"``.

    The template comes from the operator and is checked once; the fields come from the records
    and are only substituted, never parsed as a template.
    """

    def __init__(self, template: str) -> None:
        names: list[str] = []
        try:
            for _, name, _, _ in string.Formatter().parse(template):
                if name is None:
                    continue
                head = name.split(".", 1)[0].split("[", 1)[0]
                if not head.isidentifier():
                    raise ValueError(
                        f"template fields must be named, like {{text}}; got {{{name}}}")
                names.append(head)
        except ValueError as e:
            raise ValueError(f"--template {template!r}: {e}") from None
        if not names:
            raise ValueError(f"--template {template!r} names no field, like {{text}}")
        self.template = template
        self.names = names

    def render(self, fields: dict[str, Any]) -> str:
        """The prompt of one record; ValueError names a missing field."""
        missing = [n for n in self.names if n not in fields]
        if missing:
            raise ValueError(f"the record has no field {missing[0]!r} for the template "
                             f"(its fields: {sorted(fields)})")
        try:
            return self.template.format_map(fields)
        except (LookupError, AttributeError, ValueError, TypeError) as e:
            raise ValueError(f"the template cannot be filled from this record: {e}") from None


class Latency(BaseModel):
    """Seconds, per record: waiting in the source (Redis), then from being read to the engine
    scheduling it (queue), to its first token (ttft) and to its last (e2e)."""

    source_wait_s: float | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class StreamResult(BaseModel):
    """One output line (stdout) or the ``result`` field of one output entry (Redis)."""

    id: str
    record: dict[str, Any] | None = None
    text: str | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    latency: Latency | None = None
    error: str | None = None
