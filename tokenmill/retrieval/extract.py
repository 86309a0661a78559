"""Text out of an uploaded file: UTF-8 text formats as they are, HTML without its markup.
Anything else (PDFs, images, archives, text in another encoding) is refused with a
``ValueError`` that says why, since searching garbage would only return garbage."""

from __future__ import annotations

import codecs
import os
import re
from html.parser import HTMLParser

# Plain text, markup and data formats, and source code: read as UTF-8 text.
TEXT_EXTENSIONS = frozenset("""
txt text md markdown rst adoc org tex log csv tsv json jsonl ndjson yaml yml toml ini cfg conf
xml svg html htm
py pyi js mjs cjs ts tsx jsx java kt kts scala go rs c h cc cpp cxx hpp hh cs m mm swift rb php
pl pm lua r jl sh bash zsh fish ps1 bat sql css scss less vue svelte dart ex exs erl hs ml
clj el vim proto graphql gradle cmake mk dockerfile makefile
""".split())
HTML_EXTENSIONS = frozenset({"html", "htm"})
# Bytes decoded in one call: a call holds the GIL (about 4 ms a megabyte), and a 512 MiB
# upload decoded at once would stall every other request for seconds.
DECODE_PIECE_BYTES = 1 << 20
# The first character that is not blank: found without copying the text (as strip would).
_NOT_BLANK_BYTES = re.compile(rb"[^ \t\n\r\x0b\x0c]")
_NOT_BLANK = re.compile(r"\S")


class UnsupportedFile(ValueError):
    """A file whose type retrieval cannot read (OpenAI's ``unsupported_file``)."""


class InvalidFile(ValueError):
    """A file of a supported type whose content is not text (OpenAI's ``invalid_file``)."""


def extension(filename: str) -> str:
    """The lower-case extension, or the whole lower-case name for ``Makefile``-like names."""
    base = os.path.basename(filename).lower()
    ext = base.rsplit(".", 1)[1] if "." in base.strip(".") else base
    return ext


def check_supported(filename: str) -> None:
    """UnsupportedFile unless ``filename`` names a type whose text retrieval can read."""
    if extension(filename) not in TEXT_EXTENSIONS:
        raise UnsupportedFile(
            f"{filename!r}: unsupported file type; file search reads UTF-8 text files "
            "(.txt, .md, .json, .jsonl, .csv, .html, source code, ...)")


def decode_text(data: bytes, filename: str) -> str:
    """``data`` as text (without a leading byte-order mark), decoded DECODE_PIECE_BYTES at a
    time: InvalidFile if it is empty, not UTF-8 (naming the first bad byte's offset in the
    file) or binary (NUL bytes)."""
    if not _NOT_BLANK_BYTES.search(data):
        raise InvalidFile(f"{filename!r} is empty")
    if b"\x00" in data:
        raise InvalidFile(f"{filename!r} is a binary file (it holds NUL bytes), not text")
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    pieces: list[str] = []
    first = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    for start in range(first, len(data), DECODE_PIECE_BYTES):
        end = start + DECODE_PIECE_BYTES
        held = len(decoder.getstate()[0])  # the previous piece's unfinished character
        try:
            pieces.append(decoder.decode(view[start:end], final=end >= len(data)))
        except UnicodeDecodeError as e:
            raise InvalidFile(f"{filename!r} is not UTF-8 text (invalid byte at offset "
                              f"{start - held + e.start})") from None
    return "".join(pieces)


def extract_text(data: bytes, filename: str) -> str:
    """The searchable text of a file; UnsupportedFile / InvalidFile say why there is none."""
    check_supported(filename)
    text = decode_text(data, filename)
    if extension(filename) in HTML_EXTENSIONS:
        text = html_text(text)
    if not _NOT_BLANK.search(text):
        raise InvalidFile(f"{filename!r} holds no text")
    return text


class _TextOnly(HTMLParser):
    """Collects an HTML document's text: no tags, scripts or styles; a line break at each
    block element so words of two paragraphs never run together."""

    SKIP = frozenset({"script", "style", "noscript", "template", "head"})
    BLOCKS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6",
                        "section", "article", "header", "footer", "pre", "blockquote", "table",
                        "ul", "ol", "dt", "dd", "hr", "title"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The text of an HTML document, one paragraph a line, runs of blank space squeezed."""
    parser = _TextOnly()
    parser.feed(html)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)
