// seq_extent.h: where sequence b of a batch lives and how long it is, for every kernel and params type.
//
// Padded batches: rows [0, seqlen) of batch b. Varlen: packed rows [cu_seqlens[b], cu_seqlens[b+1]).
// KV cache (FwdParams::seqused_k): the first seqused_k[b] keys of a padded or paged cache. The queries and the keys
// are packed or not each on their own: the serving call packs its queries (cu_seqlens_q) over a cache (no
// cu_seqlens_k), the other varlen calls pack both.
#pragma once
#include <cstdint>
#include "common/defs.h"

namespace sinkattn {

struct SeqExtent {
  bool varlen;    // the query rows are packed (cu_seqlens_q)
  bool k_varlen;  // the key rows are packed (cu_seqlens_k); false over a KV cache
  int64_t q_start, k_start;  // first packed row (0 when padded)
  int seqlen_q, seqlen_k;

  // The one rule for where a row of sequence b lives, in elements from a tensor's start: row `row` of head `head`
  // is at (q_start + row) * row_stride + head * head_stride when varlen (packed rows), else at
  // b * batch_stride + row * row_stride + head * head_stride. q_row for tensors with the queries' rows (q, out,
  // dout, dq), k_row for the keys' (k, v, dk, dv). With row = 0 (and head = 0) it is the sequence's (head's)
  // base, to which the kernels add row * row_stride per row: the base is computed once, the per-row part is one
  // multiply-add.
  SA_HOST_DEVICE int64_t q_row(int b, int64_t batch_stride, int64_t row_stride, int64_t head_stride, int head = 0,
                               int64_t row = 0) const {
    return (varlen ? q_start * row_stride : int64_t(b) * batch_stride) + row * row_stride + int64_t(head) * head_stride;
  }
  SA_HOST_DEVICE int64_t k_row(int b, int64_t batch_stride, int64_t row_stride, int64_t head_stride, int head = 0,
                               int64_t row = 0) const {
    return (k_varlen ? k_start * row_stride : int64_t(b) * batch_stride) + row * row_stride + int64_t(head) * head_stride;
  }
  // Row `row` of head `head` in an lse-like buffer (fp32, rows contiguous: lse, dlse, delta, dsink_rows): padded
  // (batch, heads, seqlen_q), or (heads, total_q) when varlen, whose batch stride is then 0.
  SA_HOST_DEVICE int64_t lse_row(int b, int64_t batch_stride, int64_t head_stride, int head = 0, int row = 0) const {
    return (varlen ? q_start : 0) + int64_t(b) * batch_stride + int64_t(head) * head_stride + row;
  }
  // The first row of sequence b in a buffer whose rows are every sequence's query rows back to back (the fp32
  // accumulators dq_accum; lse-like buffers when varlen): q_start when varlen, else b * seqlen_q (padded).
  SA_HOST_DEVICE int64_t q_rows_before(int b, int seqlen_q_padded) const {
    return varlen ? q_start : int64_t(b) * seqlen_q_padded;
  }
  SA_HOST_DEVICE int64_t k_rows_before(int b, int seqlen_k_padded) const {
    return k_varlen ? k_start : int64_t(b) * seqlen_k_padded;
  }
};

// Packed M tiles (FwdParams::packed_tiles): sequence b's tiles of block_m rows (its seqlen_q * group rows) are
// grid blocks [v_b, v_b + tiles_b), v_b = cu_seqlens_q[b] * group / block_m + b. Consecutive starts differ by at
// least tiles_b (floor(y) - floor(x) + 1 >= ceil(y - x)), so the ranges are disjoint and increasing, and every
// v_b + tiles_b <= packed_tile_count(total_q, ...) for any total_q >= cu_seqlens_q[batch]: the count needs only the
// padded sizes the host holds. At most one block per sequence (and the padding rows' few) has no rows and exits.
SA_HOST_DEVICE int64_t packed_tile_count(int64_t total_q, int group, int block_m, int batch) {
  return total_q * group / block_m + batch + 1;
}
// Block t -> (sequence b, its M tile): b the last sequence with v_b <= t (a binary search over cu_seqlens_q; v_b is
// strictly increasing), m_block = t - v_b.
SA_HOST_DEVICE void packed_tile(int const* cu_seqlens_q, int batch, int group, int block_m, int64_t t, int& b,
                                int& m_block) {
  int lo = 0, hi = batch - 1;  // v_lo <= t always (v_0 = 0)
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (int64_t(cu_seqlens_q[mid]) * group / block_m + mid <= t) lo = mid;
    else hi = mid - 1;
  }
  b = lo;
  m_block = int(t - (int64_t(cu_seqlens_q[lo]) * group / block_m + lo));
}

template <class Params>
SA_HOST_DEVICE SeqExtent seq_extent(Params const& p, int b) {
  SeqExtent e;
  e.varlen = p.cu_seqlens_q != nullptr;
  e.k_varlen = p.cu_seqlens_k != nullptr;
  e.q_start = e.varlen ? p.cu_seqlens_q[b] : 0;
  e.k_start = e.k_varlen ? p.cu_seqlens_k[b] : 0;
  e.seqlen_q = e.varlen ? int(p.cu_seqlens_q[b + 1] - e.q_start) : p.seqlen_q;
  int seqlen_k = p.seqlen_k;
  if constexpr (requires { p.seqused_k; }) {
    if (p.seqused_k) seqlen_k = p.seqused_k[b];
  }
  e.seqlen_k = e.k_varlen ? int(p.cu_seqlens_k[b + 1] - e.k_start) : seqlen_k;
  return e;
}

}  // namespace sinkattn
