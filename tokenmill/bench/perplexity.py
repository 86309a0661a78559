"""`tokenmill bench perplexity`: token-level perplexity of a text under the engine's model.

The text is tokenized once and scored in sliding windows of ``--context`` tokens that start
every ``--stride`` tokens (Hugging Face's recipe): each window is one sequence through the
model's own ``forward`` on a paged KV cache (the engine's
:class:`~tokenmill.engine.evaluate.EvalModel`), and only the tokens not scored by an earlier
window count, so every token after the first is scored exactly once (for stride < context),
with at least ``context - stride`` tokens of history once the first window is past.

``--recipe llama.cpp`` scores as llama.cpp's ``llama-perplexity`` does by default (no
``--ppl-stride``): the text is tokenized with the model's special tokens (BOS where the GGUF
says ``add_bos_token``), cut into ``len // context`` disjoint chunks of ``--context`` tokens
(the tail is dropped; it needs at least two chunks; one trailing newline of the file is dropped
first, as ``llama-perplexity -f`` does), the first token of each chunk is replaced
by BOS where the model adds one, and only the second half of each chunk is scored (targets
``context/2 + 1 .. context - 1``), so its numbers compare with llama.cpp's on the same file.

``--text fixed`` is the text shipped with tokenmill (``tokenmill/bench/perplexity_text.txt``:
the Declaration of Independence, the Gettysburg Address and Lincoln's Second Inaugural
Address, public-domain documents written out here; ~2.9k tokens for SmolLM2), the text of
benchmarks/results/kquant-perplexity.md.

The default text is numpy's ``LICENSE.txt`` (NumPy's BSD license followed by the licenses of
the libraries its wheels bundle, the GPL v3 among them: ~10k tokens of real English), which
every install of tokenmill has because numpy is a dependency.

    python -m tokenmill.bench.perplexity --quantization int4
    python -m tokenmill.bench.perplexity --compare none int8 int4 \\
        --result-file benchmarks/results/perplexity-cpu.json
    tokenmill bench perplexity --model FILE.gguf --text fixed --recipe llama.cpp --context 512
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.engine.evaluate import EvalModel

DEFAULT_TEXT_PACKAGE = "numpy"
DEFAULT_TEXT_NAME = "LICENSE.txt"
FIXED_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "perplexity_text.txt")
RECIPES = ("sliding", "llama.cpp")


@dataclass(frozen=True)
class PerplexityResult:
    """exp(mean negative log-likelihood) of the scored tokens, and how they were scored."""

    perplexity: float
    mean_nll: float
    num_scored: int
    num_tokens: int
    num_windows: int
    context: int
    stride: int
    recipe: str = "sliding"


def window_spans(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` per window: the model reads tokens ``[begin, end)`` and
    scores targets ``[first_target, end)``. With ``stride < context`` the windows score tokens
    ``1 .. num_tokens-1`` once each; with ``stride == context`` (disjoint windows) the first
    token of each window has no history and is skipped. ValueError unless
    ``0 < stride <= context`` and there are two tokens."""
    if context < 2:
        raise ValueError(f"context must be at least 2, got {context}")
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} tokens; perplexity needs at least 2")
    spans: list[tuple[int, int, int]] = []
    prev_end = 0
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + context, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return spans


