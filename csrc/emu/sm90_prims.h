// sm90_prims.h: EmuPrims, the host implementation of the sm90 kernels' seam (the `Prims` their bodies take; the GPU's
// is sm90/prims_gpu.cuh GpuPrims), on emu/sm90_runtime.h's CTA model. Each primitive does what the comment on its
// GpuPrims twin says it means, on CPU threads.
//
// Include it before any CuTe header of the unit: CuTe builds the real wgmma shared-memory descriptors on the host
// once __cvta_generic_to_shared has a host definition (a pointer's offset in the running CTA's shared memory), and
// reads it when the header that calls it is first parsed.
//
//   - TMA: make_tma_load runs CuTe's make_tma_copy (whose driver encode does not compile on the host) and writes the
//     project's own description (runtime TensorMap) from the box and global extents CuTe chose; tma_load issues
//     each box of the copy through the runtime (zero fill out of bounds, the swizzle as the hardware applies it).
//   - wgmma: the descriptors' fields (start address, LBO, SBO, swizzle) decoded as the hardware reads them, K- or
//     MN-major from the instruction's operand types; register A operands and accumulators in the hardware's
//     fragment layouts (the atom's ALayout / CLayout). A group is recorded at issue (its accumulators poisoned to
//     NaN: a read before its wgmma_wait shows) and computed at the wait that retires it, reading shared memory and
//     the register A operand then, as late as the hardware may read them.
//   - cp.async: issued and landed through the runtime (cp_async_issue / cp_async_land), each copy a generic-proxy
//     write of the issuing thread once it waits for it.
//   - SINKATTN_EMU90_MUTATE (tests only): a planted bug in one protocol or layout piece, to prove the checks and
//     the oracle catch it (tests/test_sm90_emulated.py): see `Mutation` below.
#pragma once
// The names of the host-compiled sm90 code are its own. CuTe's templates (make_tma_copy, the TMA copy traits, the
// shared-memory address cast) and sinkattn::sm90's are instantiated with the same arguments in the GPU units (nvcc)
// and here (the host compiler), but with different code and layouts: CuTe compiles the driver encode and the cast's
// asm only under nvcc, and its TMA copy is 256 bytes there and 192 here. The linker keeps one copy of each such weak
// symbol for the whole extension, so the emulated launcher ran nvcc's 256-byte copy into its 192-byte slot (a
// smashed stack), and the GPU launcher could as well have run the host's unencoded make_tma_copy. Renamed in every
// unit that includes this header, no symbol of CuTe or of sm90:: is shared with a GPU unit or an sm80 emulation
// unit (tests/test_build_grid.py checks the objects).
#if defined(CUTE_HOST_DEVICE)
#error "emu/sm90_prims.h must be the unit's first include: CuTe was parsed before its names were made the emulation's"
#endif
#define cute cute_emu90
#define sm90 sm90_emu
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/fp8.h"
#include "emu/sm90_runtime.h"

// CuTe's cast_smem_ptr_to_uint on the host: the shared-window address of a pointer into the CTA's shared memory.
inline size_t __cvta_generic_to_shared(void const* ptr) { return sinkattn::emu90::smem_offset(ptr); }
#define CUTE_CVTA_GENERIC_TO_SHARED_ACTIVATED 1

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/pipeline.cuh"

