"""The grammar compiler and matcher on the embedded model's tokenizer: cache, limits, choice
escaping, draft masks and rollback."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler, GrammarError, choice_grammar
from tokenmill.structured.matcher import GrammarState, allocate_bitmask, apply_bitmask

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf(embedded_model_path()).tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def allowed(state: GrammarState) -> torch.Tensor:
    """Bool [V] of the tokens the state allows next."""
    bitmask = allocate_bitmask(1, VOCAB)
    state.fill(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask, [0])
    return logits[0] == 0


def walk(state: GrammarState, tokenizer, text: str) -> int:
    return state.accept(tokenizer.encode(text, add_special_tokens=False))


def test_compiled_grammars_are_cached_by_source(compiler: GrammarCompiler) -> None:
    a = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "x": {"type": "integer"}}}))
    # The same schema sent again (another dict) is the same source.
    b = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "x": {"type": "integer"}}}))
    assert a is b
    # Keys in another order are another source: properties are written in the schema's order.
    c = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "y": {"type": "integer"}, "x": {"type": "integer"}}}))
    assert c is not compiler.compile(StructuredOutputsParams(json={"type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not a


def test_choice_allows_exactly_its_strings(compiler: GrammarCompiler, tokenizer) -> None:
    choice = ['say "hi"', "back\\slash", "naïve ✓", "line\nbreak"]
    compiled = compiler.compile(StructuredOutputsParams(choice=choice))
    for c in choice:
        state = GrammarState(compiled)
        ids = tokenizer.encode(c, add_special_tokens=False)
        assert state.accept(ids) == len(ids), c
        assert state.accept([tokenizer.eos_token_id]) == 1 and state.finished
    state = GrammarState(compiled)
    ids = tokenizer.encode("say hi", add_special_tokens=False)
    assert state.accept(ids) < len(ids)
    assert json.loads(choice_grammar(["a\"b"]).split("::= ", 1)[1]) == 'a"b'


def test_a_completed_grammar_allows_only_the_stop_token(compiler, tokenizer) -> None:
    state = GrammarState(compiler.compile(StructuredOutputsParams(regex="[0-9]{3}")))
    assert walk(state, tokenizer, "123") == len(tokenizer.encode("123", add_special_tokens=False))
    mask = allowed(state)
    assert mask.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not state.finished
    assert state.accept([tokenizer.eos_token_id, 5, 6]) == 1 and state.finished


def test_a_refused_token_ends_the_walk_before_it(compiler, tokenizer) -> None:
    state = GrammarState(compiler.compile(StructuredOutputsParams(regex="[0-9]+")))
    ids = tokenizer.encode("12a", add_special_tokens=False)
    assert state.accept(ids) < len(ids) and state.finished


def test_draft_rows_follow_the_drafts_and_roll_back(compiler, tokenizer) -> None:
    compiled = compiler.compile(StructuredOutputsParams(regex="(ab)+c"))
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    state = GrammarState(compiled)
    bitmask = allocate_bitmask(4, VOCAB)
    state.fill_drafts(bitmask, 0, [a, b, a])
    rows = []
    for r in range(4):
        logits = torch.zeros(1, VOCAB)
        apply_bitmask(logits, bitmask[r:r + 1], [0])
        rows.append(set((logits[0] == 0).nonzero().flatten().tolist()))
    assert a in rows[0] and b not in rows[0]
    assert b in rows[1] and a not in rows[1]
    assert {a, c} <= rows[2]
    assert b in rows[3]
    # Rolled back: the state is where it was before the drafts.
    assert allowed(state).nonzero().flatten().tolist() == sorted(rows[0])


def test_rows_after_a_refused_draft_allow_everything(compiler, tokenizer) -> None:
    compiled = compiler.compile(StructuredOutputsParams(regex="a+"))
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    z = tokenizer.encode("z", add_special_tokens=False)[0]
    state = GrammarState(compiled)
    bitmask = allocate_bitmask(3, VOCAB)
    state.fill_drafts(bitmask, 0, [z, a])
    assert bool((bitmask[1:] == -1).all())
    assert state.accept([a]) == 1  # nothing was consumed by the drafts


def test_errors_name_the_problem(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match=r"structured_outputs.regex cannot be used: .*"):
        compiler.compile(StructuredOutputsParams(regex="(a"))
    with pytest.raises(GrammarError, match="Unsupported type"):
        compiler.compile(StructuredOutputsParams(json={"type": "objec"}))
    with pytest.raises(GrammarError, match="an object"):
        compiler.compile(StructuredOutputsParams(json="[1, 2]"))
    with pytest.raises(ValueError, match="the limit is"):
        StructuredOutputsParams(regex="a" * (MAX_GRAMMAR_CHARS + 1))


def test_bounds_that_would_not_compile_in_time_are_refused(compiler) -> None:
    for spec, words in [
        (StructuredOutputsParams(json={"type": "string", "maxLength": 10**9}), "maxLength"),
        (StructuredOutputsParams(json={"items": {"pattern": "x{2,20000}"}}), "pattern repeats"),
        (StructuredOutputsParams(regex="a{99999}"), "repeats {99999}"),
        (StructuredOutputsParams(grammar='root ::= "a"{1,50000}'), "repeats"),
    ]:
        with pytest.raises(GrammarError, match=re.escape(words)):
            compiler.compile(spec)


def test_a_slow_grammar_is_refused_in_time(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compilation that outlasts the timeout is refused, and the compiler goes on. (The slow
    grammar is made by a sleep: no schema is reliably slow across xgrammar releases; 0.2.9
    compiles thousands of bounded repetitions in 5 ms, where earlier ones took seconds.)"""
    from tokenmill.structured import compiler as compiler_module

    compiler = GrammarCompiler(tokenizer, VOCAB, timeout_s=0.05)
    compile_one = compiler_module._compile
    slow_source = '{"type": "array"}'

    def slow(xgr_compiler, spec):  # noqa: ANN001, ANN202
        if spec.source == slow_source:
            time.sleep(2.0)
        return compile_one(xgr_compiler, spec)

    monkeypatch.setattr(compiler_module, "_compile", slow)
    compiler._xgr_compiler()  # the tokenizer's tables first: not part of a compilation
    with pytest.raises(GrammarError, match="did not compile within 0.05 s"):
        compiler.compile(StructuredOutputsParams(json={"type": "array"}))
    compiler.timeout_s = 30.0
    assert compiler.compile(StructuredOutputsParams(json={"type": "object"})) is not None
    compiler.close()


