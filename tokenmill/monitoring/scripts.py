"""The writing system a prompt is in, from the Unicode blocks of its letters.

A prompt's script is its most frequent non-Latin script when that has at least
``NON_LATIN_SHARE`` of the letters counted, else Latin when it has Latin letters. Latin is the
default because chat templates, role names, code and URLs put a few Latin letters into every
prompt: a short Russian message inside a template's ``user``/``assistant`` markup is still
Russian. Only the prompt's last ``TAIL_CHARS`` characters are read (the end of a chat prompt is
the newest message), so the cost per request is bounded whatever the prompt's length.
"""

from __future__ import annotations

import re

# Characters read from the end of the prompt.
TAIL_CHARS = 2000
# The share of the counted letters a non-Latin script needs to be the prompt's script.
NON_LATIN_SHARE = 0.25

# Script -> its letters' Unicode blocks, as a regex character class (letters of other blocks
# count as "other").
_BLOCKS: dict[str, str] = {
    "latin": "A-Za-z\u00c0-\u024f\u1e00-\u1eff",
    "greek": "\u0370-\u03ff\u1f00-\u1fff",
    "cyrillic": "\u0400-\u052f",
    "armenian": "\u0530-\u058f",
    "hebrew": "\u0590-\u05ff",
    "arabic": "\u0600-\u06ff\u0750-\u077f\u08a0-\u08ff\ufb50-\ufdff\ufe70-\ufeff",
    "devanagari": "\u0900-\u097f",
    "other_indic": "\u0980-\u0dff",
    "thai": "\u0e00-\u0e7f",
    "georgian": "\u10a0-\u10ff",
    "hangul": "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af",
    "kana": "\u3040-\u30ff",
    "han": "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff",
}
_PATTERNS = {name: re.compile(f"[{cls}]") for name, cls in _BLOCKS.items()}
# Any letter (a word character that is neither a digit nor "_").
_LETTER = re.compile(r"[^\W\d_]")
_ASCII_LETTER = re.compile("[A-Za-z]")
# Special-token markup of chat templates (<|im_start|>, <s>, </s>): not the user's words.
_MARKUP = re.compile(r"<\|[^|>]{0,64}\|>|</?[A-Za-z_]{1,16}>")

# Every value `prompt_script` returns.
SCRIPTS = (*_BLOCKS, "other", "none")


def letter_counts(text: str) -> dict[str, int]:
    """Letters of ``text`` per script (scripts without letters left out; "other": letters of
    scripts not listed)."""
    counts: dict[str, int] = {}
    total = len(_LETTER.findall(text))
    counted = 0
    for name, pattern in _PATTERNS.items():
        # subn counts in C; findall would build a list of every match.
        n = pattern.subn("", text)[1]
        if n:
            counts[name] = n
            counted += n
    if total > counted:
        counts["other"] = total - counted
    return counts


def prompt_script(text: str | None) -> str:
    """The script of a prompt (one of ``SCRIPTS``; "none" without letters or text)."""
    if not text:
        return "none"
    tail = _MARKUP.sub(" ", text[-TAIL_CHARS:])
    if tail.isascii():  # the common case, without a pass per script
        return "latin" if _ASCII_LETTER.search(tail) else "none"
    counts = letter_counts(tail)
    total = sum(counts.values())
    if not total:
        return "none"
    latin = counts.pop("latin", 0)
    if counts:
        name, n = max(counts.items(), key=lambda kv: kv[1])
        if n >= NON_LATIN_SHARE * total or not latin:
            return name
    return "latin"