namespace sinkattn::emu90 {

// A planted bug (tests/test_sm90_emulated.py), read once per launch from SINKATTN_EMU90_MUTATE.
enum class Mutation {
  kNone,
  kArrivalCount,    // every mbarrier counts one arrival fewer per phase than the kernel initialized it with
  kParity,          // the consumers' full-barrier waits ask for the other phase parity
  kNoFence,         // fence.proxy.async does nothing
  kExpectTx,        // arrive_expect_tx expects 16 bytes more than the kernel says
  kEarlyRelease,    // wgmma_wait<N> retires one group fewer than asked (a stage released before its group ran)
  kSwizzle,         // TMA loads land unswizzled while wgmma reads swizzled
  kSwapLboSbo,      // wgmma reads its descriptors with LBO and SBO swapped
  kPageTable,       // every block-table lookup reads the sequence's first page (a page box from the wrong page)
  kCpAsyncWait,     // cp.async.wait_group returns without the thread's copies landed
  kCpAsyncGroup,    // cp.async.wait_group N waits for one group fewer (N + 1 left in flight)
};
inline Mutation& mutation() {
  static thread_local Mutation m = Mutation::kNone;
  return m;
}
inline Mutation read_mutation() {
  char const* s = std::getenv("SINKATTN_EMU90_MUTATE");
  std::string const v = s ? s : "";
  if (v.empty()) return Mutation::kNone;
  if (v == "arrival_count") return Mutation::kArrivalCount;
  if (v == "parity") return Mutation::kParity;
  if (v == "no_fence") return Mutation::kNoFence;
  if (v == "expect_tx") return Mutation::kExpectTx;
  if (v == "early_release") return Mutation::kEarlyRelease;
  if (v == "swizzle") return Mutation::kSwizzle;
  if (v == "swap_lbo_sbo") return Mutation::kSwapLboSbo;
  if (v == "page_table") return Mutation::kPageTable;
  if (v == "cp_async_wait") return Mutation::kCpAsyncWait;
  if (v == "cp_async_group") return Mutation::kCpAsyncGroup;
  throw std::invalid_argument("SINKATTN_EMU90_MUTATE=" + v + ": not a mutation of the sm90 host emulation");
}

// ---- wgmma ---------------------------------------------------------------------------------------------------
template <class Frg>
struct DescMajor {
  static constexpr bool kSmem = false;
};
template <cute::GMMA::Major M>
struct DescMajor<cute::GMMA::smem_desc<M>> {
  static constexpr bool kSmem = true;
  static constexpr bool kKMajor = M == cute::GMMA::Major::K;
};
template <class Traits>
constexpr bool a_from_smem() {
  if constexpr (requires { typename Traits::FrgTypeA; }) return DescMajor<typename Traits::FrgTypeA>::kSmem;
  return false;
}

// The byte address (in the CTA's shared memory) of element (row, k) of one wgmma operand tile, rows being M for A
// and N for B, k in [0, 16 bytes * 2 / element size): the canonical layouts of cute/arch/mma_sm90_desc.hpp in
// 16-byte units, T elements per unit, W units per swizzle row (8 / 4 / 2 for 128 / 64 / 32 bytes, 1 interleaved):
//   K-major   interleaved ((8,n),2):((1,SBO),LBO)      swizzled ((8,n),2):((W,SBO),1)
//   MN-major  interleaved ((T,n),(8,k)):((1,SBO),(T,LBO))   swizzled ((T,W,n),(8,k)):((1,T,LBO),(WT,SBO)) in elements
// then the swizzle of the address bits. Base offset 0 (CuTe's; the pattern starts at a 1024-byte boundary).
struct Desc {
  uint32_t start, lbo, sbo;
  int layout, swizzle_bits, w;
  explicit Desc(uint64_t d) {
    start = uint32_t(d & 0x3FFF) << 4;
    lbo = uint32_t((d >> 16) & 0x3FFF) << 4;
    sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
    layout = int((d >> 62) & 3);
    if (mutation() == Mutation::kSwapLboSbo) std::swap(lbo, sbo);
    if (((d >> 49) & 7) != 0) fail(here() + " issued a wgmma descriptor with a nonzero base offset");
    swizzle_bits = layout == 1 ? 3 : layout == 2 ? 2 : layout == 3 ? 1 : 0;
    w = 1 << swizzle_bits;
  }
  uint32_t address(bool k_major, int row, int k, int eb) const {
    int const t = 16 / eb;
    uint32_t off;
    if (k_major) {
      off = swizzle_bits == 0 ? (row % 8) * 16 + (row / 8) * sbo + (k / t) * lbo + (k % t) * eb
                              : (row % 8) * w * 16 + (row / 8) * sbo + (k / t) * 16 + (k % t) * eb;
    } else {
      int const c = row / t;
      off = swizzle_bits == 0 ? c * sbo + (k % 8) * 16 + (k / 8) * lbo + (row % t) * eb
                              : (c % w) * 16 + (c / w) * lbo + (k % 8) * w * 16 + (k / 8) * sbo + (row % t) * eb;
    }
    return swizzle(start + off, swizzle_bits);
  }
};

// One committed group of one thread: what it reads at completion and where its results go. A group is one wgmma
// per K step of each of its atoms (a TiledMma of MMA_M x MMA_N m64nNk16 atoms per warpgroup: the hd256 forward's
// 48-key block is three n16 atoms).
struct WgmmaAtom {
  std::vector<uint64_t> a_desc, b_desc;  // per K step
  std::vector<void const*> a_regs;       // register A operand: the element addresses, read at completion
  std::vector<int> a_idx;                // their (m + 64 k) positions
  std::vector<float*> acc;               // accumulator registers, with their (m + M n) positions
  std::vector<int> acc_idx;
  std::vector<float> c;                  // the accumulator's input (zero for a zero-initializing group)
};
struct WgmmaGroup {
  int m = 0, n = 0, ksteps = 0;  // one atom's M, N and the group's K steps
  bool a_smem = false, a_kmajor = true, b_kmajor = true, bf16 = true;
  std::vector<WgmmaAtom> atoms;
  uint64_t serial = 0;
};
inline thread_local std::deque<WgmmaGroup> wgmma_groups;
inline thread_local uint64_t wgmma_serial = 0;

inline float load16(uint32_t off, bool bf16) {
  uint16_t raw;
  std::memcpy(&raw, ctx.block->smem + off, 2);
  return bf16 ? float(cutlass::bfloat16_t::bitcast(raw)) : float(cutlass::half_t::bitcast(raw));
}

// The byte ranges one group's descriptors cover (the in-flight check of TMA loads).
inline std::vector<std::pair<uint32_t, uint32_t>> operand_ranges(WgmmaGroup const& g) {
  std::vector<std::pair<uint32_t, uint32_t>> r;
  auto add = [&](uint64_t d, bool kmajor, int rows) {
    Desc const desc(d);
    uint32_t lo = ~0u, hi = 0;
    for (int row = 0; row < rows; ++row)
      for (int k = 0; k < 16; ++k) {
        uint32_t const a = desc.address(kmajor, row, k, 2);
        lo = std::min(lo, a);
        hi = std::max(hi, a + 2);
      }
    r.emplace_back(lo, hi);
  };
  for (auto const& atom : g.atoms)
    for (int k = 0; k < g.ksteps; ++k) {
      if (g.a_smem) add(atom.a_desc[k], g.a_kmajor, g.m);
      add(atom.b_desc[k], g.b_kmajor, g.n);
    }
  return r;
}

// The oldest group of this thread's warpgroup, computed by all 128 of its threads together (wgmma_wait is
// warpgroup-wide): per atom, the operands decoded into the warpgroup's scratch, then each thread's own accumulators.
inline void retire(WgmmaGroup const& g) {
  Block& b = *ctx.block;
  int const wg = ctx.tid / 128, t = ctx.tid % 128;
  int const ktot = 16 * g.ksteps;
  std::vector<float>& sc = b.wg_scratch[wg];
  auto read_operand = [&](uint64_t d, bool kmajor, int row, int k) {
    uint32_t const off = Desc(d).address(kmajor, row, k, 2);
    for (uint32_t w = off / 4; w <= (off + 1) / 4; ++w) {
      if (uint8_t const what = b.tma_pending[w].load(std::memory_order_relaxed)) {
        fail(here() + "'s wgmma read shared byte " + std::to_string(off) + " before the " + pending_copy_name(what) +
             " into it completed (its full barrier not waited for)");
        throw Aborted{};
      }
      if (unfenced(b.last_write[w].load(std::memory_order_relaxed))) {
        fail(here() + "'s wgmma read shared byte " + std::to_string(off) + " that thread " +
             std::to_string(int(b.last_write[w].load() >> 32) - 1) +
             " wrote through the generic proxy with no fence.proxy.async since");
        throw Aborted{};
      }
    }
    return load16(off, g.bf16);
  };
  for (size_t ai = 0; ai < g.atoms.size(); ++ai) {
    // Every thread of the warpgroup holds the same number of atoms (the same TiledMma): ai is warpgroup-uniform.
    WgmmaAtom const& atom = g.atoms[ai];
    // The scratch is free once every thread is done with the previous atom's; the first atom's, at the barrier
    // that ends each retire.
    if (ai > 0) sync_warpgroup();
    if (t == 0) sc.assign(size_t(g.m + g.n) * ktot, 0.f);
    sync_warpgroup();
    float* A = sc.data();
    float* B = sc.data() + size_t(g.m) * ktot;
    if (g.a_smem) {
      for (int i = t; i < g.m * ktot; i += 128) {
        int const m = i % g.m, k = i / g.m;
        A[m + size_t(g.m) * k] = read_operand(atom.a_desc[k / 16], g.a_kmajor, m, k % 16);
      }
    } else {
      for (size_t i = 0; i < atom.a_regs.size(); ++i) {
        uint16_t raw;
        std::memcpy(&raw, atom.a_regs[i], 2);
        A[atom.a_idx[i]] = g.bf16 ? float(cutlass::bfloat16_t::bitcast(raw)) : float(cutlass::half_t::bitcast(raw));
      }
    }
    for (int i = t; i < g.n * ktot; i += 128) {
      int const n = i % g.n, k = i / g.n;
      B[n + size_t(g.n) * k] = read_operand(atom.b_desc[k / 16], g.b_kmajor, n, k % 16);
    }
    sync_warpgroup();
    for (size_t v = 0; v < atom.acc.size(); ++v) {
      int const m = atom.acc_idx[v] % g.m, n = atom.acc_idx[v] / g.m;
      float s = atom.c[v];
      for (int k = 0; k < ktot; ++k) s += A[m + size_t(g.m) * k] * B[n + size_t(g.n) * k];
      *atom.acc[v] = s;
    }
  }
  if (t == 0) {
    std::lock_guard<std::mutex> lock(b.mu);
    for (size_t i = 0; i < b.flights.size(); ++i)
      if (b.flights[i].warpgroup == wg && b.flights[i].serial == g.serial) {
        b.flights.erase(b.flights.begin() + long(i));
        break;
      }
  }
  sync_warpgroup();
}

struct EmuPrims {
  // ---- host side: descriptors --------------------------------------------------------------------------------
  template <class GmemTensor, class SmemLayout>
  static auto make_tma_load(GmemTensor const& gmem, SmemLayout const& smem_layout) {
    using namespace cute;
    auto tma = make_tma_copy(SM90_TMA_LOAD{}, gmem, smem_layout);
    using Aux = typename decltype(tma)::AuxParams;
    using Basis = std::remove_cvref_t<typename Aux::TmaGmemBasis>;
    using Swz = std::remove_cvref_t<typename Aux::TmaSwizzle>;
    using Element = typename GmemTensor::value_type;
    cute::array<uint64_t, 5> shape = {1, 1, 1, 1, 1}, stride = {0, 0, 0, 0, 0};
    detail::fill_tma_gmem_shape_stride(gmem, cute::stride(Basis{}), shape, stride);
    TensorMap m{};
    m.magic = TensorMap::kMagic;
    m.address = reinterpret_cast<char const*>(raw_pointer_cast(gmem.data()));
    m.dims = uint8_t(decltype(rank(Basis{}))::value);
    m.element_bytes = uint8_t(sizeof(Element));
    m.swizzle_bits = uint8_t(Swz::num_bits);
    for (int d = 0; d < 5; ++d) {
      m.shape[d] = shape[d];
      m.stride[d] = stride[d] * sizeof(Element);
      m.box[d] = 1;
    }
    for_each(make_seq<decltype(rank(Basis{}))::value>{}, [&](auto i) { m.box[i] = size<i>(Basis{}); });
    static_assert(sizeof(tma.tma_desc_) >= sizeof(TensorMap));
    std::memcpy(&tma.tma_desc_, &m, sizeof(m));
    return tma;
  }

