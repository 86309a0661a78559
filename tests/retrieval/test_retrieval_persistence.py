"""Stores survive a restart (a new service on the same data folder), ingestion cut short by a
stop resumes, and concurrent uploads, attaches, searches and deletes stay consistent."""

from __future__ import annotations

import asyncio
import io
import os

import openai
from retrieval_harness import RetrievalServer, wait_done

from tokenmill.api.vector_stores import VectorStoreCreate
from tokenmill.retrieval import HashEmbedder, RetrievalService

TOPICS = ["volcano lava basalt eruption", "violin bow strings rosin", "glacier ice moraine",
          "compiler parser lexer grammar", "sourdough starter flour yeast",
          "orbit satellite apogee perigee"]


def doc(i: int) -> bytes:
    words = TOPICS[i % len(TOPICS)]
    return f"Document {i} is about {words}. It explains {words} in detail.\n".encode() * 20


def test_restart_keeps_everything(data_dir: str) -> None:
    s = RetrievalServer(data_dir).start()
    try:
        c = s.client()
        ids = [c.files.create(file=(f"d{i}.txt", io.BytesIO(doc(i))), purpose="assistants").id
               for i in range(6)]
        vs = c.vector_stores.create(name="persist", file_ids=ids[:4], metadata={"k": "v"}).id
        wait_done(c, vs)
        c.vector_stores.files.update(file_id=ids[0], vector_store_id=vs,
                                     attributes={"tag": "first"})
        c.vector_stores.files.delete(file_id=ids[3], vector_store_id=vs)
        before = {q: c.vector_stores.search(vs, query=q).model_dump() for q in TOPICS}
        files_before = [f.model_dump() for f in c.files.list()]
        store_before = c.vector_stores.retrieve(vs).model_dump()
    finally:
        s.stop()
    s = RetrievalServer(data_dir).start()
    try:
        c = s.client()
        assert [f.model_dump() for f in c.files.list()] == files_before
        after = c.vector_stores.retrieve(vs).model_dump()
        assert {k: v for k, v in after.items() if k != "last_active_at"} == {
            k: v for k, v in store_before.items() if k != "last_active_at"}
        for q in TOPICS:
            assert c.vector_stores.search(vs, query=q).model_dump() == before[q]
        assert c.vector_stores.files.retrieve(file_id=ids[0], vector_store_id=vs).attributes == {
            "tag": "first"}
        assert c.files.content(ids[5]).read() == doc(5)
        # Still writable after the restart.
        c.vector_stores.files.create_and_poll(vector_store_id=vs, file_id=ids[4])
        assert c.vector_stores.retrieve(vs).file_counts.completed == 4
    finally:
        s.stop()


class StuckEmbedder(HashEmbedder):
    """Never finishes embedding: a stop catches its files in progress."""

    async def embed(self, texts: list[str]) -> list[list[float]]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def _upload(svc: RetrievalService, name: str, data: bytes) -> str:
    path = svc.upload_path()
    with open(path, "wb") as f:
        f.write(data)
    return (await svc.create_file(path, name, "assistants", len(data))).id


def test_ingestion_resumes_after_a_stop(data_dir: str) -> None:
    async def first() -> tuple[str, list[str]]:
        svc = RetrievalService(data_dir, StuckEmbedder())
        ids = [await _upload(svc, f"d{i}.txt", doc(i)) for i in range(3)]
        vs = await svc.create_store(VectorStoreCreate(name="r", file_ids=ids))
        await asyncio.sleep(0.1)
        assert (await svc.get_store(vs.id)).file_counts.in_progress == 3
        # A half-received upload left behind by the stop.
        open(svc.upload_path(), "wb").close()
        await svc.close()
        return vs.id, ids

    async def second(vs: str, ids: list[str]) -> None:
        svc = RetrievalService(data_dir, HashEmbedder())
        await svc.start()
        await svc.ingest.wait()
        store = await svc.get_store(vs)
        assert store.file_counts.completed == 3 and store.status == "completed"
        hits = await svc.search([vs], TOPICS[1], 1)
        assert hits[0].file_id == ids[1]
        assert not [n for n in os.listdir(svc.files_dir) if n.startswith(".upload-")]
        await svc.close()

    vs, ids = asyncio.run(first())
    asyncio.run(second(vs, ids))


def test_concurrent_uploads_attaches_searches(server: RetrievalServer) -> None:
    n = 24

    async def run() -> None:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        vs = (await c.vector_stores.create(name="busy")).id
        searching = True

        async def searcher() -> int:
            done = 0
            while searching:
                page = await c.vector_stores.search(vs, query="lava eruption")
                # Never a chunk of a file that is not (or no longer) completed.
                assert all(r.filename.startswith("d") for r in page.data)
                done += 1
            return done

        async def add(i: int) -> str:
            f = await c.files.create(file=(f"d{i}.txt", io.BytesIO(doc(i))),
                                     purpose="assistants")
            await c.vector_stores.files.create(vector_store_id=vs, file_id=f.id,
                                               attributes={"i": i})
            return f.id

        searchers = [asyncio.create_task(searcher()) for _ in range(3)]
        ids = await asyncio.gather(*(add(i) for i in range(n)))
        # Delete a third of them while the rest may still be ingesting.
        await asyncio.gather(*(c.files.delete(f) for f in ids[::3]))
        while (await c.vector_stores.retrieve(vs)).file_counts.in_progress:
            await asyncio.sleep(0.05)
        searching = False
        assert all(s > 0 for s in await asyncio.gather(*searchers))

        kept = set(ids) - set(ids[::3])
        counts = (await c.vector_stores.retrieve(vs)).file_counts
        assert counts.completed == len(kept) and counts.total == len(kept)
        listed = {f.id async for f in c.vector_stores.files.list(vector_store_id=vs, limit=5)}
        assert listed == kept
        for t, words in enumerate(TOPICS):
            page = await c.vector_stores.search(vs, query=words, max_num_results=50)
            found = {r.file_id for r in page.data}
            assert found <= kept
            expected = {ids[i] for i in range(t, n, len(TOPICS))} & kept
            assert expected <= found
        await c.close()
        # Index and catalog agree: every kept chunk indexed once, no deleted file's left.
        svc = server.service
        idx = svc.index.get(vs)
        assert idx is not None and set(idx.by_file) == kept
        rows = svc.catalog.db.execute("SELECT count(*) FROM chunks WHERE store_id = ?",
                                      (vs,)).fetchone()[0]
        assert idx.index.ntotal == rows == sum(len(v) for v in idx.by_file.values())

    asyncio.run(run())
