// pipeline.cuh: the sm90 kernels' mbarrier waits, in one place: the first piece of the seam through which the sm90
// kernels reach their pipeline primitives (docs/DESIGN.md sections 4 and 8, "the diagnostic build").
//
// Why one place: a wait whose phase or arrival count is wrong hangs the kernel, and on a GPU lent for minutes a hang
// costs the whole lease. The diagnostic build (SINKATTN_DIAGNOSTIC=1, off by default: setup.py passes
// -DSINKATTN_DIAGNOSTIC=1 to the CUDA units) bounds every wait: past SINKATTN_DIAGNOSTIC_CYCLES the first lane of each
// waiting warp prints its block, warp, the barrier and slot and the phase it waited for, and the thread traps, so
// the launch fails in seconds with who waited on what. The normal build calls CUTLASS's wait, as before (the SASS
// of every sm90 kernel is unchanged by this file).
#pragma once
#include <cstdint>
#include <cstdio>

#include <cutlass/arch/barrier.h>

#ifndef SINKATTN_DIAGNOSTIC
#define SINKATTN_DIAGNOSTIC 0
#endif
#ifndef SINKATTN_DIAGNOSTIC_CYCLES
// 2^32 cycles: about 2 s at an H200's 1.98 GHz; a real wait lasts microseconds (a whole kernel, milliseconds).
#define SINKATTN_DIAGNOSTIC_CYCLES (1ll << 32)
#endif

namespace sinkattn::sm90 {

// The kernels' mbarriers, by name (the shared-memory fields of sm90/fwd_traits.h and sm90/bwd_traits.h).
enum class BarrierId : int { kTileFull, kTileEmpty, kQFull, kQEmpty, kKFull, kKEmpty, kVFull, kVEmpty, kKVFull };

__device__ __forceinline__ char const* barrier_name(BarrierId id) {
  switch (id) {
    case BarrierId::kTileFull: return "tile_full";
    case BarrierId::kTileEmpty: return "tile_empty";
    case BarrierId::kQFull: return "q_full";
    case BarrierId::kQEmpty: return "q_empty";
    case BarrierId::kKFull: return "k_full";
    case BarrierId::kKEmpty: return "k_empty";
    case BarrierId::kVFull: return "v_full";
    case BarrierId::kVEmpty: return "v_empty";
    case BarrierId::kKVFull: return "kv_full";
  }
  return "?";
}

// Wait until the mbarrier at `bar` (slot `slot` of barrier `id`) completes the phase of parity `phase`. Barrier is
// cutlass::arch::ClusterBarrier or ClusterTransactionBarrier (the same wait; the types say what the barrier counts).
template <class Barrier>
__device__ __forceinline__ void wait_barrier(uint64_t* bar, uint32_t phase, BarrierId id, int slot) {
#if SINKATTN_DIAGNOSTIC
  if (Barrier::try_wait(bar, phase)) return;
  long long const start = clock64();
  while (!Barrier::try_wait(bar, phase)) {
    long long const waited = clock64() - start;
    if (waited > SINKATTN_DIAGNOSTIC_CYCLES) {
      if (threadIdx.x % 32 == 0) {
        printf("sinkattn diagnostic: block (%d, %d, %d) warp %d waited %lld cycles on %s[%d] for phase parity %u; "
               "trapping\n", int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(threadIdx.x / 32), waited,
               barrier_name(id), slot, phase);
      }
      __trap();
    }
  }
#else
  (void)id;
  (void)slot;
  Barrier::wait(bar, phase);
#endif
}

}  // namespace sinkattn::sm90