  // ---- who and where -------------------------------------------------------------------------------------------
  static unsigned thread_index() { return unsigned(ctx.tid); }
  static int thread_index_reread() { return ctx.tid; }
  static unsigned block_index() { return unsigned(ctx.block->index); }
  static unsigned grid_size() { return unsigned(ctx.block->grid); }

  // ---- whole-CTA and warp --------------------------------------------------------------------------------------
  static void sync_threads() { emu90::sync_threads(); }
  static float shfl_xor(float x, int lane_mask) { return emu90::shfl_xor(x, lane_mask); }
  template <int kRegs>
  static void setmaxnreg_dec() {}
  template <int kRegs>
  static void setmaxnreg_inc() {}

  // ---- mbarriers -----------------------------------------------------------------------------------------------
  static void barrier_init(uint64_t* bar, int count) {
    mbar_init(bar, mutation() == Mutation::kArrivalCount && count > 1 ? count - 1 : count);
  }
  static void fence_barrier_init() {}
  static void arrive(uint64_t* bar) { mbar_arrive(bar); }
  static void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    mbar_arrive(bar, bytes + (mutation() == Mutation::kExpectTx ? 16 : 0), true);
  }
  static void wait(uint64_t* bar, uint32_t phase, sm90::BarrierId id, int slot) {
    bool const full = id == sm90::BarrierId::kQFull || id == sm90::BarrierId::kKFull ||
                      id == sm90::BarrierId::kVFull || id == sm90::BarrierId::kKVFull;
    if (mutation() == Mutation::kParity && full) phase ^= 1;
    mbar_wait(bar, phase, std::string(sm90::barrier_name(id)) + "[" + std::to_string(slot) + "]");
  }

