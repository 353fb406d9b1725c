// online_softmax.h: the softmax of every kernel, forward and backward, in one place (docs/DESIGN.md section 1).
//
// - ScoreScale: what turns a raw dot product q.k into a score: softmax_scale, or with softcap
//   s = softcap * tanh(softmax_scale * qk / softcap), then unscaled.
// - OnlineSoftmax: per accumulator row, the running max of the scores seen (raw units: scale_log2 folds the
//   scale into the exp2) and the running sum of exp(s - max); rescale() takes one key block's scores (rescale_lazy()
//   too, moving the max only when it rises by more than 2^8), finalize() adds the learnable sink once per row and
//   gives the output scale and the LSE.
// - finalize_row: that last step on plain numbers (host tests call it through the extension).
// The row reductions across the 4 lanes of a quad go through Shfl::shfl_xor, so the same code runs on the GPU
// and under host emulation (emu/sm80_prims.h).
#pragma once
#include <cfloat>
#include <cmath>
#include "common/defs.h"

namespace sinkattn {

struct RowFinal {
  float out_scale;  // multiply the unnormalised output accumulator by this
  float lse;        // natural log, includes the sink
};

// row_max: max of the scaled scores seen (-inf if none), natural-log units; row_sum: sum of exp(s - row_max);
// sink: the sink logit, -inf when there is none. Re-basing on max(row_max, sink) keeps a large sink (say +30
// against scores near 0) from overflowing, and a row that saw no key gives out = 0 and lse = sink (or -inf)
// instead of NaN.
SA_HOST_DEVICE RowFinal finalize_row(float row_max, float row_sum, float sink) {
  if (row_max == -INFINITY || !(row_sum > 0.f)) {
    return RowFinal{0.f, sink};  // no visible key: out = 0, lse = sink (-inf without one)
  }
  if (sink == INFINITY) {  // the sink takes all the weight: out = 0, lse = +inf (the rebase below would be inf - inf)
    return RowFinal{0.f, INFINITY};
  }
  if (sink == -INFINITY) {  // bit for bit the plain-attention math
    return RowFinal{1.f / row_sum, row_max + logf(row_sum)};
  }
  float m = fmaxf(row_max, sink);
  float sum = row_sum * expf(row_max - m) + expf(sink - m);
  return RowFinal{expf(row_max - m) / sum, m + logf(sum)};
}

// The lse the backward recomputes P = exp(s - lse) with, for every backward (sm80, sm90, the emulation): the
// forward's lse, except that a row that saw no key and has no sink (finalize_row gave it lse = -inf, out = 0)
// takes +inf, so its P is exp(-inf) = 0 rather than exp(-inf - -inf) = NaN and the row adds nothing to dK, dV.
// (Rows past the sequence, which have no lse, take +inf as well: they add nothing either.)
SA_HOST_DEVICE float bwd_lse(float lse) { return lse == -INFINITY ? INFINITY : lse; }

// Sum or max over the 4 lanes of a quad, which hold the columns of the same accumulator rows (the m16n8 and
// wgmma C layouts: lane / 4 picks the row, lane % 4 the column pair).
template <class Shfl>
SA_DEVICE float quad_max(float x) {
  x = fmaxf(x, Shfl::shfl_xor(x, 1));
  return fmaxf(x, Shfl::shfl_xor(x, 2));
}
template <class Shfl>
SA_DEVICE float quad_sum(float x) {
  x += Shfl::shfl_xor(x, 1);
  return x + Shfl::shfl_xor(x, 2);
}

// Whether softcap is compiled out (kOff) or read at run time (kRunTime). The compute-bound tiles (prefill
// forward, every backward tile) are compiled twice, and the launcher (fwd_config.h, bwd_config.h) runs the kOff
// kernel when softcap is 0: a run-time test there was if-converted by ptxas into FMUL/MUFU.TANH/FMUL issued
// with a false predicate over every score of every block, about 12% of the forward's key-block loop (peer_sass
// FINDINGS, cause 3). With softcap on, the kRunTime kernel issues the same instructions a softcap-only kernel
// would (one compiled with softcap always on spilled 170-180 bytes in the hd64 prefill tile). Decode tiles,
// which wait on K/V bytes, are compiled once, kRunTime.
enum class Softcap { kOff, kRunTime };

// Raw dot products -> scores. Forward: bound() in place (softcap only), then OnlineSoftmax folds `log2` (the
// scale, or 1 with softcap, times log2 e) into its exp2, and `natural` converts its max to natural-log units.
// Backward: score() gives the natural-log score of one element and the tanh derivative it needs.
template <Softcap kCap = Softcap::kRunTime>
struct ScoreScale {
  bool softcap;
  float cap, scale;
  float natural;       // raw max -> natural-log units
  float log2;          // raw score -> log2 units
  float tanh_in;       // softmax_scale / softcap

