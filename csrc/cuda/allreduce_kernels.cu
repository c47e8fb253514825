// custom_all_reduce, custom_all_reduce_add_rms_norm: a one-shot all-reduce over peer memory for
// 2..8 ranks, optionally with the residual add and the RMSNorm in its epilogue. The buffers and
// their peer pointers come from compilelm/distributed/custom_all_reduce.py (torch symmetric
// memory, no NVLink multicast). Each rank's buffer:
//
//   [flags: uint32 [2 phases][kMaxBlocks][kMaxRanks]] [staged rows of x: buffer_bytes]
//
// One launch, block b of every rank handling the same rows (same shape -> same grid):
//   stage    copy its rows of x into this rank's buffer
//   barrier  phase 0: signal every peer's block b, wait for theirs (the rows are staged everywhere)
//   reduce   per row: sum the rows of ranks 0..world-1 in fp32, in rank order (bit-identical on
//            every rank), rounded to T as an NCCL sum is; with the norm, residual_out = T(sum +
//            residual) and out = T(weight * T(residual_out * rsqrt(mean(residual_out^2) + eps)))
//   barrier  phase 1: no rank stages the next call's rows while a peer still reads these
//
// Flags are self-resetting (put: CAS 0 -> 1 on the peer, wait: CAS 1 -> 0 at home), so a call
// carries no epoch from the host and a captured CUDA graph replays correctly. Each block waits
// only on its namesake in the other ranks; all blocks must be resident at once, hence the grid
// cap (kMaxBlocks <= SMs). A wait that spins 10 s traps instead of hanging the process.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_ops.h"
#include "cuda/fused_common.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 128;
constexpr int kMaxThreads = 512;  // more vectors in a row: a thread takes several
constexpr int64_t kFlagBytes = 2 * kMaxBlocks * kMaxRanks * sizeof(uint32_t);  // = custom_all_reduce.FLAG_BYTES
constexpr uint64_t kTimeoutNs = 10ull * 1000 * 1000 * 1000;

struct Peers {
  char* ptrs[kMaxRanks];  // every rank's buffer (flags first), in this process's address space
};

struct OneShotParams {
  Peers peers;
  const void* x;         // [rows, cols] contiguous
  const void* residual;  // norm: [rows, cols] contiguous
  const void* weight;    // norm: [cols]
  void* out;             // [rows, cols]: the sum, or the normed rows
  void* residual_out;    // norm: [rows, cols]
  int64_t rows;
  int cols, rank, world;
  float eps;
};

__device__ __forceinline__ uint32_t* flag(char* buffer, int phase, int block, int rank) {
  return reinterpret_cast<uint32_t*>(buffer) + (phase * kMaxBlocks + block) * kMaxRanks + rank;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *addr == from, then sets it to `to`; release (put) or acquire (wait) at system scope.
template <bool kRelease>
__device__ __forceinline__ void cas_spin(uint32_t* addr, uint32_t from, uint32_t to) {
  const uint64_t start = global_ns();
  while (true) {
    uint32_t old;
    if constexpr (kRelease) {
      asm volatile("atom.release.sys.global.cas.b32 %0, [%1], %2, %3;"
                   : "=r"(old) : "l"(addr), "r"(from), "r"(to) : "memory");
    } else {
      asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;"
                   : "=r"(old) : "l"(addr), "r"(from), "r"(to) : "memory");
    }
    if (old == from) return;
    if (global_ns() - start > kTimeoutNs) __trap();  // a peer never came: fail loudly
  }
}

// Block b of every rank meets here: thread t signals rank t's block b and waits for its signal.
__device__ __forceinline__ void block_barrier(const OneShotParams& p, int phase) {
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < p.world && peer != p.rank) {
    cas_spin<true>(flag(p.peers.ptrs[peer], phase, blockIdx.x, p.rank), 0u, 1u);
    cas_spin<false>(flag(p.peers.ptrs[p.rank], phase, blockIdx.x, peer), 1u, 0u);
  }
  __syncthreads();
}

// A vector of a peer's staged row: bypasses L1 (written by another GPU during this kernel).
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_peer(const T* row, int chunk) {
  static_assert(sizeof(Vec<T, N>) == sizeof(uint4));
  const uint4 u = __ldcg(reinterpret_cast<const uint4*>(row) + chunk);
  return *reinterpret_cast<const Vec<T, N>*>(&u);
}

