// Tensor-core and async-copy helpers of the attention kernels (paged_attention_prefill.cu,
// paged_attention_decode_mma.cu): cp.async into shared memory, ldmatrix, mma.sync m16n8k16 with
// bf16/fp16 operands and fp32 accumulators, and the online softmax over accumulator tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace compilelm::cuda {

// 16 bytes global -> shared, asynchronously; !valid writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// c += a @ b for a 16x16 (row) by 16x8 (col) tile, fp32 accumulators. Fragments (lane = 4 *
// group + quad): a = rows {group, group + 8} x columns {2 quad, 2 quad + 1} (+ 8 for a[2], a[3]);
// c = rows {group, group + 8} x columns {2 quad, 2 quad + 1}.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 values as one register of two 16-bit elements (x in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// One online-softmax step of a warp's 16 rows over NT accumulator tiles of scores s (log2 units,
// rows {group, group + 8}: h = 0, 1; a row's scores live in the 4 lanes of a quad): the running max
// m and sum l of each row and the output tiles o are rescaled to the new max, s becomes the
// unnormalized weights exp2(s - max). Every row needs a finite score in its first step.
template <int NT, int DT>
__device__ __forceinline__ void online_softmax_step(float (&s)[NT][4], float (&o)[DT][4], float (&m)[2],
                                                    float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = m[h];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) row_max = fmaxf(row_max, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float correction = exp2f(m[h] - row_max);  // the first step: exp2(-inf) = 0
    m[h] = row_max;
    l[h] *= correction;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][2 * h] *= correction;
      o[dt][2 * h + 1] *= correction;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * h] = exp2f(s[nt][2 * h] - row_max);
      s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - row_max);
      l[h] += s[nt][2 * h] + s[nt][2 * h + 1];
    }
  }
}

}  // namespace compilelm::cuda