  // ---- named barriers ------------------------------------------------------------------------------------------
  static void named_sync(uint32_t threads, uint32_t id) { named(threads, id, true); }
  static void named_arrive(uint32_t threads, uint32_t id) { named(threads, id, false); }

  // ---- proxies and the compiler --------------------------------------------------------------------------------
  static void fence_async_shared() {
    if (mutation() != Mutation::kNoFence) fence_proxy_async();
  }
  static void compiler_fence() { std::atomic_signal_fence(std::memory_order_seq_cst); }

  // ---- TMA -----------------------------------------------------------------------------------------------------
  template <class Tma>
  static void prefetch_tma(Tma const&) {}
  template <class Tma, class Src, class Dst>
  static void tma_load(Tma const& tma, uint64_t& bar, Src const& src, Dst&& dst) {
    using namespace cute;
    TensorMap m;
    std::memcpy(&m, tma.get_tma_descriptor(), sizeof(m));
    if (mutation() == Mutation::kSwizzle) m.swizzle_bits = 0;
    // The copy is one or more boxes: its elements in order, each box's the innermost (cute::copy splits it into
    // instructions of the box's size, the atom's value count).
    uint32_t box = 1;
    for (int d = 0; d < m.dims; ++d) box *= m.box[d];
    int const n = int(size(src));
    if (n % int(box) != 0 || int(size(dst)) != n) {
      fail(here() + " issued a TMA copy that is not whole boxes");
      throw Aborted{};
    }
    for (int i = 0; i < n; i += int(box)) {
      int crd[5] = {0, 0, 0, 0, 0};
      auto const coord = src(i);
      for_each(make_seq<decltype(rank(coord))::value>{}, [&](auto j) { crd[j] = int(get<j>(coord)); });
      tma_issue(m, &bar, crd, raw_pointer_cast(&dst(i)));
    }
  }

