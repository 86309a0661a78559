"""The whole loop from one `tokenmill serve` with its default models (the embedded chat model
and all-MiniLM-L6-v2), through the official client: embeddings, a file in a vector store,
search, an answer from /v1/responses with file_search (whole and streamed) citing the file,
requests to both models interleaved, and a restart that keeps the store."""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, start_server  # noqa: E402

HANDBOOK = """# Refunds
Customers can get a full refund within 30 days of purchase. Refunds go back to the card used.

# Shipping
Orders ship from our warehouse in Lyon within two business days.

# Passwords
To reset a password, open Settings, then Security, then choose Reset password.
"""


def serve(data_dir: Path) -> Server:
    # No --model: the default pair. The harness adds --max-model-len 512 (MiniLM reads 256).
    return start_server("--data-dir", str(data_dir), "--max-model-len", "256")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rag-data")


@pytest.fixture(scope="module")
def rag(data_dir: Path) -> Iterator[Server]:
    s = serve(data_dir)
    yield s
    assert s.stop() == 0, s.log()


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_default_server_has_both_models_and_interleaves_them(rag: Server) -> None:
    client = client_of(rag)
    ids = [m.id for m in client.models.list().data]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1", "all-MiniLM-L6-v2"]

    def call(i: int) -> int:
        if i % 2:
            r = client.embeddings.create(model="all-MiniLM-L6-v2", input=[f"text {i}", "more"])
            return len(r.data[0].embedding)
        r = client.chat.completions.create(model=ids[0], max_tokens=4,
                                           messages=[{"role": "user", "content": f"Hi {i}"}])
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        out = list(pool.map(call, range(12)))
    assert out[1::2] == [384] * 6 and all(0 < n <= 4 for n in out[::2])
    with pytest.raises(openai.BadRequestError, match="computes embeddings"):
        client.chat.completions.create(model="all-MiniLM-L6-v2", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])


def test_files_vector_store_search_and_answers(rag: Server, tmp_path: Path) -> None:
    client = client_of(rag)
    path = tmp_path / "handbook.md"
    path.write_text(HANDBOOK)
    f = client.files.create(file=path.open("rb"), purpose="assistants")
    vs = client.vector_stores.create(name="handbook")
    attached = client.vector_stores.files.create_and_poll(
        vector_store_id=vs.id, file_id=f.id, attributes={"team": "support"},
        poll_interval_ms=200)
    assert attached.status == "completed", attached.last_error
    hits = client.vector_stores.search(vs.id, query="How do I reset my password?",
                                       max_num_results=2)
    assert hits.data[0].filename == "handbook.md"
    assert "Reset password" in hits.data[0].content[0].text

    tools = [{"type": "file_search", "vector_store_ids": [vs.id], "max_num_results": 2}]
    r = client.responses.create(model="SmolLM2-135M-Instruct.Q4_1", input="How long do I have "
                                "to ask for a refund?", tools=tools, max_output_tokens=40,
                                temperature=0, include=["file_search_call.results"])
    kinds = [item.type for item in r.output]
    assert kinds == ["file_search_call", "message"]
    call, message = r.output
    assert call.results and call.results[0].filename == "handbook.md"
    cited = {a.file_id for a in message.content[0].annotations if a.type == "file_citation"}
    assert cited == {f.id}
    assert r.output_text and r.usage.output_tokens > 0

    events = [e.type for e in client.responses.create(
        model="SmolLM2-135M-Instruct.Q4_1", input="Where do orders ship from?", tools=tools,
        max_output_tokens=20, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed",
                                                               "response.incomplete")
    assert "response.file_search_call.completed" in events
    assert "response.output_text.annotation.added" in events


def test_a_restart_keeps_the_store(rag: Server, data_dir: Path) -> None:
    client = client_of(rag)
    stores = {s.name: s.id for s in client.vector_stores.list()}
    assert "handbook" in stores
    assert rag.stop() == 0, rag.log()
    again = serve(data_dir)
    try:
        c2 = client_of(again)
        assert {s.name: s.id for s in c2.vector_stores.list()}["handbook"] == stores["handbook"]
        hits = c2.vector_stores.search(stores["handbook"], query="warehouse in Lyon")
        assert hits.data and "Lyon" in hits.data[0].content[0].text
    finally:
        assert again.stop() == 0, again.log()
