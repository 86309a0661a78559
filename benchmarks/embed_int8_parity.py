"""Would int8 matmuls keep all-MiniLM-L6-v2's embeddings within issue 15's parity goal?

The throughput goal (2x sentence-transformers) needs less arithmetic per token than fp32 on a
CPU without bf16 (int8 matmuls: PyTorch's fbgemm-backed dynamic int8 linear runs ~1.6x the
fp32 GEMM rate at these shapes on AVX2). This measures what int8 costs in accuracy before
any kernel is written: sentence-transformers' own model with every ``nn.Linear`` of the
encoder computing on fake-quantized values, against the same model in fp32 (and, for scale,
the fp32 and dynamic-int8 matmul rates at the model's shapes):

- ``w8``: weights int8, one scale per output row (symmetric); activations fp32;
- ``w8a8``: the same weights, and activations int8 with one scale per token (symmetric);
- ``w8a8-asym``: activations int8 with a scale and a zero point per token.

Cosine similarity of each sentence's normalized embedding to the fp32 one, over the parity
sentences of ``tokenmill bench embed`` plus 200 generated ones; the goal is >= 0.9999.

    python benchmarks/embed_int8_parity.py [--result-file FILE]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.bench.embed_sentences import PARITY_SENTENCES, generated_sentences
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.model_loader import embedded_embedding_model_path

GOAL = 0.9999


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to int8 with one symmetric scale per row (the last dimension's)."""
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (w / scale).round().clamp(-127, 127) * scale


def int8_rows_asym(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to 256 levels between each row's min and max."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).clamp_min(1e-12)
    return ((x - lo) / scale).round().clamp(0, 255) * scale + lo


# Every scheme rounds the weights to int8; this is how each rounds the activations.
SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {
    "w8": None,
    "w8a8": int8_rows,
    "w8a8-asym": int8_rows_asym,
}


class FakeQuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, activations: Callable[[torch.Tensor], torch.Tensor] | None
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(int8_rows(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias
        self.activations = activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            x = self.activations(x)
        return nn.functional.linear(x, self.weight, self.bias)


def quantized_copy(st: Any, scheme: str) -> Any:
    import copy

    activations = SCHEMES[scheme]
    model = copy.deepcopy(st)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, FakeQuantLinear(child, activations))
    return model


# all-MiniLM-L6-v2's projections (out x in) at a 2,048-token step.
GEMM_SHAPES = [(1152, 384), (1536, 384), (384, 1536)]
GEMM_ROWS = 2048


def gemm_rates(threads: int) -> list[dict[str, Any]]:
    """fp32 ``F.linear`` against PyTorch's dynamic int8 linear (fbgemm on x86: activations
    quantized per call) at the model's shapes: what int8 could buy if it kept the accuracy."""
    import time
    import warnings

    torch.set_num_threads(threads)
    out = []
    for n, k in GEMM_SHAPES:
        x = torch.randn(GEMM_ROWS, k)
        lin = nn.Linear(k, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.ao.quantization.quantize_dynamic(nn.Sequential(lin), {nn.Linear},
                                                       dtype=torch.qint8)
        rates = {}
        for name, f in (("fp32", lambda lin=lin, x=x: lin(x)),
                        ("int8_dynamic", lambda q=q, x=x: q(x))):
            with torch.inference_mode():
                for _ in range(3):
                    f()
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(5):
                        f()
                    best = min(best, (time.perf_counter() - t) / 5)
            rates[name] = 2 * GEMM_ROWS * n * k / best / 1e9
        out.append({"shape": [n, k], "rows": GEMM_ROWS, "gflops": rates})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--generated", type=int, default=200)
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    path = embedded_embedding_model_path()
    st = SentenceTransformer(path, device="cpu")
    texts = list(PARITY_SENTENCES) + generated_sentences(args.generated, seed=1)
    ref = st.encode(texts, convert_to_tensor=True, normalize_embeddings=True,
                    show_progress_bar=False)
    rows, results = [], {}
    for scheme in SCHEMES:
        got = quantized_copy(st, scheme).encode(texts, convert_to_tensor=True,
                                                normalize_embeddings=True,
                                                show_progress_bar=False)
        cos = (got * ref).sum(-1)
        results[scheme] = {"min_cosine": cos.min().item(), "mean_cosine": cos.mean().item(),
                           "below_goal": int((cos < GOAL).sum()), "below_0.999":
                           int((cos < 0.999).sum())}
        r = results[scheme]
        rows.append([scheme, f"{r['min_cosine']:.5f}", f"{r['mean_cosine']:.5f}",
                     f"{r['below_goal']} / {len(texts)}", f"{r['below_0.999']} / {len(texts)}"])
    print(hardware_line(hardware()))
    print(markdown_table(["scheme", "min cosine", "mean cosine", f"below {GOAL}", "below 0.999"],
                         rows))
    rates = gemm_rates(args.threads)
    print(markdown_table(["projection (out x in)", "rows", "fp32 GFLOP/s", "int8 dynamic GOP/s",
                          "ratio"],
                         [[f"{r['shape'][0]} x {r['shape'][1]}", r["rows"],
                           f"{r['gflops']['fp32']:.1f}", f"{r['gflops']['int8_dynamic']:.1f}",
                           f"{r['gflops']['int8_dynamic'] / r['gflops']['fp32']:.2f}x"]
                          for r in rates]))
    if args.result_file:
        write_json(args.result_file, {"created": now_iso(), "hardware": hardware(),
                                      "threads": args.threads, "model": path,
                                      "num_sentences": len(texts), "goal": GOAL,
                                      "results": results, "gemm_rates": rates})


if __name__ == "__main__":
    main()