  static int page_entry(int const* table, int i) { return table[mutation() == Mutation::kPageTable ? 0 : i]; }

  template <class Element>
  static uint4 fp8x8_decode(uint32_t lo, uint32_t hi, int format) {
    uint16_t e[8];
    for (int i = 0; i < 8; ++i) {
      uint32_t const code = ((i < 4 ? lo : hi) >> (8 * (i % 4))) & 0xffu;
      Element const x(fp8_to_float(code, format));
      std::memcpy(&e[i], &x, 2);
    }
    uint4 v;
    std::memcpy(&v, e, 16);
    return v;
  }

  // ---- cp.async ------------------------------------------------------------------------------------------------
  static void cp_async16(uint32_t smem_addr, void const* src, bool fill) { cp_async_issue(smem_addr, src, fill); }
  static void cp_async_commit() { emu90::cp_async_commit(); }
  template <int N>
  static void cp_async_wait_group() {
    if (mutation() == Mutation::kCpAsyncWait) return;
    cp_async_land(mutation() == Mutation::kCpAsyncGroup ? N + 1 : N);
  }

  // ---- wgmma ---------------------------------------------------------------------------------------------------
  template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
  static void wgmma(TiledMma&, TA const& a, TB const& b, TC& acc) {
    using namespace cute;
    using Traits = typename TiledMma::Atom::Traits;
    constexpr int M = size<0>(typename Traits::Shape_MNK{});
    constexpr int N = size<1>(typename Traits::Shape_MNK{});
    constexpr int K = size<2>(typename Traits::Shape_MNK{});
    static_assert(M == 64 && K == 16, "16-bit wgmma atoms (m64nNk16)");
    static_assert(sizeof(typename Traits::ValTypeB) == 2);
    constexpr int kAtomsM = decltype(size<1>(acc))::value, kAtomsN = decltype(size<2>(acc))::value;
    static_assert(decltype(size<1>(a))::value == kAtomsM && decltype(size<1>(b))::value == kAtomsN);
    constexpr bool kASmem = a_from_smem<Traits>();
    WgmmaGroup g;
    g.m = M;
    g.n = N;
    g.ksteps = size<2>(a);
    g.a_smem = kASmem;
    g.bf16 = std::is_same_v<typename Traits::ValTypeB, cutlass::bfloat16_t>;
    g.b_kmajor = DescMajor<typename Traits::FrgTypeB>::kKMajor;
    if constexpr (kASmem) g.a_kmajor = DescMajor<typename Traits::FrgTypeA>::kKMajor;
    int const t = ctx.tid % 128;
    for (int mi = 0; mi < kAtomsM; ++mi)
      for (int ni = 0; ni < kAtomsN; ++ni) {
        WgmmaAtom atom;
        for (int k = 0; k < g.ksteps; ++k) {
          atom.b_desc.push_back(uint64_t(b(0, ni, k)));
          if constexpr (kASmem) {
            atom.a_desc.push_back(uint64_t(a(0, mi, k)));
          } else {
            for (int v = 0; v < size<0>(a); ++v) {
              int const idx = typename Traits::ALayout{}(t, v);
              atom.a_regs.push_back(&a(v, mi, k));
              atom.a_idx.push_back(idx % M + M * (16 * k + idx / M));
            }
          }
        }
        for (int v = 0; v < size<0>(acc); ++v) {
          atom.acc.push_back(&acc(v, mi, ni));
          atom.acc_idx.push_back(typename Traits::CLayout{}(t, v));
          atom.c.push_back(kZeroInit ? 0.f : acc(v, mi, ni));
          acc(v, mi, ni) = std::numeric_limits<float>::quiet_NaN();  // in flight: a read before wgmma_wait shows
        }
        g.atoms.push_back(std::move(atom));
      }
    g.serial = ++wgmma_serial;
    if (t == 0) {
      Flight f{ctx.tid / 128, g.serial, operand_ranges(g)};
      std::lock_guard<std::mutex> lock(ctx.block->mu);
      ctx.block->flights.push_back(std::move(f));
    }
    wgmma_groups.push_back(std::move(g));
  }
  template <int kPending>
  static void wgmma_wait() {
    size_t const keep = size_t(kPending) + (mutation() == Mutation::kEarlyRelease ? 1 : 0);
    while (wgmma_groups.size() > keep) {
      retire(wgmma_groups.front());
      wgmma_groups.pop_front();
    }
  }
  template <class T>
  static void fence_operand(T&) {}

