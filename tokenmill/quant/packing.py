"""Weight-only quantization formats and the packed layouts of PyTorch's CPU kernels.

int8: symmetric per output channel, ``w = q * scale[n]`` with ``q`` in [-128, 127], the form
``torch.ops.aten._weight_int8pack_mm`` takes.

int4: asymmetric per group of ``group_size`` input columns, ``w = q * scale + min`` with ``q`` in
[0, 15] (:class:`Int4Groups`, GGUF Q4_1's form). ``_weight_int4pack_mm_for_cpu`` wants the
nibbles in an opaque packed layout and ``(scale, zero)`` pairs in the activation dtype with
``w = (q - 8) * scale + zero``; :func:`pack_int4` converts, :func:`unpack_int4` undoes the
packing for the dense (large-batch) path, and :func:`int4_block_n` finds once which width of
row blocks this build packs with (it follows the CPU: 64 rows with AVX-512, 32 with AVX2 only).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The quantized kernels take bf16 scales and activations; fp32 ones run ~10x slower on CPU.
KERNEL_DTYPE = torch.bfloat16


@functools.cache
def dense_dtype(device_type: str) -> torch.dtype:
    """The dtype of the dense path's matmul (many rows, weight dequantized on the fly): bf16,
    except on CPUs that do not multiply bf16 natively (no AVX-512: oneDNN then runs bf16
    matmuls about 80x slower than fp32, measured on an AVX2-only EPYC), where it is fp32."""
    if device_type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return KERNEL_DTYPE


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Sapphire Rapids and later), where oneDNN's bf16
    matmuls run several times faster than on AVX512-BF16 alone (Linux: /proc/cpuinfo)."""
    from tokenmill.kernels.cpu import cpu_flags

    return "amx_bf16" in cpu_flags().split()


INT4_GROUP_SIZES = (32, 64, 128, 256)
# _convert_weight_to_int4pack_for_cpu needs the output size to be a multiple of this.
INT4_N_MULTIPLE = 16
# Quantize this many rows at a time: fp32 temporaries of a 49152-row embedding would otherwise
# add several hundred MB to the peak memory of loading.
QUANTIZE_ROWS = 4096


@dataclass(frozen=True)
class Int4Groups:
    """4-bit weights in the plain layout: ``w[n, k] = q[n, k] * scale[n, g] + min[n, g]``.

    ``q`` is uint8 ``[N, K]`` in [0, 15]; ``scale`` and ``min`` are fp32 ``[N, K // group_size]``
    with ``g = k // group_size``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 weights ``[N, K]`` (the same arithmetic as gguf's Q4_1 dequantization)."""
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group_size, self.group_size)
        return (q * self.scale.unsqueeze(-1) + self.min.unsqueeze(-1)).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Stack the rows of several tensors of the same group size (fused projections)."""
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"cannot fuse int4 parts of group sizes {sorted(sizes)}")
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.min for p in parts]), parts[0].group_size)


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    """ValueError unless the int4 kernel can take a weight of this shape and group size."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    if out_features % INT4_N_MULTIPLE:
        raise ValueError(f"out_features {out_features} is not a multiple of {INT4_N_MULTIPLE}")


# ------------------------------------------------------------------------ symmetric, per row


def scale_rows_absmax(x: torch.Tensor, max_value: float,
                      scale_dtype: torch.dtype = torch.float32
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / scale, scale)`` for a symmetric per-row format whose largest value is
    ``max_value``: ``scale`` ``[N, 1]`` maps each row's largest magnitude onto ``max_value``
    (1 for an all-zero row), and ``x / scale`` is in fp32, ready to round or cast.

    The scale is rounded to ``scale_dtype`` *before* dividing, so that the quantized values
    are the best choice for the scale the kernel will actually use. Both divisions are IEEE
    ones on every device, as the Triton kernels' (CUDA turns a division by a Python number
    into a multiplication by its rounded reciprocal, one ulp off at times).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    peak = amax.new_full((1, 1), max_value)
    scale = torch.where(amax > 0, amax / peak, torch.ones_like(amax)).to(scale_dtype)
    return xf / scale.float(), scale


# ---------------------------------------------------------------------------------- int8

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q int8 [N, K], scales bf16 [N])``, ``w ~= q * scales``."""
    qs, scales = [], []
    for rows in weight.detach().split(QUANTIZE_ROWS):
        scaled, s = scale_rows_absmax(rows, INT8_MAX, KERNEL_DTYPE)
        qs.append(torch.round(scaled).clamp_(-128, INT8_MAX).to(torch.int8))
        scales.append(s.view(-1))
    return torch.cat(qs), torch.cat(scales)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scales`` as ``[N, K]`` in ``dtype``."""
    # int8 * bf16 promotes to bf16 in one pass, without an intermediate copy of q.
    return q * scales.to(dtype).unsqueeze(1)


# Output tiles of int8_q16_tiles_linear (tokenmill/kernels/cpu/int_dot.h): 16 outputs a tile, two
# tiles a unit, inputs in pairs.
Q16_TILE_N = 16
Q16_UNIT_N = 2 * Q16_TILE_N


