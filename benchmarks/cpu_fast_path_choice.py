"""Issue 56 item 4: how should the CPU fast path run a family's one definition? Measured.

(a) the op-program route: the model's layers run by a C++ loop; today's C++ layer stack
    (``FusedDecoder.forward``) is what such a loop costs per step.
(b) ``torch.compile`` of the plain model (inductor on the CPU, as gpt-fast), with the project's
    kernels (paged attention, the int8/int4 matmuls, the quantized embedding) registered as
    ``torch.library`` custom ops so that the graph does not break on them. The wrappers live in
    this script only: they show what (b) would give without touching tokenmill/.

Per model it times, alternated in rounds (A B C ... A B C ...): a decode step at batch 1 and 8
(128-token contexts) and a 500-token prefill, for the C++ stack, eager ``model.forward``, eager
``model.forward`` over the custom ops, and each compiled variant; and per compiled variant the
first call of each step kind (compile or recompile), the graphs Dynamo made and its graph
breaks. Prints a table, writes JSON and a short Markdown note under benchmarks/results/.

    OMP_NUM_THREADS=2 python benchmarks/cpu_fast_path_choice.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tokenmill.quant.linear import StepKindMarks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = ("decode_b1", "decode_b8", "prefill_500")
CONTEXT = 128  # tokens of context behind each decode row
BLOCK = 16

# ----------------------------------------------------------------------------- custom ops
# The kernels the compiled graph calls as opaque ops: tensors in, a fresh tensor out, and a
# fake impl that gives inductor the output's shape. Modules are addressed by an index into
# these lists (an int argument is a constant of the graph).
_EXT: list[object] = []
_LINEARS: list[nn.Module] = []
_EMBEDS: list[tuple[nn.Module, int, torch.dtype]] = []


# The KV write is not declared as a mutation: declared, inductor functionalizes the op and
# copies the layer's whole cache tensor around every call (a 2-layer Qwen3 decode step took
# 175 ms instead of 18). Nothing else in the graph reads the cache, so undeclared is safe
# here; vLLM gets the same effect by passing a layer name and reading the cache from a context.
@torch.library.custom_op("tmbench::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Store the step's K/V, then the extension's decode kernel (decode-only step) or its
    prefill kernel (any other), as the C++ stack runs them."""
    ext = _EXT[0]
    t, hq, d = q.shape
    hkv = k.shape[1]
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
    if q.stride(-1) != 1 or q.stride(-2) != d:
        q = q.contiguous()
    out = q.new_empty(t, hq * d)
    b = seq_lens.shape[0]
    if t == b:
        ext.decode_attention(q, kv_cache, block_tables, seq_lens, scale, out)
        return out
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    chunks = [x for i in range(b) for x in (qsl[i], qsl[i + 1] - qsl[i], sl[i], i)]
    ext.prefill_attention(q, kv_cache, block_tables, chunks, scale, out)
    return out


@paged_attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("tmbench::module_linear", mutates_args=())
def module_linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """A quantized projection's own forward (tokenmill's int8/int4 kernels)."""
    return _LINEARS[index](x)


@module_linear.register_fake
def _(x, index):
    return x.new_empty(*x.shape[:-1], _LINEARS[index].out_features)


@torch.library.custom_op("tmbench::module_embed", mutates_args=())
def module_embed(ids: torch.Tensor, index: int) -> torch.Tensor:
    """A quantized embedding table's lookup."""
    return _EMBEDS[index][0](ids)


@module_embed.register_fake
def _(ids, index):
    _, dim, dtype = _EMBEDS[index]
    return torch.empty(*ids.shape, dim, dtype=dtype, device=ids.device)


