"""Compiling a request's output constraint into an xgrammar ``CompiledGrammar``.

One ``GrammarCompiler`` per engine, built from the engine's tokenizer and the model's vocabulary
size (the logits' width, which may exceed the tokenizer's). Compiled grammars are cached by
their source, so a schema sent by every request of a job is compiled once. Compilation runs on
worker threads (xgrammar releases the GIL) with a time limit: a grammar that takes longer is
refused, and the caller is never stalled for longer than that, whatever the client sent.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from typing import TYPE_CHECKING

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

# Seconds one grammar may take to compile before the request is refused.
COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept (by source). A compiled JSON schema takes tens of kilobytes.
CACHE_SIZE = 512
# Compilations running at once; one that times out keeps its thread until it ends.
COMPILE_THREADS = 2
# The largest length, item count or repetition count a constraint may ask for. xgrammar's
# compile time grows with these (a string of maxLength 10,000 takes seconds on a CPU, one of
# 10**9 does not finish), and a compilation that overruns cannot be stopped, only abandoned.
MAX_BOUND = 10_000
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
               "maxProperties")
# A JSON pointer into the schema itself, the only "$ref" xgrammar resolves.
_LOCAL_REF = re.compile(r"#(/.*)?\Z", re.DOTALL)
# Keywords whose values are JSON data, not schemas: a "$ref" or a bound inside is just data.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                        "dependentSchemas"})
# {m}, {m,} and {m,n} in a regex or an EBNF rule.
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class GrammarError(ValueError):
    """The constraint cannot be used: bad syntax, an unsupported feature, or too slow to
    compile. The message names what was wrong."""


def _xgrammar():  # noqa: ANN202 - the module, imported on first use (it imports transformers)
    import xgrammar
    return xgrammar


def choice_grammar(choice: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choice``."""
    # JSON string escapes are xgrammar EBNF string escapes; non-ASCII text stays literal.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: collections.OrderedDict[tuple[str, str, bool], xgrammar.CompiledGrammar] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                           thread_name_prefix="grammar")

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = tokenizer_info(self._tokenizer, self.vocab_size)
                # xgrammar's own cache is off: ours keys by source and bounds the count.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); GrammarError if it cannot be used."""
        key = (spec.kind, spec.source, spec.any_whitespace)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        check_bounds(spec)
        compiler = self._xgr_compiler()
        future = self._pool.submit(_compile, compiler, spec)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"structured_outputs.{spec.kind} did not compile within "
                               f"{self.timeout_s:g} s; simplify it") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop the worker threads (a compilation under way finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_bounds(spec: StructuredOutputsParams) -> None:
    """GrammarError when the constraint asks for a length or repetition over MAX_BOUND, or a
    JSON schema refers (``$ref``) to another document."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError:
            return  # _compile names the syntax error
        _check_schema_bounds(schema, "structured_outputs.json")
    elif spec.kind in ("regex", "grammar"):
        _check_repeats(spec.source, f"structured_outputs.{spec.kind}")


def check_schema(schema: object, where: str) -> None:
    """GrammarError naming the keyword, under ``where``, of a JSON schema that asks for a bound
    over MAX_BOUND or refers (``$ref``) to another document."""
    _check_schema_bounds(schema, where)


def _check_schema_bounds(node: object, where: str) -> None:
    # Iterative: a schema nested thousands deep must not exhaust the recursion limit. Each
    # entry says whether the dict maps names to schemas ("properties"), where a key named
    # like a keyword ("default") is a name, not that keyword.
    stack: list[tuple[object, str, bool]] = [(node, where, False)]
    while stack:
        item, path, names = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                inner = f"{path}.{key}"
                if not names:
                    _check_keyword(key, value, inner)
                if names or key not in _DATA_KEYS:
                    stack.append((value, inner, not names and key in _NAME_MAPS))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]", False) for i, v in enumerate(item))


def _check_keyword(key: str, value: object, where: str) -> None:
    if key in _BOUND_KEYS and isinstance(value, (int, float)) and value > MAX_BOUND:
        raise GrammarError(f"{where} is {value}; tokenmill compiles bounds up to {MAX_BOUND}")
    if key == "pattern" and isinstance(value, str):
        _check_repeats(value, where)
    if key == "$ref" and isinstance(value, str) and not _LOCAL_REF.match(value):
        # xgrammar would read such a reference as "any JSON": refuse it instead.
        raise GrammarError(f"{where} is {value!r}; tokenmill resolves only references inside "
                           "the schema ('#' or '#/...'), not other documents")


def _check_repeats(source: str, where: str) -> None:
    for m in _REPEAT.finditer(source):
        for count in m.groups():
            if count and int(count) > MAX_BOUND:
                raise GrammarError(f"{where} repeats {m.group(0)}; tokenmill compiles "
                                   f"repetitions up to {MAX_BOUND}")


def _compile(compiler: xgrammar.GrammarCompiler,
             spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    kind = spec.kind
    try:
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "json":
            source = spec.source
            try:
                schema = json.loads(source)
            except json.JSONDecodeError as e:
                raise GrammarError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("structured_outputs.json must be a JSON schema (an object)")
            return compiler.compile_json_schema(source, any_whitespace=spec.any_whitespace,
                                                strict_mode=True)
        if kind == "regex":
            return compiler.compile_regex(spec.source)
        if kind == "choice":
            assert spec.choice is not None
            return compiler.compile_grammar(choice_grammar(spec.choice))
        return compiler.compile_grammar(spec.source)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and ValueError) with its reason
        raise GrammarError(f"structured_outputs.{kind} cannot be used: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    # "[12:00:00] /project/cpp/regex_converter.cc:83: Regex parsing error ..."
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0]:
            text = parts[1]
    return text.splitlines()[0] if text else type(e).__name__


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's token string, how strings encode bytes
    (byte-level BPE, SentencePiece byte fallback or raw), and the stop tokens."""
    xgr = _xgrammar()
    backend = tokenizer.backend
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    encoded: list[str] = [""] * max(vocab_size, tokenizer.vocab_size)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < len(encoded):
            encoded[i] = token
    stop = sorted(tokenizer.eos_token_ids) or None
    return xgr.TokenizerInfo(encoded[:vocab_size], meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop, add_prefix_space=meta["add_prefix_space"])