def llama_cpp_spans(num_tokens: int, context: int) -> list[tuple[int, int, int]]:
    """llama-perplexity's default chunks as ``(begin, end, first_target)``: ``num_tokens //
    context`` disjoint chunks, each scoring targets ``context // 2 + 1 .. context - 1`` (the
    logits of positions ``context // 2 .. context - 2``). ValueError unless the text has at
    least ``2 * context`` tokens (llama.cpp refuses shorter texts too)."""
    if context < 4:
        raise ValueError(f"context must be at least 4 for the llama.cpp recipe, got {context}")
    if num_tokens < 2 * context:
        raise ValueError(f"the text has {num_tokens} tokens; the llama.cpp recipe with context "
                         f"{context} needs at least {2 * context}")
    first = context // 2 + 1
    return [(i * context, (i + 1) * context, i * context + first)
            for i in range(num_tokens // context)]


@torch.inference_mode()
def perplexity(model: EvalModel | nn.Module, token_ids: list[int], context: int = 512,
               stride: int = 256, recipe: str = "sliding",
               bos_token_id: int | None = None) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``model`` (an :class:`EvalModel`, or a bare tokenmill
    model scored with torch attention): in sliding windows (see :func:`window_spans`), or with
    ``recipe="llama.cpp"`` in llama-perplexity's chunks (see :func:`llama_cpp_spans`), the first
    token of each chunk replaced by ``bos_token_id`` when one is given."""
    if recipe == "llama.cpp":
        spans, stride = llama_cpp_spans(len(token_ids), context), context
    elif recipe == "sliding":
        spans = window_spans(len(token_ids), context, stride)
    else:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    scorer = model if isinstance(model, EvalModel) else EvalModel(model)
    nll = 0.0
    scored = 0
    for begin, end, first in spans:
        window = list(token_ids[begin:end])
        if recipe == "llama.cpp" and bos_token_id is not None:
            window[0] = bos_token_id  # llama.cpp starts every chunk at BOS
        for logprobs in scorer.token_logprobs(window, first - begin):
            nll -= logprobs.double().sum().item()
            scored += logprobs.numel()
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, len(token_ids), len(spans),
                            context, stride, recipe)


# ------------------------------------------------------------------------------ the command


def default_text_path() -> str:
    """numpy's top-level LICENSE.txt, as installed with numpy (a tokenmill dependency)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_TEXT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    files = [f for f in (dist.files or []) if f.name == DEFAULT_TEXT_NAME] if dist else []
    files.sort(key=lambda f: len(f.parts))  # the wheel's own license, not a vendored one
    for f in files:
        path = str(dist.locate_file(f))  # type: ignore[union-attr]
        if os.path.isfile(path):
            return path
    raise ValueError(f"{DEFAULT_TEXT_PACKAGE}'s {DEFAULT_TEXT_NAME} was not found; pass --text")


def add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench perplexity` (engine options plus the text and window options)."""
    p = subparsers.add_parser(
        "perplexity", help="token-level perplexity of a text under the model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_perplexity_args(p)
    p.set_defaults(func=cmd_perplexity)


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    """The options of `bench perplexity` (engine options included)."""
    from tokenmill.engine.args import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("perplexity")
    g.add_argument("--text", default=None,
                   help="UTF-8 text file, or 'fixed' for the text shipped with tokenmill "
                        "(default: numpy's LICENSE.txt from site-packages)")
    g.add_argument("--recipe", choices=RECIPES, default="sliding",
                   help="'sliding': windows of --context every --stride tokens, each token "
                        "scored once; 'llama.cpp': llama-perplexity's disjoint chunks of "
                        "--context, BOS first, the second half of each scored")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="score only the first N tokens of the text (default: all)")
    g.add_argument("--context", type=int, default=512, help="tokens per window")
    g.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    g.add_argument("--group-size", type=int, default=32,
                   help="int4 group size; other than 32, layers are quantized after loading")
    g.add_argument("--requantize", action="store_true",
                   help="load float weights and quantize them (the Hugging Face path) "
                        "instead of building int4 layers from a GGUF file's Q4 blocks")
    g.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                   help="run each SPEC ('none', 'int8', 'int4 --group-size 64', ...) in its "
                        "own process and tabulate them")
    g.add_argument("--result-file", default=None, help="write the result JSON here")
    g.add_argument("--markdown", default=None, help="also write a markdown table here")


def cmd_perplexity(args: argparse.Namespace) -> int:
    """Entry point of `tokenmill bench perplexity`."""
    if args.compare:
        runs = [_run_child(args, spec) for spec in args.compare]
    else:
        runs = [run_one(args)]
        print(_summary_line(runs[0]))
    report = _report(args, runs)
    if len(runs) > 1 or args.markdown:
        print(markdown_report(report))
    if args.result_file:
        from tokenmill.bench.report import write_json

        write_json(args.result_file, report)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown_report(report) + "\n")
    return 0


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model as configured, score the text, and return the run's facts."""
    from tokenmill.bench.report import peak_rss_mib

    text_path = _text_path(args.text)
    text = _read_text(text_path)  # before the model: a wrong path should fail fast
    started = time.perf_counter()
    loaded, after_load = _load(args)
    load_s = time.perf_counter() - started
    rss_after_load = _current_rss_mib()
    ids, bos = _tokens(loaded.tokenizer, text, args.recipe)
    used = ids if args.max_tokens is None else ids[:args.max_tokens]
    started = time.perf_counter()
    result = perplexity(loaded, used, args.context, args.stride, args.recipe, bos)
    eval_s = time.perf_counter() - started
    method = args.quantization if after_load else loaded.quantization
    dtype = loaded.dtype
    return {
        "label": _label(method, args.group_size, args.requantize, dtype),
        "quantization": method, "group_size": args.group_size if method == "int4" else None,
        "weights_from": "float, quantized after loading" if after_load else "file",
        "model": loaded.path, "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "text": {"path": text_path, "sha256": _sha256(text_path), "num_tokens": len(ids)},
        **asdict(result),
        "weight_mib": loaded.weight_bytes / 2**20,
        "rss_after_load_mib": rss_after_load, "peak_rss_mib": peak_rss_mib(),
        "load_s": load_s, "eval_s": eval_s,
        "window_tokens_per_s": result.num_windows * args.context / eval_s
        if args.recipe == "llama.cpp" else sum(e - b for b, e, _ in window_spans(
            len(used), args.context, args.stride)) / eval_s,
    }


def _text_path(text: str | None) -> str:
    if text == "fixed":
        return FIXED_TEXT_PATH
    return text or default_text_path()


def _tokens(tokenizer: Any, text: str, recipe: str) -> tuple[list[int], int | None]:
    """The text's token ids for ``recipe``, and the BOS that starts each llama.cpp chunk (None
    where the model adds no BOS: llama.cpp asks the GGUF's add_bos_token, as the tokenizer
    does). llama-perplexity's ``-f`` drops one trailing newline of the file; so does this."""
    if recipe != "llama.cpp":
        return tokenizer.encode(text, add_special_tokens=False), None
    text = text.removesuffix("\n")
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and ids[:1] == [bos] and tokenizer.encode(
        text, add_special_tokens=False)[:1] != [bos]
    return ids, bos if adds_bos else None


def _load(args: argparse.Namespace) -> tuple[EvalModel, bool]:
    """``(EvalModel, quantized after loading?)`` for the engine options.

    An int4 group size other than 32, or ``--requantize``, loads float weights and quantizes
    them after loading (the engine's own option is int4 in groups of 32).
    """
    from tokenmill.engine.args import engine_config_from_args

    config = engine_config_from_args(args)
    method = config.model.quantization
    regroup = method == "int4" and args.group_size != 32
    after_load = method in ("int8", "int4") and (args.requantize or regroup)
    loaded = EvalModel.load(config, method if after_load else None, args.group_size)
    return loaded, after_load


def _run_child(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """One --compare entry in a fresh process, so that its peak memory is its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "tokenmill.bench.perplexity", *_common_argv(args),
               "--quantization", *shlex.split(spec), "--result-file", out]
        print("+", shlex.join(["python", *cmd[1:]]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)  # it prints its own summary line
        with open(out, encoding="utf-8") as f:
            return json.load(f)["runs"][0]


def _common_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--dtype", args.dtype, "--load-format", args.load_format, "--device", args.device,
            "--context", str(args.context), "--stride", str(args.stride),
            "--recipe", args.recipe]
    for flag, value in (("--model", args.model), ("--threads", args.num_threads),
                        ("--text", args.text), ("--max-tokens", args.max_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    from tokenmill.bench.report import hardware, now_iso

    base = next((r["perplexity"] for r in runs if r["quantization"] == "none"), None)
    for r in runs:
        r["vs_none"] = None if base is None else r["perplexity"] / base - 1.0
    return {"benchmark": "perplexity", "timestamp": now_iso(), "hardware": hardware(),
            "command": shlex.join(["python", "-m", "tokenmill.bench.perplexity", *sys.argv[1:]]),
            "runs": runs}


def markdown_report(report: dict[str, Any]) -> str:
    """The runs of a report as a markdown table."""
    from tokenmill.bench.report import markdown_table

    rows = [[r["label"], r["weights_from"], f"{r['perplexity']:.3f}",
             "-" if r["vs_none"] is None else f"{100 * r['vs_none']:+.2f}%",
             f"{r['weight_mib']:.0f}", f"{r['rss_after_load_mib']:.0f}",
             f"{r['peak_rss_mib']:.0f}", f"{r['window_tokens_per_s']:.0f}"]
            for r in report["runs"]]
    return markdown_table(["quantization", "weights from", "perplexity", "vs none",
                           "weights MiB", "RSS after load MiB", "peak RSS MiB",
                           "eval tok/s"], rows)


def _label(method: str, group: int, requantize: bool, dtype: torch.dtype) -> str:
    label = method if method != "int4" else f"int4 g{group}"
    if requantize and method != "none":
        label += " requantized"
    return label if dtype == torch.float32 else f"{label} ({str(dtype).removeprefix('torch.')})"


def _summary_line(run: dict[str, Any]) -> str:
    windows = (f"{run['num_windows']} llama.cpp chunks of {run['context']}"
               if run.get("recipe") == "llama.cpp" else
               f"{run['num_windows']} windows of {run['context']}, stride {run['stride']}")
    return (f"{run['label']}: perplexity {run['perplexity']:.4f} over {run['num_scored']} "
            f"tokens ({windows}); weights {run['weight_mib']:.0f} MiB, peak RSS "
            f"{run['peak_rss_mib']:.0f} MiB; {run['eval_s']:.1f} s")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path!r} is not a readable UTF-8 text file: {e}") from e


def _current_rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenmill.bench.perplexity`: the same options as `tokenmill bench perplexity`."""
    import logging

    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.perplexity",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_perplexity_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return cmd_perplexity(args)
    except ValueError as e:
        print(f"perplexity: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