template <typename T, int N, bool kNorm>
__global__ void __launch_bounds__(kMaxThreads) one_shot_kernel(const __grid_constant__ OneShotParams p) {
  const int chunks = p.cols / N;
  const T* x = static_cast<const T*>(p.x);
  T* staged = reinterpret_cast<T*>(p.peers.ptrs[p.rank] + kFlagBytes);

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      store_vec<T, N>(staged + row * p.cols, c, load_vec<T, N>(x + row * p.cols, c));
    }
  }
  __threadfence_system();
  block_barrier(p, 0);

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    T* out_row = static_cast<T*>(p.out) + row * p.cols;
    T* res_out_row = kNorm ? static_cast<T*>(p.residual_out) + row * p.cols : nullptr;
    float sum_sq = 0.f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      Vec<T, N> v[kMaxRanks];  // every rank's vector, loads in flight together
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if (r < p.world) {
          v[r] = r == p.rank ? load_vec<T, N>(x + row * p.cols, c)
                             : load_peer<T, N>(reinterpret_cast<const T*>(p.peers.ptrs[r] + kFlagBytes) + row * p.cols, c);
        }
      }
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = to_float(v[0].v[i]);
#pragma unroll
      for (int r = 1; r < kMaxRanks; ++r) {
        if (r < p.world) {
#pragma unroll
          for (int i = 0; i < N; ++i) acc[i] += to_float(v[r].v[i]);
        }
      }
      Vec<T, N> s;
      if constexpr (kNorm) {
        const Vec<T, N> res = load_vec<T, N>(static_cast<const T*>(p.residual) + row * p.cols, c);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          s.v[i] = from_float<T>(round_to<T>(acc[i]) + to_float(res.v[i]));
          sum_sq += to_float(s.v[i]) * to_float(s.v[i]);
        }
        store_vec<T, N>(res_out_row, c, s);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) s.v[i] = from_float<T>(acc[i]);
        store_vec<T, N>(out_row, c, s);
      }
    }
    if constexpr (kNorm) {
      const float inv_rms = rsqrtf(block_reduce<false>(sum_sq) / p.cols + p.eps);
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const Vec<T, N> r = load_vec<T, N>(res_out_row, c);  // this thread's own store above
        const Vec<T, N> w = load_vec<T, N>(static_cast<const T*>(p.weight), c);
        Vec<T, N> y;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          y.v[i] = from_float<T>(to_float(w.v[i]) * round_to<T>(to_float(r.v[i]) * inv_rms));
        }
        store_vec<T, N>(out_row, c, y);
      }
    }
  }
  block_barrier(p, 1);
}

template <typename T, bool kNorm>
void launch(const OneShotParams& p) {
  constexpr int N = 16 / sizeof(T);
  const int grid = static_cast<int>(std::min<int64_t>(p.rows, kMaxBlocks));
  one_shot_kernel<T, N, kNorm>
      <<<grid, std::min(row_threads(p.cols / N), kMaxThreads), 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kNorm>
void dispatch(const OneShotParams& p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return launch<__nv_bfloat16, kNorm>(p);
    case at::kHalf: return launch<__half, kNorm>(p);
    default: return launch<float, kNorm>(p);
  }
}

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

void check_rows(const at::Tensor& t, const at::Tensor& x, const char* what, const char* op) {
  TORCH_CHECK(t.device() == x.device() && t.scalar_type() == x.scalar_type() && t.is_contiguous() &&
                  aligned_16(t.const_data_ptr()),
              op, ": ", what, " must be a contiguous, 16-byte aligned ", x.scalar_type(), " tensor on ", x.device(),
              ", got ", t.scalar_type(), " on ", t.device());
}

OneShotParams params(const at::Tensor& x, at::IntArrayRef buffer_ptrs, int64_t rank, int64_t buffer_bytes,
                     const char* op) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, op, ": x must be a [num_tokens, hidden] CUDA tensor, got ", x.sizes(),
              " on ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  check_rows(x, x, "x", op);
  const int64_t world = static_cast<int64_t>(buffer_ptrs.size());
  TORCH_CHECK(world >= 2 && world <= kMaxRanks, op, ": 2..", kMaxRanks, " ranks, got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, op, ": rank ", rank, " outside 0..", world - 1);
  TORCH_CHECK((x.size(1) * x.element_size()) % 16 == 0 && x.size(1) < (int64_t{1} << 31), op,
              ": hidden * element size must be a multiple of 16 bytes (and hidden < 2^31), got hidden ", x.size(1));
  TORCH_CHECK(x.numel() * x.element_size() <= buffer_bytes, op, ": x (", x.numel() * x.element_size(),
              " bytes) does not fit the buffer (", buffer_bytes, " bytes)");
  OneShotParams p{};
  for (int64_t r = 0; r < world; ++r) p.peers.ptrs[r] = reinterpret_cast<char*>(buffer_ptrs[r]);
  p.x = x.const_data_ptr();
  p.rows = x.size(0);
  p.cols = static_cast<int>(x.size(1));
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  return p;
}

}  // namespace

at::Tensor custom_all_reduce(const at::Tensor& x, at::IntArrayRef buffer_ptrs, int64_t rank, int64_t buffer_bytes) {
  OneShotParams p = params(x, buffer_ptrs, rank, buffer_bytes, "custom_all_reduce");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  p.out = out.mutable_data_ptr();
  if (p.rows > 0) dispatch<false>(p, x.scalar_type());
  return out;
}

std::tuple<at::Tensor, at::Tensor> custom_all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                                  const at::Tensor& weight, double eps,
                                                                  at::IntArrayRef buffer_ptrs, int64_t rank,
                                                                  int64_t buffer_bytes) {
  const char* op = "custom_all_reduce_add_rms_norm";
  OneShotParams p = params(x, buffer_ptrs, rank, buffer_bytes, op);
  check_rows(residual, x, "residual", op);
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual must be ", x.sizes(), ", got ", residual.sizes());
  check_rows(weight, x, "weight", op);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must be [", x.size(1), "], got ",
              weight.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x), residual_out = at::empty_like(x);
  p.residual = residual.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.residual_out = residual_out.mutable_data_ptr();
  p.eps = static_cast<float>(eps);
  if (p.rows > 0) dispatch<true>(p, x.scalar_type());
  return {out, residual_out};
}

}  // namespace compilelm::cuda
