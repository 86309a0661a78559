"""Triton matmuls over GGUF's quantized blocks as the file stores them: Q4_K, Q5_K, Q6_K, Q8_0,
and the 32-element types that K-quant files mix in (Q4_0, Q4_1, Q5_0, Q5_1).

``kquant_matmul(x, w, qtype)`` computes ``x @ W.T`` for ``x`` ``[T, K]`` (fp16, bf16 or fp32)
and a weight kept as a uint8 tensor ``[N, K / QK * block_bytes]``: one row of the weight is
its GGUF blocks back to back, exactly the file's bytes (the layout of
``tokenmill/quant/kquant.py``), so loading needs no repacking and the weight takes the file's
memory. Each program dequantizes one super-block of its ``BLOCK_N`` rows in registers per step
(no dequantized copy of the weight is ever written) and multiplies it with the activations on
the tensor cores in the activations' dtype, accumulating in fp32.

The block layouts (ggml-common.h; d and dmin are fp16, QK_K = 256):

- Q4_K, 144 bytes: d, dmin, scales[12] (eight 6-bit sub-block scales and mins), qs[128]
  (4-bit; byte ``32j + l`` holds element ``64j + l`` low and ``64j + 32 + l`` high);
  ``w = d * sc * q - dmin * m``.
- Q5_K, 176 bytes: d, dmin, scales[12], qh[32] (bit ``k // 32`` of byte ``k % 32`` is the fifth
  bit of element k), qs[128] as Q4_K.
- Q6_K, 210 bytes: ql[128], qh[64], scales[16] (int8, one per 16 elements), d;
  ``w = d * sc * (q - 32)`` with q six bits from ql and qh.
- Q8_0, 34 bytes per 32 elements: d, qs[32] (int8); ``w = d * q``.
- Q4_0 / Q4_1, 18 / 20 bytes per 32: d (and m), qs[16] (element l low, l + 16 high);
  Q5_0 / Q5_1, 22 / 24 bytes: d (and m), qh[4] (bit e: element e's fifth bit), qs[16];
  ``w = d * (q - 8)``, ``d * (q - 16)``, or ``d * q + m`` for the _1 types. A Q4_K_M file keeps
  the tensors whose rows are not a multiple of 256 in these (SmolLM2's 576-wide projections are
  Q5_0 in its Q4_K_M file).

Every fp16 scale sits at an even byte offset of an even-sized row, so the kernel reads them
through a float16 view of the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class KQuantType:
    """A GGUF block type this module multiplies: ggml's type id, elements and bytes a block."""

    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int


# ggml's type ids (gguf.GGMLQuantizationType) of the types with a kernel here.
KQUANT_TYPES: dict[str, KQuantType] = {t.name: t for t in (
    KQuantType("Q4_0", 2, 32, 18),
    KQuantType("Q4_1", 3, 32, 20),
    KQuantType("Q5_0", 6, 32, 22),
    KQuantType("Q5_1", 7, 32, 24),
    KQuantType("Q8_0", 8, 32, 34),
    KQuantType("Q4_K", 12, 256, 144),
    KQuantType("Q5_K", 13, 256, 176),
    KQuantType("Q6_K", 14, 256, 210),
)}
_KERNEL_CODE = {"Q8_0": 0, "Q4_K": 1, "Q5_K": 2, "Q6_K": 3, "Q4_0": 4, "Q4_1": 5, "Q5_0": 6,
                "Q5_1": 7}


def kquant_type(qtype: str | int) -> KQuantType:
    """The :class:`KQuantType` for a name ("Q4_K") or a ggml type id (``GGMLQuantizationType``);
    ValueError naming the supported types otherwise."""
    for t in KQUANT_TYPES.values():
        if qtype == t.name or (isinstance(qtype, int) and qtype == t.ggml_type):
            return t
    name = getattr(qtype, "name", qtype)
    if isinstance(qtype, int):
        from gguf import GGMLQuantizationType  # only to name the type in the message

        try:
            name = GGMLQuantizationType(qtype).name
        except ValueError:
            name = f"id {qtype}"
    raise ValueError(f"GGUF type {name} has no Triton kernel; supported: "
                     f"{', '.join(KQUANT_TYPES)}")


