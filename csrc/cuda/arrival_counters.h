// Per-device arrival counters for kernels whose blocks merge their work in the last block to
// arrive (decode attention's split-K, argmax_rows, linear_argmax_out): all zero between
// launches, every launch leaves them as it found them. Each user has its own range, so two users
// never share a counter. kLmHeadArgmax's range: the counter at [0], then from int 2 on (8-byte
// aligned) one 64-bit running-maximum key per row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace compilelm::cuda {

enum class CounterUser { kAttention = 0, kArgmax = 1, kLmHeadArgmax = 2 };
constexpr int kCounterUsers = 3;

constexpr int64_t kArrivalCounters = 1 << 16;  // per user and device

// `count` zeroed counters of `user` on the current device. Allocated once, outside stream capture
// (the graphs' warm-up run comes first); null when capturing before that, or when count is over
// kArrivalCounters: the caller then merges another way.
int* arrival_counters(CounterUser user, int64_t count, cudaStream_t stream);

}  // namespace compilelm::cuda
