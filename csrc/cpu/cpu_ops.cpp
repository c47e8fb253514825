// Registers the CPU kernels (cache_kernels.cpp, paged_attention.cpp) for the schemas of
// csrc/ops.cpp. Tensors live in host memory with the layouts documented in csrc/ops.cpp.
#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(compilelm, CPU, m) {
  m.impl("reshape_and_cache", &compilelm::cpu::reshape_and_cache);
  m.impl("paged_attention", &compilelm::cpu::paged_attention);
}
