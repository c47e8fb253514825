#include "cuda/arrival_counters.h"

#include <c10/cuda/CUDAException.h>

#include <mutex>

namespace compilelm::cuda {

int* arrival_counters(CounterUser user, int64_t count, cudaStream_t stream) {
  constexpr int kDevices = 64;
  static std::mutex mutex;
  static int* counters[kDevices] = {};  // kCounterUsers ranges of kArrivalCounters
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (count > kArrivalCounters || device >= kDevices) return nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (counters[device] == nullptr) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return nullptr;
    int* buffer = nullptr;  // kept for the process's life, like a cuBLAS workspace
    C10_CUDA_CHECK(cudaMalloc(&buffer, kCounterUsers * kArrivalCounters * sizeof(int)));
    C10_CUDA_CHECK(cudaMemset(buffer, 0, kCounterUsers * kArrivalCounters * sizeof(int)));
    counters[device] = buffer;
  }
  return counters[device] + static_cast<int>(user) * kArrivalCounters;
}

}  // namespace compilelm::cuda
