// Kernel launches with programmatic dependent launch (PDL, Hopper): a kernel may start while the
// kernel before it on the stream finishes, and waits for it in `wait_for_prior_kernels()`.
//
// A decode step at batch 1 is a chain of ~8 short kernels per layer (SmolLM2-135M: ~250 in one
// CUDA graph, 2-5 us each), so the gap between two kernels (the next one's launch, its blocks'
// start, the memory flush) is a large share of the step. With PDL the next kernel's blocks are
// resident before the previous one ends. Stream capture keeps these as programmatic edges in the
// CUDA graph. Measured on an H100 (benchmarks/results/bench_decode.json, --pdl both): SmolLM2-135M
// batch 1 0.888 -> 0.791 ms per step (graph 0.807 -> 0.714); Llama-3.1-8B batch 1 5.98 -> 5.96 ms;
// batch 64 unchanged.
//
// Contract of every kernel launched with `launch_kernel`: it calls `wait_for_prior_kernels()`
// before it reads anything an earlier kernel writes and before it writes anything (an earlier
// kernel may still read it). Ours call it first thing: even a weight may be an earlier kernel's
// output when an op is called directly. It then calls
// `allow_dependent_kernels()` at once: the next kernel's blocks may start and wait in turn.
// Kernels launched the ordinary way (Inductor's, cuBLAS) wait for full completion as before.
//
// `compilelm::set_programmatic_launch(False)` (csrc/ops.cpp) launches without the attribute
// (for A/B benchmarks); GPUs before sm_90 never get it.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace compilelm {
bool programmatic_launch_enabled();  // csrc/ops.cpp
}  // namespace compilelm

namespace compilelm::cuda {

__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, shared, stream>>>(args...), with the PDL attribute where enabled. The launch
// error is checked here (no C10_CUDA_KERNEL_LAUNCH_CHECK after it).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled() && at::cuda::getCurrentDeviceProperties()->major >= 9) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace compilelm::cuda
