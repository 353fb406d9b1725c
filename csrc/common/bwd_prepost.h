// bwd_prepost.h: the pre- and postprocess steps of the backward (BwdParams in params.h), per row or per
// element, shared by the GPU kernels and the host emulation. Every reduction runs in a fixed order, so the
// results are bitwise repeatable.
#pragma once
#include <cmath>
#include <cstdint>
#include "common/defs.h"
#include "common/seq_extent.h"
#include "params.h"

namespace sinkattn {

// Index of row i of sequence b, head h, in lse-like buffers (lse, dlse, delta, dsink_rows).
SA_HOST_DEVICE int64_t bwd_lse_index(BwdParams const& p, int b, int h, int i) {
  int64_t const start = p.cu_seqlens_q ? p.cu_seqlens_q[b] : 0;
  return start + int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i;
}

// Offset of row i of sequence b, head h, in out and dout (their strides are the same).
SA_HOST_DEVICE int64_t bwd_out_row_offset(BwdParams const& p, SeqExtent const& ext, int b, int h, int i) {
  return ext.q_row(b, p.o_batch_stride, p.o_row_stride, p.o_head_stride, h, i);
}

// The rest of row li's preprocess once dot = rowsum(dO_i * O_i) is known: delta_i = dot - dlse_i, and the row's
// term of dsinks[h], p_i * (dlse_i - D_i) = -exp(sink - lse_i) * delta_i.
SA_HOST_DEVICE void bwd_preprocess_finish(BwdParams const& p, int64_t li, int h, float dot) {
  float const delta = dot - (p.dlse ? p.dlse[li] : 0.f);
  p.delta[li] = delta;
  if (p.sinks) {
    float const sink = p.sinks[h], lse = p.lse[li];
    // A +inf sink holds all of the row's weight (lse is +inf too, and expf(inf - inf) would be NaN).
    float const prob = (sink == -INFINITY || lse == -INFINITY) ? 0.f : sink == INFINITY ? 1.f : expf(sink - lse);
    p.dsink_rows[li] = -prob * delta;
  }
}

// Preprocess of row (b, h, i), one thread for the row (the host emulation; the GPU spreads a row over a group of
// threads, common/bwd_prepost_launch.cuh). Rows past the sequence are skipped.
template <class Element>
SA_HOST_DEVICE void bwd_preprocess_row(BwdParams const& p, int b, int h, int i) {
  SeqExtent const ext = seq_extent(p, b);
  if (i >= ext.seqlen_q) return;
  int64_t const off = bwd_out_row_offset(p, ext, b, h, i);
  Element const* o = static_cast<Element const*>(p.out) + off;
  Element const* d_o = static_cast<Element const*>(p.dout) + off;
  float dot = 0.f;
  for (int c = 0; c < p.headdim; ++c) dot += float(o[c]) * float(d_o[c]);
  bwd_preprocess_finish(p, bwd_lse_index(p, b, h, i), h, dot);
}

// Where row `row` of an fp32 accumulator (every sequence's rows back to back, the rows SeqExtent::q_rows_before /
// k_rows_before count) lives in its (batch, seqlen, heads, d) tensor, or its packed (total, heads, d) one when varlen.
SA_HOST_DEVICE int64_t bwd_accum_row_offset(bool varlen, int64_t row, int64_t seqlen, int64_t batch_stride,
                                            int64_t row_stride) {
  return varlen ? row * row_stride : (row / seqlen) * batch_stride + (row % seqlen) * row_stride;
}

// dq element (row of q, head, column): the dq slots summed in order (dS K, unscaled), times softmax_scale, converted.
template <class Element>
SA_HOST_DEVICE void bwd_convert_dq(BwdParams const& p, int64_t idx) {
  int const c = int(idx % p.headdim);
  int64_t const rh = idx / p.headdim;
  int const h = int(rh % p.nheads);
  int64_t const row = rh / p.nheads;
  float const acc = p.dq_accum[(row * p.nheads + h) * p.headdim_rounded + c] * p.softmax_scale;
  int64_t const dst = bwd_accum_row_offset(p.cu_seqlens_q, row, p.seqlen_q, p.dq_batch_stride, p.dq_row_stride);
  static_cast<Element*>(p.dq)[dst + int64_t(h) * p.dq_head_stride + c] = Element(acc);
}

// dk and dv element (row of k, KV head, column): the query heads of the group summed in order, converted.
template <class Element>
SA_HOST_DEVICE void bwd_convert_dkv(BwdParams const& p, int64_t idx) {
  int const c = int(idx % p.headdim);
  int64_t const rh = idx / p.headdim;
  int const hk = int(rh % p.nheads_k);
  int64_t const row = rh / p.nheads_k;
  int const group = p.nheads / p.nheads_k;
  float dk = 0.f, dv = 0.f;
  for (int g = 0; g < group; ++g) {
    int64_t const a = (row * p.nheads + hk * group + g) * p.headdim_rounded + c;
    dk += p.dk_accum[a];
    dv += p.dv_accum[a];
  }
  bool const varlen = p.cu_seqlens_k != nullptr;
  int64_t const dk_dst = bwd_accum_row_offset(varlen, row, p.seqlen_k, p.dk_batch_stride, p.dk_row_stride) +
                         int64_t(hk) * p.dk_head_stride + c;
  int64_t const dv_dst = bwd_accum_row_offset(varlen, row, p.seqlen_k, p.dv_batch_stride, p.dv_row_stride) +
                         int64_t(hk) * p.dv_head_stride + c;
  static_cast<Element*>(p.dk)[dk_dst] = Element(dk);
  static_cast<Element*>(p.dv)[dv_dst] = Element(dv);
}

// dsinks[h]: the rows' terms in order (sequence by sequence, row by row); the host emulation's (the GPU sums them
// with a block per head in a fixed order, common/bwd_prepost_launch.cuh).
SA_HOST_DEVICE void bwd_sum_dsinks(BwdParams const& p, int h) {
  float acc = 0.f;
  int const batches = p.cu_seqlens_q ? 1 : p.batch;
  int64_t const rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  for (int b = 0; b < batches; ++b) {
    float const* r = p.dsink_rows + int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride;
    for (int64_t i = 0; i < rows; ++i) acc += r[i];
  }
  p.dsinks[h] = acc;
}

}  // namespace sinkattn
