"""The portable loops of tokenmill/kernels/cpu/int_dot.h (what CPUs without AVX2 and FMA run: ARM
laptops, old x86) give the same bits as the vectorized ones this machine runs."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import pytest
import torch

from tokenmill.kernels.cpu import clear_stale_build_lock, load_extension
from tokenmill.quant.packing import pack_int4_q8, pack_int8_q16_tiles

CSRC = Path(__file__).resolve().parents[2] / "tokenmill" / "kernels" / "cpu"
HERE = Path(__file__).resolve().parent / "csrc"


@pytest.fixture(scope="module")
def builds():
    """(vectorized extension, a build of int_dot.h for plain x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the vectorized loops are x86's; elsewhere the extension is portable")
    from torch.utils import cpp_extension

    fast = load_extension()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags or " fma" not in flags:
        pytest.skip("this CPU runs the portable loops in the extension itself")
    # torch's build cache is keyed by name and does not see header edits: hash the sources in
    digest = hashlib.sha256((CSRC / "int_dot.h").read_bytes()
                            + (HERE / "int_dot_portable.cpp").read_bytes()).hexdigest()[:12]
    name = f"tokenmill_int_dot_portable_{digest}"
    clear_stale_build_lock(name)  # a killed run's lock would make this wait forever
    portable = cpp_extension.load(
        name=name, sources=[str(HERE / "int_dot_portable.cpp")],
        extra_include_paths=[str(CSRC)],
        # x86-64 baseline: SSE2 only, no AVX2 or FMA; -ffp-contract=off so that the compiler
        # fuses no multiply-add the source does not spell as std::fma.
        extra_cflags=["-O2", "-march=x86-64", "-mtune=generic", "-ffp-contract=off"],
        verbose=False)
    return fast, portable


@pytest.mark.parametrize("bits", [8, 16])
def test_int4_same_bits(builds, bits: int) -> None:
    fast, portable = builds
    gen = torch.Generator().manual_seed(0)
    n, k, group = 48, 192, 64
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sz = torch.stack([torch.rand(k // group, n, generator=gen) * 0.02 + 0.001,
                      torch.randn(k // group, n, generator=gen) * 0.01], dim=-1).bfloat16()
    packed, scales = pack_int4_q8(q, sz)
    x = torch.randn(6, k, generator=gen)
    a = fast.int4_q8_linear(x, packed, scales, group, bits)
    b = portable.int4_q8_linear(x, packed, scales, group, bits)
    assert torch.equal(a, b)


def test_int8_same_bits(builds) -> None:
    fast, portable = builds
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-128, 128, (21, 2100), generator=gen, dtype=torch.int8)
    scales = torch.rand(21, generator=gen).bfloat16()
    x = torch.randn(3, 2100, generator=gen)
    assert torch.equal(fast.int8_q16_linear(x, w, scales), portable.int8_q16_linear(x, w, scales))


def test_int8_tiles_same_bits(builds) -> None:
    fast, portable = builds
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-128, 128, (45, 1030), generator=gen, dtype=torch.int8)
    scales = torch.rand(45, generator=gen).bfloat16()
    tiles = pack_int8_q16_tiles(w)
    x = torch.randn(11, 1030, generator=gen)
    a = fast.int8_q16_tiles_linear(x, tiles, scales, 45)
    assert torch.equal(a, portable.int8_q16_tiles_linear(x, tiles, scales, 45))
    assert torch.equal(a, fast.int8_q16_linear(x, w, scales))