@pytest.mark.parametrize("vocab", [VOCAB, 100, 33])
def test_extension_masks_like_xgrammar(vocab: int) -> None:
    """The C++ mask the sampler uses on the CPU equals xgrammar's: random words, words that
    allow all or nothing, a vocabulary that ends inside a word, rows not in the list kept."""
    from tokenmill.kernels.cpu import load_extension

    ext = load_extension()
    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[1] = 0
    bitmask[2] = -1
    bitmask[3, : words // 2] = 0
    logits = torch.randn(5, vocab, generator=gen)
    rows = [0, 1, 2, 3]
    ours, theirs = logits.clone(), logits.clone()
    ext.apply_token_bitmask(ours, bitmask, torch.tensor(rows))
    apply_bitmask(theirs, bitmask, rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[4], logits[4]) and torch.isinf(ours[1]).all()
    with pytest.raises(RuntimeError, match="outside"):
        ext.apply_token_bitmask(ours, bitmask, torch.tensor([5]))


def test_batch_fill_equals_one_by_one(compiler: GrammarCompiler, tokenizer) -> None:
    """fill_rows (xgrammar's batch filler) writes each row as the state's own fill does."""
    from tokenmill.structured.matcher import fill_rows

    compiled = compiler.compile(StructuredOutputsParams(regex="[a-z]+ [0-9]+"))
    states = [GrammarState(compiled) for _ in range(3)]
    for state, text in zip(states, ["ab", "ab 1", ""], strict=True):
        assert walk(state, tokenizer, text) == len(tokenizer.encode(text,
                                                                    add_special_tokens=False))
    together, alone = allocate_bitmask(4, VOCAB), allocate_bitmask(4, VOCAB)
    fill_rows(together, states, [0, 2, 3])
    for state, row in zip(states, [0, 2, 3], strict=True):
        state.fill(alone, row)
    assert torch.equal(together, alone)
    assert (together[1] == -1).all()  # a row no state was given is left allowing everything
    assert not torch.equal(together[0], together[2])
