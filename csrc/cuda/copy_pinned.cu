// copy_pinned_: dst.copy_(src) between pinned host memory and the GPU by a kernel that reads or
// writes the host memory itself (mapped: pinned memory from cudaHostAlloc is addressable by the
// GPU), instead of a copy-engine transfer.
//
// The sampler's results (a decode step's token ids: 8 bytes at batch 1) leave the GPU this way.
// On the stream that copy sits between two CUDA graphs, and a copy-engine transfer after a
// kernel started 1-8 us after it, a handoff between engines that a kernel does not pay. H100,
// SmolLM2-135M batch 1 (benchmarks/results/copy_pinned_ab_gpu.log): 0.611-0.612 -> 0.604-0.606
// ms per step. The step's input copy (~100 bytes, host to GPU) stays a copy-engine transfer: as a
// kernel reading host memory it was slower (0.608-0.609 ms).
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_ops.h"

namespace compilelm::cuda {
namespace {

constexpr int kThreads = 256;

template <typename V>
__global__ void __launch_bounds__(kThreads) copy_kernel(V* __restrict__ dst, const V* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    dst[i] = src[i];
  }
}

// The device address of `t`'s data: itself on the GPU, its mapping if pinned host memory.
char* device_address(const at::Tensor& t, const char* name) {
  if (t.is_cuda()) return static_cast<char*>(t.data_ptr());
  TORCH_CHECK(t.is_cpu() && t.is_pinned(), "copy_pinned_: ", name,
              " must be a CUDA tensor or pinned host memory, got a tensor on ", t.device(),
              t.is_cpu() ? " (not pinned)" : "");
  void* mapped = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, t.data_ptr(), 0));
  return static_cast<char*>(mapped);
}

}  // namespace

void copy_pinned_(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_cuda() != src.is_cuda(),
              "copy_pinned_: one of dst and src must be on the GPU and the other pinned host memory, got ", dst.device(),
              " and ", src.device());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes() && dst.is_contiguous() &&
                  src.is_contiguous(),
              "copy_pinned_: dst and src must be contiguous with the same dtype and shape, got ", dst.scalar_type(),
              dst.sizes(), " and ", src.scalar_type(), src.sizes());
  const at::Tensor& gpu = dst.is_cuda() ? dst : src;
  const c10::cuda::CUDAGuard guard(gpu.device());
  const int64_t bytes = dst.numel() * dst.element_size();
  if (bytes == 0) return;
  char* d = device_address(dst, "dst");
  const char* s = device_address(src, "src");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto addresses = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | bytes;
  const auto launch = [&](auto* typed_dst, auto* typed_src, int64_t width) {
    const int64_t n = bytes / width;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
    copy_kernel<<<blocks, kThreads, 0, stream>>>(typed_dst, typed_src, n);
  };
  if (addresses % 16 == 0) {
    launch(reinterpret_cast<int4*>(d), reinterpret_cast<const int4*>(s), 16);
  } else if (addresses % 8 == 0) {
    launch(reinterpret_cast<int64_t*>(d), reinterpret_cast<const int64_t*>(s), 8);
  } else if (addresses % 4 == 0) {
    launch(reinterpret_cast<int*>(d), reinterpret_cast<const int*>(s), 4);
  } else {
    launch(d, s, 1);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // As a non-blocking copy does: the host block goes back to torch's pinned-memory cache only
  // once the stream has passed this kernel, even if its tensor is freed before.
  const at::Tensor& host = dst.is_cuda() ? src : dst;
  at::getHostAllocator(at::kCUDA)->record_event(host.data_ptr(), host.storage().data_ptr().get_context(),
                                                c10::cuda::getCurrentCUDAStream().unwrap());
}

}  // namespace compilelm::cuda
