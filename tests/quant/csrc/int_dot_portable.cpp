// tokenmill/kernels/cpu/int_dot.h built without AVX2 (its portable loops), for
// tests/quant/test_int_dot_portable.py to compare with the vectorized build bit for bit.
#include <torch/extension.h>

#include "int_dot.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_q8_linear", [](const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& scales, int64_t group_size, int64_t act_bits) {
    return tokenmill::intdot::int4_q8_linear(x, packed, scales, group_size, act_bits);
  });
  m.def("int8_q16_linear", &tokenmill::intdot::int8_q16_linear);
  m.def("int8_q16_tiles_linear", &tokenmill::intdot::int8_q16_tiles_linear);
}
