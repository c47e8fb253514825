// Kernel launches with programmatic dependent launch (PDL, Hopper): a kernel may start while the
// kernel before it on the stream finishes, and waits for it in `wait_for_prior_kernels()`.
//
// A decode step at batch 1 is a chain of ~8 short kernels per layer (a few hundred in one CUDA
// graph for a small model), so the gap between two kernels (the next one's launch, its blocks'
// start, the memory flush) is a large share of the step. With PDL the next kernel's blocks are
// resident before the previous one ends. Stream capture keeps these as programmatic edges in the
// CUDA graph. Measurements: docs/perf.md, "Programmatic dependent launch (PDL)".
//
// Contract of every kernel launched with `launch_kernel`: it calls `wait_for_prior_kernels()`
// before it reads anything the kernel just before it may write and before it writes anything (an
// earlier kernel may still read it), then `allow_dependent_kernels()` at once: the next kernel's
// blocks may start and wait in turn. So at most one kernel runs ahead, and every kernel older
// than the one just before is complete when a kernel starts. (Allowing dependents before the
// wait in every kernel let several kernels run ahead, each holding blocks in its wait: slower.)
//
// Two exceptions allow their dependent at their start:
// - in small models (rope_cache_kernels.cu: query width <= kSmallModelQueryWidth) rope_and_cache,
//   so decode attention reads its metadata, block table and older context rows while the QKV
//   projection two kernels back still runs: the chain of dependent loads before attention's wait
//   was otherwise exposed. (In wide models the early attention blocks hold SMs the projection's
//   weight stream needs.)
// - the (add +) RMSNorm variants of linear (skinny_mm.cu: the QKV and gate_up projections
//   at batch 1-2), so rope_and_cache / decode attention and down_proj's weight stream start
//   while the projection still waits and normalizes.
// A kernel may therefore start before the ones two or three back are complete; what it reads
// before its wait is never written during a forward, and its wait returns only after the kernel
// just before, which itself waited for the one before it.
//
// Before the wait a kernel may read only what no kernel writes during a forward: weights
// (parameters, the RoPE cos/sin table), a step's metadata (positions, slots, sequence lengths,
// block tables: copied from the host before the step) and the KV cache rows of earlier steps.
// linear starts its weight stream there, decode attention its first context rows,
// rope_and_cache its cos/sin: these loads overlap the kernel before.
// Kernels launched the ordinary way (Inductor's, cuBLAS) wait for full completion as before.
//
// `compilelm::set_programmatic_launch(False)` (csrc/ops.cpp) launches without the attribute
// (for A/B benchmarks); GPUs before sm_90 never get it.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

namespace compilelm {
bool programmatic_launch_enabled();  // csrc/ops.cpp
bool cluster_merge_enabled();        // csrc/ops.cpp
bool decode_mma_enabled();           // csrc/ops.cpp
int decode_splits_forced();          // csrc/ops.cpp: 0 = by shape
bool hopper_gemm_enabled();          // csrc/ops.cpp
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

// Blocks of `kernel` resident on the whole GPU at once, launched with `threads` threads and `shared`
// dynamic shared bytes (occupancy per SM x SMs, at least one per SM). Callers keep it in a static.
template <typename... Params>
int64_t resident_blocks(void (*kernel)(Params...), int threads, size_t shared) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared));
  return static_cast<int64_t>(std::max(per_sm, 1)) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// kernel<<<grid, block, shared, stream>>>(args...), with the PDL attribute where enabled, in
// thread block clusters of `cluster` blocks if that is not 1 x 1 x 1 (sm_90+: the caller checks).
// The launch error is checked here (no C10_CUDA_KERNEL_LAUNCH_CHECK after it).
template <typename... Params, typename... Args>
void launch_kernel_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t shared,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  config.attrs = attributes;
  if (programmatic_launch_enabled() && at::cuda::getCurrentDeviceProperties()->major >= 9) {
    attributes[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++config.numAttrs;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attributes[config.numAttrs].val.clusterDim.x = cluster.x;
    attributes[config.numAttrs].val.clusterDim.y = cluster.y;
    attributes[config.numAttrs].val.clusterDim.z = cluster.z;
    ++config.numAttrs;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   Args&&... args) {
  launch_kernel_in_clusters(kernel, grid, dim3(1, 1, 1), block, shared, stream, std::forward<Args>(args)...);
}

}  // namespace compilelm::cuda