class OpLinear(nn.Module):
    """Stands in for a quantized projection: one custom op."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.index = len(_LINEARS)
        self.out_features = module.out_features
        _LINEARS.append(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tmbench.module_linear(x, self.index)


class OpEmbedding(nn.Module):
    """Stands in for a quantized embedding table: one custom op."""

    def __init__(self, module: nn.Module, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = len(_EMBEDS)
        _EMBEDS.append((module, dim, dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.tmbench.module_embed(ids, self.index)


class OpBackend:
    """An attention backend whose forward is the paged_attention custom op."""

    name = "tmbench-ops"
    fuses_rotary = False

    def forward(self, q, k, v, kv_cache, meta, scale):  # noqa: ANN001, ANN201 - the backend's
        return torch.ops.tmbench.paged_attention(q, k, v, kv_cache, meta.slot_mapping,
                                                 meta.block_tables, meta.seq_lens,
                                                 meta.query_start_loc, scale)


def _tree_copy(module: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every tensor (so submodules can be swapped in the
    copy while the original keeps running eagerly and in the C++ stack)."""
    clone = copy.copy(module)
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {k: None if m is None else _tree_copy(m) for k, m in module._modules.items()}
    return clone


def op_model(model: nn.Module) -> tuple[nn.Module, int, int]:
    """``model``'s tree with quantized projections and tables as custom ops; also returns how
    many of each it wrapped."""
    from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    clone = _tree_copy(model)
    wrapped = 0
    for sub in list(clone.modules()):
        for child_name, child in list(sub.named_children()):
            if type(child) in (Int8WeightOnlyLinear, Int4WeightOnlyLinear):
                setattr(sub, child_name, OpLinear(child))
                wrapped += 1
    embeds = 0
    if not isinstance(model.model.embed_tokens, nn.Embedding):
        # The original table (the clone's has its int8 matrix swapped for an OpLinear).
        clone.model.embed_tokens = OpEmbedding(model.model.embed_tokens,
                                               model.config.hidden_size,
                                               model.model.norm.weight.dtype)
        embeds = 1
    return clone, wrapped, embeds


# ----------------------------------------------------------------------------- steps


@dataclass
class Step:
    """One step's inputs: ids, positions, metadata for the real backend and for the op one."""

    name: str
    ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    op_meta: object


def make_step(name: str, backend: object, caches: list[torch.Tensor], batch: int,
              query: int, context: int, vocab: int, first_block: int = 1) -> Step:
    """``batch`` sequences each adding ``query`` tokens to a ``context``-token sequence, laid
    out by FlatBatch as the runner lays a step out."""
    from tokenmill.runner.flat_batch import FlatBatch

    flat = FlatBatch(BLOCK)
    per_seq = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(batch * 1000 + query)
    for i in range(batch):
        blocks = list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
        toks = torch.randint(0, vocab, (query,), generator=gen).tolist()
        flat.add(toks, context - query, blocks)
    ids, positions, meta = flat.build(backend, caches, torch.device("cpu"))
    return Step(name, ids, positions, meta, replace(meta, backend=OpBackend()))


def build_steps(backend: object, caches: list[torch.Tensor], vocab: int) -> dict[str, Step]:
    """The three timed steps and two more shapes for the recompile check."""
    # Disjoint blocks: no step rewrites another's context, so every variant's output can be
    # checked against the C++ stack's whenever it runs.
    return {
        "decode_b1": make_step("decode_b1", backend, caches, 1, 1, CONTEXT, vocab, 1),
        "decode_b8": make_step("decode_b8", backend, caches, 8, 1, CONTEXT, vocab, 9),
        "prefill_500": make_step("prefill_500", backend, caches, 1, 500, 500, vocab, 80),
        # Shapes the timed ones do not have: a longer block table, another prompt length.
        "decode_b8_ctx400": make_step("decode_b8_ctx400", backend, caches, 8, 1, 400, vocab,
                                      120),
        "prefill_300": make_step("prefill_300", backend, caches, 1, 300, 300, vocab, 330),
    }


# ----------------------------------------------------------------------------- variants


@dataclass
class Variant:
    """A way to compute a step's hidden states."""

    name: str
    run: Callable[[Step], torch.Tensor]
    compiled: bool = False
    first_calls_s: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    graphs: int = 0
    graph_breaks: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def _decode_ctx(step: Step, marks: StepKindMarks) -> Iterator[None]:
    """Tell the int4 layers the step's kind, as the eager step backend does."""
    marks.mark(step.meta.decode_only)
    yield


