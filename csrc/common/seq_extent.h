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
