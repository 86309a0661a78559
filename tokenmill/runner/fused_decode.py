"""The former name of :mod:`tokenmill.runner.cpu_program` (the C++ decoder layer stack became
an op program lowered from the module tree); its old names, for callers not yet moved."""

from __future__ import annotations

from tokenmill.runner.cpu_linear import (
    KIND_FLOAT,
    KIND_INT4,
    KIND_INT8,
    LinearParts,
    UnsupportedModel,
    linear_parts,
)
from tokenmill.runner.cpu_program import (
    DEFAULT_ENABLED,
    ENV_FLAG,
    PREFILL_ENV_FLAG,
    PROFILE_RANGE,
    CpuProgram,
    fused_cache_dtype_ok,
    fused_decode_enabled,
    fused_prefill_enabled,
    make_cpu_program,
    make_invariant_program,
)

FusedDecoder = CpuProgram
make_fused_decoder = make_cpu_program
make_invariant_decoder = make_invariant_program

__all__ = ["DEFAULT_ENABLED", "ENV_FLAG", "KIND_FLOAT", "KIND_INT4", "KIND_INT8",
           "PREFILL_ENV_FLAG", "PROFILE_RANGE", "CpuProgram", "FusedDecoder", "LinearParts",
           "UnsupportedModel", "fused_cache_dtype_ok", "fused_decode_enabled",
           "fused_prefill_enabled", "linear_parts", "make_cpu_program", "make_fused_decoder",
           "make_invariant_decoder", "make_invariant_program"]
