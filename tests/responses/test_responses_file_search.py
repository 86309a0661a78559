"""The file_search tool through client.responses.create, on an in-process server whose search
is tests/responses/conftest.py's FakeSearch: the search runs with the user's question, its
chunks reach the model, the answer carries file_citation annotations, the file_search_call
item carries the results when ``include`` asks, streamed events come in OpenAI's order, and
bad searches are 4xx that lose nothing."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from responses_helpers import DOCS, InProcessServer

QUESTION = "What is the secret code word of the lighthouse?"


def _tool(**extra: Any) -> dict[str, Any]:
    return {"type": "file_search", "vector_store_ids": ["vs_docs"], **extra}


def _ask(client: openai.OpenAI, rag: InProcessServer, **kwargs: Any) -> Any:
    kwargs.setdefault("input", QUESTION)
    kwargs.setdefault("tools", [_tool()])
    kwargs.setdefault("max_output_tokens", 24)
    return client.responses.create(model=rag.model, temperature=0, **kwargs)


def test_answer_from_the_files_with_citations(rag_client: openai.OpenAI,
                                              rag: InProcessServer) -> None:
    rag.search.calls.clear()
    r = _ask(rag_client, rag, tools=[_tool(max_num_results=2, filters={
        "type": "eq", "key": "kind", "value": ".md"})])
    # The server searched once, with the user's question and the tool's settings.
    assert rag.search.calls == [(["vs_docs"], QUESTION, 2, {"type": "eq", "key": "kind",
                                                           "value": ".md"})]
    assert r.tools[0].filters.key == "kind"  # the request's tools are echoed
    search, message = r.output
    assert search.type == "file_search_call" and search.id.startswith("fs_")
    assert search.status == "completed" and search.queries == [QUESTION]
    assert search.results is None  # not asked for in include
    assert message.type == "message" and r.status == "completed"
    # The chunk reached the model: its answer repeats the code word.
    assert "PELICAN" in r.output_text.upper()
    annotations = message.content[0].annotations
    assert annotations, "the answer names the files it drew from"
    for a in annotations:
        assert a.type == "file_citation" and a.file_id in DOCS
        assert a.filename == DOCS[a.file_id][0] and 0 <= a.index <= len(r.output_text)
    # The best hit is among the files cited.
    assert "file-pelican" in {a.file_id for a in annotations}


def test_results_when_included(rag_client: openai.OpenAI, rag: InProcessServer) -> None:
    r = _ask(rag_client, rag, include=["file_search_call.results"], max_output_tokens=4)
    results = r.output[0].results
    assert [x.file_id for x in results][0] == "file-pelican" and len(results) == len(DOCS)
    for x in results:
        name, text = DOCS[x.file_id]
        assert x.filename == name and x.text == text and 0 <= x.score <= 1
        assert x.attributes == {"kind": name[-3:]}
    assert results == sorted(results, key=lambda x: -x.score)
    # ranking_options.score_threshold drops the weak hits.
    best = results[0].score
    r = _ask(rag_client, rag, include=["file_search_call.results"], max_output_tokens=4,
             tools=[_tool(ranking_options={"score_threshold": best})])
    assert [x.file_id for x in r.output[0].results] == ["file-pelican"]


def test_streamed_file_search(rag_client: openai.OpenAI, rag: InProcessServer) -> None:
    with _ask(rag_client, rag, stream=True, include=["file_search_call.results"]) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    annotations = kinds.count("response.output_text.annotation.added")
    assert deltas >= 1 and annotations >= 1
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.file_search_call.in_progress",
        "response.file_search_call.searching", "response.file_search_call.completed",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done",
        *["response.output_text.annotation.added"] * annotations,
        "response.content_part.done", "response.output_item.done", "response.completed"]
    search_item = events[6].item
    assert events[2].item.type == "file_search_call" and search_item.status == "completed"
    assert search_item.results[0].file_id == "file-pelican"
    assert events[7].output_index == 1
    done = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.output_text == text
    streamed = [e.annotation for e in events if e.type == "response.output_text.annotation.added"]
    assert [a.annotation_index for a in events if a.type ==
            "response.output_text.annotation.added"] == list(range(annotations))
    assert [a.model_dump() for a in done.output[1].content[0].annotations] == \
        [a.model_dump() for a in streamed]
    whole = _ask(rag_client, rag)
    assert whole.output_text == text  # greedy: the same answer streamed or whole
    assert [(a.file_id, a.index) for a in whole.output[1].content[0].annotations] == \
        [(a.file_id, a.index) for a in streamed]


def test_long_chunks_are_trimmed_to_the_context(rag_client: openai.OpenAI,
                                                rag: InProcessServer) -> None:
    rag.search.long = True
    try:
        r = _ask(rag_client, rag, max_output_tokens=64, include=["file_search_call.results"])
    finally:
        rag.search.long = False
    assert r.status in ("completed", "incomplete")
    # 3 x 3,000 words went in as results, the prompt still left room for the answer.
    assert sum(len(x.text.split()) for x in r.output[0].results) > 6000
    assert r.usage.input_tokens + 64 <= rag.max_model_len
    assert r.usage.input_tokens > rag.max_model_len // 2  # the room was used


def test_tool_choice_none_skips_the_search(rag_client: openai.OpenAI,
                                           rag: InProcessServer) -> None:
    rag.search.calls.clear()
    r = _ask(rag_client, rag, tool_choice="none", max_output_tokens=4)
    assert rag.search.calls == [] and [o.type for o in r.output] == ["message"]
    assert r.output[0].content[0].annotations == []


def test_file_search_with_previous_response(rag_client: openai.OpenAI,
                                            rag: InProcessServer) -> None:
    first = _ask(rag_client, rag, max_output_tokens=8)
    rag.search.calls.clear()
    follow = _ask(rag_client, rag, input="When do they water the tomatoes?",
                  previous_response_id=first.id, include=["file_search_call.results"])
    # The search uses the newest question, not the first one.
    assert rag.search.calls[0][1] == "When do they water the tomatoes?"
    assert follow.output[0].queries == ["When do they water the tomatoes?"]
    assert follow.output[0].results[0].file_id == "file-garden"


def test_with_the_real_retrieval_service(rag_client: openai.OpenAI,
                                         rag: InProcessServer) -> None:
    """A file uploaded, attached and indexed by tokenmill's retrieval service (the embedder
    is the tests' HashEmbedder), found and cited by file_search."""
    from tokenmill.api.vector_stores import VectorStoreCreate

    service = rag.retrieval
    files = []
    for name, text in [("pelican.md", DOCS["file-pelican"][1]),
                       ("bikes.txt", DOCS["file-bikes"][1])]:
        upload = service.upload_path()
        with open(upload, "w", encoding="utf-8") as f:
            f.write(text)
        files.append(rag.run(service.create_file(upload, name, "assistants", len(text))))
    store = rag.run(service.create_store(VectorStoreCreate(name="docs",
                                                           file_ids=[f.id for f in files])))
    deadline = time.monotonic() + 60
    while rag.run(service.get_store(store.id)).file_counts.completed < 2:
        assert time.monotonic() < deadline, "the files were not indexed"
        time.sleep(0.1)
    r = _ask(rag_client, rag, tools=[_tool(vector_store_ids=[store.id])],
             include=["file_search_call.results"])
    search, message = r.output
    assert search.results[0].file_id == files[0].id
    assert search.results[0].filename == "pelican.md"
    assert search.results[0].text == DOCS["file-pelican"][1]
    assert "PELICAN" in r.output_text.upper()
    cited = {(a.file_id, a.filename) for a in message.content[0].annotations}
    assert (files[0].id, "pelican.md") in cited
    with pytest.raises(openai.NotFoundError) as err:
        _ask(rag_client, rag, tools=[_tool(vector_store_ids=[store.id, "vs_gone"])])
    assert err.value.body["param"] == "tools" and "vs_gone" in err.value.body["message"]


