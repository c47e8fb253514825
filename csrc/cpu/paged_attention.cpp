// CPU paged attention: decode rows and (chunked) prefill rows of many sequences in one call.
//
// Layout:
//   query         [num_tokens, num_heads, head_size]   token stride free, inner dims contiguous
//   key_cache     [num_blocks, block_size, num_kv_heads, head_size]   contiguous (value_cache alike)
//   cu_seqlens_q  int32 [num_seqs + 1]   query rows of seq i are cu[i]:cu[i+1]
//   seq_lens      int32 [num_seqs]       context length including the new rows (already cached)
//   block_tables  int32 [num_seqs, max_blocks_per_seq]   logical block -> physical block
//   out           [num_tokens, num_heads, head_size]   contiguous; rows >= cu[num_seqs] are zero
// Row j of seq i sits at position seq_len - q_len + j and sees cache positions 0 ..= that.
//
// Work item = (sequence, kv head, tile of query rows). Its rows x group query vectors
// (group = num_heads / num_kv_heads) share one kv head, so each key/value row is read (and
// widened to fp32) once per item and serves the whole GQA group. Keys are visited kKeyChunk
// positions at a time with an online (flash-style) softmax; all math is fp32. Items are
// sorted longest first and pulled from a shared counter, so one long prefill next to many
// decodes still keeps every thread busy.
//
// A float8_e4m3fn cache (FP8 KV cache) is widened through a 256-entry table; k_scale folds into
// the query's pre-scale and v_scale into the output (keys = key_cache * k_scale, values alike).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/cpu_ops.h"
#include "op_checks.h"
#include "cpu/vec.h"

namespace compilelm::cpu {
namespace {

constexpr int64_t kQueryVectors = 64;  // query vectors (rows x group) per work item
constexpr int64_t kKeyChunk = 32;      // key positions per online-softmax step
static_assert(kKeyChunk % vec::kLanes == 0, "the softmax exponentiates whole vectors of scores");

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_size, block_size, max_blocks, q_token_stride;
  int64_t rows_per_item;  // query rows per work item: about kQueryVectors / group, at least 1
  const int32_t* cu_seqlens_q;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  float scale;    // the softmax scale times k_scale (fp8 caches)
  float v_scale;  // 1, or an fp8 cache's value scale
};

struct WorkItem {
  int64_t seq, kv_head, row_begin, row_end;  // query rows [row_begin, row_end) of the sequence
  int64_t cost;                              // query vectors x keys visited
};

// fp32 scratch of one thread, sized for the largest work item (max_q query vectors).
struct Scratch {
  Scratch(const Problem& p, int64_t max_q)
      : q(max_q * p.head_size), acc(max_q * p.head_size), m(max_q), l(max_q), visible(max_q),
        scores(kKeyChunk), k_rows(kKeyChunk * p.head_size), v_rows(kKeyChunk * p.head_size),
        k(kKeyChunk), v(kKeyChunk) {}
  std::vector<float> q, acc;          // [num_q, D] pre-scaled queries, unnormalized outputs
  std::vector<float> m, l;            // [num_q] running max and softmax denominator
  std::vector<int64_t> visible;       // [num_q] keys of the current chunk each query may see
  std::vector<float> scores;          // [kKeyChunk]
  std::vector<float> k_rows, v_rows;  // [kKeyChunk, D] widened rows (unused for fp32)
  std::vector<const float*> k, v;     // [kKeyChunk] fp32 row pointers of the chunk
};

// Online-softmax step of num_q query vectors (q: [num_q, D], pre-scaled) against one chunk of
// keys; query i sees the first visible[i] of them. m, l: running max / denominator [num_q];
// acc: [num_q, D]; scores: [kKeyChunk] scratch.
COMPILELM_CPU_CLONES
void attend_chunk(const float* q, int64_t num_q, const float* const* k, const float* const* v,
                  const int64_t* visible, int64_t D, float* m, float* l, float* acc, float* scores) {
  using vec::kLanes;
  const int64_t D_vec = D - D % kLanes;  // vectorized part of head_size; the rest runs scalar
  for (int64_t i = 0; i < num_q; ++i) {
    const int64_t n = visible[i];
    if (n <= 0) continue;
    const float* qi = q + i * D;
    float* ai = acc + i * D;

    // scores = q . k and the new running max
    float mx = m[i];
    for (int64_t j = 0; j < n; ++j) {
      vec::fvec p0 = {}, p1 = {};  // two partial sums: two FMA chains in flight
      int64_t d = 0;
      for (; d + 2 * kLanes <= D_vec; d += 2 * kLanes) {
        p0 += vec::load(qi + d) * vec::load(k[j] + d);
        p1 += vec::load(qi + d + kLanes) * vec::load(k[j] + d + kLanes);
      }
      if (d < D_vec) {
        p0 += vec::load(qi + d) * vec::load(k[j] + d);
        d += kLanes;
      }
      float dot = vec::reduce_add(p0 + p1);
      for (; d < D; ++d) dot += qi[d] * k[j][d];
      scores[j] = dot;
      mx = std::max(mx, dot);
    }

    // p = exp(score - max); what was accumulated under the old max shrinks by `correction`
    const float correction = std::exp(m[i] - mx);  // 0 on the first chunk (m = -inf)
    m[i] = mx;
    for (int64_t j = 0; j < n; j += kLanes) vec::store(scores + j, vec::exp(vec::load(scores + j) - mx));
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += scores[j];
    l[i] = l[i] * correction + sum;

    // acc = acc * correction + p @ v, one vector-wide slice of head_size at a time; four partial
    // sums keep four FMAs in flight instead of one chain as long as the chunk
    int64_t d = 0;
    for (; d < D_vec; d += kLanes) {
      vec::fvec a0 = vec::load(ai + d) * correction, a1 = {}, a2 = {}, a3 = {};
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        a0 += vec::broadcast(scores[j]) * vec::load(v[j] + d);
        a1 += vec::broadcast(scores[j + 1]) * vec::load(v[j + 1] + d);
        a2 += vec::broadcast(scores[j + 2]) * vec::load(v[j + 2] + d);
        a3 += vec::broadcast(scores[j + 3]) * vec::load(v[j + 3] + d);
      }
      for (; j < n; ++j) a0 += vec::broadcast(scores[j]) * vec::load(v[j] + d);
      vec::store(ai + d, (a0 + a1) + (a2 + a3));
    }
    for (; d < D; ++d) {
      float a = ai[d] * correction;
      for (int64_t j = 0; j < n; ++j) a += scores[j] * v[j][d];
      ai[d] = a;
    }
  }
}