@triton.jit
def _signed8(b):
    """A uint8 value (as int32) read as int8."""
    return tl.where(b >= 128, b - 256, b)


@triton.jit
def _k4_scale_min(base, w_ptr, sub, SCALES: tl.constexpr):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block ``sub`` (ggml's get_scale_min_k4)."""
    s_sub = tl.load(w_ptr + base + SCALES + sub).to(tl.int32)
    s_p4 = tl.load(w_ptr + base + SCALES + sub + 4).to(tl.int32)
    s_m4 = tl.load(w_ptr + base + SCALES + tl.maximum(sub - 4, 0)).to(tl.int32)
    low = sub < 4
    sc = tl.where(low, s_sub & 63, (s_p4 & 15) | ((s_m4 >> 6) << 4))
    mn = tl.where(low, s_p4 & 63, (s_p4 >> 4) | ((s_sub >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_legacy(w_ptr, wh_ptr, base, k, QTYPE: tl.constexpr):
    """Q4_0 (4), Q4_1 (5), Q5_0 (6), Q5_1 (7): blocks of 32 with an fp16 d (and m)."""
    HAS_MIN: tl.constexpr = QTYPE % 2 == 1
    FIVE: tl.constexpr = QTYPE >= 6
    QS: tl.constexpr = 2 + 2 * HAS_MIN + 4 * FIVE
    qs = tl.load(w_ptr + base + QS + k % 16).to(tl.int32)
    q = tl.where(k >= 16, qs >> 4, qs & 15)
    if FIVE:
        qh = tl.load(w_ptr + base + 2 + 2 * HAS_MIN + k // 8).to(tl.int32)
        q |= ((qh >> (k % 8)) & 1) << 4
    d = tl.load(wh_ptr + base // 2).to(tl.float32)
    if HAS_MIN:
        return d * q.to(tl.float32) + tl.load(wh_ptr + base // 2 + 1).to(tl.float32)
    else:
        return d * (q - (16 if FIVE else 8)).to(tl.float32)


@triton.jit
def _dequant_block(w_ptr, wh_ptr, base, k, QTYPE: tl.constexpr):
    """fp32 values of elements ``k`` (``[1, QK]``) of the blocks starting at byte ``base``
    (``[BLOCK_N, 1]``), one block per row."""
    if QTYPE == 0:  # Q8_0
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        q = _signed8(tl.load(w_ptr + base + 2 + k).to(tl.int32))
        return d * q.to(tl.float32)
    elif QTYPE >= 4:
        return _dequant_legacy(w_ptr, wh_ptr, base, k, QTYPE)
    elif QTYPE == 3:  # Q6_K
        half = k // 128
        g = (k % 128) // 32
        lane = k % 32
        ql = tl.load(w_ptr + base + 64 * half + lane + 32 * (g % 2)).to(tl.int32)
        qh = tl.load(w_ptr + base + 128 + 32 * half + lane).to(tl.int32)
        q = (tl.where(g >= 2, ql >> 4, ql & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
        sc = _signed8(tl.load(w_ptr + base + 192 + 8 * half + lane // 16 + 2 * g).to(tl.int32))
        d = tl.load(wh_ptr + (base + 208) // 2).to(tl.float32)
        return d * (sc * q).to(tl.float32)
    else:  # Q4_K, Q5_K
        sub = k // 32
        lane = k % 32
        QS: tl.constexpr = 16 if QTYPE == 1 else 48
        qs = tl.load(w_ptr + base + QS + 32 * (k // 64) + lane).to(tl.int32)
        q = tl.where(sub % 2 == 1, qs >> 4, qs & 15)
        if QTYPE == 2:
            qh = tl.load(w_ptr + base + 16 + lane).to(tl.int32)
            q += ((qh >> sub) & 1) << 4
        sc, mn = _k4_scale_min(base, w_ptr, sub, 4)
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        dmin = tl.load(wh_ptr + base // 2 + 1).to(tl.float32)
        return d * sc * q.to(tl.float32) - dmin * mn


@triton.jit
def _kquant_matmul_kernel(x_ptr, w_ptr, wh_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                          row_bytes, QTYPE: tl.constexpr, QK: tl.constexpr,
                          BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One program per ``[BLOCK_M, BLOCK_N]`` tile of ``out = x @ W.T``: each step reads one
    block (QK elements) of every row of the tile, dequantizes it and multiplies."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, QK)
    mask_m = rows_m < M
    # Rows past N read row 0's bytes (always in bounds) and are masked at the store.
    row_base = tl.where(rows_n < N, rows_n, 0).to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // QK):
        x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * stride_xm + kb * QK + k[None, :],
                    mask=mask_m[:, None], other=0.0)
        w = _dequant_block(w_ptr, wh_ptr, row_base + kb * BLOCK_BYTES, k[None, :], QTYPE)
        if IEEE:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = out_ptr + rows_m[:, None].to(tl.int64) * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (rows_n[None, :] < N))


def check_kquant_weight(w: torch.Tensor, k: int, qtype: str | int) -> KQuantType:
    """The weight's type after checking that ``w`` is a contiguous uint8 ``[N, row_bytes]``
    holding ``k`` columns of ``qtype`` blocks; ValueError naming what is wrong otherwise."""
    t = kquant_type(qtype)
    if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"a {t.name} weight must be a contiguous 2-D uint8 tensor, got "
                         f"{w.dtype} of shape {tuple(w.shape)}")
    if k % t.block_elems:
        raise ValueError(f"K={k} is not a multiple of {t.name}'s {t.block_elems}-element block")
    row_bytes = k // t.block_elems * t.block_bytes
    if w.shape[1] != row_bytes:
        raise ValueError(f"a {t.name} weight of K={k} has {row_bytes} bytes a row, got "
                         f"{w.shape[1]}")
    return t


def kquant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str | int, block_m: int = 16,
                  block_n: int = 32, num_warps: int = 4) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[..., K]`` and ``W`` held as GGUF ``qtype`` blocks in ``w``
    (uint8 ``[N, K / QK * block_bytes]``, the file's bytes); the result has x's dtype.
    ValueError for a type without a kernel or a weight whose bytes do not fit K."""
    k = x.shape[-1]
    t = check_kquant_weight(w, k, qtype)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _kquant_matmul_kernel[grid](
            x2, w, w.view(torch.float16), out, m, n, k, x2.stride(0), out.stride(0),
            w.shape[1], QTYPE=_KERNEL_CODE[t.name], QK=t.block_elems,
            BLOCK_BYTES=t.block_bytes, BLOCK_M=block_m, BLOCK_N=block_n,
            IEEE=x.dtype == torch.float32, num_warps=num_warps)
    return out.reshape(*x.shape[:-1], n)


def kquant_matmul_segments(x: torch.Tensor, weight: torch.Tensor,
                           segments: torch.Tensor | list[tuple[int, int]]) -> torch.Tensor:
    """``x @ W.T`` for a weight held as ``KQuantLinear`` holds it: ``weight`` the flat uint8
    bytes of one or more segments of rows, ``segments`` each one's ``(ggml type, rows)`` in
    order (a fused q/k/v projection of a Q4_K_M file mixes Q4_K and Q6_K). One kernel launch a
    segment, on a view of its bytes; ValueError for a segment type without a kernel."""
    k = x.shape[-1]
    table = segments.tolist() if isinstance(segments, torch.Tensor) else list(segments)
    outs, start = [], 0
    for ggml_type, rows in table:
        t = kquant_type(int(ggml_type))
        nbytes = rows * (k // t.block_elems) * t.block_bytes
        if start + nbytes > weight.numel():
            raise ValueError(f"the segments need {start + nbytes} bytes of weight, got "
                             f"{weight.numel()}")
        outs.append(kquant_matmul(x, weight[start:start + nbytes].view(rows, -1), t.name))
        start += nbytes
    if start != weight.numel():
        raise ValueError(f"the segments cover {start} bytes of a {weight.numel()}-byte weight")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
