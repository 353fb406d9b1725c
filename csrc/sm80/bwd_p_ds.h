// bwd_p_ds.h: the sm80 backward's pass from S and dP to P and dS for one (M tile, N tile), and P and dS staged in
// shared memory for the dV, dK and dQ products (bwd_kernel.h).
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "params.h"
#include "sm80/layout_utils.h"

namespace sinkattn::sm80 {

using namespace cute;

// The lse (bwd_lse's rule applied: +inf past the sequence) and delta of this thread's rows of one M tile. The kernel
// loads them at the top of the tile, ahead of its S and dP products: loaded inside the pass, each tile waited on
// those global loads (the model's chain of the hd128 tile, tools/perf_model.py --path profile: 856 of its 1609
// cycles of waits per tile, the loads' whole latency).
template <int kRows>
struct RowStats {
  float lse[kRows], delta[kRows];
};
template <int kRows, class Coords>
SA_DEVICE RowStats<kRows> load_row_stats(BwdParams const& p, Coords const& tScS, int i0, int seqlen_q, int64_t lse_seq) {
  RowStats<kRows> st;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int const i = i0 + get<0>(tScS(r, 0));
    st.lse[r] = bwd_lse(i < seqlen_q ? p.lse[lse_seq + i] : INFINITY);
    st.delta[r] = i < seqlen_q ? p.delta[lse_seq + i] : 0.f;
  }
  return st;
}

// P = exp(S - lse), the forward's probabilities recomputed (lse holds the sink), and dS = P (dP - delta), element
// by element in one pass over acc_s (S in, P out) and acc_dp (dP in, dS out); the mask's row bounds
// (TileMask::row_keys) decide each element's visibility in the same pass: P = 0 and dS = 0 where hidden. Rows
// past the sequence, and rows that see no key and have no sink (lse = -inf), take lse = +inf (bwd_lse): P = 0
// there, never NaN. tScS: the (row, key) of this thread's elements in the tile (rows x cols view). st: the rows'
// lse and delta (load_row_stats). i0, j0: the tile's first query and key (m_block * kBlockM,
// n_block * kBlockN), computed once by the caller, which the dQ adds share: computing them here as well changed
// the integer code around the M-tile loop and cost the sm_90 hd128 softcap tile 4 registers (218 -> 222).
// Without softcap the mask is TileMask::apply on the raw scores (-inf: exp2 gives P = 0 and dS = 0), as in the
// forward, and the pass over the elements has no test in it: a visibility test per element in the pass cost ~170
// instructions per tile on sm_90. The caller applies it (mask_raw_scores), in the kernel's body. With softcap
// (tanh(-inf) would be -1) each element's test stays (kTestEach; `masked`: whether the tile needs the mask).
template <class Kt>
inline constexpr bool kTestEach = Kt::kCap != Softcap::kOff;

template <class Coords, class AccS>
SA_DEVICE void mask_raw_scores(TileMask const& tile_mask, Coords const& tScS, int i0, int j0, AccS& acc_s) {
  constexpr int kRows = decltype(size<0>(tScS))::value, kCols = decltype(size<1>(tScS))::value;
  Tensor scores = rowcol_view(acc_s);
  tile_mask.apply<kRows, kCols>(tScS, i0, j0, [&](int r, int c) { scores(r, c) = -INFINITY; });
}

template <class Kt, class Coords, class AccS, class AccDp>
SA_DEVICE void p_ds_pass(BwdParams const& p, TileMask const& tile_mask, ScoreScale<Kt::kCap> const& score,
                         Coords const& tScS, bool masked, int i0, int j0,
                         RowStats<decltype(size<0>(tScS))::value> const& st, AccS& acc_s, AccDp& acc_dp) {
  constexpr int kRows = decltype(size<0>(tScS))::value, kCols = decltype(size<1>(tScS))::value;
  float const log2e = float(M_LOG2E);
  Tensor scores = rowcol_view(acc_s);
  Tensor dps = rowcol_view(acc_dp);
  // ScoreScale's log2 without softcap, written from the parameter again: read from `score`, ptxas held it in a
  // register (hd64 bwd 246 -> 251 registers on sm_80, the same instructions).
  float const scale_log2 = p.softmax_scale * log2e;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int const i = i0 + get<0>(tScS(r, 0));
    float const delta = st.delta[r];
    float const lse_log2 = st.lse[r] * log2e;
    TileMask::RowKeys const keys = tile_mask.row_keys(i, j0);
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      if constexpr (kTestEach<Kt>) {
        float dtanh;
        float const s = score.score(scores(r, c), dtanh);
        float const prob = !masked || keys.visible(get<1>(tScS(r, c))) ? exp2f(s * log2e - lse_log2) : 0.f;
        scores(r, c) = prob;
        dps(r, c) = prob * (dps(r, c) - delta) * dtanh;
      } else {
        float const prob = exp2f(scores(r, c) * scale_log2 - lse_log2);
        scores(r, c) = prob;
        dps(r, c) = prob * (dps(r, c) - delta);
      }
    }
  }
}

// P and dS in the input precision, registers -> shared memory (tPsP, tPsdS: the smem_copy_c partitions of sP and
// sdS), converted in one loop over both fragments. The caller's barrier completes them.
template <class Element, class SmemCopy, class SmemThr, class AccS, class AccDp, class SP, class SdS>
SA_DEVICE void stage_p_ds(SmemCopy const& smem_copy_c, SmemThr const& smem_thr_c, AccS const& acc_s,
                          AccDp const& acc_dp, SP& tPsP, SdS& tPsdS) {
  Tensor rP = make_tensor<Element>(acc_s.layout());
  Tensor rdS = make_tensor<Element>(acc_dp.layout());
  CUTE_UNROLL
  for (int e = 0; e < size(acc_s); ++e) {
    rP(e) = Element(acc_s(e));
    rdS(e) = Element(acc_dp(e));
  }
  copy(smem_copy_c, smem_thr_c.retile_S(rP), tPsP);
  copy(smem_copy_c, smem_thr_c.retile_S(rdS), tPsdS);
}

}  // namespace sinkattn::sm80
