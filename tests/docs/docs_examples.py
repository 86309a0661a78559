"""The marked examples of README.md and docs/: fenced code blocks preceded by a marker line

    <!-- docs-test: offline -->      run as it is (python or bash), on the embedded model
    <!-- docs-test: server -->       run against a test server (`tokenmill serve` on a free port)
    <!-- docs-test: skip REASON -->  not run, for the reason given

tests/docs/test_docs_examples.py runs them, so the documentation's examples stay true."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("offline", "server", "skip")
_MARKER = re.compile(r"^<!-- docs-test: (\w+)(.*?)-->\s*$")
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Example:
    """One fenced code block and how the test treats it."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kind: str | None  # None: no marker
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples(path: Path) -> list[Example]:
    """Every fenced block of a markdown file, with the marker of the line before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence.group(1)):
            end += 1
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        kind, reason = (marker.group(1), marker.group(2).strip()) if marker else (None, "")
        found.append(Example(path, i + 1, fence.group(2), "\n".join(lines[i + 1:end]) + "\n",
                             kind, reason))
        i = end + 1
    return found


def markdown_files() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def all_examples() -> list[Example]:
    return [e for path in markdown_files() for e in examples(path)]


def for_server(code: str, url: str) -> str:
    """The example pointed at the test server instead of the default port."""
    host = url.removeprefix("http://")
    return code.replace("127.0.0.1:8000", host).replace("localhost:8000", host)