  SA_HOST_DEVICE ScoreScale(float softmax_scale, float softcap_)
      : softcap(kCap == Softcap::kRunTime && softcap_ > 0.f), cap(softcap_),
        scale(softmax_scale), natural(on() ? 1.f : softmax_scale), log2(natural * float(M_LOG2E)),
        tanh_in(on() ? softmax_scale / softcap_ : 0.f) {}

  // A constant (false) under kOff, so the compiler drops the softcap branch.
  SA_HOST_DEVICE constexpr bool on() const {
    if constexpr (kCap == Softcap::kRunTime) return softcap;
    return false;
  }

  template <class Frag>
  SA_DEVICE void bound(Frag& acc) const {
    if (on()) {
      SA_UNROLL
      for (int i = 0; i < int(size(acc)); ++i) acc(i) = cap * tanhf(acc(i) * tanh_in);
    }
  }

  // The natural-log score of raw dot product x; dtanh = d score / d (scale x) over the softcap (1 without).
  SA_HOST_DEVICE float score(float x, float& dtanh) const {
    if (on()) {
      float const t = tanhf(x * tanh_in);
      dtanh = 1.f - t * t;
      return cap * t;
    }
    dtanh = 1.f;
    return x * scale;
  }
};

// The forward's per-row state over the key blocks of one tile. kRows: accumulator rows held by this thread.
template <int kRows, class Shfl>
struct OnlineSoftmax {
  float row_max[kRows];  // raw units; -inf until a visible key
  float row_sum[kRows];  // this thread's columns until reduce_sums(), then the row's

  SA_DEVICE OnlineSoftmax() {
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // The three steps of a key block, per row r of this thread. rescale() takes them row by row, rescale_lazy() the
  // first for every row, then the second only where the warp's vote says so, then the third.

  // Row r's running max extended by the block's scores (bounded and masked, raw units), across the row's quad.
  template <class Scores>
  SA_DEVICE float block_max(Scores const& scores, int r) const {
    float m = row_max[r];
    SA_UNROLL
    for (int c = 0; c < int(size<1>(scores)); ++c) m = fmaxf(m, scores(r, c));
    return quad_max<Shfl>(m);
  }
  // Row r's running max moved to m, its sum rescaled to it; returns what O's row r must be multiplied by.
  SA_DEVICE float rebase(int r, float m, float log2) {
    float const correction = exp2f(row_max[r] * log2 - scaled_max(m, log2));
    row_max[r] = m;
    row_sum[r] *= correction;
    return correction;
  }
  // Row r's scores become exp2(s * log2 - running max) in place and are added to its sum.
  template <class Scores>
  SA_DEVICE void exponentiate(Scores& scores, int r, float log2) {
    float const m_scaled = scaled_max(row_max[r], log2);
    SA_UNROLL
    for (int c = 0; c < int(size<1>(scores)); ++c) {
      float const e = exp2f(scores(r, c) * log2 - m_scaled);
      scores(r, c) = e;
      row_sum[r] += e;
    }
  }
  // A row that has seen only masked keys keeps max -inf; taking its exponentials against 0 then gives p = 0
  // instead of NaN.
  SA_DEVICE static float scaled_max(float m, float log2) { return m == -INFINITY ? 0.f : m * log2; }

  // One key block: scores(r, c) (bounded and masked, raw units) become exp2(s * log2 - new max) in place, the
  // running sums are rescaled and extended; correction[r] is what O's row r must be multiplied by.
  template <class Scores>
  SA_DEVICE void rescale(Scores& scores, float log2, float (&correction)[kRows]) {
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      correction[r] = rebase(r, block_max(scores, r), log2);
      exponentiate(scores, r, log2);
    }
  }

