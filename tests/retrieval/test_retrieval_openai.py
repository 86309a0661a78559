"""Every Files and Vector Stores call of the official ``openai`` client against the test
server (hashing embedder): shapes, statuses, pagination, filters and search."""

from __future__ import annotations

import io

import openai
import pytest
from retrieval_harness import wait_done

DOCS = {
    "cats.txt": "Cats purr when they are content. A cat sleeps sixteen hours a day.",
    "rust.md": "# Rust\n\nThe borrow checker enforces ownership rules at compile time.",
    "tea.html": "<html><head><style>p {color: red}</style></head><body><h1>Tea</h1>"
                "<p>Green tea is steeped at eighty degrees.</p><script>x()</script></body></html>",
    "notes.json": '{"topic": "volcanoes", "fact": "Basalt lava flows are fluid and hot."}',
}


def upload(client: openai.OpenAI, name: str, text: str | bytes,
           purpose: str = "assistants") -> openai.types.FileObject:
    data = text.encode() if isinstance(text, str) else text
    return client.files.create(file=(name, io.BytesIO(data)), purpose=purpose)  # type: ignore[arg-type]


def test_files_roundtrip(client: openai.OpenAI) -> None:
    f = upload(client, "cats.txt", DOCS["cats.txt"])
    assert f.object == "file" and f.id.startswith("file-")
    assert f.filename == "cats.txt" and f.bytes == len(DOCS["cats.txt"]) and f.purpose == "assistants"
    assert client.files.retrieve(f.id).model_dump() == f.model_dump()
    assert client.files.content(f.id).read() == DOCS["cats.txt"].encode()
    other = upload(client, "data.bin", b"\x00\x01\x02", purpose="user_data")
    assert [x.id for x in client.files.list()] == [other.id, f.id]  # newest first
    assert [x.id for x in client.files.list(purpose="user_data")] == [other.id]
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_pagination(client: openai.OpenAI) -> None:
    ids = [upload(client, f"f{i}.txt", f"file number {i}").id for i in range(5)]
    first = client.files.list(limit=2, order="asc")
    assert [f.id for f in first.data] == ids[:2] and first.has_more
    second = client.files.list(limit=2, order="asc", after=first.data[-1].id)
    assert [f.id for f in second.data] == ids[2:4]
    # The client's auto-pagination walks every page.
    assert [f.id for f in client.files.list(limit=2, order="asc")] == ids
    assert [f.id for f in client.files.list(limit=2, order="desc")] == ids[::-1]
    stores = [client.vector_stores.create(name=f"s{i}").id for i in range(3)]
    page = client.vector_stores.list(limit=1, order="asc", after=stores[0])
    assert [s.id for s in page.data] == [stores[1]] and page.has_more
    assert [s.id for s in client.vector_stores.list(order="asc", before=stores[2])] == stores[:2]


def test_vector_store_lifecycle(client: openai.OpenAI) -> None:
    files = {name: upload(client, name, text) for name, text in DOCS.items()}
    vs = client.vector_stores.create(
        name="kb", file_ids=[files["cats.txt"].id], metadata={"team": "docs"},
        expires_after={"anchor": "last_active_at", "days": 7})
    assert vs.object == "vector_store" and vs.name == "kb" and vs.metadata == {"team": "docs"}
    assert vs.expires_after.days == 7 and vs.expires_at == vs.last_active_at + 7 * 86400
    assert vs.file_counts.total == 1
    wait_done(client, vs.id)
    vs = client.vector_stores.retrieve(vs.id)
    assert vs.status == "completed" and vs.file_counts.completed == 1 and vs.usage_bytes > 0

    vf = client.vector_stores.files.create_and_poll(
        vector_store_id=vs.id, file_id=files["rust.md"].id,
        attributes={"lang": "en", "year": 2024, "draft": False},
        chunking_strategy={"type": "static", "static": {"max_chunk_size_tokens": 100,
                                                        "chunk_overlap_tokens": 50}})
    assert vf.status == "completed" and vf.last_error is None
    assert vf.attributes == {"lang": "en", "year": 2024, "draft": False}
    assert vf.chunking_strategy.static.max_chunk_size_tokens == 100
    assert client.vector_stores.files.retrieve(file_id=vf.id, vector_store_id=vs.id).status == "completed"
    updated = client.vector_stores.files.update(file_id=vf.id, vector_store_id=vs.id,
                                                attributes={"lang": "de"})
    assert updated.attributes == {"lang": "de"}
    content = client.vector_stores.files.content(file_id=vf.id, vector_store_id=vs.id)
    assert "borrow checker" in "".join(c.text for c in content)
    listed = client.vector_stores.files.list(vector_store_id=vs.id, order="asc")
    assert [f.id for f in listed] == [files["cats.txt"].id, vf.id]
    assert [f.id for f in client.vector_stores.files.list(vector_store_id=vs.id,
                                                          filter="failed")] == []

    renamed = client.vector_stores.update(vs.id, name="kb2", metadata={"team": "x"})
    assert renamed.name == "kb2" and renamed.metadata == {"team": "x"}
    assert vs.id in [s.id for s in client.vector_stores.list()]

    gone = client.vector_stores.files.delete(file_id=vf.id, vector_store_id=vs.id)
    assert gone.deleted and gone.object == "vector_store.file.deleted"
    assert client.vector_stores.retrieve(vs.id).file_counts.total == 1
    assert client.files.retrieve(vf.id).id == vf.id  # detaching keeps the file
    deleted = client.vector_stores.delete(vs.id)
    assert deleted.deleted and deleted.object == "vector_store.deleted"
    with pytest.raises(openai.NotFoundError):
        client.vector_stores.retrieve(vs.id)


