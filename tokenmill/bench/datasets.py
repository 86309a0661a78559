"""Benchmark workloads: random prompts of an exact token length, or prompts from a JSONL file.

Random prompts are random common English words, cut to exactly ``input_len`` tokens of the
target's tokenizer: text -> tokens, keep the first ``input_len``, tokens -> text, and check that
the text re-tokenizes to the same length (adding a word or trimming again until it does). Words
rather than random token ids, because random ids seldom survive a decode/encode round trip with
the same count, and servers tokenize text. The tokenizer is the server's own (``/tokenize`` and
``/detokenize``, see :mod:`tokenmill.bench.codec`) when it has them, else a local one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Tries at the decode/encode round trip before taking the closest length seen.
MAX_FIT_TRIES = 16

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this "
    "be or has had not but its have they one new first their all also after two been other when "
    "there more into time who would over some years can about such many most only may state "
    "world city during school under three water light river house music north south east west "
    "small large early later great common local public power field report study system market "
    "story paper science history family nature energy garden mountain island forest bridge road "
    "train station window summer winter morning evening number reason result problem question "
    "answer simple quick quiet bright dark green yellow blue red silver golden ancient modern "
    "careful gentle strong rapid slow open closed empty full heavy light warm cold fresh "
    "write read build carry follow change measure travel remember explain discover gather"
).split()


class TokenCodec(Protocol):
    """Text <-> token ids, as the benchmarked engine or server sees them."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class SampleRequest:
    """One request of a workload: text or token ids, its token count and the output to ask."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def parse_len(spec: str | int, name: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"100:1024"`` -> (100, 1024), both inclusive."""
    lo_s, sep, hi_s = str(spec).partition(":")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX, got {spec!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be >= 1 with MIN <= MAX, got {spec!r}")
    return lo, hi


def fit_prompt(codec: TokenCodec, n: int, rng: random.Random) -> tuple[str, list[int]]:
    """Random words that tokenize to exactly ``n`` tokens (or the closest found)."""
    text = " ".join(rng.choice(WORDS) for _ in range(n + 8))
    ids = codec.encode(text)
    best: tuple[str, list[int]] | None = None
    for _ in range(MAX_FIT_TRIES):
        while len(ids) < n:  # too short: more words
            text += " " + " ".join(rng.choice(WORDS) for _ in range(n - len(ids) + 4))
            ids = codec.encode(text)
        text = codec.decode(ids[:n])
        ids = codec.encode(text)
        if best is None or abs(len(ids) - n) < abs(len(best[1]) - n):
            best = (text, ids)
        if len(ids) == n:
            return text, ids
    assert best is not None
    return best


def random_requests(codec: TokenCodec, num: int, input_len: str | int, output_len: str | int,
                    seed: int) -> list[SampleRequest]:
    """``num`` random prompts; lengths are fixed or drawn uniformly from MIN:MAX ranges."""
    if num < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num}")
    in_lo, in_hi = parse_len(input_len, "input_len")
    out_lo, out_hi = parse_len(output_len, "output_len")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        text, ids = fit_prompt(codec, n_in, rng)
        out.append(SampleRequest(text, len(ids), n_out))
    return out


def load_jsonl(path: str, num: int | None, output_len: str | int, seed: int,
               codec: TokenCodec | None) -> list[SampleRequest]:
    """Requests from a JSONL file, one object a line.

    Fields: ``prompt`` (text) or ``prompt_token_ids``; optional ``output_len`` (else drawn from
    ``output_len``) and ``prompt_len`` (else counted with ``codec``). With ``num`` smaller than
    the file, the first ``num`` lines; larger, the lines repeat.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append(_parse_row(json.loads(line), f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"dataset {path} has no requests")
    num = len(rows) if num is None else num
    out_lo, out_hi = parse_len(output_len, "output_len")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt, prompt_len, n_out = rows[i % len(rows)]
        if prompt_len is None:
            if isinstance(prompt, list):
                prompt_len = len(prompt)
            elif codec is None:
                raise ValueError(f"{path}: rows without prompt_len need a tokenizer")
            else:
                prompt_len = len(codec.encode(prompt))
        out.append(SampleRequest(prompt, prompt_len, n_out or rng.randint(out_lo, out_hi)))
    return out


def _parse_row(row: object, where: str) -> tuple[str | list[int], int | None, int | None]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt = row.get("prompt", row.get("prompt_token_ids"))
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'prompt_token_ids'")
    prompt_len, output_len = row.get("prompt_len"), row.get("output_len")
    for name, v in (("prompt_len", prompt_len), ("output_len", output_len)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    return prompt, prompt_len, output_len  # type: ignore[return-value]


def write_jsonl(path: str, requests: Sequence[SampleRequest]) -> None:
    """Save requests so that another run (or another engine) replays the same workload."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            key = "prompt_token_ids" if isinstance(r.prompt, list) else "prompt"
            f.write(json.dumps({key: r.prompt, "prompt_len": r.prompt_len,
                                "output_len": r.output_len}) + "\n")
