"""Classification by exact label scoring, offline: LLM.classify against independent full
forwards (the engine's, uncached, and transformers'), prefix-cache reuse, bad arguments; and
the engine feature under it, prompt logprobs from ``prompt_logprobs_start`` on."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, ClassificationResult, SamplingParams
from tokenmill.engine.classify import (
    MAX_LABEL_TOKENS,
    MAX_LABELS,
    LabelScorer,
    default_instruction,
)

LABELS = ["Payments", "Bugs", "Login", "Delivery", "Something else entirely"]
TICKETS = ["I was charged twice for my subscription this month.",
           "The app crashes every time I open the settings page.",
           "I forgot my password and can't log in."]


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=64 << 20,
               quantization="none", enable_prefix_caching=False)


def _reference_sums(llm: LLM, scorer: LabelScorer) -> list[list[float]]:
    """Each label's summed logprob from its own whole sequence, prompt logprobs from token 1."""
    sums = []
    for prompt in scorer.prompts:
        seqs = [prompt + ids for ids in scorer.label_ids]
        outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        sums.append([sum(lp.logprob for lp in out.prompt_logprobs[len(prompt):])
                     for out in outs])
    return sums


def _softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    ws = [math.exp(x - top) for x in xs]
    return [w / sum(ws) for w in ws]


def test_classify_matches_full_forwards_of_each_label(llm: LLM, uncached: LLM) -> None:
    results = llm.classify(TICKETS, LABELS, instruction="Route the support ticket.")
    assert [r.index for r in results] == [0, 1, 2]
    assert all(isinstance(r, ClassificationResult) for r in results)
    scorer = LabelScorer(llm.get_tokenizer(), llm.engine.max_model_len, TICKETS, LABELS,
                         "Route the support ticket.")
    want = _reference_sums(uncached, scorer)
    for r, sums in zip(results, want, strict=True):
        assert list(r.probs) == LABELS and list(r.logprobs) == LABELS
        assert list(r.logprobs.values()) == pytest.approx(sums, abs=1e-3)
        assert list(r.probs.values()) == pytest.approx(_softmax(sums), abs=1e-4)
        assert sum(r.probs.values()) == pytest.approx(1.0)
        assert r.label == LABELS[max(range(len(sums)), key=sums.__getitem__)]
        assert r.num_prompt_tokens == len(scorer.prompts[r.index]) + sum(
            len(ids) for ids in scorer.label_ids)


def test_classify_matches_transformers(llm: LLM, hf_smollm) -> None:
    [result] = llm.classify(TICKETS[0], LABELS)
    scorer = LabelScorer(llm.get_tokenizer(), llm.engine.max_model_len, TICKETS[0], LABELS)
    prompt = scorer.prompts[0]
    sums = []
    with torch.no_grad():
        for ids in scorer.label_ids:
            logits = hf_smollm(torch.tensor([prompt + ids])).logits[0].float()
            lps = torch.log_softmax(logits, dim=-1)
            sums.append(sum(lps[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)))
    assert list(result.logprobs.values()) == pytest.approx(sums, abs=2e-3)
    assert list(result.probs.values()) == pytest.approx(_softmax(sums), abs=1e-3)


def test_later_labels_find_the_prompt_in_the_prefix_cache(llm: LLM) -> None:
    kv = llm.engine.core.scheduler.kv
    before = (kv.prefix_stats.queries, kv.prefix_stats.hits)
    ticket = "My order number 4471 shows delivered but the box never came. " * 4
    llm.classify(ticket, LABELS)
    scorer = LabelScorer(llm.get_tokenizer(), llm.engine.max_model_len, ticket, LABELS)
    prompt_len = len(scorer.prompts[0])
    queries = kv.prefix_stats.queries - before[0]
    hits = kv.prefix_stats.hits - before[1]
    # Every label looked its sequence up; each after the first found the prompt's full blocks
    # (all but the block holding the prompt's last token).
    assert queries == sum(prompt_len + len(ids) for ids in scorer.label_ids)
    full_blocks = (prompt_len - 1) // kv.block_size * kv.block_size
    assert full_blocks >= 64
    assert hits >= (len(LABELS) - 1) * full_blocks
    computed = queries - hits
    assert computed < prompt_len + len(LABELS) * (kv.block_size + MAX_LABEL_TOKENS)
    assert computed < len(LABELS) * prompt_len / 2


def test_prompt_logprobs_start_reports_from_there_and_uses_the_cache(llm: LLM) -> None:
    prompt = list(range(3000, 3070))
    full = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    kv = llm.engine.core.scheduler.kv
    hits = kv.prefix_stats.hits
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=50)
    part = llm.generate([prompt], params)[0]
    assert kv.prefix_stats.hits - hits == 48  # three full blocks before token 49
    assert len(part.prompt_logprobs) == len(prompt)
    assert part.prompt_logprobs[:50] == [None] * 50
    for got, want in zip(part.prompt_logprobs[50:], full.prompt_logprobs[50:], strict=True):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top.keys() == want.top.keys()


def test_one_label_and_one_string(llm: LLM) -> None:
    [r] = llm.classify("hello", ["Greeting"])
    assert r.label == "Greeting" and r.probs == {"Greeting": 1.0}
    assert r.logprobs["Greeting"] < 0


def test_default_instruction_names_the_labels() -> None:
    text = default_instruction(["Payments", "Bugs"])
    assert "- Payments\n- Bugs" in text


@pytest.mark.parametrize(("inputs", "labels", "instruction", "match"), [
    ("x", [], None, "labels must not be empty"),
    ("x", [f"l{i}" for i in range(MAX_LABELS + 1)], None, f"at most {MAX_LABELS} labels"),
    ("x", ["a", "b", "a"], None, r"labels\[2\] 'a' repeats labels\[0\]"),
    ("x", ["a", 3], None, r"labels\[1\] must be a string"),
    ("x", ["a", ""], None, r"labels\[1\] must not be an empty string"),
    ("x", "ab", None, "labels must be a list"),
    ("x", ["a", "word " * 100], None, r"labels\[1\] has \d+ tokens"),
    ([], ["a"], None, "input must not be empty"),
    (["ok", ""], ["a"], None, r"input\[1\] must not be an empty string"),
    (["ok", None], ["a"], None, r"input\[1\] must be a string"),
    ("x", ["a"], "", "instruction must not be an empty string"),
    ("word " * 3000, ["a"], None, "maximum context length of 2048"),
])
def test_bad_arguments_are_value_errors(llm: LLM, inputs, labels, instruction,
                                        match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.classify(inputs, labels, instruction)
    assert not llm.engine.has_unfinished_requests()
    assert llm.classify("hi", ["Greeting", "Complaint"])[0].label in {"Greeting", "Complaint"}