def test_file_batches(client: openai.OpenAI) -> None:
    ids = [upload(client, name, text).id for name, text in DOCS.items()]
    vs = client.vector_stores.create(name="batch")
    batch = client.vector_stores.file_batches.create_and_poll(
        vector_store_id=vs.id, file_ids=ids, attributes={"source": "wiki"})
    assert batch.object == "vector_store.files_batch" and batch.status == "completed"
    assert batch.file_counts.completed == len(ids) and batch.file_counts.total == len(ids)
    assert client.vector_stores.file_batches.retrieve(batch.id, vector_store_id=vs.id).id == batch.id
    listed = client.vector_stores.file_batches.list_files(batch.id, vector_store_id=vs.id)
    assert sorted(f.id for f in listed) == sorted(ids)
    assert all(f.attributes == {"source": "wiki"} for f in listed)
    cancelled = client.vector_stores.file_batches.cancel(batch.id, vector_store_id=vs.id)
    assert cancelled.status == "completed"  # nothing was left to cancel


def _store(client: openai.OpenAI) -> tuple[str, dict[str, str]]:
    vs = client.vector_stores.create(name="search")
    ids = {}
    for i, (name, text) in enumerate(DOCS.items()):
        f = upload(client, name, text)
        client.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id,
                                          attributes={"rank": i, "kind": name.split(".")[1]})
        ids[name] = f.id
    wait_done(client, vs.id)
    return vs.id, ids


def test_search(client: openai.OpenAI) -> None:
    vs, ids = _store(client)
    page = client.vector_stores.search(vs, query="borrow checker ownership rules")
    top = page.data[0]
    assert top.file_id == ids["rust.md"] and top.filename == "rust.md"
    assert top.attributes == {"rank": 1, "kind": "md"}
    assert top.content[0].type == "text" and "borrow checker" in top.content[0].text
    assert [r.score for r in page.data] == sorted((r.score for r in page.data), reverse=True)
    assert len(list(client.vector_stores.search(vs, query="tea", max_num_results=2))) == 2
    # HTML comes back as its text: no tags, no script or style.
    tea = client.vector_stores.search(vs, query="green tea steeped degrees").data[0]
    assert tea.filename == "tea.html" and "<" not in tea.content[0].text
    assert "color" not in tea.content[0].text and "x()" not in tea.content[0].text
    # A list of queries: each chunk scores its best.
    both = client.vector_stores.search(vs, query=["cat sleeps", "basalt lava"], max_num_results=2)
    assert {r.filename for r in both.data} == {"cats.txt", "notes.json"}


def test_search_filters_and_threshold(client: openai.OpenAI) -> None:
    vs, ids = _store(client)
    q = "cats purr borrow checker tea basalt"

    def names(filters: dict) -> set[str]:
        return {r.filename for r in client.vector_stores.search(vs, query=q, filters=filters)}

    assert names({"key": "kind", "type": "eq", "value": "md"}) == {"rust.md"}
    assert names({"key": "kind", "type": "ne", "value": "md"}) == set(DOCS) - {"rust.md"}
    assert names({"key": "rank", "type": "gte", "value": 2}) == {"tea.html", "notes.json"}
    assert names({"key": "rank", "type": "lt", "value": 1}) == {"cats.txt"}
    assert names({"key": "kind", "type": "in", "value": ["txt", "json"]}) == {"cats.txt",
                                                                               "notes.json"}
    assert names({"key": "kind", "type": "nin", "value": ["txt", "json"]}) == {"rust.md",
                                                                                "tea.html"}
    assert names({"type": "and", "filters": [{"key": "rank", "type": "gt", "value": 0},
                                             {"key": "rank", "type": "lte", "value": 1}]}) == {
        "rust.md"}
    assert names({"type": "or", "filters": [{"key": "kind", "type": "eq", "value": "txt"},
                                            {"key": "missing", "type": "eq", "value": 1}]}) == {
        "cats.txt"}
    everything = client.vector_stores.search(vs, query=q).data
    cut = (everything[0].score + everything[-1].score) / 2
    kept = client.vector_stores.search(vs, query=q, ranking_options={"score_threshold": cut})
    assert kept.data and all(r.score >= cut for r in kept.data)
    assert len(kept.data) < len(everything)


def test_deleting_a_file_removes_its_chunks(client: openai.OpenAI) -> None:
    vs, ids = _store(client)
    assert client.vector_stores.search(vs, query="borrow checker").data[0].filename == "rust.md"
    client.files.delete(ids["rust.md"])
    names = {r.filename for r in client.vector_stores.search(vs, query="borrow checker")}
    assert "rust.md" not in names and names
    assert client.vector_stores.retrieve(vs).file_counts.total == len(DOCS) - 1
