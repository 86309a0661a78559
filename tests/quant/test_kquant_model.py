"""A GGUF model of K-quant tensors (written here) keeps each tensor's own type under
quantization="auto": its layers hold the file's bytes, compute what the float model computes
within the activations' rounding, and the CPU op program generates what model.forward does. A
type without a kernel is refused by name; int8 still requantizes on request."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from kquant_helpers import QUANTIZABLE, make_blocks
from quant_helpers import PagedKVCache, logits_of

from tokenmill.model_loader import resolve_quantization
from tokenmill.model_loader.gguf import GGUFModel, load_gguf
from tokenmill.model_loader.gguf_quantized import load_gguf_quantized
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class
from tokenmill.quant import Int8WeightOnlyLinear, quantize_model
from tokenmill.quant.kquant import KQuantLinear
from tokenmill.quant.model import KEEP_GGUF_TYPES, decode_read_bytes
from tokenmill.runner.cpu_program import CpuProgram

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 384
# A Q4_K_M-like mix, every kernel type of a super-block among the layers.
LAYER_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q3_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
               "ffn_gate": Q.Q2_K, "ffn_up": Q.IQ4_XS, "ffn_down": Q.Q8_0}


def layer_shapes(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """Each layer tensor's [out, in] for HEADS / KV_HEADS heads."""
    kv = KV_HEADS * hidden // HEADS
    return {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
            "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn)}

HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def write_kquant_gguf(path: Path, types: dict[str, Q], hidden: int = HIDDEN,
                      ffn: int = FFN) -> int:
    """A one-layer llama GGUF with the layers in ``types``; returns the layers' bytes."""
    shapes = layer_shapes(hidden, ffn)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("add_block_count", 1), ("add_context_length", 256),
                       ("add_embedding_length", hidden), ("add_feed_forward_length", ffn),
                       ("add_head_count", HEADS), ("add_head_count_kv", KV_HEADS),
                       ("add_layer_norm_rms_eps", 1e-5)]:
        getattr(writer, key)(value)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(
        rng.standard_normal((VOCAB, hidden)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    layer_bytes = 0
    for i, (name, qtype) in enumerate(types.items()):
        rows, cols = shapes[name]
        blocks = make_blocks(qtype, rows, cols, seed=10 + i,
                             scale=1.0 if qtype in QUANTIZABLE else 0.03)
        writer.add_tensor(f"blk.0.{name}.weight", blocks, raw_dtype=qtype)
        layer_bytes += blocks.nbytes
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        writer.add_tensor(name, norm, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return layer_bytes


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFModel, int]:
    path = tmp_path_factory.mktemp("kquant") / "mix.gguf"
    layer_bytes = write_kquant_gguf(path, LAYER_TYPES)
    return load_gguf(str(path)), layer_bytes


def _load(file: GGUFModel, method: str) -> torch.nn.Module:
    arch = ArchConfig.from_hf_dict(file.hf_config)
    model = get_model_class([arch.architecture])(arch).eval()
    if method == "none":
        model.load_weights(file.tensors())
    else:
        load_gguf_quantized(model, file, method)
        quantize_model(model, method)
    return model


def test_auto_keeps_the_files_types_at_the_files_bytes(kquant_file) -> None:
    file, layer_bytes = kquant_file
    assert resolve_quantization("auto", file, torch.device("cpu")) == KEEP_GGUF_TYPES
    model = _load(file, KEEP_GGUF_TYPES)
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, KQuantLinear) and qkv.type_names() == ["Q4_K", "Q3_K", "Q6_K"]
    assert gate_up.type_names() == ["Q2_K", "IQ4_XS"]
    assert layer.self_attn.o_proj.type_names() == ["Q5_K"]
    assert layer.mlp.down_proj.type_names() == ["Q8_0"]
    kept = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    # the file's bytes, once: no float or requantized copy of any layer
    assert sum(m.weight.nbytes for m in kept) == layer_bytes
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    file_bytes = sum(np.asarray(t.data).nbytes for t in file._header.tensors)
    assert decode_read_bytes(model) <= 1.05 * file_bytes


def test_logits_match_the_float_model(kquant_file) -> None:
    file, _ = kquant_file
    ids = [3, 17, 250, 9, 81, 44, 5]
    kept = logits_of(_load(file, KEEP_GGUF_TYPES), ids)
    ref = logits_of(_load(file, "none"), ids)
    # int8 activations and bf16 rounding between layers, as the int8 / int4 layers have
    rel = (kept - ref).norm() / ref.norm()
    assert rel < 0.02, rel
    assert (kept.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def _greedy(model: torch.nn.Module, arch: ArchConfig, step, prompt: list[int],
            n: int, program: CpuProgram | None = None) -> tuple[list[int], torch.Tensor]:
    cache = PagedKVCache.for_arch(arch, num_blocks=16)
    out: list[int] = []
    logits = []
    ids = torch.tensor(prompt)
    for _ in range(n):
        meta, pos = cache.step([(0, len(ids))])
        assert program is None or program.supports(ids, meta)
        with torch.inference_mode():
            hidden = step(ids, pos, meta)
            logits.append(model.compute_logits(hidden[-1:]))
        out.append(int(logits[-1].argmax(-1)))
        ids = torch.tensor([out[-1]])
    return out, torch.cat(logits)


def test_greedy_eager_equals_the_op_program(kquant_file) -> None:
    file, _ = kquant_file
    model = _load(file, KEEP_GGUF_TYPES)
    arch = ArchConfig.from_hf_dict(file.hf_config)
    program = CpuProgram(model)
    # a prompt past the dense cut-over (its rows dequantize), then decode steps on the kernels
    prompt = list(range(7, 7 + 60))
    eager, eager_logits = _greedy(model, arch, model, prompt, 8)
    got, got_logits = _greedy(model, arch, program.forward, prompt, 8, program)
    assert got == eager
    # the glue around the projections rounds as for the int8 / int4 layers (bf16 between them)
    scale = eager_logits.abs().max().item()
    torch.testing.assert_close(got_logits, eager_logits, rtol=0, atol=0.01 * scale)


def test_a_type_without_kernel_is_refused_by_name(tmp_path: Path) -> None:
    types = dict(LAYER_TYPES, ffn_up=Q.IQ2_XS)
    path = tmp_path / "iq2.gguf"
    write_kquant_gguf(path, types)
    file = load_gguf(str(path))
    with pytest.raises(ValueError, match=r"ffn_up|up_proj") as err:
        _load(file, KEEP_GGUF_TYPES)
    assert "IQ2_XS" in str(err.value) and "Q4_K" in str(err.value)
    assert "quantization 'none'" in str(err.value)


def test_int8_still_requantizes_on_request(kquant_file) -> None:
    file, _ = kquant_file
    model = _load(file, "int8")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int8WeightOnlyLinear)
    assert not any(isinstance(m, KQuantLinear) for m in model.modules())


RSS_SCRIPT = """
import gc, sys
import torch
from tokenmill.kernels.cpu import load_extension
from tokenmill.model_loader.gguf import load_gguf
from tokenmill.model_loader.gguf_quantized import load_gguf_quantized
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import create_model
from tokenmill.utils import release_freed_memory

def rss():  # anonymous memory: the file's own pages, mapped and reclaimable, are not a copy
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024

load_extension()
file = load_gguf(sys.argv[1])
arch = ArchConfig.from_hf_dict(file.hf_config)
gc.collect(); release_freed_memory()
before = rss()
model = create_model(arch, torch.float32, "cpu")  # as load_model builds it
load_gguf_quantized(model, file, "gguf")
del file
gc.collect(); release_freed_memory()
print(rss() - before)
"""


def test_rss_after_loading_is_the_files_bytes(tmp_path: Path) -> None:
    """In a process of its own: the layers' blocks are the only copy in memory (no float
    layer was ever filled in, no temporary left behind)."""
    import subprocess
    import sys

    # a layer large enough that a copy would show: a 2048 x 8192 MLP, ~35 MB of blocks
    layer_bytes = write_kquant_gguf(tmp_path / "big.gguf",
                                    dict.fromkeys(layer_shapes(1, 1), Q.Q4_K), 2048, 8192)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "big.gguf")],
                         capture_output=True, text=True, check=True)
    grown = int(out.stdout.strip().splitlines()[-1])
    # the blocks, plus the norms, the (small) embedding table and the rotary tables
    assert layer_bytes * 0.95 < grown < layer_bytes * 1.05 + 8 * 2**20, (grown, layer_bytes)
