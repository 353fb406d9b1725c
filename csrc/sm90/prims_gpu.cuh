// prims_gpu.cuh: the sm90 kernels' hardware primitives on a real GPU (nvcc, sm_90a): GpuPrims, the implementation
// the kernel bodies (sm90/fwd_kernel.cuh, bwd_kernel.cuh) take as their `Prims` parameter, and the only sm90 file that
// issues an mbarrier, named-barrier, TMA, wgmma, setmaxnreg or other inline-asm instruction, or reads the thread
// and block indices (tests/test_build_grid.py checks it). The protocol vocabulary around it (barrier ids, stage
// rings, warp roles) is sm90/pipeline.cuh's.
//
// Each primitive is the instruction sequence the kernels issued before the seam, through the same CUTLASS / CuTe
// calls, force-inlined: the seam changes no SASS (registers and instruction counts per kernel, cuobjdump -sass).
// The host implementation (emu/sm90_prims.h EmuPrims) gives each of them its meaning on CPU threads; the comments
// here say what that meaning is.
#pragma once
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <utility>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/fp8.h"
#include "sm90/pipeline.cuh"

#ifndef SINKATTN_DIAGNOSTIC
#define SINKATTN_DIAGNOSTIC 0
#endif
#ifndef SINKATTN_DIAGNOSTIC_CYCLES
// 2^32 cycles: about 2 s at an H200's 1.98 GHz; a real wait lasts microseconds (a whole kernel, milliseconds).
#define SINKATTN_DIAGNOSTIC_CYCLES (1ll << 32)
#endif

namespace sinkattn::sm90 {

// The TMA load copy of a global tensor into one shared-memory tile layout (the traits' TmaQ / TmaKV types and the
// launchers' descriptors): CuTe's SM90_TMA_LOAD, one box per copy, no multicast (one CTA per cluster).
template <class GmemTensor, class SmemLayout>
using TmaLoad = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, std::declval<GmemTensor>(), SmemLayout{}));

