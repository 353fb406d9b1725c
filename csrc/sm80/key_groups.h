// key_groups.h: the merge at the end of a split-keys decode tile of the sm80 forward (fwd_traits.h: key groups).
#pragma once
#include <cmath>
#include <cute/tensor.hpp>
#include "common/defs.h"
#include "sm80/layout_utils.h"

namespace sinkattn::sm80 {

using namespace cute;

// Each key group holds the softmax state (max and sum per row) and O of its own keys, like a split of
// split-KV. Groups 1.. hand theirs to group 0 through the K/V stages, which rescales every state to the common
// max and adds them up; true for group 0's threads, which then hold the tile's result. A group that saw no
// visible key of a row has max -inf there and weighs 0. rows[r]: the tile row of the thread's r-th accumulator
// row; row_max (raw units) and row_total (the quad's sum) are replaced by the merged state.
template <class Kt, class Acc, int kRows>
SA_DEVICE bool merge_key_groups(char* smem_kv, int tid, float scale_log2, int const (&rows)[kRows],
                                float (&row_max)[kRows], float (&row_total)[kRows], Acc& acc_o) {
  using Prims = typename Kt::Prims;
  constexpr int kGroups = Kt::kKeyGroups, kM = Kt::kBlockM, kGroupThreads = 32 * Kt::kMmaWarps;
  constexpr int kFrag = decltype(size(acc_o))::value;
  float* merge_max = reinterpret_cast<float*>(smem_kv);  // [group][row]
  float* merge_sum = merge_max + kGroups * kM;           // [group][row]
  float* merge_o = merge_sum + kGroups * kM;             // [group - 1][fragment value][mma_tid]: conflict-free
  int const group = tid / kGroupThreads, mma_tid = tid % kGroupThreads;
  Prims::sync_threads();  // every warp's reads of the K/V stages done (with 3+ stages no barrier ends the loop)
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    if (mma_tid % 4 == 0) {  // the quad's 4 lanes hold the same row state
      Prims::smem_store(&merge_max[group * kM + rows[r]], row_max[r]);
      Prims::smem_store(&merge_sum[group * kM + rows[r]], row_total[r]);
    }
  }
  if (group > 0) {
    CUTE_UNROLL
    for (int i = 0; i < kFrag; ++i)
      Prims::smem_store(&merge_o[((group - 1) * kFrag + i) * kGroupThreads + mma_tid], acc_o(i));
  }
  Prims::sync_threads();
  if (group > 0) return false;
  auto const rc = acc_rowcol(acc_o.layout());
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) m = fmaxf(m, Prims::smem_load(&merge_max[g * kM + rows[r]]));
    float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
    float total = 0.f;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float const f = exp2f(Prims::smem_load(&merge_max[g * kM + rows[r]]) * scale_log2 - m_scaled);
      total += f * Prims::smem_load(&merge_sum[g * kM + rows[r]]);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(rc); ++c) {
        int const i = rc(r, c);
        acc_o(i) = g == 0 ? acc_o(i) * f
                          : acc_o(i) + f * Prims::smem_load(&merge_o[((g - 1) * kFrag + i) * kGroupThreads + mma_tid]);
      }
    }
    row_max[r] = m;
    row_total[r] = total;
  }
  return true;
}

}  // namespace sinkattn::sm80
