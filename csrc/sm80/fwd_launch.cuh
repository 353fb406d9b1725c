// fwd_launch.cuh: the launcher of the sm80 forward (nvcc only, no torch): picks the tile configuration
// (fwd_config.h) and launches it, then the split-KV combine.
//
// The tiles are compiled in two translation units per head dim and dtype (generate_kernels.py), so neither
// holds every configuration: the one named fwd_sm80_hdim*_* holds run_fwd_sm80 and the row tiles, the one
// named *_keys the key-group (decode) tiles, reached through launch_fwd_part. The unit that does not compile a
// part sees launch_fwd_part for it as an explicit instantiation declaration (extern template, written by the
// generator), so its kernels are not instantiated twice. Measured on the 2-core dev machine: one unit of all
// the tiles took 83-87 s at hd64/hd128 (sm_80 + sm_90 SASS), which the split halves and runs in parallel.
#pragma once
#include <cuda_runtime.h>

#include "build_info.h"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_tile.cuh"

namespace sinkattn {

namespace sm80 {

// The tiles of `kUnit` for this problem (never called with a problem whose tile another unit compiles).
template <int kHeadDim, class Element, FwdUnit kUnit>
void launch_fwd_part(FwdParams const& p, cudaStream_t stream) {
  with_fwd_config<kHeadDim, Element, GpuPrims>(p, p.max_smem_per_block, [&]<class Kt>() {
    if constexpr (fwd_unit_of<Kt> == kUnit) launch_fwd_tile<Kt>(p, stream);
  });
}

// A tuning-grid variant (generate_kernels.py SWEEP_SM80; bench/sweep.py runs it by name, dispatch never does):
// one tile for every problem, softcap compiled out (its registry entry lists no softcap, so api.cpp never runs it
// with one), no split-KV (the plain forward's num_splits is 1).
template <class Tile, class Element>
void launch_fwd_variant(FwdParams const& p, cudaStream_t stream) {
  launch_fwd_tile<FwdTraits<Tile, Element, GpuPrims, Softcap::kOff>>(p, stream);
}

}  // namespace sm80

template <int kHeadDim, class Element>
void run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  sm80::with_fwd_config<kHeadDim, Element, sm80::GpuPrims>(p, p.max_smem_per_block, [&]<class Kt>() {
    sm80::launch_fwd_part<kHeadDim, Element, sm80::fwd_unit_of<Kt>>(p, stream);
  });
  if (p.num_splits > 1) sm80::launch_fwd_combine<Element>(p, stream);
}

}  // namespace sinkattn