def pack_int8_q16_tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` as ``[units, K2, 64]`` (``N`` padded with zero rows to a multiple of 32,
    ``K`` with a zero column to an even count, ``K2 = K / 2`` pairs): in unit ``u``, pair ``p``,
    byte ``32 t + 2 j + i`` holds input ``2 p + i`` of output ``32 u + 16 t + j``."""
    n, k = q.shape
    n_pad, k_pad = -(-n // Q16_UNIT_N) * Q16_UNIT_N, k + k % 2
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8, device=q.device)
    padded[:n, :k] = q
    units = padded.view(n_pad // Q16_UNIT_N, 2, Q16_TILE_N, k_pad // 2, 2)
    return units.permute(0, 3, 1, 2, 4).contiguous().view(n_pad // Q16_UNIT_N, k_pad // 2,
                                                          2 * Q16_UNIT_N)


# ---------------------------------------------------------------------------------- int4


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Groups:
    """Asymmetric min/max int4 per group of ``group_size`` input columns.

    The grid is the one the kernel will use: scale and zero are rounded to bf16 first and the
    weights rounded onto that grid.
    """
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    return Int4Groups.cat([_quantize_int4_rows(rows, group_size)
                           for rows in weight.detach().split(QUANTIZE_ROWS)])


def _quantize_int4_rows(weight: torch.Tensor, group_size: int) -> Int4Groups:
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).to(KERNEL_DTYPE).float()
    zero = (lo + 8.0 * scale).to(KERNEL_DTYPE).float()
    grid_min = zero - 8.0 * scale
    # A constant group has scale 0: any q dequantizes to its value, so divide by 1 instead.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - grid_min.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    return Int4Groups(q.to(torch.uint8).view(n, k), scale, grid_min, group_size)


def pack_int4(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(packed weight uint8, scales_and_zeros bf16 [K // g, N, 2])``."""
    n, k = groups.q.shape
    check_int4_shape(n, k, groups.group_size)
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    if n > QUANTIZE_ROWS and int4_layout_known():
        # The layout is block-major, so whole blocks of rows pack independently: the int32
        # copy the op wants stays a few MB instead of 4 bytes per weight.
        packed = torch.cat([convert(rows.to(torch.int32), 1).reshape(-1)
                            for rows in groups.q.split(QUANTIZE_ROWS)]).view(n, k // 2)
    else:
        packed = convert(groups.q.to(torch.int32), 1)
    return packed, int4_scales_and_zeros(groups)


# tokenmill's int4 x int8 CPU kernel (tokenmill/kernels/cpu/int_dot.h) takes outputs in tiles of
# this many and inputs in blocks of Q8_BLOCK (one int8 activation scale each).
Q8_TILE_N = 16
Q8_BLOCK = 32


def q8_layout_fits(n: int, k: int, group_size: int) -> bool:
    """Whether a ``[n, k]`` int4 weight of this group size packs into q8 tiles."""
    return n % Q8_TILE_N == 0 and group_size % Q8_BLOCK == 0 and k % group_size == 0


def unpack_int4_blocks(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """All nibbles ``[N, K]`` (uint8) of a weight packed by :func:`pack_int4` in whole blocks
    of :func:`int4_block_n` rows: views and two nibble ops, one byte a weight of temporaries
    (:func:`unpack_int4` serves any row count with 8-byte gather indices)."""
    block_n = _known_block_n()
    blocks = packed.view(n // block_n, k, block_n // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).permute(0, 2, 1).reshape(n, k)


def pack_int4_q8(q: torch.Tensor, scales_and_zeros: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Nibbles ``q`` uint8 ``[N, K]`` and bf16 ``[K // g, N, 2]`` (scale, zero) in the layout
    of the int4 x int8 kernel (``tokenmill/kernels/cpu/int_dot.h``): uint8 ``[N / 16, K / 4, 32]``,
    where byte ``4 j + i`` of tile ``t``, step ``s`` holds input ``4 s + i`` of output
    ``16 t + j`` (low nibble) and of output ``16 t + 8 + j`` (high), and bf16 scales
    ``[N / 16, groups, 2, 16]``."""
    n, k = q.shape
    tiles = n // Q8_TILE_N
    # [tile, half, j, step, i] -> [tile, step, half, j, i]
    t = q.to(torch.uint8).reshape(tiles, 2, 8, k // 4, 4).permute(0, 3, 1, 2, 4)
    packed = (t[:, :, 0] | (t[:, :, 1] << 4)).reshape(tiles, k // 4, 32).contiguous()
    groups = scales_and_zeros.shape[0]
    scales = (scales_and_zeros.reshape(groups, tiles, Q8_TILE_N, 2).permute(1, 0, 3, 2)
              .to(KERNEL_DTYPE).contiguous())
    return packed, scales


def int4_scales_and_zeros(groups: Int4Groups) -> torch.Tensor:
    """bf16 ``[K // g, N, 2]`` (scale, zero) with ``w = (q - 8) * scale + zero``: the form both
    int4 kernels (the CPU one and CUDA's tinygemm) take."""
    zero = groups.min + 8.0 * groups.scale
    scales_and_zeros = torch.stack([groups.scale, zero], dim=-1).transpose(0, 1)
    return scales_and_zeros.to(KERNEL_DTYPE).contiguous()


def _layout_indices(n: int, k: int, rows: torch.Tensor, block_n: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets ``[R, K]`` and nibble shifts ``[R, 1]`` of ``rows`` in the packed weight.

    Rows come in blocks of ``block_n``, each stored as ``[K][block_n / 2]`` bytes with row ``i``
    in the low nibble and row ``i + block_n / 2`` in the high one; the last, shorter block
    (``n % block_n`` rows) pairs rows ``2j`` (low) and ``2j + 1`` (high) instead.
    """
    full = n - n % block_n
    in_tail = rows >= full
    block_start = torch.where(in_tail, torch.full_like(rows, full), rows - rows % block_n)
    width = torch.where(in_tail, torch.full_like(rows, n - full), torch.full_like(rows, block_n))
    i = rows - block_start
    half = width // 2
    col = torch.where(in_tail, i // 2, i % half)
    high = torch.where(in_tail, i % 2 == 1, i >= half)
    base = block_start * (k // 2) + col
    offsets = base.unsqueeze(1) + torch.arange(k, dtype=rows.dtype).unsqueeze(0) * half.unsqueeze(1)
    return offsets, (high.to(torch.uint8) * 4).unsqueeze(1)


def unpack_int4_rows(packed: torch.Tensor, n: int, k: int, rows: torch.Tensor,
                     block_n: int | None = None) -> torch.Tensor:
    """The nibbles ``[R, K]`` (uint8) of the given rows of a weight packed by :func:`pack_int4`
    (in blocks of ``block_n`` rows; default: this build's, :func:`int4_block_n`)."""
    offsets, shift = _layout_indices(n, k, rows.to(torch.int64), block_n or _known_block_n())
    return (packed.reshape(-1)[offsets] >> shift) & 15


def unpack_int4(packed: torch.Tensor, n: int, k: int, block_n: int | None = None) -> torch.Tensor:
    """All nibbles ``[N, K]`` (uint8) of a weight packed by :func:`pack_int4`."""
    return unpack_int4_rows(packed, n, k, torch.arange(n), block_n)


def dequantize_int4_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                      n: int, k: int) -> torch.Tensor:
    """The transposed weight ``[K, N]`` in bf16, for ``x @ w.T`` as one dense matmul.

    Only for ``n`` a multiple of :func:`int4_block_n`: whole blocks of rows decode with views
    and two nibble ops (about a third of a bf16 matmul at 512 rows); use :func:`unpack_int4`
    otherwise.
    """
    block_n = _known_block_n()
    blocks = packed.view(n // block_n, k, block_n // 2)
    # [N/block_n, K, block_n] with rows in order; q - 8 in int8 (half the bytes of bf16).
    centred = torch.cat([blocks & 15, blocks >> 4], dim=-1).view(torch.int8).sub_(8)
    q = centred.permute(1, 0, 2).reshape(k // group_size, group_size, n).to(KERNEL_DTYPE)
    # Contiguous scale / zero rows keep addcmul on its fast path; it rounds
    # (q - 8) * scale + zero once, as the kernel computes it.
    scale = scales_and_zeros[..., 0].unsqueeze(1).contiguous()
    zero = scales_and_zeros[..., 1].unsqueeze(1).contiguous()
    return torch.addcmul(zero, q, scale).view(k, n)


# Row-block widths ``_convert_weight_to_int4pack_for_cpu`` is known to pack with: 64 where the
# CPU has AVX-512, 32 where it has AVX2 only.
INT4_BLOCK_NS = (64, 32)


@functools.cache
def int4_block_n() -> int | None:
    """The width of the row blocks this PyTorch, on this CPU, packs int4 weights in; None if
    the packing matches none of the layouts :func:`unpack_int4` reads.

    The layout is an implementation detail of ``_convert_weight_to_int4pack_for_cpu``; if a
    release changes it, the int4 modules keep to the kernel itself instead of decoding it.
    """
    gen = torch.Generator().manual_seed(0)
    # Whole blocks and each kind of tail, for either width.
    samples = [torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.int32)
               for n in (64, 80, 176)]
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1) for q in samples]
    for block_n in INT4_BLOCK_NS:
        if all(torch.equal(unpack_int4(p, q.shape[0], 64, block_n).to(torch.int32), q)
               for p, q in zip(packed, samples, strict=True)):
            return block_n
    logger.warning("unknown int4 packed layout in torch %s: int4 layers use the int4 kernel "
                   "at every batch size", torch.__version__)
    return None


def int4_layout_known() -> bool:
    """Whether :func:`unpack_int4` can read this build's int4 packing."""
    return int4_block_n() is not None


def _known_block_n() -> int:
    block_n = int4_block_n()
    if block_n is None:
        raise RuntimeError("this PyTorch packs int4 weights in an unknown layout")
    return block_n
