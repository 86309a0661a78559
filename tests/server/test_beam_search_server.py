"""Beam search through `tokenmill serve`, with vLLM's request fields (``use_beam_search``,
``length_penalty``, ``early_stopping``; ``n`` is the beam width): completions, chat and their
streams answer exactly what the offline engine's beam search answers; every field beam search
cannot honour is a 400 that names it, after which the server still serves; batch lines run the
same search; Ollama's routes are untouched."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from server_harness import Server, idle, start_server, wait_for

from tokenmill import LLM, SamplingParams
from tokenmill.batch import run_batch
from tokenmill.outputs import CompletionOutput

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lora"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "batch"))

from batch_helpers import by_custom_id, chat, completion, read_results, write_jsonl  # noqa: E402
from lora_helpers import PROMPTS, make_base  # noqa: E402

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_TOKENS = 10
# Token ids that end a hypothesis beside eos: hypotheses then end at many lengths, so that
# length_penalty and early_stopping change which ones win.
STOPS = list(range(3, 256, 8))
# Chat messages render to their own words, so a chat turn is the same prompt as a completion.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
BEAM = {"use_beam_search": True, "stop_token_ids": STOPS}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# (text, finish_reason) of each choice, in order.
Answer = list[tuple[str, str | None]]
T = TypeVar("T")


def words(ids: list[int]) -> str:
    """Token ids as the word-level tokenizer's text."""
    return " ".join(f"t{i}" for i in ids)


