// fwd_launch.cuh: the sm80 forward on the GPU (nvcc only, no torch): the __global__ wrapper of the kernel body
// (fwd_kernel.h), the launch of one tile configuration, the launcher that picks the configuration
// (fwd_config.h), and the split-KV combine after it (common/combine_launch.cuh).
//
// The tiles are compiled in three translation units per head dim and dtype (generate_kernels.py), one per
// FwdUnit (fwd_config.h), so none holds every configuration: the one named fwd_sm80_hdim*_* holds run_fwd_sm80
// and the row tiles, the one named *_keys the key-group (decode) tiles, the one named *_softcap the prefill
// tiles that serve softcap; the launcher reaches the others through launch_fwd_part. A unit that does not
// compile a part sees launch_fwd_part for it as an explicit instantiation declaration (extern template, written
// by the generator), so its kernels are not instantiated twice. Measured on the 2-core dev machine: one unit of
// all the tiles took 83-87 s at hd64/hd128 (sm_80 + sm_90 SASS), which the split divides and runs in parallel.
#pragma once
#include <cuda_runtime.h>

#include "build_info.h"
#include "common/combine_launch.cuh"
#include "params.h"
#include "sm80/fwd_config.h"
#include "sm80/fwd_kernel.h"
#include "sm80/launch_tile.cuh"
#include "sm80/prims_gpu.cuh"

namespace sinkattn {

namespace sm80 {

// The launch bounds: FwdTraits::kMinCtasPerSm.
template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinCtasPerSm) fwd_kernel(__grid_constant__ const FwdParams p, FwdTileOrder const grid) {
  extern __shared__ __align__(128) char smem[];
  int m_block, split, head, batch;
  grid.decode(blockIdx.x, m_block, split, head, batch);
  fwd_block<Kt>(p, smem, threadIdx.x, m_block, batch, head, split);
}
// The decode tiles over FP8 caches (sm80/fp8_kv.h), with their own params (a kernel of its own, so the kernels above
// keep their names and parameter block).
template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinCtasPerSm) fwd_fp8_kernel(__grid_constant__ const FwdFp8Params p, FwdTileOrder const grid) {
  extern __shared__ __align__(128) char smem[];
  int m_block, split, head, batch;
  grid.decode(blockIdx.x, m_block, split, head, batch);
  fwd_block<Kt>(p, smem, threadIdx.x, m_block, batch, head, split);
}

// One tile configuration's launch.
template <class Kt>
void launch_fwd_tile(typename Kt::Params const& p, cudaStream_t stream) {
  FwdTileOrder const grid = fwd_tile_order<Kt::kBlockM>(p);
  if constexpr (Kt::kFp8) {
    launch_tile_kernel("fwd", fwd_fp8_kernel<Kt>, grid.count(), Kt::kNThreads, Kt::kSmemBytes, stream, p, grid);
  } else {
    launch_tile_kernel("fwd", fwd_kernel<Kt>, grid.count(), Kt::kNThreads, Kt::kSmemBytes, stream, p, grid);
  }
}

// The tiles of `kUnit` for this problem (never called with a problem whose tile another unit compiles).
template <int kHeadDim, class Element, FwdUnit kUnit>
void launch_fwd_part(FwdParams const& p, cudaStream_t stream) {
  with_fwd_config<kHeadDim, Element, GpuPrims>(p, p.max_smem_per_block, [&]<class Kt>() {
    if constexpr (fwd_unit_of<Kt> == kUnit) launch_fwd_tile<Kt>(p, stream);
  });
}

// A tuning-grid variant (sweep_grid.py SWEEP_SM80; bench/sweep/runner.py runs it by name, dispatch never does):
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
  if (p.num_splits > 1) launch_fwd_combine<Element>(p, stream);
}

// Decode over FP8 KV caches (sm80/fp8_kv.h): one unit per head dim and dtype (fwd_fp8_sm80_hdim*_*), every FP8 tile
// of the head dim in it, both formats in each kernel.
template <int kHeadDim, class Element>
void run_fwd_fp8_sm80(FwdFp8Params const& p, cudaStream_t stream) {
  sm80::with_fwd_fp8_tile<kHeadDim>(sm80::choose_fwd_fp8_tile(kHeadDim, sm80::fwd_shape(p).rows, p.max_smem_per_block),
                                    [&]<class Tile>() {
                                      sm80::launch_fwd_tile<sm80::FwdFp8Traits<Tile, Element, sm80::GpuPrims>>(p, stream);
                                    });
  if (p.num_splits > 1) launch_fwd_combine<Element>(p, stream);
}

}  // namespace sinkattn
