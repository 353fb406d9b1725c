// bwd_emu_steps.h: the backward on the host around its main kernel body, for the emulated backwards of both
// families (emu/bwd_sm80_emu.h, emu/bwd_sm90_emu.h): the preprocess rows, the body, then the conversions of dQ and
// dK / dV and the dsinks sums. The steps are common/bwd_prepost.h's, which the GPU runs as kernels of their own.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/bwd_prepost.h"
#include "params.h"

namespace sinkattn {

template <int kHeadDim, class Element, class Body>
void run_bwd_steps_on_host(BwdParams const& p, Body const& body) {
  if (p.headdim_rounded != kHeadDim)  // the kernel adds dQ over whole dq_accum rows of kHeadDim columns
    throw std::runtime_error("sinkattn bwd: headdim_rounded " + std::to_string(p.headdim_rounded) +
                             " is not the kernel's head dim " + std::to_string(kHeadDim));
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.nheads; ++h)
      for (int i = 0; i < p.seqlen_q; ++i) bwd_preprocess_row<Element>(p, b, h, i);
  body();
  for (int64_t e = 0; e < int64_t(p.total_q) * p.nheads * p.headdim; ++e) bwd_convert_dq<Element>(p, e);
  for (int64_t e = 0; e < int64_t(p.total_k) * p.nheads_k * p.headdim; ++e) bwd_convert_dkv<Element>(p, e);
  if (p.dsinks)
    for (int h = 0; h < p.nheads; ++h) bwd_sum_dsinks(p, h);
}

}  // namespace sinkattn
