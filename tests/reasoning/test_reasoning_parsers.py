"""The reasoning parsers and the budget's tracker, on text and token ids."""

from __future__ import annotations

import random

import pytest

from tokenmill.api.reasoning import (
    PARSERS,
    ReasoningReader,
    resolve_reasoning_parser,
)
from tokenmill.runner.thinking import ThinkingTracker
from tokenmill.sampling_params import SamplingParams, ThinkingBudget

QWEN3 = PARSERS["qwen3"]


@pytest.mark.parametrize(("text", "inside", "expected"), [
    # Qwen3 opens its thinking itself.
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False,
     ("Let me see.", "The answer is 4.")),
    # DeepSeek-R1's template opened it: only the end is in the output.
    ("Let me see.\n</think>\n\nThe answer is 4.", True, ("Let me see.", "The answer is 4.")),
    # Thinking cut short by max_tokens: all of it is thinking.
    ("Let me see. Hmm", True, ("Let me see. Hmm", "")),
    ("<think>Let me", False, ("Let me", "")),
    # No thinking at all (enable_thinking false): the text is the answer, untouched.
    (" The answer is 4.", False, (None, " The answer is 4.")),
    # A marker inside the answer stays text.
    ("The tag <think> is XML-ish.", False, (None, "The tag <think> is XML-ish.")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("<think></think>Hi", False, ("", "Hi")),
])
def test_split(text: str, inside: bool, expected: tuple[str | None, str]) -> None:
    assert QWEN3.split(text, inside) == expected


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_add_up_to_the_whole_split(inside: bool, seed: int) -> None:
    rng = random.Random(seed)
    text = ("" if inside else " <think>") + "\n step one\n step two \n</think>\n\n answer <think>!"
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = QWEN3.stream(inside)
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert (reasoning + r, content + c) == QWEN3.split(text, inside)
    assert reasoning + r == "step one\n step two" and content + c == "answer <think>!"


def test_auto_picks_by_the_chat_template() -> None:
    assert resolve_reasoning_parser("auto", "{{ '<think>\\n' }}") is PARSERS["qwen3"]
    r1 = "<\uff5cAssistant\uff5c><think>\n"
    assert resolve_reasoning_parser("auto", r1) is PARSERS["deepseek_r1"]
    assert resolve_reasoning_parser("auto", "{{ messages }}") is None
    assert resolve_reasoning_parser("none", "<think>") is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve_reasoning_parser("nope", None)


def test_reasoning_tokens_are_counted_up_to_the_end_marker() -> None:
    reader = ReasoningReader(QWEN3, inside=False, start_ids=(100,), end_id=101)
    assert reader.count([100, 5, 6, 101, 7, 8]) == 4
    assert reader.count([7, 8]) == 0
    inside = ReasoningReader(QWEN3, inside=True, start_ids=(100,), end_id=101)
    assert inside.count([5, 6, 101, 7]) == 3
    for token in [5, 6, 101, 7]:
        inside.observe(0, [token])
    assert inside.streamed_count == 3


def budget(n: int, inside: bool = True) -> ThinkingBudget:
    return ThinkingBudget(n, start_token_ids=(100,), end_token_id=101,
                          end_token_ids=(9, 101, 9), starts_inside=inside)


def run(tracker: ThinkingTracker, prompt: list[int], sampled: list[int]) -> list[int]:
    """The tokens written when the model would write ``sampled`` (forced ones replace it)."""
    ids = list(prompt)
    for token in sampled:
        forced = tracker.forced_token(ids)
        ids.append(token if forced is None else forced)
    return ids[len(prompt):]


def test_the_tracker_forces_the_ending_once_the_budget_is_spent() -> None:
    assert run(ThinkingTracker(budget(3), 2), [1, 2], [5] * 9) == [5, 5, 5, 9, 101, 9, 5, 5, 5]
    assert run(ThinkingTracker(budget(0), 2), [1, 2], [5] * 4) == [9, 101, 9, 5]
    # Thinking the model ends itself within the budget is left alone.
    assert run(ThinkingTracker(budget(3), 1), [1], [5, 101, 5, 5, 5]) == [5, 101, 5, 5, 5]
    # A model that opens its thinking itself is counted from its start marker.
    assert run(ThinkingTracker(budget(2, inside=False), 1), [1],
               [7, 100, 5, 5, 5, 5, 5]) == [7, 100, 5, 5, 9, 101, 9]


def test_a_budget_turns_speculation_off_and_is_validated() -> None:
    assert SamplingParams(thinking_budget=budget(2)).speculative is False
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_budget=budget(-1))