def user(ids: list[int]) -> list[dict[str, str]]:
    return [{"role": "user", "content": words(ids)}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = make_base(tmp_path_factory.mktemp("beam_server") / "base")
    config_path = base.path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return base.path


@pytest.fixture(scope="module")
def offline(folder: Path) -> LLM:
    """The reference: the same folder and limits in the offline engine."""
    return LLM(str(folder), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def beam_server(folder: Path) -> Iterator[Server]:
    s = start_server("--model", str(folder), "--max-model-len", str(MAX_MODEL_LEN),
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", "16")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(beam_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{beam_server.url}/v1", api_key="x", max_retries=0)


def beam_params(n: int = 3, **fields: Any) -> SamplingParams:
    fields.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(n=n, use_beam_search=True, stop_token_ids=STOPS, **fields)


def search(offline: LLM, ids: list[int], n: int = 3, **fields: Any) -> list[CompletionOutput]:
    """The offline engine's beam search of the prompt ``ids`` (its best hypotheses, in order)."""
    return offline.generate(words(ids), beam_params(n, **fields))[0].outputs


def chat_search(offline: LLM, ids: list[int], n: int = 3, **fields: Any
                ) -> list[CompletionOutput]:
    return offline.chat(user(ids), beam_params(n, **fields))[0].outputs


def answer(outputs: list[CompletionOutput]) -> Answer:
    return [(o.text, o.finish_reason) for o in outputs]


def num_tokens(outputs: list[CompletionOutput]) -> int:
    return sum(len(o.token_ids) for o in outputs)


def choices(response: Any) -> Answer:
    """The same of a completions or chat response."""
    return [(c.message.content if hasattr(c, "message") else c.text, c.finish_reason)
            for c in response.choices]


def complete(client: openai.OpenAI, server: Server, prompt: str | list[str], n: int = 3,
             **extra: Any) -> Any:
    """A beam search completion (``extra``: more of vLLM's fields)."""
    return client.completions.create(model=server.model, prompt=prompt, n=n,
                                     max_tokens=MAX_TOKENS, extra_body={**BEAM, **extra})


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=60)


def within(seconds: float, work: Callable[[], T]) -> T:
    """``work()``, failing the test if it takes longer than ``seconds``: beam groups that wait
    for each other's batch slots would otherwise hang the suite."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: do the beam searches wait forever?")
    if "error" in result:
        raise result["error"]
    return result["value"]


def assert_serving(client: openai.OpenAI, server: Server, offline: LLM) -> None:
    """A plain greedy completion still answers what the offline engine does."""
    r = client.completions.create(model=server.model, prompt=words(PROMPTS[0]), max_tokens=4,
                                  temperature=0)
    want = offline.generate(words(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=4))
    assert r.choices[0].text == want[0].outputs[0].text


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize("prompt", [0, 1])
def test_completions_answer_the_offline_beam_search(client: openai.OpenAI, beam_server: Server,
                                                    offline: LLM, prompt: int) -> None:
    # No temperature: beam search does not use it, so leaving it out is no error.
    r = complete(client, beam_server, words(PROMPTS[prompt]))
    want = search(offline, PROMPTS[prompt])
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert choices(r) == answer(want)
    assert len({c.text for c in r.choices}) == 3  # three hypotheses, not one three times
    assert r.usage.completion_tokens == num_tokens(want)
    assert r.usage.prompt_tokens == len(PROMPTS[prompt])


def test_sampling_fields_are_ignored(client: openai.OpenAI, beam_server: Server,
                                     offline: LLM) -> None:
    r = complete(client, beam_server, words(PROMPTS[1]), top_k=5, min_p=0.2, temperature=1.7,
                 top_p=0.3, seed=11)
    assert choices(r) == answer(search(offline, PROMPTS[1]))


def test_two_prompts_number_their_choices(client: openai.OpenAI, beam_server: Server,
                                          offline: LLM) -> None:
    r = complete(client, beam_server, [words(PROMPTS[0]), words(PROMPTS[1])], n=2)
    want = search(offline, PROMPTS[0], n=2) + search(offline, PROMPTS[1], n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert choices(r) == answer(want)
    assert r.usage.completion_tokens == num_tokens(want)


def test_best_of_is_the_beam_width(client: openai.OpenAI, beam_server: Server,
                                   offline: LLM) -> None:
    r = complete(client, beam_server, words(PROMPTS[1]), n=2, best_of=3)
    want = search(offline, PROMPTS[1], n=3)
    assert choices(r) == answer(want)[:2]
    # Like best_of's samples, every hypothesis searched is counted.
    assert r.usage.completion_tokens == num_tokens(want)


def test_echo_puts_the_prompt_before_each_hypothesis(client: openai.OpenAI, beam_server: Server,
                                                     offline: LLM) -> None:
    r = complete(client, beam_server, words(PROMPTS[1]), echo=True)
    prompt = words(PROMPTS[1])
    assert [c.text for c in r.choices] == [prompt + o.text for o in search(offline, PROMPTS[1])]


def test_chat_answers_the_offline_beam_search(client: openai.OpenAI, beam_server: Server,
                                              offline: LLM) -> None:
    r = client.chat.completions.create(model=beam_server.model, messages=user(PROMPTS[1]), n=3,
                                       max_tokens=MAX_TOKENS, extra_body=BEAM)
    want = chat_search(offline, PROMPTS[1])
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert choices(r) == answer(want)
    assert r.usage.completion_tokens == num_tokens(want)


def test_chat_without_max_tokens_searches_to_the_context(client: openai.OpenAI,
                                                         beam_server: Server,
                                                         offline: LLM) -> None:
    # vLLM's default: the beams may fill what the prompt leaves of the context. (early
    # stopping ends the search once three hypotheses are done, long before that.)
    r = client.chat.completions.create(model=beam_server.model, messages=user(PROMPTS[0]), n=3,
                                       extra_body={**BEAM, "early_stopping": True})
    prompt_len = r.usage.prompt_tokens
    want = chat_search(offline, PROMPTS[0], early_stopping=True,
                       max_tokens=MAX_MODEL_LEN - prompt_len)
    assert choices(r) == answer(want)


@pytest.mark.parametrize("fields", [{"length_penalty": 3.0}, {"early_stopping": True},
                                    {"early_stopping": "never"},
                                    {"length_penalty": 0.5, "early_stopping": "never"}])
def test_length_penalty_and_early_stopping_reach_the_engine(
        client: openai.OpenAI, beam_server: Server, offline: LLM, fields: dict) -> None:
    want = answer(search(offline, PROMPTS[1], **fields))
    assert want != answer(search(offline, PROMPTS[1]))  # else the test could not fail
    r = complete(client, beam_server, words(PROMPTS[1]), **fields)
    assert choices(r) == want
    chat_r = client.chat.completions.create(model=beam_server.model, messages=user(PROMPTS[1]),
                                            n=3, max_tokens=MAX_TOKENS,
                                            extra_body={**BEAM, **fields})
    assert choices(chat_r) == answer(chat_search(offline, PROMPTS[1], **fields))


def test_tools_with_auto_choice_still_search(client: openai.OpenAI,
                                             beam_server: Server) -> None:
    # Only a forced call needs a grammar; "auto" reads calls out of the hypotheses' text.
    r = client.chat.completions.create(model=beam_server.model, messages=user(PROMPTS[1]), n=3,
                                       max_tokens=MAX_TOKENS, tools=TOOLS, tool_choice="auto",
                                       extra_body=BEAM)
    assert len(r.choices) == 3 and all(c.finish_reason for c in r.choices)


# ------------------------------------------------------------------ streams


def test_completion_stream_sends_each_choice_then_usage(client: openai.OpenAI,
                                                        beam_server: Server,
                                                        offline: LLM) -> None:
    chunks = list(client.completions.create(
        model=beam_server.model, prompt=[words(PROMPTS[0]), words(PROMPTS[1])], n=2,
        max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True},
        extra_body=BEAM))
    want = search(offline, PROMPTS[0], n=2) + search(offline, PROMPTS[1], n=2)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1, 2, 3]
    assert [(texts[i], reasons[i]) for i in range(4)] == answer(want)
    assert not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == num_tokens(want)


def test_chat_stream_sends_roles_then_each_choice(client: openai.OpenAI, beam_server: Server,
                                                  offline: LLM) -> None:
    chunks = list(client.chat.completions.create(
        model=beam_server.model, messages=user(PROMPTS[1]), n=3, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body=BEAM))
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [
        (0, "assistant"), (1, "assistant"), (2, "assistant")]
    texts = {i: "" for i in range(3)}
    reasons: dict[int, str | None] = {}
    for chunk in chunks[1:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    want = chat_search(offline, PROMPTS[1])
    assert [(texts[i], reasons.get(i)) for i in range(3)] == answer(want)
    assert chunks[-1].usage.completion_tokens == num_tokens(want)


def test_stream_ends_with_done(beam_server: Server) -> None:
    body = {"prompt": words(PROMPTS[1]), "n": 2, "max_tokens": MAX_TOKENS, "stream": True,
            **BEAM}
    with httpx.stream("POST", f"{beam_server.url}/v1/completions",
                      json={"model": beam_server.model, **body}, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    sent = [c for e in events[:-1] for c in json.loads(e[5:])["choices"]]
    assert sorted({c["index"] for c in sent}) == [0, 1]


# ------------------------------------------------------------------ refusals

COMPLETIONS = {"prompt": words(PROMPTS[1]), "n": 3, "max_tokens": MAX_TOKENS, **BEAM}
CHAT = {"messages": user(PROMPTS[1]), "n": 3, "max_tokens": MAX_TOKENS, **BEAM}
REFUSALS = [
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"stop": ["t5"]}, "stop"),
    ("/v1/chat/completions", {"stop": "t5"}, "stop"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "t[0-9]+"}},
     "structured_outputs"),
    ("/v1/completions", {"guided_choice": ["t5", "t6"]}, "guided_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -0.5}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 10.0}}, "logit_bias"),
    ("/v1/completions", {"length_penalty": 10.5}, "length_penalty"),
    ("/v1/chat/completions", {"length_penalty": -11.0}, "length_penalty"),
    ("/v1/completions", {"early_stopping": "sometimes"}, "early_stopping"),
    ("/v1/chat/completions", {"early_stopping": 1}, "early_stopping"),
    ("/v1/completions", {"use_beam_search": "true"}, "use_beam_search"),
    ("/v1/completions", {"n": MAX_NUM_SEQS + 1}, "n"),
    ("/v1/chat/completions", {"n": MAX_NUM_SEQS + 1}, "n"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"n": 2, "best_of": 3, "stream": True}, "best_of"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSALS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, _, n in REFUSALS])
def test_refusals_name_the_field(client: openai.OpenAI, beam_server: Server, offline: LLM,
                                 path: str, extra: dict, param: str) -> None:
    body = {**(COMPLETIONS if path == "/v1/completions" else CHAT), **extra}
    r = post(beam_server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert_serving(client, beam_server, offline)


def test_refusals_through_the_openai_client(client: openai.OpenAI, beam_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=beam_server.model, messages=user(PROMPTS[1]), n=2,
                                       max_tokens=4, presence_penalty=0.5, extra_body=BEAM)
    assert e.value.body["param"] == "presence_penalty"
    assert "use_beam_search" in e.value.body["message"]


def test_logprobs_of_each_hypothesis(client: openai.OpenAI, beam_server: Server,
                                     offline: LLM) -> None:
    """Each choice's tokens with their logprobs and top alternatives: the offline search's,
    summing to its cumulative logprob."""
    want = search(offline, PROMPTS[1], logprobs=2)
    got = complete(client, beam_server, words(PROMPTS[1]), logprobs=2)
    for c, w in zip(got.choices, want, strict=True):
        assert c.text == w.text
        assert len(c.logprobs.tokens) == len(w.token_ids)
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in w.logprobs])
        assert sum(c.logprobs.token_logprobs) == pytest.approx(w.cumulative_logprob)
        assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=beam_server.model, messages=user(PROMPTS[1]), n=3, max_tokens=MAX_TOKENS,
        logprobs=True, top_logprobs=2, extra_body=BEAM)
    chat_want = chat_search(offline, PROMPTS[1], logprobs=2)
    for c, w in zip(chat.choices, chat_want, strict=True):
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(
            [lp.logprob for lp in w.logprobs])
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)


# ------------------------------------------------------------------ the engine's life


def test_searches_leave_nothing_in_the_engine(client: openai.OpenAI,
                                              beam_server: Server) -> None:
    # Beams share their parents' KV blocks: every one must be freed once the search ends.
    complete(client, beam_server, words(PROMPTS[2]), n=MAX_NUM_SEQS)
    assert wait_for(lambda: idle(beam_server)), beam_server.metrics()


def test_searches_beside_other_requests(client: openai.OpenAI, beam_server: Server,
                                        offline: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    jobs = {
        "beam0": lambda: complete(client, beam_server, words(PROMPTS[0])),
        "beam1": lambda: complete(client, beam_server, words(PROMPTS[1]), n=2,
                                  early_stopping=True),
        "greedy": lambda: client.completions.create(model=beam_server.model,
                                                    prompt=words(PROMPTS[2]),
                                                    max_tokens=MAX_TOKENS, temperature=0),
    }
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        got = {name: choices(f.result()) for name, f in futures.items()}
    assert got["beam0"] == answer(search(offline, PROMPTS[0]))
    assert got["beam1"] == answer(search(offline, PROMPTS[1], n=2, early_stopping=True))
    assert got["greedy"] == answer(offline.generate(words(PROMPTS[2]), greedy)[0].outputs)


def test_searches_wider_together_than_the_batch_finish(beam_server: Server,
                                                      offline: LLM) -> None:
    # Three searches of three beams on four batch slots: each must get its turn.
    slow = openai.OpenAI(base_url=f"{beam_server.url}/v1", api_key="x", max_retries=0,
                         timeout=60)
    start = threading.Barrier(len(PROMPTS))

    def run(ids: list[int]) -> Answer:
        start.wait()
        return choices(complete(slow, beam_server, words(ids)))

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(run, PROMPTS))
    assert got == [answer(search(offline, ids)) for ids in PROMPTS]


def test_batch_lines_run_the_beam_search(tmp_path: Path, offline: LLM) -> None:
    lines = [
        completion("p", words(PROMPTS[0]), MAX_TOKENS, n=3, **BEAM),
        completion("lp", words(PROMPTS[1]), MAX_TOKENS, n=3, length_penalty=3.0, **BEAM),
        chat("c", words(PROMPTS[1]), MAX_TOKENS, n=3, **BEAM),
        completion("logprobs", words(PROMPTS[1]), MAX_TOKENS, n=3, logprobs=1, **BEAM),
        completion("wide", words(PROMPTS[1]), MAX_TOKENS, n=MAX_NUM_SEQS + 1, **BEAM),
    ]
    out = tmp_path / "out.jsonl"
    # The lines run together: nine beams of three searches on four batch slots.
    stats = within(120, lambda: run_batch(str(write_jsonl(tmp_path / "in.jsonl", lines)),
                                          str(out), offline, progress=False))
    assert (stats.succeeded, stats.failed) == (4, 1)
    results = {k: r["response"] for k, r in by_custom_id(read_results(out)).items()}
    p = results["p"]["body"]
    assert [(c["text"], c["finish_reason"]) for c in p["choices"]] == answer(
        search(offline, PROMPTS[0]))
    assert p["usage"]["completion_tokens"] == num_tokens(search(offline, PROMPTS[0]))
    assert [(c["text"], c["finish_reason"]) for c in results["lp"]["body"]["choices"]] == answer(
        search(offline, PROMPTS[1], length_penalty=3.0))
    assert [(c["message"]["content"], c["finish_reason"])
            for c in results["c"]["body"]["choices"]] == answer(chat_search(offline, PROMPTS[1]))
    lps = results["logprobs"]["body"]["choices"][0]["logprobs"]
    assert sum(lps["token_logprobs"]) == pytest.approx(
        search(offline, PROMPTS[1], logprobs=1)[0].cumulative_logprob)
    assert results["wide"]["status_code"] == 400
    assert results["wide"]["body"]["error"]["param"] == "n"


def test_ollama_routes_still_answer(client: openai.OpenAI, beam_server: Server) -> None:
    # Ollama's options have no beam search; its routes share the request fields this adds.
    r = httpx.post(f"{beam_server.url}/api/generate", json={
        "model": beam_server.model, "prompt": words(PROMPTS[0]), "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 4}}, timeout=60)
    assert r.status_code == 200, r.text
    want = client.completions.create(model=beam_server.model, prompt=words(PROMPTS[0]),
                                     max_tokens=4, temperature=0)
    assert r.json()["response"] == want.choices[0].text
