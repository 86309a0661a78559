// tokenmill/kernels/cpu/kquant.h built for other CPUs than this one (AVX2 without AVX-512, or
// plain x86-64), for tests/quant/test_kquant_portable.py to check those paths' results too.
#include <torch/extension.h>

#include "kquant.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kquant_linear", &tokenmill::kquant::kquant_linear);
  m.def("kquant_dequantize", &tokenmill::kquant::kquant_dequantize);
}
