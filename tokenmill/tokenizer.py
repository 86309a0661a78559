"""Tokenizer: Hugging Face `tokenizers` underneath, chat templates rendered in a Jinja sandbox.

Built either from a Hugging Face folder (tokenizer.json and friends) or from the tokenizer
metadata llama.cpp stores in a GGUF file (vocabulary, merges, token types, special ids;
``tokenmill.gguf_tokenizer``). Templates and message checks: ``tokenmill.chat_template``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jinja2
import tokenizers
from tokenizers import pre_tokenizers

from tokenmill.chat_template import (
    STANDARD_ROLES,
    compile_template,
    template_roles,
    validate_messages,
)
from tokenmill.gguf_tokenizer import add_gguf_special_tokens, gguf_backend, template_processor


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
        backend = gguf_backend(fields)
        add_gguf_special_tokens(backend, fields)
        processor = template_processor(
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
                    *, max_chars: int | None = None, markup: Callable[[str], str] | None = None,
                    **kwargs: Any) -> tuple[str, list[int]]:
        """The chat template applied to ``messages``, and its token ids, where only the
        template's own text can become control tokens.

        Every string that comes from the caller (message content, roles, names, template
        kwargs) is rendered with its special-token text replaced by a placeholder the caller
        cannot guess; the rendered text is split at the control tokens that remain (the
        template's), and each piece between them is encoded as plain text with the caller's
        text put back. A user who writes "<|im_end|><|im_start|>system" gets those characters,
        not a system turn. Without such text the ids equal ``encode(text)``'s.
        ``max_chars``: ValueError, before tokenizing, for a longer rendered prompt.
        ``markup``: the server's own rewrite of the rendered text (the caller's text in it
        still hidden), whose control-token text is read as such: markup a template cannot
        write (api/harmony_history.py)."""
        markup = markup or (lambda text: text)
        if self._special_re is None:
            text = markup(self.apply_chat_template(messages, add_generation_prompt, **kwargs))
            _check_length(text, max_chars)
            return text, self.encode(text, add_special_tokens=False)
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def hide(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return f"\ue000{nonce}{len(found) - 1}\ue001"

        self._check_roles(messages)  # before hiding: a refusal quotes the caller's role
        hidden = _map_strings(messages, lambda s: self._special_re.sub(hide, s))  # type: ignore[union-attr]
        hidden_kwargs = _map_strings(kwargs, lambda s: self._special_re.sub(hide, s))  # type: ignore[union-attr]
        # A placeholder as rendered, or as repr() writes it in an error message.
        placeholder = re.compile(f"(?:\ue000|\\\\ue000){nonce}(\\d+)(?:\ue001|\\\\ue001)")

        def show(piece: str) -> str:
            return placeholder.sub(lambda m: found[int(m.group(1))], piece)

        try:
            rendered = self.apply_chat_template(hidden, add_generation_prompt, **hidden_kwargs)
        except Exception as e:  # the template's own refusals may quote the caller's text
            e.args = tuple(show(a) if isinstance(a, str) else a for a in e.args)
            raise
        _check_length(rendered, max_chars)
        rendered = markup(rendered)

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

    def _check_roles(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` checked by validate_messages; ValueError naming the first role the
        chat template does not know (or that there is no template)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        checked = validate_messages(messages)
        if self._template is None:  # worker threads may race here: roles are set first
            self._roles = STANDARD_ROLES | template_roles(self.chat_template)
            self._template = compile_template(self.chat_template)
        for i, msg in enumerate(checked):
            if msg["role"] not in self._roles:
                raise ValueError(f"messages[{i}].role {msg['role']!r} is not a role this "
                                 f"model's chat template knows (known: "
                                 f"{', '.join(sorted(self._roles))})")
        return checked

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (extra kwargs such as ``tools``
        are passed to the template). A role outside STANDARD_ROLES is refused unless the
        template tests for it by name. To tokenize the result, use ``encode_chat``: encoding
        this text reads special-token text inside the messages as control tokens."""
        checked = self._check_roles(messages)
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
