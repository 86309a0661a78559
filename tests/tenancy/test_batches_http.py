"""OpenAI's Batch API (``/v1/batches``) through the official client: a batch over an uploaded
JSONL file answers each line as the endpoint would, into an output and an error file; it is
its project's (another project's key gets 404 on it, its files and its input file) and its
lines count as the project's usage; a cancelled batch stops."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tenancy_harness import ADMIN, SERVER_KEY, Server, new_key, new_project, start

# A batch is waited for at most this long (a bound on a wait, not a speed check).
WAIT_S = 300


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def upload(c: openai.OpenAI, lines: list[str], purpose: str = "batch") -> str:
    data = ("\n".join(lines) + "\n").encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose=purpose).id


def wait(c: openai.OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    pytest.fail(f"the batch did not end in {WAIT_S} s: {batch}")


def jsonl(c: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).read().decode().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start(Path(tmp_path_factory.mktemp("data")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def done(server: Server) -> dict[str, Any]:
    """Project a's finished batch: two good lines, a refused body, a line for another url."""
    pa = new_project(server)
    a = client(server, new_key(server, pa)["value"])
    b = client(server, new_key(server, new_project(server))["value"])
    chat = {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    file_id = upload(a, [line("one", chat), line("two", {**chat, "stream": True}),
                         line("bad", {**chat, "max_tokens": -1}),
                         line("other", {"model": server.model, "prompt": "x"},
                              "/v1/completions")])
    batch = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"team": "a"})
    assert batch.status == "validating" and batch.input_file_id == file_id
    return {"a": a, "b": b, "project": pa, "file": file_id, "batch": wait(a, batch.id)}


def test_a_batch_answers_each_line_as_the_endpoint_would(done: dict) -> None:
    a, batch = done["a"], done["batch"]
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (4, 2, 2)
    assert batch.metadata == {"team": "a"} and batch.completed_at >= batch.created_at
    out = {o["custom_id"]: o for o in jsonl(a, batch.output_file_id)}
    assert set(out) == {"one", "two"}
    for o in out.values():
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
    errors = {o["custom_id"]: o for o in jsonl(a, batch.error_file_id)}
    assert errors["bad"]["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(errors["bad"]["response"]["body"])
    assert "url must be the batch's endpoint" in errors["other"]["error"]["message"]
    assert a.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [x.id for x in a.batches.list()]


BATCH_CALLS = {
    "batches.retrieve": lambda b, o: b.batches.retrieve(o["batch"].id),
    "batches.cancel": lambda b, o: b.batches.cancel(o["batch"].id),
    "files.content(output)": lambda b, o: b.files.content(o["batch"].output_file_id),
    "files.content(errors)": lambda b, o: b.files.content(o["batch"].error_file_id),
    "batches.create(input_file_id)": lambda b, o: b.batches.create(
        input_file_id=o["file"], endpoint="/v1/chat/completions", completion_window="24h"),
}


@pytest.mark.parametrize("name", list(BATCH_CALLS))
def test_another_project_gets_404(done: dict, name: str) -> None:
    with pytest.raises(openai.NotFoundError):
        BATCH_CALLS[name](done["b"], done)
    assert done["a"].batches.retrieve(done["batch"].id).status == "completed"


def test_lists_and_usage_are_the_projects(server: Server, done: dict) -> None:
    assert done["batch"].id not in [x.id for x in done["b"].batches.list()]
    srv = client(server, SERVER_KEY)
    assert srv.batches.retrieve(done["batch"].id).status == "completed"
    r = httpx.get(f"{server.url}/v1/organization/usage/export", headers=ADMIN, timeout=30,
                  params={"start_time": done["batch"].created_at - 5, "format": "jsonl",
                          "project_ids": done["project"]})
    rows = [json.loads(x) for x in r.text.splitlines()]
    assert len(rows) >= 2 and {x["project_id"] for x in rows} == {done["project"]}


def test_bad_batches_are_400s_and_the_next_is_answered(server: Server) -> None:
    c = client(server, new_key(server, new_project(server))["value"])
    chat = {"model": server.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}
    not_batch = upload(c, [line("x", chat)], purpose="assistants")
    good = upload(c, [line("x", chat)])
    cases = [({"input_file_id": not_batch}, "purpose"),
             ({"input_file_id": good, "endpoint": "/v1/moderations"}, "endpoint"),
             ({"input_file_id": good, "completion_window": "1h"}, "completion_window")]
    for change, word in cases:
        body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError, match=word):
            c.batches.create(**body)
    batch = c.batches.create(input_file_id=good, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert wait(c, batch.id).request_counts.completed == 1


def test_a_cancelled_batch_stops(server: Server) -> None:
    c = client(server, SERVER_KEY)
    chat = {"model": server.model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "count"}]}
    file_id = upload(c, [line(f"n{i}", chat) for i in range(200)])
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    ended = wait(c, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert ended.request_counts.completed + ended.request_counts.failed < 200


def test_input_lines_are_read_one_by_one_and_checked(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.api.errors import APIError
    from tokenmill.retrieval import batches

    path = tmp_path / "in.jsonl"
    body = {"model": "m", "prompt": "x"}
    path.write_text("\n".join([line("a", body, "/v1/completions"), "",
                               line("a", body, "/v1/completions"), line("b", body),
                               "not json"]) + "\n")
    items = list(batches.read_lines(str(path), "/v1/completions"))
    assert [type(i).__name__ for i in items] == ["BatchRequest", "LineError", "LineError",
                                                 "LineError"]
    assert "already used on line 1" in items[1].message
    assert "url must be the batch's endpoint" in items[2].message
    assert batches.count_lines(str(path)) == 4
    monkeypatch.setattr(batches, "MAX_BATCH_LINES", 3)
    with pytest.raises(APIError, match="at most 3 requests"):
        batches.count_lines(str(path))