@pytest.mark.parametrize(("tool", "status", "word"), [
    (_tool(vector_store_ids=["vs_missing"]), 404, "vs_missing"),
    (_tool(vector_store_ids=[]), 400, "vector_store_ids"),
    (_tool(ranking_options={"score_threshold": 2}), 400, "score_threshold"),
    (_tool(filters={"type": "near", "key": "kind", "value": "x"}), 400, "filters"),
    ({"type": "file_search", "vector_store_ids": "vs_docs"}, 400, "vector_store_ids"),
])
def test_bad_search_is_4xx_and_loses_nothing(rag_client: openai.OpenAI, rag: InProcessServer,
                                             tool: dict[str, Any], status: int,
                                             word: str) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        _ask(rag_client, rag, tools=[tool])
    assert err.value.status_code == status
    assert err.value.body["param"] == "tools" and word in err.value.body["message"]
    r = _ask(rag_client, rag, max_output_tokens=2)
    assert r.output[0].type == "file_search_call"


def test_readme_rag_example(rag_client: openai.OpenAI, rag: InProcessServer,
                            tmp_path: Any) -> None:
    """The README's example, through the official client end to end: upload, vector store,
    attach, ask with file_search, answer and citations (the embedder is the HashEmbedder)."""
    client = rag_client
    path = tmp_path / "handbook.md"
    path.write_text("# Lighthouse handbook\n\nThe secret code word of the lighthouse is "
                    "PELICAN. The keeper changes it every winter.\n\nTomatoes in the garden "
                    "are watered every Tuesday and Friday morning.\n")
    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="assistants")
    store = client.vector_stores.create(name="handbook")
    attached = client.vector_stores.files.create_and_poll(vector_store_id=store.id,
                                                         file_id=file.id)
    assert attached.status == "completed"
    r = client.responses.create(
        model=rag.model, input="What is the secret code word of the lighthouse?",
        instructions="Answer in one sentence.", max_output_tokens=40, temperature=0,
        tools=[{"type": "file_search", "vector_store_ids": [store.id], "max_num_results": 3}],
        include=["file_search_call.results"])
    search, message = r.output
    assert search.queries == ["What is the secret code word of the lighthouse?"]
    assert [x.filename for x in search.results] == ["handbook.md"] * len(search.results)
    assert "PELICAN" in r.output_text.upper()
    assert [(a.type, a.filename, a.file_id) for a in message.content[0].annotations] == \
        [("file_citation", "handbook.md", file.id)]
