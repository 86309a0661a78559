"""Model references by name on a Hugging Face hub, and which GGUF files one picks.

A reference is ``ORG/NAME`` (a repo of config, safetensors and tokenizer files, or of GGUF
files), ``ORG/NAME:QUANT`` (the GGUF file of that quantization, as llama-server's ``-hf`` and
Ollama's ``hf.co/ORG/NAME:QUANT`` pick it), or ``ORG/NAME/FILE.gguf`` (that file), each with an
optional ``@REVISION`` (a branch, tag or commit). Pure functions: no network, no files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# The quantization picked when a reference names none: Q4_K_M (llama.cpp's and Ollama's
# default), else the first of these the repo has, else the first GGUF file by name.
PREFERRED_QUANTS = (
    "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "IQ4_XS", "IQ4_NL", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1",
    "Q6_K", "Q8_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "BF16", "F16", "F32",
)
# Hugging Face's repo name rule: letters, digits, '-', '_', '.', 96 characters at most.
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO_RE = re.compile(rf"^{_NAME}/{_NAME}$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
# A file name's quantization label: Q4_K_M, IQ4_XS, Q8_0, BF16, F16...
_LABEL_RE = re.compile(r"^(?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)
# The shard suffix of a split GGUF: name-00001-of-00003.gguf.
_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    """A model named on a hub: the repo, and optionally a revision, a quantization to pick
    among its GGUF files, or the one GGUF file to take."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        text += f":{self.quant}" if self.quant else ""
        return text + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        """The name a server answers to for this model: the reference without its revision."""
        return str(HubRef(self.repo_id, None, self.quant, self.filename))


def parse_hub_ref(text: str, revision: str | None = None) -> HubRef | None:
    """``text`` as a hub reference, or None when it is not shaped like one (a local path, a
    preset name). ``revision`` (``--revision``) applies when the text names none itself;
    ValueError when both name one and they differ."""
    if not text or text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    body, at, rev = text.partition("@")
    quant: str | None = None
    if ":" in rev:  # ORG/NAME@REV:QUANT (git refs cannot hold ':')
        rev, _, quant = rev.partition(":")
    if ":" in body:
        if quant is not None:
            return None
        body, _, quant = body.partition(":")
    if at and not rev or quant is not None and not _QUANT_RE.match(quant):
        return None
    filename: str | None = None
    parts = body.split("/")
    if len(parts) == 3 and parts[2].lower().endswith(".gguf"):
        filename = parts[2]
        body = "/".join(parts[:2])
    if not _REPO_RE.match(body) or ".." in body or "--" in body:
        return None
    if filename is not None and quant is not None:
        raise ValueError(f"model {text!r}: name a GGUF file or a quantization, not both")
    if rev and revision and rev != revision:
        raise ValueError(f"model {text!r} names revision {rev!r} and --revision {revision!r}: "
                         "give one of them")
    return HubRef(body, rev or revision or None, quant or None, filename)


def quant_label(filename: str) -> str | None:
    """The quantization a GGUF file's name says (``Q4_K_M`` in ``m-Q4_K_M-00001-of-00002.gguf``),
    in upper case, or None."""
    base = filename.rsplit("/", 1)[-1]
    for token in reversed(re.split(r"[-.]", _SHARD_RE.sub(".gguf", base))):
        if _LABEL_RE.match(token):
            return token.upper()
    return None


def _group(filename: str) -> str:
    """The files that make one model: a split GGUF's shards share the name without the suffix."""
    return _SHARD_RE.sub("", filename)


def gguf_files(files: Iterable[str]) -> list[str]:
    """The model GGUF files of a repo's listing, sorted (multimodal projectors left out)."""
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and "mmproj" not in f.rsplit("/", 1)[-1].lower())


def available_quants(files: Iterable[str]) -> list[str]:
    """The quantizations a repo offers (labels, else file names), each once, sorted."""
    return sorted({quant_label(f) or _group(f) for f in gguf_files(files)})


def pick_gguf(ref: HubRef, files: Iterable[str]) -> list[str]:
    """The GGUF file(s) ``ref`` stands for in a repo listing ``files`` (every shard of a split
    model, first shard first); ValueError naming the quantizations the repo has."""
    ggufs = gguf_files(files)
    if ref.filename is not None:
        if ref.filename not in ggufs:
            raise ValueError(f"{ref.repo_id} has no file {ref.filename!r}; its GGUF files: "
                             f"{', '.join(ggufs) or 'none'}")
        chosen = ref.filename
    elif ref.quant is not None:
        wanted = ref.quant.upper()
        matches = [f for f in ggufs if wanted in f.rsplit("/", 1)[-1].upper()]
        exact = [f for f in matches if quant_label(f) == wanted]
        if not matches:
            raise ValueError(f"{ref.repo_id} has no {ref.quant} GGUF file; it has: "
                             f"{', '.join(available_quants(ggufs)) or 'no GGUF files'}")
        chosen = (exact or _by_preference(matches))[0]
    else:
        if not ggufs:
            raise ValueError(f"{ref.repo_id} has no GGUF files")
        chosen = _by_preference(ggufs)[0]
    group = _group(chosen)
    return [f for f in ggufs if _group(f) == group] if _SHARD_RE.search(chosen) else [chosen]


def _by_preference(files: list[str]) -> list[str]:
    """``files`` ordered by PREFERRED_QUANTS (unknown labels last, then by name)."""
    rank = {q: i for i, q in enumerate(PREFERRED_QUANTS)}
    return sorted(files, key=lambda f: (rank.get(quant_label(f) or "", len(rank)), f))