def make_variants(model: nn.Module, fused: object, modes: list[str]) -> tuple[list[Variant], dict]:
    """The C++ stack, eager, eager over the custom ops, and the compiled variants."""
    opm, wrapped, embeds = op_model(model)
    info = {"custom_op_linears": wrapped, "custom_op_embeddings": embeds}
    marks = StepKindMarks(nn.ModuleList([model, opm]))

    def cxx(step: Step) -> torch.Tensor:
        return fused.forward(step.ids, step.positions, step.meta)

    def eager(step: Step) -> torch.Tensor:
        step.meta.backend_plan = None  # the runner makes new metadata every step
        with _decode_ctx(step, marks):
            return model(step.ids, step.positions, step.meta)

    def eager_ops(step: Step) -> torch.Tensor:
        with _decode_ctx(step, marks):
            return opm(step.ids, step.positions, step.op_meta)

    variants = [Variant("cxx_stack", cxx), Variant("eager", eager),
                Variant("eager_customops", eager_ops)]
    for mode in modes:
        variants.append(Variant(f"compile_{mode}", _compiled(opm, mode), compiled=True))
    return variants, info


def _compiled(opm: nn.Module, mode: str) -> Callable[[Step], torch.Tensor]:
    kwargs: dict = {"dynamic": True, "fullgraph": False}
    if mode == "default":
        pass
    elif mode == "cpp_wrapper":
        kwargs["options"] = {"cpp_wrapper": True}
    elif mode == "freezing":
        kwargs["options"] = {"freezing": True}
    else:
        kwargs["mode"] = mode
    fn = torch.compile(opm.forward, **kwargs)
    marks = StepKindMarks(opm)

    def run(step: Step) -> torch.Tensor:
        with _decode_ctx(step, marks):
            return fn(step.ids, step.positions, step.op_meta)

    return run


def warm_up(variants: list[Variant], steps: dict[str, Step], ref: dict[str, torch.Tensor],
            log: Callable[[str], None]) -> None:
    """First calls: for compiled variants, the compile of each shape (timed), the graphs and
    breaks Dynamo counted; every variant's output against the C++ stack's."""
    from torch._dynamo.utils import counters

    for v in variants:
        if v.compiled:
            torch._dynamo.reset()
            counters.clear()
        for name in ("decode_b1", "decode_b8", "prefill_500", "decode_b8_ctx400", "prefill_300"):
            step = steps[name]
            t0 = time.perf_counter()
            try:
                out = v.run(step)
            except Exception as e:  # a failed compile is a result here
                v.error = f"{name}: {type(e).__name__}: {str(e)[:300]}"
                log(f"  {v.name}: FAILED at {name}: {v.error}")
                break
            v.first_calls_s[name] = time.perf_counter() - t0
            if name in ref:
                # Largest difference from the C++ stack's output, relative to its largest value.
                v.first_calls_s[f"{name}_reldiff"] = float(
                    (out - ref[name]).abs().max() / ref[name].abs().max())
        if v.compiled:
            v.graphs = int(counters["stats"].get("unique_graphs", 0))
            v.graph_breaks = {str(k)[:160]: int(n) for k, n in counters["graph_break"].items()}
        log(f"  {v.name}: first calls {json.dumps({k: round(s, 4) for k, s in v.first_calls_s.items()})}"
            f" graphs={v.graphs} breaks={sum(v.graph_breaks.values())}")


