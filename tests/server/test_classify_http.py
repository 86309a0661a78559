"""POST /v1/classify on the shared server: the answer's shape, its scores against each label
scored alone through /v1/completions, prefix-cache reuse, bad bodies (each a 400 naming the
field, none reaching the engine), and a client that leaves in the middle."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from server_harness import Server, idle, wait_for

from tokenmill.engine.classify import default_instruction

CLASSIFY = "/v1/classify"
LABELS = ["Payments", "Bugs", "Login", "Delivery"]
TICKETS = ["I was charged twice for my subscription this month.",
           "The parcel was delivered to the wrong address."]
INSTRUCTION = "You route customer support tickets to a team. Teams: " + ", ".join(LABELS) + "."


def post(server: Server, path: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, timeout=timeout,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def counter(server: Server, name: str) -> float:
    return server.metrics()[f"tokenmill:{name}"]


def test_classify_answers_each_input_with_label_probabilities(server: Server) -> None:
    r = post(server, CLASSIFY, {"model": server.model, "input": TICKETS, "labels": LABELS,
                                "instruction": INSTRUCTION})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model
    assert body["id"].startswith("classify-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d in body["data"]:
        assert list(d["probs"]) == LABELS
        assert sum(d["probs"].values()) == pytest.approx(1.0, abs=1e-6)
        assert d["label"] == max(LABELS, key=lambda lab, d=d: d["probs"][lab])
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    # One string is one input; without an instruction the default one names the labels.
    r = post(server, CLASSIFY, {"input": TICKETS[0], "labels": LABELS})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == [0]


def _tokens(server: Server, body: dict) -> list[int]:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_probabilities_match_each_label_scored_alone(server: Server) -> None:
    """The reference: each prompt + label sequence computed whole by /v1/completions (echo,
    prompt logprobs from the first token: no prefix cache), summed over the label's tokens."""
    r = post(server, CLASSIFY, {"input": TICKETS[1], "labels": LABELS,
                                "instruction": INSTRUCTION})
    assert r.status_code == 200, r.text
    probs = r.json()["data"][0]["probs"]
    messages = [{"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": TICKETS[1]}]
    prompt = _tokens(server, {"messages": messages, "add_generation_prompt": True})
    sums = []
    for label in LABELS:
        ids = _tokens(server, {"prompt": label, "add_special_tokens": False})
        r = post(server, "/v1/completions", {"prompt": prompt + ids, "max_tokens": 1,
                                             "echo": True, "logprobs": 0, "temperature": 0})
        assert r.status_code == 200, r.text
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        sums.append(sum(lps[len(prompt):len(prompt) + len(ids)]))
    top = max(sums)
    want = [math.exp(s - top) for s in sums]
    want = [w / sum(want) for w in want]
    # Q4 weights on the CPU: logits move a little with the batch (and its cached prefix).
    assert list(probs.values()) == pytest.approx(want, abs=0.05)


def test_later_labels_find_the_prompt_in_the_prefix_cache(server: Server) -> None:
    ticket = "Order 5512 says delivered, but nothing came and the driver never called. " * 3
    messages = [{"role": "system", "content": default_instruction(LABELS)},
                {"role": "user", "content": ticket}]
    prompt_len = len(_tokens(server, {"messages": messages, "add_generation_prompt": True}))
    assert wait_for(lambda: idle(server))
    queries0 = counter(server, "prefix_cache_queries_total")
    hits0 = counter(server, "prefix_cache_hits_total")
    r = post(server, CLASSIFY, {"input": ticket, "labels": LABELS})
    assert r.status_code == 200, r.text
    label_tokens = r.json()["usage"]["prompt_tokens"] - prompt_len
    # Each label after the first found every full block of the prompt (16 tokens a block).
    full_blocks = (prompt_len - 1) // 16 * 16
    assert full_blocks >= 48
    assert wait_for(lambda: idle(server))  # the last step's counters are recorded
    hits = counter(server, "prefix_cache_hits_total") - hits0
    looked_up = counter(server, "prefix_cache_queries_total") - queries0
    assert looked_up == len(LABELS) * prompt_len + label_tokens
    assert hits >= (len(LABELS) - 1) * full_blocks
    assert looked_up - hits < len(LABELS) * prompt_len / 2