COMPILELM_CPU_CLONES
void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  vec::bf16_to_float(src, dst, n);
}

// float8_e4m3fn code -> its value (all 256 codes; 0x7f / 0xff are NaN).
const float* fp8_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// fp32 view of one cache row: the row itself for fp32, else widened into buf.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buf, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else if constexpr (std::is_same_v<scalar_t, c10::Float8_e4m3fn>) {
    const float* table = fp8_table();
    const auto* codes = reinterpret_cast<const uint8_t*>(row);
    for (int64_t d = 0; d < D; ++d) buf[d] = table[codes[d]];
    return buf;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    widen_bf16(reinterpret_cast<const uint16_t*>(row), buf, D);
    return buf;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

template <typename scalar_t, typename cache_t>
void run_item(const WorkItem& w, const Problem& p, const scalar_t* query, const cache_t* key_cache,
              const cache_t* value_cache, scalar_t* out, Scratch& s) {
  const int64_t D = p.head_size;
  const int64_t first_row = p.cu_seqlens_q[w.seq];
  const int64_t q_len = p.cu_seqlens_q[w.seq + 1] - first_row;
  const int64_t first_pos = p.seq_lens[w.seq] - q_len;  // position of the sequence's row 0
  const int32_t* block_table = p.block_tables + w.seq * p.max_blocks;
  const int64_t num_q = (w.row_end - w.row_begin) * p.group;

  // Query vector i = (row r, head h of the group), pre-scaled, fp32.
  for (int64_t i = 0; i < num_q; ++i) {
    const int64_t token = first_row + w.row_begin + i / p.group;
    const int64_t head = w.kv_head * p.group + i % p.group;
    const scalar_t* src = query + token * p.q_token_stride + head * D;
    for (int64_t d = 0; d < D; ++d) s.q[i * D + d] = static_cast<float>(src[d]) * p.scale;
  }
  std::fill_n(s.m.begin(), num_q, -std::numeric_limits<float>::infinity());
  std::fill_n(s.l.begin(), num_q, 0.f);
  std::fill_n(s.acc.begin(), num_q * D, 0.f);

  const int64_t num_keys = first_pos + w.row_end;  // the last row sees this many positions
  for (int64_t start = 0; start < num_keys; start += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, num_keys - start);
    int64_t block = start / p.block_size, in_block = start % p.block_size;  // of key position start + j
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = int64_t{block_table[block]} * p.block_size + in_block;
      const int64_t offset = (slot * p.num_kv_heads + w.kv_head) * D;
      s.k[j] = as_float(key_cache + offset, s.k_rows.data() + j * D, D);
      s.v[j] = as_float(value_cache + offset, s.v_rows.data() + j * D, D);
      if (++in_block == p.block_size) {
        in_block = 0;
        ++block;
      }
    }
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t pos = first_pos + w.row_begin + i / p.group;
      s.visible[i] = std::clamp<int64_t>(pos + 1 - start, 0, n);
    }
    attend_chunk(s.q.data(), num_q, s.k.data(), s.v.data(), s.visible.data(), D, s.m.data(), s.l.data(),
                 s.acc.data(), s.scores.data());
  }

  for (int64_t i = 0; i < num_q; ++i) {
    const int64_t token = first_row + w.row_begin + i / p.group;
    const int64_t head = w.kv_head * p.group + i % p.group;
    scalar_t* dst = out + (token * p.num_heads + head) * D;
    const float inv = p.v_scale / s.l[i];  // l > 0: every row sees at least position 0
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(s.acc[i * D + d] * inv);
  }
}

