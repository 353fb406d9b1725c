// split.h: split-KV for decode. A CTA of a split visits a contiguous share of the key blocks its M tile
// sees; the partial results (normalised over their own keys, no sink) are combined afterwards, with the
// sink counted once, by combine_row.
#pragma once
#include <cmath>
#include <cstdint>
#include "common/defs.h"

namespace sinkattn {

// The share [begin, end) of `count` visited blocks that split `split` of `num_splits` takes.
SA_HOST_DEVICE void split_share(int count, int split, int num_splits, int& begin, int& end) {
  int per = (count + num_splits - 1) / num_splits;
  begin = split * per < count ? split * per : count;
  end = begin + per < count ? begin + per : count;
}

// num_splits = 0 picks this: enough CTAs to fill the SMs (decode launches few CTAs, one per sequence and
// KV head), but never more splits than key blocks, and the fewest splits whose wave efficiency is within
// 85% of the best, since every split costs a partial write and a combine read.
SA_HOST_DEVICE int choose_num_splits(int64_t ctas, int num_sms, int n_blocks, int max_splits) {
  if (ctas <= 0 || n_blocks <= 1 || ctas >= int64_t(num_sms) * 4 / 5) return 1;
  int limit = max_splits < n_blocks ? max_splits : n_blocks;
  float eff[129];
  float best = 0.f;
  if (limit > 128) limit = 128;
  for (int s = 1; s <= limit; ++s) {
    float waves = float(ctas * s) / float(num_sms);
    eff[s] = waves / ceilf(waves);
    best = eff[s] > best ? eff[s] : best;
  }
  for (int s = 1; s <= limit; ++s) {
    // A split count that leaves the per-split block count unchanged only adds overhead.
    if (s > 1 && (n_blocks + s - 1) / s == (n_blocks + s - 2) / (s - 1)) continue;
    if (eff[s] >= 0.85f * best) return s;
  }
  return 1;
}

// The merged lse of `n` split partials of one row (each normalised over its own keys, without the sink),
// with the sink counted once: lse = log(sum_s exp(lse_s) + exp(sink)). Split s then weighs
// exp(lse_s - lse) in the output; an empty split (lse -inf) weighs 0; a row with nothing at all gets -inf.
SA_HOST_DEVICE float combine_lse(float const* lse_parts, int64_t stride, int n, float sink) {
  float m = sink;
  for (int s = 0; s < n; ++s) m = fmaxf(m, lse_parts[s * stride]);
  if (m == -INFINITY) return -INFINITY;
  if (sink == INFINITY) return INFINITY;  // all the weight on the sink (expf(sink - m) would be inf - inf)
  float sum = expf(sink - m);
  for (int s = 0; s < n; ++s) sum += expf(lse_parts[s * stride] - m);
  return m + logf(sum);
}

SA_HOST_DEVICE float split_weight(float lse_part, float lse) {
  return (lse == -INFINITY || lse_part == -INFINITY) ? 0.f : expf(lse_part - lse);
}

}  // namespace sinkattn