def test_concurrent_requests_each_get_their_own_answer(server: Server) -> None:
    bodies = [{"input": t, "labels": LABELS, "instruction": INSTRUCTION} for t in TICKETS]
    alone = [post(server, CLASSIFY, b).json()["data"][0]["probs"] for b in bodies]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post(CLASSIFY, json=b) for b in bodies * 3))

    # The two tickets score apart, so an answer built from the other's labels would show.
    pairs = zip(alone[0].values(), alone[1].values(), strict=True)
    assert max(abs(a - b) for a, b in pairs) > 0.2
    for i, r in enumerate(asyncio.run(together())):
        assert r.status_code == 200, r.text
        got = r.json()["data"][0]["probs"]
        # Q4 weights on the CPU: a token's logits move a little with its batch mates.
        assert list(got.values()) == pytest.approx(list(alone[i % 2].values()), abs=0.05)


def test_a_client_that_leaves_frees_its_requests(server: Server) -> None:
    labels = [f"Queue number {i}" for i in range(64)]
    body = {"input": [f"Ticket {i}: my order is late." for i in range(8)], "labels": labels}
    with pytest.raises(httpx.TimeoutException):
        post(server, CLASSIFY, body, timeout=1.0)
    assert wait_for(lambda: idle(server), timeout=60)
    r = post(server, CLASSIFY, {"input": "hello", "labels": ["Greeting", "Complaint"]})
    assert r.status_code == 200, r.text


LONG_LABEL = "word " * 100
# (name, body, status, param)
BAD: list[tuple[str, dict | bytes, int, str | None]] = [
    ("labels empty", {"input": "x", "labels": []}, 400, "labels"),
    ("labels over the limit", {"input": "x", "labels": [f"l{i}" for i in range(65)]}, 400,
     "labels"),
    ("labels repeated", {"input": "x", "labels": ["a", "b", "a"]}, 400, "labels"),
    ("label not a string", {"input": "x", "labels": ["a", 5]}, 400, "labels"),
    ("label empty", {"input": "x", "labels": ["a", ""]}, 400, "labels"),
    ("label too long", {"input": "x", "labels": ["a", LONG_LABEL]}, 400, "labels"),
    ("labels a string", {"input": "x", "labels": "a,b"}, 400, "labels"),
    ("labels missing", {"input": "x"}, 400, "labels"),
    ("input empty string", {"input": "", "labels": ["a"]}, 400, "input"),
    ("input empty list", {"input": [], "labels": ["a"]}, 400, "input"),
    ("input with an empty string", {"input": ["ok", ""], "labels": ["a"]}, 400, "input"),
    ("input not strings", {"input": ["ok", 3], "labels": ["a"]}, 400, "input"),
    ("too many inputs", {"input": ["x"] * 257, "labels": ["a"]}, 400, "input"),
    ("input missing", {"labels": ["a"]}, 400, "input"),
    ("inputs x labels past the limit", {"input": ["x"] * 65, "labels": [f"l{i}" for i in
                                                                      range(32)]}, 400, "input"),
    ("prompt and label past the context", {"input": "word " * 600, "labels": ["a"]}, 400,
     "input"),
    ("input past the characters the context takes", {"input": "a" * (512 * 32),
                                                     "labels": ["a"]}, 400, "input"),
    ("instruction empty", {"input": "x", "labels": ["a"], "instruction": ""}, 400,
     "instruction"),
    ("instruction not a string", {"input": "x", "labels": ["a"], "instruction": 1}, 400,
     "instruction"),
    ("lone surrogate in a label", b'{"input": "x", "labels": ["\\ud800"]}', 400, None),
    ("not JSON", b'{"input": "x", "labels": [', 400, None),
    ("unknown model", {"model": "gpt-4", "input": "x", "labels": ["a"]}, 404, "model"),
]


def _engine_counters(server: Server) -> tuple[float, float]:
    m = server.metrics()
    finished = sum(v for k, v in m.items() if k.startswith("tokenmill:request_success_total"))
    return finished, m["tokenmill:prompt_tokens_total"]


@pytest.mark.parametrize(("body", "status", "param"), [c[1:] for c in BAD],
                         ids=[c[0] for c in BAD])
def test_bad_classify_body(server: Server, body: dict | bytes, status: int,
                           param: str | None) -> None:
    assert wait_for(lambda: idle(server))  # the last request's counters are recorded
    before = _engine_counters(server)
    r = post(server, CLASSIFY, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert _engine_counters(server) == before  # refused before the engine
    r = post(server, CLASSIFY, {"input": "hi", "labels": ["Greeting", "Complaint"]})
    assert r.status_code == 200, r.text
