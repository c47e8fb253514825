// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
// counter-based generator, so any thread draws the random bits of any (key, counter) without
// shared state; sample_rows (argmax_kernels.cu) keys its Gumbel noise on (row key, column).
#pragma once

#include <cstdint>

namespace compilelm::cuda {

struct Philox4 {
  uint32_t x, y, z, w;
};

// Four 32-bit random words of counter (c0, c1, c2, c3) under key (k0, k1).
__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{c0, c1, c2, c3};
}

// A uniform in (0, 1), never 0 or 1: the top 23 bits of `bits` and half a step, (k + 0.5) / 2^23,
// exact in fp32 (with 24 bits, k + 0.5 at k = 2^24 - 1 rounds to 2^24: u = 1).
__device__ __forceinline__ float uniform_open(uint32_t bits) {
  return (static_cast<float>(bits >> 9) + 0.5f) * 0x1p-23f;
}

}  // namespace compilelm::cuda
