"""Large text never reaches the tokenizer in one piece: a file is tokenized in bounded pieces
(the same chunks as tokenizing it whole), an embeddings input or a search query longer than
the model can read is refused (400 naming the field and the limit) or, truncated anyway, only
its start is read. The tokenizer is the embedded all-MiniLM-L6-v2's, wrapped to count the
characters each call is given: one call's length is what the GIL is held for."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import openai
import pytest
import tokenizers
from retrieval_harness import RetrievalServer, wait_done

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN
from tokenmill.api.embeddings import EmbeddingRequest, prepare_embeddings
from tokenmill.api.errors import APIError
from tokenmill.model_loader import embedded_embedding_model_path
from tokenmill.retrieval import HashEmbedder, extract
from tokenmill.retrieval.chunking import (
    TOKENIZE_PIECE_CHARS,
    Chunk,
    Chunking,
    chunk_text,
    text_pieces,
)
from tokenmill.retrieval.embedder import TokenizerEmbedder, max_text_chars
from tokenmill.tokenizer import Tokenizer

WORDS = ("The lighthouse keeper logs every passing ship, 42 gulls and the tide's "
         "height; naïve café owners disagree.\n")


class CountingTokenizer:
    """A tokenizers.Tokenizer that records the characters each encoding call is given."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self.calls: list[int] = []

    def encode(self, text: str, *args: Any, **kw: Any) -> Any:
        self.calls.append(len(text))
        return self._backend.encode(text, *args, **kw)

    def encode_batch(self, texts: list[str], *args: Any, **kw: Any) -> Any:
        self.calls.append(sum(len(t) for t in texts))
        return self._backend.encode_batch(texts, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@pytest.fixture(scope="module")
def minilm() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer.from_file(
        os.path.join(embedded_embedding_model_path(), "tokenizer.json"))
    # As the model loader leaves it: the file's 128-token truncation and padding off.
    tok.no_truncation()
    tok.no_padding()
    return tok


def reference_chunks(text: str, tokens: list[tuple[int, int]], c: Chunking) -> list[Chunk]:
    """Windows over the whole text's tokens, as chunking did before it worked in pieces."""
    out = []
    for first in range(0, len(tokens), c.max_tokens - c.overlap):
        last = min(first + c.max_tokens, len(tokens)) - 1
        out.append(Chunk(text[tokens[first][0]:tokens[last][1]], tokens[first][0]))
        if last == len(tokens) - 1:
            break
    return out


def test_a_large_file_is_tokenized_in_bounded_pieces(minilm: tokenizers.Tokenizer) -> None:
    text = WORDS * 6000  # 660,000 characters
    counting = CountingTokenizer(minilm)
    embedder = TokenizerEmbedder(HashEmbedder().embed, counting, max_model_len=256)
    chunking = Chunking(200, 100)
    chunks = chunk_text(text, embedder.token_spans, chunking)
    assert max(counting.calls) <= TOKENIZE_PIECE_CHARS
    assert sum(counting.calls) == len(text)
    whole = [tuple(o) for o in minilm.encode(text, add_special_tokens=False).offsets]
    assert chunks == reference_chunks(text, whole, chunking)


# Pieces longer than any word: cut only at whitespace.
@pytest.mark.parametrize("piece", [16, 50, 10_000])
@pytest.mark.parametrize("size,overlap", [(10, 0), (10, 5), (7, 3), (1, 0)])
def test_chunks_do_not_depend_on_the_piece_size(piece: int, size: int, overlap: int) -> None:
    emb = HashEmbedder()
    for text in ["", "   ", "one", WORDS * 3, " a  b " * 9, WORDS[:-1] * 4]:
        chunking = Chunking(size, overlap)
        expected = reference_chunks(text, emb.token_spans(text), chunking)
        assert chunk_text(text, emb.token_spans, chunking, piece) == expected, (text, piece)


def test_pieces_cover_the_text_and_cut_at_whitespace() -> None:
    text = WORDS * 50 + "y" * 3000 + " end"
    pieces = list(text_pieces(text, 1000))
    assert "".join(p for _, p in pieces) == text
    assert all(len(p) <= 1000 and text.startswith(p, at) for at, p in pieces)
    # Every cut but the ones inside the 3000-character word falls before whitespace.
    cuts = [at for at, _ in pieces[1:]]
    inside = [at for at in cuts if not text[at].isspace()]
    start = len(WORDS) * 50
    assert inside and all(start < at < start + 3000 for at in inside)
    assert len(inside) <= 3


# --- /v1/embeddings (and /api/embed, which shares prepare_embeddings) ----------------------

class EmbeddingFacts:
    """What prepare_embeddings sees of an embedding engine."""

    task = "embed"
    cross_encoder = False
    max_model_len = 256
    embedding_size = 384

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size


@pytest.fixture
def served(minilm: tokenizers.Tokenizer) -> EmbeddingFacts:
    tok = Tokenizer.from_hf_dir(embedded_embedding_model_path())
    tok.backend.no_truncation()
    tok.backend.no_padding()
    tok._tok = CountingTokenizer(tok._tok)  # type: ignore[attr-defined]
    return EmbeddingFacts(tok)


def calls(served: EmbeddingFacts) -> list[int]:
    return served.tokenizer.backend.calls  # type: ignore[attr-defined,no-any-return]


def test_an_input_longer_than_the_model_can_read_is_refused_untokenized(
        served: EmbeddingFacts) -> None:
    limit = served.max_model_len * MAX_CHARS_PER_TOKEN
    big = WORDS * (limit // len(WORDS) + 1)
    for inputs, where in [(big, "input has"), (["short", big], "input[1] has")]:
        with pytest.raises(APIError) as exc:
            prepare_embeddings(EmbeddingRequest(input=inputs), served)
        err = exc.value
        assert err.status == 400 and err.param == "input"
        assert where in err.message and f"{len(big)} characters" in err.message
        assert str(limit) in err.message
        assert all(n < len(big) for n in calls(served))
    call = prepare_embeddings(EmbeddingRequest(input=["short", WORDS]), served)
    ids = served.tokenizer.encode(WORDS)
    assert call.prompts[1]["prompt_token_ids"] == ids


def test_a_truncated_input_reads_only_its_start(served: EmbeddingFacts,
                                                minilm: tokenizers.Tokenizer) -> None:
    limit = served.max_model_len * MAX_CHARS_PER_TOKEN
    big = WORDS * (4 * limit // len(WORDS))
    call = prepare_embeddings(EmbeddingRequest(input=big, truncate_prompt_tokens=-1), served)
    assert max(calls(served)) <= limit
    # The same tokens as truncating the whole text.
    whole = minilm.encode(big, add_special_tokens=False)
    whole.truncate(served.max_model_len - 2)
    ids = call.prompts[0]["prompt_token_ids"]
    assert ids == minilm.post_process(whole).ids
    assert len(ids) == served.max_model_len


# --- vector-store search ------------------------------------------------------------------

@pytest.fixture
def store(client: openai.OpenAI) -> str:
    f = client.files.create(file=("keeper.txt", WORDS.encode()), purpose="assistants")
    vs = client.vector_stores.create(name="s", file_ids=[f.id]).id
    wait_done(client, vs)
    return vs


def test_a_query_longer_than_the_model_can_read_is_refused(server: RetrievalServer,
                                                           client: openai.OpenAI,
                                                           store: str) -> None:
    limit = max_text_chars(server.embedder.max_input_tokens)
    calls_before = server.embedder.calls  # type: ignore[attr-defined]
    big = "lighthouse " * (limit // 11 + 1)
    for query, where in [(big, "query has"), (["keeper", big], "query[1] has")]:
        r = httpx.post(f"{server.url}/v1/vector_stores/{store}/search",
                       json={"query": query}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "query" and where in err["message"]
        assert str(limit) in err["message"]
    assert server.embedder.calls == calls_before  # type: ignore[attr-defined]
    hit = client.vector_stores.search(store, query="lighthouse keeper").data[0]
    assert "lighthouse" in hit.content[0].text


def test_the_embedder_cuts_what_the_model_cannot_read() -> None:
    seen: list[list[str]] = []

    async def embed(texts: list[str]) -> list[list[float]]:
        seen.append(texts)
        return [[1.0] for _ in texts]

    emb = TokenizerEmbedder(embed, None, max_model_len=130)
    limit = max_text_chars(128)
    asyncio.run(emb.embed(["a" * (limit + 10), "short"]))
    assert seen == [["a" * limit, "short"]]



# --- decoding an upload -------------------------------------------------------------------

def test_a_large_file_is_decoded_in_bounded_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = extract.codecs.getincrementaldecoder

    def counting(encoding: str) -> Any:
        class Decoder(real(encoding)):  # type: ignore[misc,valid-type]
            def decode(self, data: Any, final: bool = False) -> str:
                sizes.append(len(data))
                return super().decode(data, final)
        return Decoder

    monkeypatch.setattr(extract.codecs, "getincrementaldecoder", counting)
    data = (WORDS * 30_000).encode()  # 3.5 MB, not all ASCII
    assert extract.extract_text(data, "big.txt") == data.decode()
    assert sizes and max(sizes) <= extract.DECODE_PIECE_BYTES and sum(sizes) == len(data)


@pytest.mark.parametrize("piece", [1, 2, 3, 1 << 20])
def test_decoding_in_pieces_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                            piece: int) -> None:
    monkeypatch.setattr(extract, "DECODE_PIECE_BYTES", piece)
    bom = b"\xef\xbb\xbf"
    for text in [WORDS, "日本 😀 x", "a\ufeff b"]:
        assert extract.extract_text(text.encode(), "a.md") == text
        assert extract.extract_text(bom + text.encode(), "a.md") == text
    # The offset of the first bad byte in the file, a byte-order mark included.
    for data, offset in [(b"ab\xffcd", 2), (bom + b"ab\xffcd", 5), ("日本".encode()[:-1], 3),
                         (bom + "é日".encode() + b"\x80", 8)]:
        with pytest.raises(extract.InvalidFile, match=f"invalid byte at offset {offset}\\)"):
            extract.extract_text(data, "a.txt")
    for blank in [b"", b" \n\t", bom + b" ", "\u3000".encode()]:
        with pytest.raises(extract.InvalidFile, match="empty|holds no text"):
            extract.extract_text(blank, "a.txt")
