"""The batch job in-process: both endpoints in one file, bad lines, resuming a results file."""

from __future__ import annotations

import json

import pytest
from batch_helpers import by_custom_id, chat, completion, read_results, texts, write_jsonl

from tokenmill import SamplingParams
from tokenmill.batch import run_batch


def test_both_endpoints_in_one_file(tmp_path, small_llm):
    lines = [
        chat("c1", "Name a color."),
        completion("p1", "The capital of France is"),
        completion("p2", ["One, two,", "Red, green,"], n=2, max_tokens=4),
        chat("c2", "Say hi.", logprobs=True, top_logprobs=2, max_tokens=3),
        completion("p3", [504, 3458, 282], max_tokens=4, logprobs=1, echo=True),
    ]
    out = tmp_path / "out.jsonl"
    stats = run_batch(str(write_jsonl(tmp_path / "in.jsonl", lines)), str(out),
                      small_llm.engine, progress=False)
    assert (stats.succeeded, stats.failed, stats.skipped) == (5, 0, 0)
    results = by_custom_id(read_results(out))
    assert set(results) == {"c1", "p1", "p2", "c2", "p3"}
    for r in results.values():
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["id"].startswith("batch_req_")
        assert r["response"]["request_id"] == r["response"]["body"]["id"]

    greedy = SamplingParams(temperature=0, max_tokens=6)
    c1 = results["c1"]["response"]["body"]
    assert c1["object"] == "chat.completion" and c1["model"] == "SmolLM2-135M-Instruct.Q4_1"
    want = small_llm.chat([{"role": "user", "content": "Name a color."}], greedy)[0]
    assert texts(results["c1"]) == [want.outputs[0].text]
    assert c1["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)

    assert results["p1"]["response"]["body"]["object"] == "text_completion"
    want = small_llm.generate("The capital of France is", greedy)[0]
    assert texts(results["p1"]) == [want.outputs[0].text]

    p2 = results["p2"]["response"]["body"]  # two prompts x n=2: indices 0..3
    assert [c["index"] for c in p2["choices"]] == [0, 1, 2, 3]
    assert p2["usage"]["completion_tokens"] == 16

    lps = results["c2"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(lps) == 3 and all(len(t["top_logprobs"]) == 2 for t in lps)
    p3 = results["p3"]["response"]["body"]["choices"][0]
    assert len(p3["logprobs"]["tokens"]) == 3 + 4  # echo: the prompt's tokens come first


def test_bad_lines_get_errors_and_the_job_goes_on(tmp_path, small_llm):
    lines = [
        completion("ok1", "Hello"),
        "{not json",
        "[1, 2]",
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        completion("dup", "Hi"),
        completion("dup", "Hi again"),
        {**completion("bad-url", "x"), "url": "/v1/images/generations"},
        {**completion("bad-method", "x"), "method": "GET"},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions", "body": "text"},
        completion("hot", "x", temperature="hot"),
        chat("no-messages", "x") | {"body": {"messages": []}},
        completion("too-long", "word " * 600),
        completion("big-max", "Hello", max_tokens=10_000),
        completion("neg-top-p", "Hello", top_p=-1.0),
        completion("ok2", "Goodbye"),
    ]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with open(path, "ab") as f:  # bytes that are not UTF-8, and a blank line (skipped)
        f.write(b'{"custom_id": "\xff"}\n\n')
    out = tmp_path / "out.jsonl"
    stats = run_batch(str(path), str(out), small_llm.engine, progress=False)
    results = read_results(out)
    assert len(results) == 16 and (stats.succeeded, stats.failed) == (3, 13)
    by_line = {int(r["id"].removeprefix("batch_req_")): r for r in results}

    def error(line: int) -> str:
        r = by_line[line]
        assert r["response"] is None
        return r["error"]["message"]

    def refusal(line: int) -> dict:
        r = by_line[line]
        assert r["error"] is None and r["response"]["status_code"] == 400
        return r["response"]["body"]["error"]

    assert "line 2: not valid JSON" in error(2)
    assert "line 3: must be a JSON object, got list" in error(3)
    assert "line 4: custom_id must be a non-empty string" in error(4)
    assert "custom_id 'dup' is already used on line 5" in error(6)
    assert by_line[6]["custom_id"] is None
    assert "url must be one of" in error(7) and by_line[7]["custom_id"] == "bad-url"
    assert "method must be 'POST'" in error(8)
    assert "body must be a JSON object, got str" in error(9)
    assert refusal(10)["param"] == "temperature"
    assert refusal(11)["param"] == "messages"
    assert "maximum context length is 512" in refusal(12)["message"]
    assert refusal(13)["param"] == "max_tokens"
    assert refusal(14)["param"] == "top_p"
    assert "line 16: not valid UTF-8" in error(16)
    for line in (1, 5, 15):
        assert by_line[line]["response"]["status_code"] == 200


def test_resume_skips_answered_lines_and_cuts_a_torn_one(tmp_path, small_llm):
    lines = [completion(f"r{i}", f"Count to {i}:") for i in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    # An earlier run answered r0 (by custom_id) and line 2 (r1, by id), then died mid-line.
    earlier = [{"id": "batch_req_99", "custom_id": "r0", "response": None, "error": "marker"},
               {"id": "batch_req_2", "custom_id": None, "response": None, "error": "marker"}]
    out.write_text("".join(json.dumps(e) + "\n" for e in earlier) + '{"id": "batch_req_3", "cu')
    stats = run_batch(str(inp), str(out), small_llm.engine, progress=False)
    assert (stats.skipped, stats.succeeded) == (2, 4)
    results = read_results(out)  # every line parses: the torn one is gone
    assert results[:2] == earlier
    assert sorted(r["custom_id"] for r in results[2:]) == ["r2", "r3", "r4", "r5"]

    again = run_batch(str(inp), str(out), small_llm.engine, progress=False)
    assert (again.skipped, again.answered) == (6, 0)
    assert len(read_results(out)) == 6


def test_refuses_a_results_file_it_did_not_write(tmp_path, small_llm):
    inp = write_jsonl(tmp_path / "in.jsonl", [completion("a", "x")])
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n")
    with pytest.raises(ValueError, match="line 1: not a batch output line"):
        run_batch(str(inp), str(out), small_llm.engine, progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        run_batch(str(tmp_path / "missing.jsonl"), str(out), small_llm.engine)


def test_structured_outputs_in_a_batch_file(tmp_path, small_llm):
    schema = {"type": "object", "properties": {"queue": {"enum": ["billing", "sales"]}},
              "required": ["queue"], "additionalProperties": False}
    lines = [
        chat("s1", "Route: my card was charged twice.", max_tokens=30,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "route", "schema": schema}}),
        completion("s2", "Pick one:", max_tokens=10, guided_choice=["up", "down"]),
        completion("s3", "Digits:", max_tokens=10, structured_outputs={"regex": "[0-9]{4}"}),
        completion("bad", "x", structured_outputs={"regex": "(ab"}),
    ]
    out = tmp_path / "out.jsonl"
    stats = run_batch(str(write_jsonl(tmp_path / "in.jsonl", lines)), str(out),
                      small_llm.engine, progress=False)
    assert (stats.succeeded, stats.failed) == (3, 1)
    results = by_custom_id(read_results(out))
    assert json.loads(texts(results["s1"])[0])["queue"] in ("billing", "sales")
    assert texts(results["s2"])[0] in ("up", "down")
    assert len(texts(results["s3"])[0]) == 4 and texts(results["s3"])[0].isdigit()
    error = results["bad"]["response"]["body"]["error"]
    assert error["param"] == "structured_outputs" and "regex" in error["message"]