  // How far (log2 units) a block's max may rise above the running max before rescale_lazy moves it: the block's
  // exponentials are then at most 2^8, exact in fp32 sums and in bf16 / fp16 P (a relative precision that does
  // not depend on magnitude; 256 is far from fp16's 65504).
  static constexpr float kLazyRebaseLog2 = 8.f;

  // rescale() that moves the running max only when some row of the warp needs it: when no row's block max rises
  // more than kLazyRebaseLog2 above its running max, the block's exponentials are taken against the old max
  // (p <= 2^8) and neither the sums nor O are rescaled, so the warp skips on_rebase (O's rescale: 128 FMULs a
  // thread at hd256, 32 at hd64) on most key blocks past the first. Otherwise every row rebases as in rescale()
  // and on_rebase(correction) rescales O. The math is the same: out and the LSE are a function of (max, sum)
  // pairs that need any common reference, not the true max (docs/DESIGN.md section 1). Warp-uniform (a vote), so
  // that skipping is a uniform branch; every lane of the warp must call it.
  template <class Scores, class OnRebase>
  SA_DEVICE void rescale_lazy(Scores& scores, float log2, OnRebase&& on_rebase) {
    float m[kRows];
    // The largest rise of a row's max over the block, raw units. A row without a key yet rises from the lowest
    // finite float: the first visible key always moves its max, a block with none leaves it (-inf), no NaN.
    float rise = -INFINITY;
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      m[r] = block_max(scores, r);
      rise = fmaxf(rise, m[r] - (row_max[r] == -INFINITY ? -FLT_MAX : row_max[r]));
    }
    // A loop of 0 or 1 trips, not an `if`: ptxas if-converted the `if` into predicated instructions that every
    // block issues (the 32 / 128 FMULs of O's rescale under @P0 in the hd64 / hd256 tiles' SASS, no branch), the
    // work this is here to skip; it does not if-convert a loop. The trip count passes through Shfl::opaque so that
    // the front end cannot bound it by 1 and turn the loop back into an `if`.
    int rebases = Shfl::opaque(Shfl::any(rise * log2 > kLazyRebaseLog2) ? 1 : 0);
    SA_NO_UNROLL
    for (; rebases > 0; --rebases) {
      float correction[kRows];
      SA_UNROLL
      for (int r = 0; r < kRows; ++r) correction[r] = rebase(r, m[r], log2);
      on_rebase(correction);
    }
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) exponentiate(scores, r, log2);
  }

  // out_rows(r, c) *= correction[r]: O catches up with a rescale.
  template <class Rows>
  SA_DEVICE static void rescale_rows(Rows& out_rows, float const (&correction)[kRows]) {
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      SA_UNROLL
      for (int c = 0; c < int(size<1>(out_rows)); ++c) out_rows(r, c) *= correction[r];
    }
  }

  // After the last block: each row's sum over the whole quad.
  SA_DEVICE void reduce_sums() {
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] = quad_sum<Shfl>(row_sum[r]);
  }

  // Row r's output scale and LSE with the sink (-inf: none) counted once; after reduce_sums().
  SA_DEVICE RowFinal finalize(int r, float sink, float natural) const {
    float const max_nat = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * natural;
    return finalize_row(max_nat, row_sum[r], sink);
  }
};

}  // namespace sinkattn
