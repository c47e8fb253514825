// 8-lane fp32 SIMD for the CPU kernels, written with GCC/Clang vector extensions: no
// ISA-specific intrinsics. Each op is one ymm instruction with AVX2 and two xmm on the x86-64
// baseline (or the vector unit of another architecture). 8 lanes, not 16: GCC's AVX2 code for
// 16-lane vectors spills and scalarizes, and AVX-512 gains nothing over AVX2 here (docs/perf.md,
// "CPU").
// The build targets the baseline ISA (no -march=native); kernels put COMPILELM_CPU_CLONES on
// their hot functions so GCC also emits an AVX2+FMA version and picks it at load time where the
// CPU has it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COMPILELM_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define COMPILELM_CPU_CLONES
#endif
#define COMPILELM_INLINE inline __attribute__((always_inline))

namespace compilelm::cpu::vec {

constexpr int64_t kLanes = 8;
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));
typedef float f32x4 __attribute__((vector_size(16)));

COMPILELM_INLINE fvec load(const float* p) {
  fvec v;
  __builtin_memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

COMPILELM_INLINE void store(float* p, fvec v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

COMPILELM_INLINE fvec broadcast(float x) {
  return fvec{} + x;
}

// n bfloat16 values (raw bits) to fp32: a bf16 is the upper half of the fp32 with the same value.
COMPILELM_INLINE void bf16_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    hvec half;
    __builtin_memcpy(&half, src + i, sizeof(half));
    const ivec bits = __builtin_convertvector(half, ivec) << 16;
    __builtin_memcpy(dst + i, &bits, sizeof(bits));
  }
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{src[i]} << 16;
    __builtin_memcpy(dst + i, &bits, sizeof(bits));
  }
}

// Sum of the lanes: halves, then the last four.
COMPILELM_INLINE float reduce_add(fvec v) {
  f32x4 lo, hi;
  __builtin_memcpy(&lo, &v, sizeof(lo));
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const f32x4 s = lo + hi;
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// exp(x) to ~2 ulp for x <= 88 (softmax feeds it x - max <= 0): exp(x) = 2^n * exp(r) with
// n = round(x / ln 2) and |r| <= ln(2) / 2, exp(r) from its degree-7 Taylor polynomial.
COMPILELM_INLINE fvec exp(fvec x) {
  x = x < -87.f ? broadcast(-87.f) : x;  // below this 2^n leaves the normal range; exp ~ 0
  x = x > 88.f ? broadcast(88.f) : x;
  const fvec round_magic = broadcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const fvec n = (x * 1.44269504f + round_magic) - round_magic;
  const fvec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 split in two for precision
  fvec p = broadcast(1.f / 5040.f);
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n as a float
  fvec scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace compilelm::cpu::vec
