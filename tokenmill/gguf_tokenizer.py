"""A Hugging Face `tokenizers` backend from the tokenizer metadata llama.cpp stores in a GGUF
file: vocabulary, merges or scores, token types, the pre-tokenizer's name and special ids."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes llama.cpp uses for `tokenizer.ggml.pre`; GPT-2's own regex is ByteLevel's default.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}
_GPT2_PRES = ("default", "gpt2", "gpt-2", "starcoder", "refact", "codeshell")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte, the alphabet byte-level BPE vocabularies use."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for ``tokenizer.ggml.pre``, as a `tokenizers` pre-tokenizer."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp: "\p{N}" then the GPT-2 regex; SmolLM's own tokenizer.json says the same.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre is not None and pre not in _GPT2_PRES:
        logger.warning("unknown tokenizer.ggml.pre %r: splitting text with the GPT-2 regex", pre)
    return byte_level


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scored result first (the same order transformers derives)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for tok, score in zip(tokens, scores, strict=True):
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok))
                 if tok[:k] in vocab and tok[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def gguf_backend(fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers` model, pre-tokenizer and decoder for a GGUF vocabulary."""
    kind = fields.get("tokenizer.ggml.model")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens outside the byte alphabet are spelled as raw text in some files; respell them.
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", ())]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        return backend
    if kind == "llama":
        scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                             f"{len(tokens)} tokens")
        unk_id = fields.get("tokenizer.ggml.unknown_token_id")
        backend = tokenizers.Tokenizer(models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=_spm_merges(tokens, scores),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True, byte_fallback=True))
        prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(steps)
        return backend
    raise ValueError(
        f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')")


def add_gguf_special_tokens(backend: tokenizers.Tokenizer, fields: Mapping[str, Any]) -> None:
    """Register control tokens as special and user-defined ones as plain added tokens, so both
    are matched whole in text; only control tokens are dropped by skip_special_tokens."""
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    # A byte-level "control" token spelled outside the byte alphabet is a llama.cpp mislabel.
    alphabet = (set(_bytes_to_unicode().values())
                if fields.get("tokenizer.ggml.model") == "gpt2" else None)
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types, strict=True)
               if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def template_processor(fields: Mapping[str, Any], tokens: Sequence[str],
                        default_bos: bool) -> processors.TemplateProcessing | None:
    """A post-processor adding BOS/EOS the way the GGUF's add_bos/add_eos flags say."""
    bos_id, eos_id = (fields.get("tokenizer.ggml.bos_token_id"),
                      fields.get("tokenizer.ggml.eos_token_id"))
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return None
    first = [tokens[bos_id]] if add_bos else []
    last = [tokens[eos_id]] if add_eos else []
    ids = {tokens[i]: i for i in (bos_id if add_bos else None, eos_id if add_eos else None)
           if i is not None}
    return processors.TemplateProcessing(
        single=" ".join([*first, "$A", *last]),
        pair=" ".join([*first, "$A", *last, *first, "$B:1", *last]),
        special_tokens=list(ids.items()))