// Checks the batch description against the cache and lists the work items.
std::vector<WorkItem> plan(const Problem& p, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks) {
  const int32_t* cu = p.cu_seqlens_q;
  TORCH_CHECK(cu[0] == 0, "cu_seqlens_q[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[num_seqs] <= num_tokens, "cu_seqlens_q[-1] = ", cu[num_seqs], " exceeds num_tokens = ",
              num_tokens);
  std::vector<WorkItem> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = cu[seq + 1] - cu[seq];
    const int64_t seq_len = p.seq_lens[seq];
    TORCH_CHECK(q_len >= 0, "cu_seqlens_q must be non-decreasing (seq ", seq, ")");
    TORCH_CHECK(q_len <= seq_len, "seq ", seq, ": query length ", q_len, " exceeds seq_len ", seq_len);
    TORCH_CHECK(seq_len <= p.max_blocks * p.block_size, "seq ", seq, ": seq_len ", seq_len,
                " does not fit its block table (", p.max_blocks, " blocks of ", p.block_size, ")");
    for (int64_t b = 0; b * p.block_size < seq_len; ++b) {
      const int32_t block = p.block_tables[seq * p.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                  " is outside the cache (", num_blocks, " blocks)");
    }
    for (int64_t row = 0; row < q_len; row += p.rows_per_item) {
      const int64_t row_end = std::min(q_len, row + p.rows_per_item);
      const int64_t cost = (row_end - row) * p.group * (seq_len - q_len + row_end);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({seq, h, row, row_end, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

}  // namespace

at::Tensor paged_attention(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens,
    const at::Tensor& block_tables,
    double scale,
    int64_t max_query_len,
    bool /*prefill_rows: every row is written*/,
    double k_scale,
    double v_scale) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got ", query.device());
  TORCH_CHECK(max_query_len >= 0, "max_query_len must be >= 0 (0 = unknown), got ", max_query_len);
  check_paged_attention_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables);
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (fp8) {
    check_kv_scale(k_scale, "k_scale");
    check_kv_scale(v_scale, "v_scale");
  }
  const int64_t num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t num_seqs = seq_lens.size(0);

  const auto cu = cu_seqlens_q.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto tables = block_tables.contiguous();
  const Problem p{num_heads,
                  num_kv_heads,
                  num_heads / num_kv_heads,
                  query.size(2),
                  key_cache.size(1),
                  tables.size(1),
                  query.stride(0),
                  std::max<int64_t>(1, kQueryVectors / (num_heads / num_kv_heads)),
                  cu.const_data_ptr<int32_t>(),
                  lens.const_data_ptr<int32_t>(),
                  tables.const_data_ptr<int32_t>(),
                  static_cast<float>(fp8 ? scale * k_scale : scale),
                  fp8 ? static_cast<float>(v_scale) : 1.f};
  const int64_t num_tokens = query.size(0);
  const std::vector<WorkItem> items = plan(p, num_seqs, num_tokens, key_cache.size(0));

  at::Tensor out = at::empty(query.sizes(), query.options());
  const int64_t row_elems = num_heads * p.head_size;
  const int64_t num_rows = p.cu_seqlens_q[num_seqs];
  if (num_rows < num_tokens) {  // padding rows
    std::memset(static_cast<char*>(out.mutable_data_ptr()) + num_rows * row_elems * out.element_size(), 0,
                (num_tokens - num_rows) * row_elems * out.element_size());
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const auto run = [&](const auto* k, const auto* v) {
      using cache_t = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
      std::atomic<int64_t> next{0};
      const auto worker = [&](int64_t /*begin*/, int64_t /*end*/) {
        Scratch scratch(p, p.rows_per_item * p.group);
        const auto n = static_cast<int64_t>(items.size());
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
          run_item<scalar_t, cache_t>(items[i], p, q, k, v, o, scratch);
        }
      };
      // One slot per thread; each drains the shared queue (a nested call runs serially).
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items.size()), 1, worker);
    };
    if (fp8) {
      run(static_cast<const c10::Float8_e4m3fn*>(key_cache.const_data_ptr()),
          static_cast<const c10::Float8_e4m3fn*>(value_cache.const_data_ptr()));
    } else {
      run(key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>());
    }
  });
  return out;
}

}  // namespace compilelm::cpu
