// Registers the CUDA kernels (cache_kernels.cu, paged_attention*.cu) for the schemas of
// csrc/ops.cpp. Built only with COMPILELM_CUDA (CMakeLists.txt).
#include <torch/library.h>

#include "cuda/cuda_ops.h"

TORCH_LIBRARY_IMPL(compilelm, CUDA, m) {
  m.impl("reshape_and_cache", &compilelm::cuda::reshape_and_cache);
  m.impl("paged_attention", &compilelm::cuda::paged_attention);
}