// The GPU implementation only where nvcc compiles (the host emulation's units include this header for TmaLoad and
// take emu/sm90_prims.h EmuPrims instead).
#if defined(__CUDACC__)
struct GpuPrims {
  // ---- host side: descriptors --------------------------------------------------------------------------------
  // The descriptor of a TMA load of `smem_layout` boxes from `gmem` (cuTensorMapEncodeTiled through CuTe; the
  // caller checks the encode, sm90/tma_gmem.h checked_tma).
  template <class GmemTensor, class SmemLayout>
  static TmaLoad<GmemTensor, SmemLayout> make_tma_load(GmemTensor const& gmem, SmemLayout const& smem_layout) {
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, gmem, smem_layout);
  }

  // ---- who and where ---------------------------------------------------------------------------------------------
  // The thread's index in its CTA, the CTA's index and the grid's size (1-D launches). thread_index_reread reads
  // %tid.x through asm volatile, which the compiler cannot keep live or hoist: what is derived from it is
  // recomputed where used instead of held in a register across a loop (the backward spilled otherwise).
  static __device__ __forceinline__ unsigned thread_index() { return threadIdx.x; }
  static __device__ __forceinline__ int thread_index_reread() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
  }
  // Unsigned, as the hardware's registers: the tile walks widen them to 64 bits, and a signed int there would cost
  // sign extensions the kernels never had.
  static __device__ __forceinline__ unsigned block_index() { return blockIdx.x; }
  static __device__ __forceinline__ unsigned grid_size() { return gridDim.x; }

  // ---- whole-CTA and warp ----------------------------------------------------------------------------------------
  // Before the role split only: every thread of the CTA (the barrier inits visible to all).
  static __device__ __forceinline__ void sync_threads() { __syncthreads(); }
  // The online softmax's row reductions across a quad's lanes (common/online_softmax.h takes this type).
  static __device__ __forceinline__ float shfl_xor(float x, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, x, lane_mask);
  }
  // setmaxnreg: the producer warpgroup gives registers back, the consumer warpgroups take them (a warpgroup-wide
  // instruction; the budgets are the tile's, sm90/fwd_tiles.h). The registers available, not what a thread means.
  template <int kRegs>
  static __device__ __forceinline__ void setmaxnreg_dec() { cutlass::arch::warpgroup_reg_dealloc<kRegs>(); }
  template <int kRegs>
  static __device__ __forceinline__ void setmaxnreg_inc() { cutlass::arch::warpgroup_reg_alloc<kRegs>(); }

  // ---- mbarriers ------------------------------------------------------------------------------------------------
  // A barrier in shared memory whose phase completes when `count` arrivals have come and (for a transaction
  // barrier) the expected bytes have landed. Initialized by one thread, then fence_barrier_init and sync_threads
  // before any thread uses it.
  static __device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
    cutlass::arch::ClusterBarrier::init(bar, count);
  }
  static __device__ __forceinline__ void fence_barrier_init() { cutlass::arch::fence_barrier_init(); }
  // One arrival; release: this thread's earlier shared-memory writes are visible to whoever waits on the phase.
  static __device__ __forceinline__ void arrive(uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); }
  // One arrival that also adds `bytes` to the phase's expected transaction count: the phase completes only when
  // the TMA loads naming this barrier have delivered that many bytes (the producer's call before its loads).
  static __device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, bytes);
  }
  // Wait until the barrier (slot `slot` of barrier `id`) completes the phase of parity `phase`; acquire: what the
  // arrivals released (and the TMA bytes) is visible after it. The ring's rule for which parity is
  // pipeline.cuh's wait_full / wait_empty.
  //
  // SINKATTN_DIAGNOSTIC=1 (off by default; setup.py passes -DSINKATTN_DIAGNOSTIC=1 to the CUDA units) bounds it:
  // past SINKATTN_DIAGNOSTIC_CYCLES the first lane of each waiting warp prints its block, warp, the barrier and
  // slot and the parity it waited for, and the thread traps, so a hang on a GPU lent for minutes fails the launch
  // in seconds with who waited on what. The normal build calls CUTLASS's wait (try_wait in a loop).
  static __device__ __forceinline__ void wait(uint64_t* bar, uint32_t phase, BarrierId id, int slot) {
#if SINKATTN_DIAGNOSTIC
    using Barrier = cutlass::arch::ClusterBarrier;
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
    cutlass::arch::ClusterBarrier::wait(bar, phase);
#endif
  }

  // ---- named barriers -------------------------------------------------------------------------------------------
  // Hardware barrier `id` (pipeline.cuh NamedBarrier, above CUTLASS's reserved ids) among `threads` threads, whole
  // warps: sync waits until that many have arrived or synced (and orders their shared-memory accesses around it);
  // arrive counts this warp's threads without waiting (the ping-pong hand-over).
  static __device__ __forceinline__ void named_sync(uint32_t threads, uint32_t id) {
    cutlass::arch::NamedBarrier::sync(threads, id);
  }
  static __device__ __forceinline__ void named_arrive(uint32_t threads, uint32_t id) {
    cutlass::arch::NamedBarrier::arrive(threads, id);
  }

  // ---- proxies and the compiler ---------------------------------------------------------------------------------
  // fence.proxy.async (shared): this thread's generic-proxy shared-memory accesses ordered with the async proxy's
  // (TMA writes, wgmma reads). After writing what a wgmma reads (dS^T, zeroed tail rows), and after reading what a
  // TMA load will overwrite (O in Q's buffer) before releasing it.
  static __device__ __forceinline__ void fence_async_shared() { cutlass::arch::fence_view_async_shared(); }
  // A compiler-only fence: CUTLASS's mbarrier wait and arrive are asm volatile without a memory clobber, so the
  // compiler may move a plain shared-memory load or store across them (asm volatile statements keep their order
  // among themselves, memory accesses do not); the hardware's ordering (a wait acquires, an arrive releases) needs
  // each access on its side in the program. One after every wait whose data is then read by plain loads, one
  // before every arrive that publishes plain stores. No instruction.
  static __device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

  // ---- TMA ------------------------------------------------------------------------------------------------------
  // The descriptor into the cache before its first use (the initializing thread, once per CTA).
  template <class Tma>
  static __device__ __forceinline__ void prefetch_tma(Tma const& tma) {
    cute::prefetch_tma_descriptor(tma.get_tma_descriptor());
  }
  // One box from global coordinates `src` (a tma_partition of the descriptor's tensor) into shared memory `dst`,
  // completing as transaction bytes on `bar` (async proxy; out-of-bounds rows and columns of the descriptor's
  // tensor land as zeros). The issuing thread said how many bytes to expect (arrive_expect_tx).
  template <class Tma, class Src, class Dst>
  static __device__ __forceinline__ void tma_load(Tma const& tma, uint64_t& bar, Src const& src, Dst&& dst) {
    cute::copy(tma.with(bar), src, dst);
  }

  // ---- cp.async (the producer warpgroup's gather of pages smaller than a TMA box) ----------------------------
  // 16 bytes from global `src` into shared memory at `smem_addr` (16-byte aligned both), through L1 (.ca: the gather
  // reads half a 32-byte sector per instruction, the other half with the next); !fill: 16 zero bytes, nothing read
  // (src-size 0). Asynchronous: the bytes are this thread's generic-proxy writes once the wait for their group returns, and
  // a wgmma may read them only after the writer's fence_async_shared.
  static __device__ __forceinline__ void cp_async16(uint32_t smem_addr, void const* src, bool fill) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
  }
  // The cp.async this thread issued since its last commit become one group; cp_async_wait_group<N> returns once at
  // most the N newest of its groups are in flight (the older ones landed).
  static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
  template <int N>
  static __device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
  }

  // ---- FP8 codes (the gather of FP8 caches) -------------------------------------------------------------------
  // Eight codes (lo: codes 0-3, hi: 4-7, the lowest byte first) of an FP8 cache in `format` (common/fp8.h: kFp8E4M3,
  // kFp8E5M2) as eight Elements in a 16-byte vector, exactly (every code of both formats is an fp16 and a bf16
  // value): cvt.rn.f16x2.{e4m3x2,e5m2x2} per pair of codes (sm_89 on; the lower code into the lower half), then, for
  // bf16, each half through fp32 (cvt.rn.bf16x2.f32 puts its first operand in the upper half).
  template <class Element>
  static __device__ __forceinline__ uint4 fp8x8_decode(uint32_t lo, uint32_t hi, int format) {
    uint32_t h[4];
    uint32_t const w[2] = {lo, hi};
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      if (format == kFp8E5M2) {
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e5m2x2 %0, l;\ncvt.rn.f16x2.e5m2x2 %1, h;\n}\n"
            : "=r"(h[2 * i]), "=r"(h[2 * i + 1]) : "r"(w[i]));
      } else {
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
            : "=r"(h[2 * i]), "=r"(h[2 * i + 1]) : "r"(w[i]));
      }
    }
    if constexpr (!std::is_same_v<Element, cutlass::half_t>) {
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        asm("{\n.reg .f16 l, h;\n.reg .f32 fl, fh;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 fl, l;\ncvt.f32.f16 fh, h;\n"
            "cvt.rn.bf16x2.f32 %0, fh, fl;\n}\n"
            : "=r"(h[i]) : "r"(h[i]));
      }
    }
    return make_uint4(h[0], h[1], h[2], h[3]);
  }

  // Entry i of a block-table row: the pool page that holds a sequence's i-th page of keys (read-only for the kernel's
  // life, so through the non-coherent cache).
  static __device__ __forceinline__ int page_entry(int const* table, int i) { return __ldg(table + i); }

  // ---- wgmma ----------------------------------------------------------------------------------------------------
  // acc (+)= A * B over the K mode, issued as one committed group by the warpgroup: the operands' registers fenced,
  // wgmma.fence, one wgmma per K step (the first zeroing acc when kZeroInit), commit_group. The group runs
  // asynchronously: acc (and a register A operand) may be touched again only after wgmma_wait lets it complete.
  template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
  static __device__ __forceinline__ void wgmma(TiledMma& mma, TA const& a, TB const& b, TC& acc) {
    using namespace cute;
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
      gemm(mma, a(_, _, k), b(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }
  // Wait until at most kPending of this warpgroup's committed groups are still in flight.
  template <int kPending>
  static __device__ __forceinline__ void wgmma_wait() { cute::warpgroup_wait<kPending>(); }
  // A compiler fence on a register tensor (no instruction): its registers are neither read early nor reused
  // across the asynchronous wgmma that reads or writes them.
  template <class T>
  static __device__ __forceinline__ void fence_operand(T& t) { cute::warpgroup_fence_operand(t); }

  // ---- plain shared-memory accesses through 32-bit shared addresses --------------------------------------------
  // A shared pointer's 32-bit shared-window address (a generic pointer holds 64 bits per precomputed address,
  // which the epilogues then spilled).
  template <class T>
  static __device__ __forceinline__ uint32_t smem_address(T const* ptr) { return cute::cast_smem_ptr_to_uint(ptr); }
  static __device__ __forceinline__ void sts32(uint32_t addr, uint32_t value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
  }
  static __device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
  // 16 bytes of global memory that no thread writes during the kernel (q), through the non-coherent cache.
  static __device__ __forceinline__ uint4 ldg128(void const* ptr) { return __ldg(static_cast<uint4 const*>(ptr)); }
  // 16 zero bytes at each of two shared addresses (one asm: the varlen tail zeroing of two tiles).
  static __device__ __forceinline__ void sts128_zero2(uint32_t a, uint32_t b) {
    asm volatile("st.shared.v4.u32 [%0], {%2, %2, %2, %2};\n"
                 "st.shared.v4.u32 [%1], {%2, %2, %2, %2};\n" ::"r"(a), "r"(b), "r"(0u)
                 : "memory");
  }
  static __device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
  }
  static __device__ __forceinline__ uint4 lds128(void const* ptr) {
    uint32_t const addr = cute::cast_smem_ptr_to_uint(ptr);
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
  }

  // ---- global atomics and the deterministic backward's turn ----------------------------------------------------
  // The dynamic tile walk's next index (relaxed, device scope).
  static __device__ __forceinline__ int fetch_add(int* p, int x) { return atomicAdd(p, x); }
  // Two adjacent fp32 adds into dq_accum (one float2 atomic, sm_90's). A template, so that host code including
  // this header through the traits for another arch (tests/layout_facts) never compiles it.
  template <class Float2>
  static __device__ __forceinline__ void atomic_add(Float2* p, Float2 x) { atomicAdd(p, x); }
  // One thread waits for the counter to reach `value` (spinning with a short sleep), then fences: the adds of the
  // turn before are visible to this CTA's adds after.
  static __device__ __forceinline__ void wait_until_equal(int* p, int value) {
    while (atomicAdd(p, 0) != value) __nanosleep(32);
    __threadfence();
  }
  static __device__ __forceinline__ void thread_fence() { __threadfence(); }
  static __device__ __forceinline__ void signal(int* p, int value) { atomicExch(p, value); }
};
#endif  // __CUDACC__

}  // namespace sinkattn::sm90