def time_rounds(variants: list[Variant], steps: dict[str, Step], rounds: int,
                reps: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """Per variant and step, one mean time per round; variants alternate within each round."""
    times: dict[str, dict[str, list[float]]] = {v.name: {s: [] for s in STEPS} for v in variants}
    live = [v for v in variants if v.error is None]
    for _ in range(rounds):
        for s in STEPS:
            for v in live:
                if reps[s] > 1:  # one untimed call: the caches with this variant's code
                    v.run(steps[s])
                t0 = time.perf_counter()
                for _ in range(reps[s]):
                    v.run(steps[s])
                times[v.name][s].append((time.perf_counter() - t0) / reps[s])
    return times


# ----------------------------------------------------------------------------- models


def smollm(quantization: str) -> tuple[str, nn.Module, object, object, list[torch.Tensor], int]:
    """The embedded SmolLM2-135M through LLM(...), as the tests load it."""
    from tokenmill import LLM

    llm = LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=512 << 20,
              max_num_batched_tokens=512, quantization=quantization)
    runner = llm.engine.core.executor.runner
    if runner.cpu_program is None:
        raise RuntimeError("the runner has no C++ stack for this model")
    name = f"smollm2-135m-{quantization}"
    return name, runner.model, runner.cpu_program, runner.backend, runner.kv_caches, llm


def qwen3(layers: int) -> tuple[str, nn.Module, object, object, list[torch.Tensor], None]:
    """Qwen3-0.6B's shapes (q/k norms, head_dim 128) with ``layers`` layers, random weights."""
    from tokenmill.attention.cpu_backend import cpu_attention_backend
    from tokenmill.model_loader.dummy import init_dummy_weights
    from tokenmill.models.config import ArchConfig
    from tokenmill.models.registry import create_model
    from tokenmill.presets import get_preset
    from tokenmill.runner.cpu_program import CpuProgram as FusedDecoder
    from tokenmill.runner.kv_memory import KVCacheShape

    cfg = dict(get_preset("qwen3-0.6b"), num_hidden_layers=layers)
    arch = ArchConfig.from_hf_dict(cfg)
    model = create_model(arch, torch.float32, "cpu")
    init_dummy_weights(model, seed=0)
    model.eval()
    caches = KVCacheShape(layers, BLOCK, arch.num_key_value_heads, arch.head_dim,
                          torch.float32).allocate(400, torch.device("cpu"))
    return (f"qwen3-0.6b-shapes-{layers}layers-fp32", model, FusedDecoder(model),
            cpu_attention_backend(), caches, None)


# ----------------------------------------------------------------------------- report


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for v, per_step in times.items():
        out[v] = {}
        for s, xs in per_step.items():
            if xs:
                out[v][s] = {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs),
                             "max_ms": 1e3 * max(xs), "rounds": len(xs)}
    return out


