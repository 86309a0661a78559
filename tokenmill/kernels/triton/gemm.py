"""A Triton matmul for the linear layers, and the per-GPU choice between it and cuBLAS.

Two products run through the same kernel, each with its own rules:

- **fp8** (``Fp8Linear``): e4m3 operands with row-wise scales, in place of
  ``torch._scaled_mm``. At decode batch sizes cuBLAS runs an 8B dense model's fp8 linears with
  128 x 128 tiles: at 256 tokens a 4,096-wide output is 2 x 32 = 64 tiles, one program each,
  on a GPU of 132 SMs (the H200's profile at batch 256 had them at 4.2 ms of a 14.8 ms step,
  about half of the tensor cores' rate). A tile shape chosen by batch size and matrix shape,
  as vLLM's CUTLASS fp8 kernels dispatch by M, can fill the GPU where a 128-row one leaves
  half of it idle.
- **16-bit** (bf16/fp16 ``Linear``): in place of ``F.linear`` for a few rows. A batch-1
  decode step is the weights read once, and cuBLAS's products read an 8B dense model's 15 GB at
  91% of the H200's copy bandwidth (3.90 ms of a 4.81 ms step); a 16-row tile with narrow
  columns (the rows padded, the tensor cores idle anyway) gives every SM many programs to
  keep the reads in flight.

Which implementation and tile serve a product is the GPU's tuning file's call
(``tokenmill/kernels/tuning/gemm/<gpu>.json``, written by ``benchmarks/gpu/gemm_bw.py
--write-tuning``; ``$TOKENMILL_GEMM_TUNING`` names another file):

    {"device": "NVIDIA H200",
     "fp8_gemm": [{"max_m": 64, "n": 4096, "k": 14336, "block_m": 64, "block_n": 64,
                   "block_k": 128, "num_warps": 4, "num_stages": 4},
                  {"max_m": 512, "block_m": 128, "block_n": 64, ...},
                  {"max_m": null, "impl": "cublas"}],
     "gemm": [{"max_m": 1, "block_m": 16, "block_n": 32, "block_k": 256, ...}]}

A product of M rows by an ``[N, K]`` weight takes the first rule of its list whose ``max_m``
is at least M (null: any) and whose ``n`` and ``k`` (optional, null: any) match; with no rule
that matches, or without a file, cuBLAS computes it, as before this module existed.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fused_ops import silu_mul_values
from tokenmill.kernels.triton.pdl import launch_options, pdl_start, prefetch_l2, prefetch_lines
from tokenmill.kernels.tuning.decode_attention import read_json, tuned_file
from tokenmill.utils import optional_positive_ints

ENV_FILE = "TOKENMILL_GEMM_TUNING"
TUNED_DIR = Path(__file__).parent.parent / "tuning" / "gemm"
IMPLS = ("triton", "cublas")
# The file's rule lists: fp8 products, 16-bit ones.
LISTS = ("fp8_gemm", "gemm")


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                   res_ptr, sum_ptr, norm_w_ptr, eps, M, N, K,
                   stride_am, stride_bn, stride_cm, stride_res, stride_sum,
                   HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                   NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PDL: tl.constexpr = False,
                   PREFETCH_LINES: tl.constexpr = 0):
    """One program per ``[BLOCK_M, BLOCK_N]`` tile of ``c = a @ b.T`` (HAS_SCALES: times
    ``scale_a`` per row and ``scale_b`` per column; HAS_BIAS: plus ``bias``): a ``[M, K]`` and
    b ``[N, K]`` with K contiguous in both (so both operands are K-major, as Hopper's fp8
    tensor cores want them), fp32 accumulation, c in its dtype. With SILU_MUL, a is a gated
    MLP's ``[M, 2K]`` gate and up halves, and the product's left operand is
    ``silu(gate) * up``, computed as each tile of it is loaded (the SiLU-and-mul kernel's
    arithmetic, so no kernel of its own writes it first).

    With NORM, the left operand is ``rms_norm(s) * norm_w``, where ``s`` is ``a``, or with
    HAS_RESIDUAL ``a + res`` rounded to a's dtype (as the eager add rounds it; the programs of
    the first column tile write it to ``sum``). A row's RMS needs all of its K columns, so the
    loop multiplies each loaded tile by the norm's weight only, sums the squares of ``s`` as
    it goes, and scales the row's accumulator by ``1 / rms`` at the end: the same product,
    with the per-row factor applied after the dot instead of before it (rounded at a
    different point, as the matmul's own order of additions already differs from cuBLAS's).

    Programs are ordered in groups of GROUP_M row tiles, so that the programs running together
    share the columns of b they read (through L2).

    With PREFETCH_LINES (programmatic dependent launch, tokenmill/kernels/triton/pdl.py), a program first asks
    L2 for that many 128-byte lines of each of its rows of b, then waits for the kernel before
    it: b is a weight, which no kernel writes."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if PREFETCH_LINES > 0:
        per_line: tl.constexpr = 128 * 8 // b_ptr.dtype.element_ty.primitive_bitwidth
        line_ks = tl.arange(0, PREFETCH_LINES) * per_line
        prefetch_l2(b_ptr + cols[:, None].to(tl.int64) * stride_bn + line_ks[None, :],
                    col_ok[:, None] & (line_ks < K)[None, :])
    pdl_start(PDL)

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_res + ks[None, :]
        if HAS_RESIDUAL and tile_n == 0:
            # The first column tile's programs write the sum, in a pass of their own (in the
            # product's loop, the store would keep a second copy of every tile live).
            sum_ptrs = sum_ptr + rows[:, None].to(tl.int64) * stride_sum + ks[None, :]
            for k0 in range(0, K, BLOCK_K):
                k_mask = row_ok[:, None] & (k0 + ks < K)[None, :]
                x = tl.load(a_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
                x += tl.load(res_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
                tl.store(sum_ptrs + k0, x.to(a_ptr.dtype.element_ty), mask=k_mask)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if SILU_MUL:
            up = tl.load(a_ptrs + K, mask=a_mask, other=0.0)
            a = silu_mul_values(a, up, a_ptr.dtype.element_ty)
        if NORM:
            if HAS_RESIDUAL:
                res = tl.load(res_ptrs, mask=a_mask, other=0.0)
                a = (a.to(tl.float32) + res.to(tl.float32)).to(a_ptr.dtype.element_ty)
                res_ptrs += BLOCK_K
            a32 = a.to(tl.float32)
            squares += tl.sum(a32 * a32, axis=1)
            w = tl.load(norm_w_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (a32 * w[None, :]).to(a_ptr.dtype.element_ty)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if NORM:
        acc = acc * (1.0 / tl.sqrt(squares / K + eps))[:, None]
    if HAS_SCALES:
        scale_a = tl.load(scale_a_ptr + rows, mask=row_ok, other=0.0)
        scale_b = tl.load(scale_b_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * scale_a[:, None] * scale_b[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemmTile:
    """The Triton kernel's launch: tile rows, columns and depth, row tiles a group, warps
    and software-pipelining depth."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"group_m must be a positive integer, got {self.group_m!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be 1..8, got {self.num_stages!r}")


@dataclass(frozen=True)
class GemmRule:
    """Products of at most ``max_m`` rows (None: any) by a weight of ``n`` x ``k`` (None:
    any) run ``tile`` in Triton, or cuBLAS where ``tile`` is None."""

    max_m: int | None
    tile: GemmTile | None
    n: int | None = None
    k: int | None = None

    def applies(self, m: int, n: int, k: int) -> bool:
        return ((self.max_m is None or m <= self.max_m) and self.n in (None, n)
                and self.k in (None, k))


@dataclass(frozen=True)
class GemmTuning:
    """The rules of a GPU model for fp8 products and for 16-bit ones, each list matched in
    order; none: every product goes to cuBLAS."""

    fp8_rules: tuple[GemmRule, ...] = ()
    rules: tuple[GemmRule, ...] = ()
    source: str = "defaults"
    # Each shape's pick, kept: an eager step asks once a linear layer (~130 times for 8B).
    _picked: dict[tuple[int, int, int, bool], GemmTile | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def tile_for(self, m: int, n: int, k: int, fp8: bool = False) -> GemmTile | None:
        """The Triton launch for an ``[m, k] x [n, k]^T`` product (in fp8, or 16-bit), or
        None for cuBLAS."""
        key = (m, n, k, fp8)
        if key not in self._picked:
            rules = self.fp8_rules if fp8 else self.rules
            self._picked[key] = next((rule.tile for rule in rules if rule.applies(m, n, k)),
                                     None)
        return self._picked[key]


def parse_tuning(data: Any, source: str) -> GemmTuning:
    """A tuning from a file's JSON; ValueError naming ``source`` and the entry."""
    if not isinstance(data, dict) or not any(data.get(name) for name in LISTS):
        raise ValueError(f"{source}: expected an object with a non-empty list "
                         f"{' or '.join(repr(name) for name in LISTS)}")
    fp8_rules, rules = (_parse_rules(data.get(name) or [], f"{source}: {name}")
                        for name in LISTS)
    return GemmTuning(fp8_rules, rules, source)


def _parse_rules(entries: Any, at_list: str) -> tuple[GemmRule, ...]:
    if not isinstance(entries, list):
        raise ValueError(f"{at_list} must be a list")
    names = {f.name for f in fields(GemmTile)}
    rules = []
    for i, entry in enumerate(entries):
        at = f"{at_list}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        bounds = optional_positive_ints(entry, ("max_m", "n", "k"), at)
        impl = entry.get("impl", "triton")
        if impl not in IMPLS:
            raise ValueError(f"{at}: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        try:
            tile = (GemmTile(**{k: v for k, v in entry.items() if k in names})
                    if impl == "triton" else None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{at}: {e}") from None
        rules.append(GemmRule(bounds["max_m"], tile, bounds["n"], bounds["k"]))
    return tuple(rules)


def load_tuning(path: str | os.PathLike[str]) -> GemmTuning:
    return parse_tuning(read_json(path), str(path))


@functools.cache
def tuning_for_device(device_name: str) -> GemmTuning:
    """The tuning of a GPU model: ``$TOKENMILL_GEMM_TUNING`` if set, else the shipped file of
    ``device_name``, else none (cuBLAS for every product)."""
    path = tuned_file(ENV_FILE, TUNED_DIR, device_name)
    return GemmTuning() if path is None else load_tuning(path)


@dataclass(frozen=True)
class NormPrologue:
    """An RMSNorm computed in the matmul's kernel on its left operand ``a``: the product is
    ``F.linear(rms_norm(a + residual) * weight, b, bias)``, and with ``residual`` the sum
    ``a + residual`` (rounded to a's dtype) is written to ``sum_out``, the residual stream a
    decoder layer carries on. Without ``residual`` the norm is of ``a`` itself."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None


def scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype,
              tile: GemmTile) -> torch.Tensor:
    """``(a @ b.T) * scale_a * scale_b (+ bias)`` in ``out_dtype``, as ``torch._scaled_mm``
    computes it with row-wise scales: ``a`` ``[M, K]`` and ``b`` ``[N, K]`` in e4m3 with
    contiguous rows, ``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]``, ``bias`` ``[N]``."""
    return _launch(a, b, (scale_a.reshape(-1), scale_b.reshape(-1)), bias, out_dtype, tile,
                   "scaled_mm")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
           tile: GemmTile, silu_mul: bool = False,
           norm: NormPrologue | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in a's dtype, as ``F.linear(a, b, bias)``: ``a`` ``[M, K]`` and
    ``b`` ``[N, K]`` with contiguous rows, ``bias`` ``[N]``. With ``silu_mul``, ``a`` is
    ``[M, 2K]``, a gated MLP's gate and up halves, and the product is
    ``F.linear(silu_and_mul(a), b, bias)``. With ``norm``, the product is of ``a`` normed
    first (:class:`NormPrologue`)."""
    if a.dtype != b.dtype:
        raise ValueError(f"matmul takes a and b of one dtype, got {a.dtype} and {b.dtype}")
    if norm is not None:
        if silu_mul:
            raise ValueError("matmul takes a SiLU prologue or a norm prologue, not both")
        _check_norm(a, norm)
    return _launch(a, b, None, bias, a.dtype, tile, "matmul", silu_mul, norm)


def _check_norm(a: torch.Tensor, norm: NormPrologue) -> None:
    k = a.shape[1]
    if norm.weight.shape != (k,) or not norm.weight.is_contiguous():
        raise ValueError(f"the norm's weight must be a contiguous [{k}], "
                         f"got {tuple(norm.weight.shape)}")
    if (norm.residual is None) != (norm.sum_out is None):
        raise ValueError("a norm prologue takes both a residual and sum_out, or neither")
    for name in ("residual", "sum_out"):
        t = getattr(norm, name)
        if t is not None and (t.shape != a.shape or t.dtype != a.dtype or t.stride(1) != 1):
            raise ValueError(f"the norm's {name} must be {tuple(a.shape)} {a.dtype} with "
                             f"contiguous rows, got {tuple(t.shape)} {t.dtype} strides "
                             f"{t.stride()}")
    if norm.sum_out is not None and norm.sum_out.data_ptr() in (a.data_ptr(),
                                                                norm.residual.data_ptr()):
        # Every column tile reads a and the residual while the first one writes the sum.
        raise ValueError("the norm's sum_out must not be a or the residual")


def _launch(a: torch.Tensor, b: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
            bias: torch.Tensor | None, out_dtype: torch.dtype, tile: GemmTile,
            name: str, silu_mul: bool = False, norm: NormPrologue | None = None
            ) -> torch.Tensor:
    m = a.shape[0]
    n, k = b.shape
    width = 2 * k if silu_mul else k
    if a.shape[1] != width or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"{name} takes a [M, {'2K' if silu_mul else 'K'}] and b [N, K] with "
                         f"contiguous rows, got {tuple(a.shape)} strides {a.stride()} and "
                         f"{tuple(b.shape)} strides {b.stride()}")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    scale_a, scale_b = (c, c) if scales is None else scales  # (unread without scales)
    residual = sum_out = norm_w = c  # (unread without a norm prologue)
    eps = 0.0
    if norm is not None:
        norm_w, eps = norm.weight, norm.eps
        if norm.residual is not None:
            residual, sum_out = norm.residual, norm.sum_out
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _matmul_kernel[grid](
        a, b, c, scale_a, scale_b, c if bias is None else bias, residual, sum_out, norm_w, eps,
        m, n, k, a.stride(0), b.stride(0), c.stride(0), residual.stride(0), sum_out.stride(0),
        HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        NORM=norm is not None, HAS_RESIDUAL=norm is not None and norm.residual is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        PREFETCH_LINES=prefetch_lines(a.device, tile.block_n, k * b.element_size()),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(a.device))
    return c
