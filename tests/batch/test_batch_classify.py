"""/v1/classify lines in a batch file: routed like the offline call, bad ones refused with the
server's 400, mixed with generation lines in one file."""

from __future__ import annotations

import pytest
from batch_helpers import by_custom_id, completion, read_results, write_jsonl

from tokenmill.batch import run_batch

LABELS = ["Payments", "Bugs", "Login", "Delivery"]
TICKETS = ["I was charged twice for my subscription this month.",
           "The app crashes every time I open the settings page.",
           "I forgot my password and can't log in.",
           "My package hasn't arrived after two weeks.",
           "Please refund the second charge on my card."]


def classify(custom_id: str, text: str | list[str], labels: list | None = None,
             **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/classify",
            "body": {"input": text, "labels": LABELS if labels is None else labels, **body}}


def test_a_file_of_tickets_is_routed(tmp_path, small_llm) -> None:
    lines = [classify(f"t{i}", t) for i, t in enumerate(TICKETS)]
    lines += [classify("two", TICKETS[:2], instruction="Route the ticket."),
              completion("gen", "The capital of France is"),
              classify("dup", "x", ["a", "a"]),
              classify("long-label", "x", ["a", "word " * 100]),
              classify("no-labels", "x", []),
              classify("past-context", "word " * 600),
              classify("after", TICKETS[3])]
    out = tmp_path / "out.jsonl"
    stats = run_batch(str(write_jsonl(tmp_path / "in.jsonl", lines)), str(out),
                      small_llm.engine, progress=False, max_in_flight=8)
    assert (stats.succeeded, stats.failed) == (8, 4)
    results = by_custom_id(read_results(out))

    want = small_llm.classify(TICKETS, LABELS)
    for i, w in enumerate(want):
        body = results[f"t{i}"]["response"]["body"]
        assert results[f"t{i}"]["response"]["request_id"] == body["id"]
        assert body["object"] == "list" and body["id"].startswith("classify-")
        [d] = body["data"]
        assert d["index"] == 0 and d["label"] == w.label
        assert list(d["probs"].values()) == pytest.approx(list(w.probs.values()), abs=1e-4)
        assert body["usage"]["prompt_tokens"] == w.num_prompt_tokens
    two = results["two"]["response"]["body"]["data"]
    assert [d["index"] for d in two] == [0, 1]
    after = results["after"]["response"]["body"]["data"][0]
    assert after["probs"] == pytest.approx(want[3].probs, abs=1e-4)
    assert results["gen"]["response"]["body"]["object"] == "text_completion"
    for name in ("dup", "long-label", "no-labels", "past-context"):
        response = results[name]["response"]
        assert response["status_code"] == 400, response
        param = "input" if name == "past-context" else "labels"
        assert response["body"]["error"]["param"] == param
    assert not small_llm.engine.has_unfinished_requests()
