// pipeline.cuh: the protocol vocabulary of the sm90 kernels (forward and backward), the half of their seam to the
// hardware that does not depend on what runs it (docs/DESIGN.md section 4, "the sm90 seam"):
//   - BarrierId: the kernels' mbarriers by name (what a diagnostic or an emulator reports on a hang);
//   - NamedBarrier: every named-barrier id either kernel uses, in one enum;
//   - PipelineState: a stage ring's position (stage index and phase parity advanced in one place);
//   - wait_full / wait_empty: the two ways a ring's mbarrier is waited on, the parity rule written once;
//   - WarpRoles: which threads of a CTA are the producer, its TMA thread, the backward's row warp and the consumers.
// The other half is the implementation of the primitives, a struct of static functions the kernel bodies take as
// their template parameter `Prims` (the sm80 bodies read theirs as `Kt::Prims`): sm90/prims_gpu.cuh's GpuPrims on
// the GPU, emu/sm90_prims.h's EmuPrims on CPU threads (the host emulation). Nothing here issues an instruction;
// tests/test_build_grid.py checks that no sm90 file but prims_gpu.cuh reaches the hardware directly.
#pragma once
#include <cstdint>

#include "common/defs.h"

// The kernel bodies' functions that the compiler inlines or not as it likes (plain __device__, as before the seam;
// SA_DEVICE forces inlining): host code under host emulation.
#if defined(__CUDACC__)
#define SA90_DEVICE __device__
#else
#define SA90_DEVICE inline
#endif

