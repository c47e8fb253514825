// 16-lane fp32 SIMD for the CPU kernels, written with GCC/Clang vector extensions: no ISA-specific
// intrinsics and no -march=native. On the x86-64 baseline each op runs on four 128-bit registers
// (which also gives four independent dependency chains); on other architectures on their own
// vector unit. (AVX2/AVX-512 clones were measured: no gain, the kernels are memory- or
// overhead-bound at these sizes.)
#pragma once

#include <cstdint>

#define COMPILELM_INLINE inline __attribute__((always_inline))

namespace compilelm::cpu::vec {

constexpr int64_t kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

COMPILELM_INLINE f32x16 load(const float* p) {
  f32x16 v;
  __builtin_memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

COMPILELM_INLINE void store(float* p, f32x16 v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

COMPILELM_INLINE f32x16 broadcast(float x) {
  return f32x16{} + x;
}

// n bfloat16 values (raw bits) to fp32: a bf16 is the upper half of the fp32 with the same value.
COMPILELM_INLINE void bf16_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    u16x16 half;
    __builtin_memcpy(&half, src + i, sizeof(half));
    const i32x16 bits = __builtin_convertvector(half, i32x16) << 16;
    __builtin_memcpy(dst + i, &bits, sizeof(bits));
  }
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{src[i]} << 16;
    __builtin_memcpy(dst + i, &bits, sizeof(bits));
  }
}

// Sum of the 16 lanes, halving the vector each step.
COMPILELM_INLINE float reduce_add(f32x16 v) {
  f32x8 lo8, hi8;
  __builtin_memcpy(&lo8, &v, sizeof(lo8));
  __builtin_memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const f32x8 s8 = lo8 + hi8;
  f32x4 lo4, hi4;
  __builtin_memcpy(&lo4, &s8, sizeof(lo4));
  __builtin_memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const f32x4 s4 = lo4 + hi4;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// exp(x) to ~2 ulp for x <= 88 (softmax feeds it x - max <= 0): exp(x) = 2^n * exp(r) with
// n = round(x / ln 2) and |r| <= ln(2) / 2, exp(r) from its degree-7 Taylor polynomial.
COMPILELM_INLINE f32x16 exp(f32x16 x) {
  x = x < -87.f ? broadcast(-87.f) : x;  // below this 2^n leaves the normal range; exp ~ 0
  x = x > 88.f ? broadcast(88.f) : x;
  const f32x16 round_magic = broadcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504f + round_magic) - round_magic;
  const f32x16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 split in two for precision
  f32x16 p = broadcast(1.f / 5040.f);
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2^n as a float
  f32x16 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace compilelm::cpu::vec
