"""The stream loop in-process with a scripted source: backpressure, write-before-ack, errors."""

from __future__ import annotations

import time

import pytest
from stream_helpers import MAX_TOKENS, REVIEWS, TEMPLATE, reference_texts

from tokenmill import SamplingParams
from tokenmill.stream import PromptTemplate, Record, StreamRunner

LIMIT = 3


class ScriptedSource:
    """Hands out records, checking that the runner never holds more than LIMIT unanswered."""

    def __init__(self, records: list[Record]) -> None:
        self.pending = list(records)
        self.exhausted = False
        self.outstanding: set[str] = set()
        self.most_outstanding = 0
        self.written: set[str] = set()  # filled by the sink
        self.acked: list[str] = []

    def read(self, max_records: int, timeout: float) -> list[Record]:
        assert len(self.outstanding) + max_records <= LIMIT
        out, self.pending = self.pending[:max_records], self.pending[max_records:]
        self.exhausted = not self.pending
        self.outstanding.update(r.id for r in out)
        self.most_outstanding = max(self.most_outstanding, len(self.outstanding))
        return out

    def ack(self, records: list[Record]) -> None:
        for r in records:
            assert r.id in self.written, f"record {r.id} acknowledged before its result was written"
            self.outstanding.remove(r.id)
            self.acked.append(r.id)


class ListSink:
    def __init__(self, source: ScriptedSource) -> None:
        self.source = source
        self.lines: dict[str, str] = {}

    def write(self, results: list[tuple[Record, str]]) -> None:
        for record, line in results:
            self.lines[record.id] = line
            self.source.written.add(record.id)


def test_backpressure_write_before_ack_and_bad_records(small_llm):
    from tokenmill.stream.records import StreamResult

    now = time.monotonic()
    records = [Record(str(i), {"text": t}, now) for i, t in enumerate(REVIEWS[:7])]
    records.append(Record("bad", None, now, error="line 8: not valid JSON"))
    records.append(Record("nofield", {"title": "x"}, now))
    source = ScriptedSource(records)
    sink = ListSink(source)
    runner = StreamRunner(small_llm.engine, source, sink, PromptTemplate(TEMPLATE),
                          SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                          max_in_flight=LIMIT)
    stats = runner.run()
    assert source.most_outstanding == LIMIT and not source.outstanding
    assert sorted(source.acked) == sorted(r.id for r in records)
    assert (stats.ok, stats.errors) == (7, 2)

    results = {k: StreamResult.model_validate_json(v) for k, v in sink.lines.items()}
    assert [results[str(i)].text for i in range(7)] == reference_texts(small_llm, REVIEWS[:7])
    assert results["bad"].error == "line 8: not valid JSON"
    assert "has no field 'text'" in results["nofield"].error
    lat = results["0"].latency
    assert 0 <= lat.queue_s <= lat.ttft_s <= lat.e2e_s
    assert "latency (ms)" in stats.summary() and "TTFT" in stats.summary()


@pytest.mark.parametrize("template, message", [
    ("no fields", "names no field"),
    ("{}", "must be named"),
    ("{0}", "must be named"),
    ("{text", "expected '}'"),
])
def test_template_errors(template, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(template)


def test_template_renders_fields():
    t = PromptTemplate("Q: {q} ({meta[lang]})")
    assert t.render({"q": "hi", "meta": {"lang": "en"}}) == "Q: hi (en)"
    with pytest.raises(ValueError, match="no field 'meta'"):
        t.render({"q": "hi"})
    with pytest.raises(ValueError, match="cannot be filled"):
        t.render({"q": "hi", "meta": {}})