  // ---- plain shared-memory accesses through 32-bit shared addresses --------------------------------------------
  template <class T>
  static uint32_t smem_address(T const* ptr) { return smem_offset(ptr); }
  static void sts32(uint32_t addr, uint32_t value) {
    char* p = ctx.block->smem + addr;
    generic_access(p, 4, true);
    std::memcpy(p, &value, 4);
  }
  static void sts128(uint32_t addr, uint4 v) {
    char* p = ctx.block->smem + addr;
    generic_access(p, 16, true);
    std::memcpy(p, &v, 16);
  }
  static uint4 ldg128(void const* ptr) {
    uint4 v;
    std::memcpy(&v, ptr, 16);
    return v;
  }
  static void sts128_zero2(uint32_t a, uint32_t b) {
    for (uint32_t addr : {a, b}) {
      char* p = ctx.block->smem + addr;
      generic_access(p, 16, true);
      std::memset(p, 0, 16);
    }
  }
  static uint4 lds128(uint32_t addr) { return lds128(ctx.block->smem + addr); }
  static uint4 lds128(void const* ptr) {
    generic_access(ptr, 16, false);
    uint4 v;
    std::memcpy(&v, ptr, 16);
    return v;
  }

  // ---- global atomics and the deterministic backward's turn ----------------------------------------------------
  static int fetch_add(int* p, int x) { return std::atomic_ref<int>(*p).fetch_add(x, std::memory_order_relaxed); }
  template <class Float2>
  static void atomic_add(Float2* p, Float2 x) {
    std::atomic_ref<float>(p->x).fetch_add(x.x, std::memory_order_relaxed);
    std::atomic_ref<float>(p->y).fetch_add(x.y, std::memory_order_relaxed);
  }
  // CTAs run one after another here, in grid order: a turn that is not due when its CTA asks never comes.
  static void wait_until_equal(int* p, int value) {
    int const now = std::atomic_ref<int>(*p).load(std::memory_order_acquire);
    if (now != value) {
      fail(here() + " waited for turn " + std::to_string(value) + " of a dq counter at " + std::to_string(now) +
           " (an earlier key block skipped its turn, or CTAs run out of order)");
      throw Aborted{};
    }
  }
  static void thread_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
  static void signal(int* p, int value) { std::atomic_ref<int>(*p).store(value, std::memory_order_release); }
};

// Each thread's end of a CTA: no wgmma group or cp.async left in flight.
inline void end_of_thread_checks() {
  if (!wgmma_groups.empty()) {
    wgmma_groups.clear();
    fail(here() + " ended its CTA with a wgmma group never waited for");
  }
  if (!cp_async_pending.empty()) {
    cp_async_pending.clear();
    fail(here() + " ended its CTA with a cp.async never waited for");
  }
}

// One sm90 kernel grid under emulation: the launch's mutation set on every thread.
inline void launch_cta_grid(int64_t grid, int nthreads, int smem_bytes, std::function<void(char*)> const& cta) {
  Mutation const m = read_mutation();
  launch(grid, nthreads, smem_bytes, [&](char* smem) {
    mutation() = m;
    cta(smem);
  }, end_of_thread_checks);
}

}  // namespace sinkattn::emu90