namespace sinkattn::sm90 {

// The kernels' mbarriers, by name (the shared-memory fields of sm90/fwd_traits.h and sm90/bwd_traits.h).
enum class BarrierId : int { kTileFull, kTileEmpty, kQFull, kQEmpty, kKFull, kKEmpty, kVFull, kVEmpty, kKVFull };

SA_HOST_DEVICE char const* barrier_name(BarrierId id) {
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

// Every named barrier of the sm90 kernels (a kernel's ids, counted from 0; the GPU implementation adds CUTLASS's
// reserved ones). The forward's come in families of one per consumer warpgroup w (FwdNamedBarriers below gives
// their ids); the backward's are single. The two kernels never share a CTA, so their ids may overlap.
enum class NamedBarrier : uint32_t {
  kFwdTurn0 = 0,  // forward: kFwdTurn0 + w gives consumer warpgroup w the tensor cores (ping-pong); then, one per
                  // warpgroup after the turns, warpgroup w's own (its zeroed V tail before its product, its O in
                  // shared memory before its global stores); then, one per warpgroup w >= 1, warpgroup 0's zeroed
                  // V tail for warpgroup w
  kBwdDs = 0,      // backward: both consumer warpgroups' dS^T written (the dQ product reads both)
  kBwdDqTurn = 1,  // backward, deterministic: this key block's turn on the M tile's dq_accum rows
  kBwdTail = 2,    // backward, varlen: a tile's rows past its sequence zeroed before any product reads them
};
SA_HOST_DEVICE constexpr uint32_t id_of(NamedBarrier b) { return static_cast<uint32_t>(b); }

// The forward's ids for kWarpgroups consumer warpgroups: turns 0 .. W-1, then each warpgroup's own W .. 2W-1 (2 + w
// in the two-warpgroup tiles; 128 threads), then the V tails 2W .. 3W-2 (warpgroup 0 arrives, warpgroup w >= 1
// syncs: 256 threads). One V-tail barrier per warpgroup, not one for all: with ping-pong, warpgroup 1 reaches it
// holding the turn that warpgroup 2 needs to get there, so a barrier counting both would never complete (the host
// emulation found that deadlock in the three-warpgroup tile). 16 hardware barriers minus CUTLASS's 8 reserved
// leave 8: up to 3 warpgroups.
template <int kWarpgroups>
struct FwdNamedBarriers {
  static_assert(3 * kWarpgroups - 1 <= 8, "the forward's named barriers past the 8 the hardware leaves after CUTLASS's");
  static SA_HOST_DEVICE uint32_t turn(int w) { return id_of(NamedBarrier::kFwdTurn0) + w; }
  static SA_HOST_DEVICE uint32_t own(int w) { return id_of(NamedBarrier::kFwdTurn0) + kWarpgroups + w; }
  static SA_HOST_DEVICE uint32_t v_tail(int w) { return id_of(NamedBarrier::kFwdTurn0) + 2 * kWarpgroups + w - 1; }
};

// A stage ring's position: how many stages the walk has passed. The stage is count % kStages and the phase
// parity of that stage's barriers (count / kStages) & 1: each pass over the ring completes one phase of each
// stage's full and empty barrier. This is CUTLASS's PipelineState in what it means (index and phase advanced in
// one place) but not in how it holds it: the count is what the kernels computed from before the seam, and the
// SASS contract (the seam changes no instruction) is kept by keeping that arithmetic; for the kernels' ring
// sizes (1, 2, 3 stages) it costs a shift or a multiply-high where the stage is needed.
template <int kStages>
struct PipelineState {
  static_assert(kStages >= 1);
  int count = 0;
  SA_HOST_DEVICE int index() const { return count % kStages; }
  SA_HOST_DEVICE uint32_t phase() const { return (count / kStages) & 1; }
  SA_HOST_DEVICE void advance() { ++count; }
};

// A consumer waits until the stage's full barrier completes the phase of this pass (its data landed). A producer
// waits on the stage's empty barrier for the phase before it (the consumers released the stage one pass ago): on
// the first pass that is the phase "before" a freshly initialized barrier, which counts as complete, so the
// producer fills every stage once without waiting. Prims: the implementation (prims_gpu.cuh's GpuPrims).
template <class Prims, int kStages>
SA_DEVICE void wait_full(uint64_t* bars, PipelineState<kStages> const& s, BarrierId id) {
  Prims::wait(&bars[s.index()], s.phase(), id, s.index());
}
template <class Prims, int kStages>
SA_DEVICE void wait_empty(uint64_t* bars, PipelineState<kStages> const& s, BarrierId id) {
  Prims::wait(&bars[s.index()], s.phase() ^ 1, id, s.index());
}

// Who does what in a CTA of 128 * (1 + consumer warpgroups) threads, by thread index (the CTA's, as
// Prims::thread_index gives it; unsigned, as the hardware's). Warpgroup 0 produces: its thread 0 (warp 0, lane 0)
// initializes the barriers and issues every TMA load; in the backward its warp 1 writes each stage's LSE / delta
// rows; the rest of it idles after giving its registers back. Warpgroups 1.. consume, numbered 0.. among themselves
// (a consumer thread index ctid in [0, 128 * consumer warpgroups)).
struct WarpRoles {
  static constexpr unsigned kProducerThreads = 128;
  static SA_HOST_DEVICE bool producer(unsigned tid) { return tid < kProducerThreads; }
  static SA_HOST_DEVICE bool initializer(unsigned tid) { return tid == 0; }
  static SA_HOST_DEVICE bool tma_thread(unsigned tid) { return tid == 0; }
  static SA_HOST_DEVICE bool rows_warp(unsigned tid) { return tid >= 32 && tid < 64; }
  static SA_HOST_DEVICE int rows_lane(unsigned tid) { return int(tid) - 32; }
  static SA_HOST_DEVICE int consumer_thread(unsigned tid) { return int(tid) - int(kProducerThreads); }
  static SA_HOST_DEVICE int consumer_thread(int tid) { return tid - int(kProducerThreads); }
  static SA_HOST_DEVICE int consumer_warpgroup(int ctid) { return ctid / 128; }
  static SA_HOST_DEVICE int thread_in_warpgroup(int ctid) { return ctid % 128; }
  static SA_HOST_DEVICE bool first_consumer(int ctid) { return ctid == 0; }
};

}  // namespace sinkattn::sm90