def table(model_name: str, summary: dict, variants: list[Variant]) -> str:
    base = summary.get("cxx_stack", {})
    lines = [f"\n{model_name}",
             f"{'variant':32s}" + "".join(f"{s + ' ms (min-max)':>30s}" for s in STEPS)
             + f"{'vs C++ (b1/b8/pf)':>22s}"]
    for v in variants:
        row = summary.get(v.name, {})
        cells, ratios = [], []
        for s in STEPS:
            r = row.get(s)
            if r is None:
                cells.append(f"{'failed' if v.error else '-':>30s}")
                ratios.append("-")
                continue
            cells.append(f"{r['median_ms']:>12.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f})".rjust(30))
            b = base.get(s)
            ratios.append(f"{r['median_ms'] / b['median_ms']:.2f}" if b else "-")
        lines.append(f"{v.name:32s}" + "".join(cells) + f"{'/'.join(ratios):>22s}")
    for v in variants:
        if v.compiled:
            fc = {k: round(x, 2) for k, x in v.first_calls_s.items() if not k.endswith("reldiff")}
            lines.append(f"  {v.name}: first-call s {fc}, graphs {v.graphs}, "
                         f"graph breaks {sum(v.graph_breaks.values())}"
                         + (f", ERROR {v.error}" if v.error else ""))
    return "\n".join(lines)


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                  if ln.startswith("Model name")), platform.processor())
    flags = next((ln for ln in lscpu.splitlines() if ln.startswith("Flags")), "")
    return {"cpu": model, "avx512": "avx512f" in flags, "amx": "amx_tile" in flags,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def write_markdown(path: Path, result: dict, tables: list[str]) -> None:
    """The note beside the JSON: command, CPU, load, the tables (conclusions are added by hand
    under them)."""
    m = result["machine"]
    lines = ["# CPU fast path: C++ layer stack vs torch.compile (issue 56 item 4)", "",
             f"Command: `{result['command']}`", "",
             f"CPU: {m['cpu']} (lscpu model name), torch {m['torch']}, {m['threads']} torch "
             f"threads, OMP_NUM_THREADS={m['OMP_NUM_THREADS']}.", "",
             f"Load (uptime) at start: `{result['uptime_start']}`; at end: "
             f"`{result.get('uptime_end', '-')}`.", "",
             f"Decode rows have {result['context_tokens']}-token contexts; "
             f"{result['rounds']} rounds, variants alternated within each round; times are "
             "the model's forward (hidden states, no logits), median (min-max) over rounds.",
             "", "```", *"\n".join(tables).strip().splitlines(), "```", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm-none,smollm-auto,qwen3",
                   help="comma list of smollm-none, smollm-auto, qwen3")
    p.add_argument("--modes", default="default,cpp_wrapper,max-autotune-no-cudagraphs",
                   help="compiled variants: default, cpp_wrapper, freezing, or a torch.compile mode")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (inductor bakes the count into its kernels)")
    p.add_argument("--decode-reps", type=int, default=5, help="decode calls timed per round")
    p.add_argument("--qwen3-layers", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "cpu-fast-path-choice-cpu.json"))
    p.add_argument("--append", action="store_true",
                   help="add this run's models to the JSON already at --out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    # No duck shapes: a decode step of 8 rows over 8-block tables would tie both sizes to one
    # symbol, and every other context length would recompile.
    torch.fx.experimental._config.use_duck_shape = False
    reps = {"decode_b1": args.decode_reps, "decode_b8": args.decode_reps, "prefill_500": 1}
    result = {"command": f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} python "
              + " ".join(sys.argv),
              "machine": machine(), "uptime_start": uptime(), "context_tokens": CONTEXT,
              "rounds": args.rounds, "reps_per_round": reps, "models": {}}
    out = Path(args.out)
    if args.append and out.exists():
        prev = json.loads(out.read_text())
        result["command"] = f"{prev['command']} && {result['command']}"
        result["uptime_start"] = f"{prev['uptime_start']}; {result['uptime_start']}"
        result["models"] = prev["models"]
    log = lambda s: print(s, flush=True)  # noqa: E731
    tables = [m["table"] for m in result["models"].values()]
    for spec in args.models.split(","):
        t0 = time.perf_counter()
        if spec.startswith("smollm"):
            name, model, fused, backend, caches, keep = smollm(spec.split("-", 1)[1])
        else:
            name, model, fused, backend, caches, keep = qwen3(args.qwen3_layers)
        _EXT[:] = [backend._ext]
        log(f"{name}: loaded in {time.perf_counter() - t0:.1f} s; {uptime()}")
        steps = build_steps(backend, caches, model.config.vocab_size)
        with torch.inference_mode():
            ref = {s: fused.forward(steps[s].ids, steps[s].positions, steps[s].meta).clone()
                   for s in ("decode_b1", "decode_b8", "prefill_500")}
            variants, info = make_variants(model, fused, args.modes.split(","))
            warm_up(variants, steps, ref, log)
            times = time_rounds(variants, steps, args.rounds, reps)
        summary = summarize(times)
        tables.append(table(name, summary, variants))
        log(tables[-1])
        result["models"][name] = {
            **info, "uptime_after": uptime(), "threads": args.threads, "table": tables[-1], "summary": summary, "raw_ms": {
                v: {s: [1e3 * x for x in xs] for s, xs in d.items()} for v, d in times.items()},
            "variants": {v.name: {"first_calls_s": v.first_calls_s, "error": v.error,
                                  "graphs": v.graphs, "graph_breaks": v.graph_breaks}
                         for v in variants}}
        del keep, model, fused, variants
        _LINEARS.clear()
        _EMBEDS.clear()
        torch._dynamo.reset()
        out.write_text(json.dumps(result, indent=1))  # each model as it finishes
    result["uptime_end"] = uptime()
    out.write_text(json.dumps(result, indent=1))
    write_markdown(out.with_suffix(".md"), result, tables)
    print("\n".join(tables))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
