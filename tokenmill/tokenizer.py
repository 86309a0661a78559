"""Tokenizer: Hugging Face `tokenizers` underneath, chat templates rendered in a Jinja sandbox.

Built either from a Hugging Face folder (tokenizer.json and friends) or from the tokenizer
metadata llama.cpp stores in a GGUF file (vocabulary, merges, token types, special ids).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
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


def _gguf_backend(fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
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


def _add_gguf_special_tokens(backend: tokenizers.Tokenizer, fields: Mapping[str, Any]) -> None:
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


def _template_processor(fields: Mapping[str, Any], tokens: Sequence[str],
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


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and
    render its body unchanged; we never need the mask."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# Roles every chat template is assumed to handle; others only where the template names them.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# `role == 'x'`, `role != "x"`, `'x' == message.role`, `role in ['x', 'y']` in a template.
_ROLE_TESTS = re.compile(
    r"""role['"]?\]?\s*(?:==|!=)\s*['"]([^'"]+)['"]"""
    r"""|['"]([^'"]+)['"]\s*(?:==|!=)\s*[\w.\[\]'"]*role\b"""
    r"""|role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")


def template_roles(template: str) -> frozenset[str]:
    """The roles a chat template tests for by name (beyond STANDARD_ROLES)."""
    roles: set[str] = set()
    for eq, rev, listed in _ROLE_TESTS.findall(template):
        roles.update(r for r in (eq, rev) if r)
        roles.update(re.findall(r"""['"]([^'"]+)['"]""", listed))
    return frozenset(roles)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies whose content is a plain string.

    A message is a dict with a str ``role`` and a ``content`` that is a str or a list of
    ``{"type": "text", "text": ...}`` parts (concatenated); an assistant message with
    ``tool_calls`` may have no content. Raises ValueError naming the message index and field.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {msg.get('role')!r}")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (not isinstance(part, dict) or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content[{j}] must be "
                                     '{"type": "text", "text": <str>}')
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str) and not (content is None and msg.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        out.append({**msg, "content": content})
    return out


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and end-of-generation ids."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, extra_eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = {eos_token_id} if eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_token_ids))
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None  # compiled on first use
        self._roles: frozenset[str] = STANDARD_ROLES
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        self.all_special_ids: list[int] = sorted(
            special | {i for i in (bos_token_id, eos_token_id) if i is not None})
        # The text of every control token, longest first: what a chat message must not forge.
        texts = {added[i].content for i in special} | {
            t for t in (self.bos_token, self.eos_token) if t}
        self._special_re = (re.compile("|".join(map(re.escape, sorted(texts, key=len,
                                                                      reverse=True))))
                            if texts else None)
        self._plain: tuple[tokenizers.Tokenizer, tokenizers.Tokenizer] | None = None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for incremental detokenization)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """BOS as text, or None."""
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """EOS as text, or None."""
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata given as ``{key: value}`` (keys like ``tokenizer.ggml.tokens``)."""
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: no tokenizer to build")
        tokens = list(fields["tokenizer.ggml.tokens"])
        backend = _gguf_backend(fields)
        _add_gguf_special_tokens(backend, fields)
        processor = _template_processor(
            fields, tokens, default_bos=fields.get("tokenizer.ggml.model") == "llama")
        if processor is not None:
            backend.post_processor = processor
        extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if fields.get(k) is not None]
        return cls(backend, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
                   extra_eos_token_ids=extra, chat_template=fields.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json plus, when present,
        tokenizer_config.json, special_tokens_map.json, chat_template.jinja/.json and
        generation_config.json (extra end-of-generation ids)."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"{path!r} has no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))

        def token_id(name: str) -> int | None:
            tok = config.get(name) or special_map.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        gen_eos = gen.get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if eos is None and extra:
            eos = extra[0]
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        return cls(backend, bos_token_id=bos, eos_token_id=eos, extra_eos_token_ids=extra,
                   chat_template=_hf_chat_template(path, config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added only where the model's settings say so."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary spelling of each id (None for an id out of range)."""
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._tok.token_to_id(token)

    def encode_plain(self, text: str, add_special_tokens: bool = False, *,
                     at_start: bool = True) -> list[int]:
        """Token ids of ``text`` read as plain characters: special-token text such as
        ``<|im_end|>`` becomes ordinary tokens, never the control token (BOS/EOS are still
        added where the model's settings say so, with ``add_special_tokens``).
        ``at_start=False`` encodes a piece that follows other tokens (no SentencePiece
        word-start space)."""
        if self._plain is None:
            self._plain = (_plain_backend(self._tok, at_start=True),
                           _plain_backend(self._tok, at_start=False))
        plain = self._plain[0 if at_start else 1]
        return plain.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    *, max_chars: int | None = None, **kwargs: Any) -> tuple[str, list[int]]:
        """The chat template applied to ``messages``, and its token ids, where only the
        template's own text can become control tokens.

        Every string that comes from the caller (message content, roles, names, template
        kwargs) is rendered with its special-token text replaced by a placeholder the caller
        cannot guess; the rendered text is split at the control tokens that remain (the
        template's), and each piece between them is encoded as plain text with the caller's
        text put back. A user who writes "<|im_end|><|im_start|>system" gets those characters,
        not a system turn. Without such text the ids equal ``encode(text)``'s.
        ``max_chars``: ValueError, before tokenizing, for a longer rendered prompt."""
        if self._special_re is None:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            _check_length(text, max_chars)
            return text, self.encode(text, add_special_tokens=False)
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def hide(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return f"\ue000{nonce}{len(found) - 1}\ue001"

        hidden = _map_strings(messages, lambda s: self._special_re.sub(hide, s))  # type: ignore[union-attr]
        hidden_kwargs = _map_strings(kwargs, lambda s: self._special_re.sub(hide, s))  # type: ignore[union-attr]
        rendered = self.apply_chat_template(hidden, add_generation_prompt, **hidden_kwargs)
        _check_length(rendered, max_chars)
        placeholder = re.compile(f"\ue000{nonce}(\\d+)\ue001")

        def show(piece: str) -> str:
            return placeholder.sub(lambda m: found[int(m.group(1))], piece)

        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(rendered):
            if m.start() > pos:
                ids += self.encode_plain(show(rendered[pos:m.start()]), at_start=pos == 0)
            ids += self.encode(m.group(0), add_special_tokens=False)
            pos = m.end()
        if pos < len(rendered):
            ids += self.encode_plain(show(rendered[pos:]), at_start=pos == 0)
        return show(rendered), ids

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (extra kwargs such as ``tools``
        are passed to the template). A role outside STANDARD_ROLES is refused unless the
        template tests for it by name. To tokenize the result, use ``encode_chat``: encoding
        this text reads special-token text inside the messages as control tokens."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        checked = validate_messages(messages)
        if self._template is None:  # worker threads may race here: roles are set first
            self._roles = STANDARD_ROLES | template_roles(self.chat_template)
            self._template = _compile_template(self.chat_template)
        for i, msg in enumerate(checked):
            if msg["role"] not in self._roles:
                raise ValueError(f"messages[{i}].role {msg['role']!r} is not a role this "
                                 f"model's chat template knows (known: "
                                 f"{', '.join(sorted(self._roles))})")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(kwargs)
        if reserved:
            raise ValueError(f"template arguments may not set {', '.join(sorted(reserved))}")
        return self._template.render(
            messages=checked, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _check_length(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the conversation renders to {len(text)} characters, more than the "
                         f"{max_chars} this model's context can take")


def _map_strings(obj: Any, fn: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples of anything) with ``fn`` applied to every string
    value; keys are kept as they are."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_strings(v, fn) for v in obj)
    return obj


def _plain_backend(backend: tokenizers.Tokenizer, *, at_start: bool) -> tokenizers.Tokenizer:
    """A copy of ``backend`` that reads special-token text as plain text. ``at_start=False``:
    for a piece that follows a control token, where a SentencePiece pre-tokenizer that adds a
    word-start space only at the start of the input ("first") must not add one."""
    plain = tokenizers.Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    pre = plain.pre_tokenizer
    if not at_start and isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first":
        pre.prepend_scheme = "never"
        plain.pre_tokenizer = pre
    return plain


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(path: str, config: Mapping[str, Any]) -> str | None:
    """The chat template: chat_template.jinja, else chat_template.json, else tokenizer_config."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    template = template if template is not None else config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
