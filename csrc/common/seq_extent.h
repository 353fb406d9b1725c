// seq_extent.h: where sequence b of a batch lives and how long it is, for every kernel and params type.
//
// Padded batches: rows [0, seqlen) of batch b. Varlen: packed rows [cu_seqlens[b], cu_seqlens[b+1]).
// KV cache (FwdParams::seqused_k): the first seqused_k[b] keys of a padded or paged cache.
#pragma once
#include <cstdint>
#include "common/defs.h"

namespace sinkattn {

struct SeqExtent {
  bool varlen;
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
    return (varlen ? k_start * row_stride : int64_t(b) * batch_stride) + row * row_stride + int64_t(head) * head_stride;
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
    return varlen ? k_start : int64_t(b) * seqlen_k_padded;
  }
};

template <class Params>
SA_HOST_DEVICE SeqExtent seq_extent(Params const& p, int b) {
  SeqExtent e;
  e.varlen = p.cu_seqlens_q != nullptr;
  e.q_start = e.varlen ? p.cu_seqlens_q[b] : 0;
  e.k_start = e.varlen ? p.cu_seqlens_k[b] : 0;
  e.seqlen_q = e.varlen ? int(p.cu_seqlens_q[b + 1] - e.q_start) : p.seqlen_q;
  int seqlen_k = p.seqlen_k;
  if constexpr (requires { p.seqused_k; }) {
    if (p.seqused_k) seqlen_k = p.seqused_k[b];
  }
  e.seqlen_k = e.varlen ? int(p.cu_seqlens_k[b + 1] - e.k_start) : seqlen_k;
  return e;
}

}  // namespace sinkattn
