// sm90_runtime.h: the Hopper CTA model on the host, for running the sm90 kernel bodies on the CPU (the primitives
// on top of it are emu/sm90_prims.h). No CuTe, no CUDA, no torch.
//
// One std::thread per CUDA thread of a CTA (384 or 512); the CTAs of a persistent grid run one after another on
// the same threads, with the block index and grid size a real launch would give. No wait spins. Under one mutex
// per CTA, on condition variables:
//   - mbarriers: init count, arrive, expect-tx, the wait for a phase parity, phase flips; a phase completes when
//     its arrivals and its transaction bytes are in;
//   - named barriers: the thread count of each generation (a sync or arrive with another count is an error);
// and off it, each with a lock of its own and a futex wait on its generation word (std::atomic::wait):
//   - gates: the warp and warpgroup collectives (shuffles, wgmma completion) and __syncthreads. They are most of
//     the emulator's waits; under the CTA mutex, each release woke 31 to 511 threads into one lock, and the kernel
//     time of those wake-ups was two thirds of the emulated tests' time (docs/build.md has the figures);
//   - TMA loads: issued into a pending list of their mbarrier; their destination is poisoned (0xFF: NaN in every
//     float format) and marked pending at issue, and the data lands, with its bytes, when a thread waits on that
//     barrier (as late as the hardware may land it before the wait returns);
//   - cp.async copies (the forward's gather of small pages): their destination poisoned and marked pending at issue,
//     grouped at the thread's commits, landed as its generic-proxy writes at its wait for their group (a wgmma reading them then needs
//     that thread's fence.proxy.async, as for any generic write);
//   - a deadlock detector: when every thread of the CTA is blocked, the pending loads land; if still every thread
//     is blocked, the launch fails with who waits on what. A wait longer than kWaitLimit fails it too.
// Ordering checks (the first violation fails the launch), per 4-byte shared-memory word:
//   - a generic access through the seam (Prims::lds128 / sts32 / sts128_zero2) or a wgmma operand read of a word a
//     TMA load has not delivered (its full barrier not waited for);
//   - a TMA load or cp.async into words an in-flight wgmma group reads (a stage released before its wgmma_wait);
//   - a TMA load over words a thread accessed through the generic proxy, or a wgmma read of words a thread wrote,
//     with no fence.proxy.async of that thread in between;
//   - at the end of a CTA: an mbarrier left in a partial phase (an arrival count off), transaction bytes
//     outstanding, a load never waited for, a named barrier partially arrived, a wgmma group or a cp.async never
//     waited for.
// What it does not model: the timing of the hardware (any interleaving the OS scheduler gives is one the GPU might
// give, not every one), plain C++ shared-memory accesses that do not go through the seam (CuTe tensor stores),
// the register file (setmaxnreg is a no-op), clusters and multicast.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sinkattn::emu90 {

// A blocked primitive's exit once the launch failed (deadlock, a timeout or another thread's violation).
struct Aborted {};

constexpr auto kWaitLimit = std::chrono::seconds(120);

struct Block;

// A barrier of n threads reused generation after generation (a warp's shuffles, a warpgroup's wgmma completion,
// the CTA's __syncthreads). Its arrivals count under its own lock; its waiters sleep on the generation word.
struct Gate {
  int n = 0;
  std::mutex mu;
  int arrived = 0;
  std::atomic<uint32_t> generation{0};
};

// One TMA box on its way: 16-byte chunks at their (swizzled) shared-memory offsets.
struct PendingLoad {
  std::vector<uint32_t> offsets;
  std::vector<unsigned char> data;  // 16 bytes per offset
  uint32_t bytes = 0;               // the transaction bytes it delivers (the whole box, zero fill included)
};

struct MBarrier {
  bool initialized = false;
  int count = 0;         // arrivals per phase
  int pending = 0;       // arrivals this phase still waits for
  int64_t tx = 0;        // transaction bytes this phase still waits for
  uint64_t completed = 0;  // phases completed; the current phase's parity is completed & 1
  bool expecting = false;  // an expect-tx arrival of this phase came (its bytes may then not overshoot)
  int blocked = 0;
  std::string name;      // "k_full[1]", learned from the first wait
  std::vector<PendingLoad> loads;
  std::condition_variable cv;
};

struct NamedBar {
  int threads = 0;  // this generation's count (0: no arrival yet)
  int arrived = 0;
  uint64_t generation = 0;
  int blocked = 0;
  std::condition_variable cv;
};

// An in-flight wgmma group's shared-memory operand bytes, [lo, hi) per operand and K step.
struct Flight {
  int warpgroup;
  uint64_t serial;
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
};

struct Block {
  int nthreads = 0;
  int64_t grid = 0, index = 0;
  char* smem = nullptr;
  size_t smem_bytes = 0;

  std::mutex mu;
  // Threads blocked in a wait whose condition does not hold: changed under the CTA mutex by the mbarrier and named
  // barrier waits, under a gate's own lock by its arrivals and release (so it is exact whenever read).
  std::atomic<int> blocked{0};
  std::atomic<bool> aborted{false};
  std::string first_error;
  std::vector<std::string> waiting_on;  // per thread, while blocked in a CTA-mutex wait
  std::unique_ptr<std::atomic<int>[]> at_gate;  // per thread: the thread count of the gate it waits at (0: none)

  std::map<uint32_t, MBarrier> bars;  // by shared-memory offset
  NamedBar named[16];
  std::vector<std::unique_ptr<Gate>> warp_gates, wg_gates;
  Gate block_gate;
  std::vector<float> warp_scratch;               // two slots of 32 per warp, taken in turn by the shuffles
  std::vector<std::vector<float>> wg_scratch;     // per warpgroup: the A and B operands of the group completing
  std::vector<Flight> flights;

  // Per 4-byte word: an async copy issued and not landed (kTmaPending or kCpAsyncPending); the last generic write
  // and read ((tid + 1) << 32 | the thread's fence count then).
  std::unique_ptr<std::atomic<uint8_t>[]> tma_pending;
  std::unique_ptr<std::atomic<uint64_t>[]> last_write, last_read;
  std::unique_ptr<std::atomic<uint32_t>[]> fences;  // per thread: fence.proxy.async count
};

// Block::tma_pending's values: what copy into the word is on its way.
enum : uint8_t { kNotPending = 0, kTmaPending = 1, kCpAsyncPending = 2 };
inline char const* pending_copy_name(uint8_t what) { return what == kCpAsyncPending ? "cp.async" : "TMA load"; }

struct Ctx {
  int tid = 0;
  Block* block = nullptr;
};
inline thread_local Ctx ctx;

// ---- failures -------------------------------------------------------------------------------------------------
// A gate's waiters wake when its generation word changes; after an abort they find `aborted` and leave.
inline void wake(Gate& g) {
  g.generation.fetch_add(1, std::memory_order_release);
  g.generation.notify_all();
}
inline void notify_all_locked(Block& b) {
  for (auto& [off, bar] : b.bars) bar.cv.notify_all();
  for (auto& n : b.named) n.cv.notify_all();
  for (auto& g : b.warp_gates) wake(*g);
  for (auto& g : b.wg_gates) wake(*g);
  wake(b.block_gate);
}
inline void fail_locked(Block& b, std::string const& what) {
  if (b.first_error.empty()) b.first_error = what;
  b.aborted = true;
  notify_all_locked(b);
}
inline void fail(std::string const& what) {
  std::lock_guard<std::mutex> lock(ctx.block->mu);
  fail_locked(*ctx.block, what);
}
inline std::string here() {
  return "block " + std::to_string(ctx.block->index) + " thread " + std::to_string(ctx.tid) + " (warpgroup " +
         std::to_string(ctx.tid / 128) + ")";
}

// ---- TMA landing ---------------------------------------------------------------------------------------------
inline void complete_phase_if_done(Block& b, MBarrier& bar) {
  if (bar.pending == 0 && bar.tx == 0) {
    ++bar.completed;
    bar.pending = bar.count;
    bar.expecting = false;
    b.blocked -= bar.blocked;
    bar.blocked = 0;
    bar.cv.notify_all();
  }
}
inline void land_locked(Block& b, MBarrier& bar) {
  std::vector<PendingLoad> loads;
  loads.swap(bar.loads);
  for (auto& l : loads) {
    for (size_t i = 0; i < l.offsets.size(); ++i) {
      std::memcpy(b.smem + l.offsets[i], &l.data[16 * i], 16);
      for (uint32_t w = 0; w < 4; ++w) {
        b.tma_pending[l.offsets[i] / 4 + w].store(kNotPending, std::memory_order_relaxed);
        b.last_write[l.offsets[i] / 4 + w].store(0, std::memory_order_relaxed);
        b.last_read[l.offsets[i] / 4 + w].store(0, std::memory_order_relaxed);
      }
    }
    bar.tx -= l.bytes;
    if (bar.tx < 0 && bar.expecting) {
      fail_locked(b, "TMA loads delivered " + std::to_string(-bar.tx) + " bytes more than mbarrier " + bar.name +
                         " expected in its phase (arrive_expect_tx too small)");
    }
    complete_phase_if_done(b, bar);
  }
}

// ---- blocking ------------------------------------------------------------------------------------------------
inline std::string gate_name(Block const& b, int n) {
  return n == b.nthreads ? std::string("the CTA-wide barrier (the end of the CTA, or __syncthreads)")
                         : "a collective of the " + std::to_string(n) + " threads of its " +
                               (n == 32 ? "warp" : "warpgroup");
}
inline std::string describe_waits(Block& b) {
  auto what = [&](int t) {
    int const gate = b.at_gate[t].load(std::memory_order_relaxed);
    return gate ? gate_name(b, gate) : b.waiting_on[t];
  };
  std::string out, prev;
  int first = -1;
  for (int t = 0; t <= b.nthreads; ++t) {
    std::string const cur = t < b.nthreads ? what(t) : std::string();
    if (t < b.nthreads && first >= 0 && cur == prev) continue;
    if (first >= 0 && !prev.empty()) {
      out += "\n  threads " + std::to_string(first) + "-" + std::to_string(t - 1) + ": " + prev;
    }
    first = t;
    prev = cur;
  }
  return out;
}

// Called under the CTA mutex when every thread is counted blocked: the loads in flight land (the hardware would
// deliver them), which may release someone; if not, the CTA is deadlocked.
inline void everyone_waits_locked(Block& b) {
  for (auto& [off, bar] : b.bars) land_locked(b, bar);
  if (b.blocked == b.nthreads) {
    fail_locked(b, "deadlock in block " + std::to_string(b.index) + ": every thread waits" + describe_waits(b));
  }
}

// Block until ready() holds (under the CTA's lock), counted as blocked meanwhile; `what` says what this thread
// waits for (the deadlock report). on_block: the object's blocked count, which its release subtracts.
template <class Ready>
void block_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, int& on_block, Ready ready,
                 std::function<std::string()> const& what) {
  Block& b = *ctx.block;
  if (b.aborted) throw Aborted{};
  if (ready()) return;
  ++on_block;
  ++b.blocked;
  b.waiting_on[ctx.tid] = what();
  if (b.blocked == b.nthreads) everyone_waits_locked(b);
  auto const start = std::chrono::steady_clock::now();
  while (!ready() && !b.aborted) {
    cv.wait_for(lock, std::chrono::milliseconds(250));
    if (!ready() && !b.aborted && std::chrono::steady_clock::now() - start > kWaitLimit) {
      fail_locked(b, here() + " waited over " + std::to_string(kWaitLimit.count()) + " s: " + what() +
                         describe_waits(b));
    }
  }
  b.waiting_on[ctx.tid].clear();
  if (b.aborted) throw Aborted{};
}

// A gate's arrival and (but for the last arrival) its wait. The arrival and the blocked count change together
// under the gate's lock, and the release subtracts its n - 1 waiters, so `blocked` never counts a thread that is
// free to run; the waiter that makes it reach every thread runs the deadlock check.
inline void gate_wait(Gate& g) {
  Block& b = *ctx.block;
  if (b.aborted) throw Aborted{};
  uint32_t gen;
  bool last;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    gen = g.generation.load(std::memory_order_relaxed);
    last = ++g.arrived == g.n;
    if (last) {
      g.arrived = 0;
      b.blocked -= g.n - 1;
      g.generation.fetch_add(1, std::memory_order_release);
    } else {
      b.at_gate[ctx.tid].store(g.n, std::memory_order_relaxed);
      ++b.blocked;
    }
  }
  if (last) {
    g.generation.notify_all();
    return;
  }
  if (b.blocked == b.nthreads) {
    std::lock_guard<std::mutex> lock(b.mu);
    if (b.blocked == b.nthreads) everyone_waits_locked(b);
  }
  while (g.generation.load(std::memory_order_acquire) == gen && !b.aborted) g.generation.wait(gen);
  b.at_gate[ctx.tid].store(0, std::memory_order_relaxed);
  if (b.aborted) throw Aborted{};
}

inline void sync_threads() { gate_wait(ctx.block->block_gate); }
inline void sync_warp() { gate_wait(*ctx.block->warp_gates[ctx.tid / 32]); }
inline void sync_warpgroup() { gate_wait(*ctx.block->wg_gates[ctx.tid / 128]); }

// Two scratch slots per warp taken in turn: one barrier per shuffle, after the lanes publish (a lane writes a slot
// again two shuffles later, past the barrier of the one in between, which every lane reaches after its read here).
inline thread_local unsigned warp_shuffles = 0;
inline float shfl_xor(float x, int lane_mask) {
  unsigned const turn = warp_shuffles++ & 1u;
  float* buf = ctx.block->warp_scratch.data() + 32 * (2 * (ctx.tid / 32) + turn);
  int const lane = ctx.tid % 32;
  buf[lane] = x;
  sync_warp();
  return buf[lane ^ lane_mask];
}

// ---- mbarriers -----------------------------------------------------------------------------------------------
inline uint32_t smem_offset(void const* p) {
  Block& b = *ctx.block;
  char const* c = static_cast<char const*>(p);
  if (c < b.smem || c >= b.smem + b.smem_bytes) {
    throw std::logic_error("sinkattn sm90 emulation: a shared-memory primitive on an address outside shared memory");
  }
  return uint32_t(c - b.smem);
}
inline MBarrier& bar_locked(void const* p, char const* what) {
  Block& b = *ctx.block;
  auto it = b.bars.find(smem_offset(p));
  if (it == b.bars.end() || !it->second.initialized) {
    fail_locked(b, here() + " " + what + " an mbarrier at shared byte " + std::to_string(smem_offset(p)) +
                       " nobody initialized");
    throw Aborted{};
  }
  return it->second;
}

inline void mbar_init(void* p, int count) {
  Block& b = *ctx.block;
  std::lock_guard<std::mutex> lock(b.mu);
  MBarrier& bar = b.bars[smem_offset(p)];
  if (bar.initialized) fail_locked(b, here() + " initialized an mbarrier twice");
  bar.initialized = true;
  bar.count = bar.pending = count;
  bar.name = "mbarrier@" + std::to_string(smem_offset(p));
}

inline void mbar_arrive(void* p, uint32_t expect_bytes = 0, bool expect = false) {
  Block& b = *ctx.block;
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.aborted) throw Aborted{};
  MBarrier& bar = bar_locked(p, "arrived on");
  if (expect) {
    bar.tx += expect_bytes;
    bar.expecting = true;
  }
  if (bar.pending <= 0) fail_locked(b, here() + " arrived on " + bar.name + " past its count");
  --bar.pending;
  complete_phase_if_done(b, bar);
}

inline void mbar_wait(void* p, uint32_t parity, std::string const& name) {
  Block& b = *ctx.block;
  std::unique_lock<std::mutex> lock(b.mu);
  if (b.aborted) throw Aborted{};
  MBarrier& bar = bar_locked(p, "waited on");
  if (bar.name.rfind("mbarrier@", 0) == 0) bar.name = name;
  // The phase of parity `parity` has completed when the current phase's parity differs.
  auto ready = [&] { return (bar.completed & 1) != parity; };
  if (!ready()) land_locked(b, bar);
  block_until(lock, bar.cv, bar.blocked, ready, [&] {
    return "mbarrier " + bar.name + " for phase parity " + std::to_string(parity) + " (" +
           std::to_string(bar.completed) + " phases completed; " + std::to_string(bar.count - bar.pending) + " of " +
           std::to_string(bar.count) + " arrivals, " + std::to_string(bar.tx) + " transaction bytes outstanding)";
  });
}

// ---- named barriers ------------------------------------------------------------------------------------------
inline void named(uint32_t threads, uint32_t id, bool sync) {
  Block& b = *ctx.block;
  std::unique_lock<std::mutex> lock(b.mu);
  if (b.aborted) throw Aborted{};
  if (id >= 16) fail_locked(b, here() + " used named barrier " + std::to_string(id) + " (16 exist)");
  NamedBar& nb = b.named[id];
  if (nb.threads == 0) nb.threads = int(threads);
  if (nb.threads != int(threads)) {
    fail_locked(b, here() + " used named barrier " + std::to_string(id) + " with " + std::to_string(threads) +
                       " threads while its generation counts " + std::to_string(nb.threads));
    throw Aborted{};
  }
  uint64_t const gen = nb.generation;
  if (++nb.arrived == nb.threads) {
    nb.arrived = 0;
    nb.threads = 0;
    ++nb.generation;
    b.blocked -= nb.blocked;
    nb.blocked = 0;
    nb.cv.notify_all();
    return;
  }
  if (!sync) return;
  block_until(lock, nb.cv, nb.blocked, [&] { return nb.generation != gen; }, [&] {
    return "named barrier " + std::to_string(id) + " (" + std::to_string(nb.arrived) + " of " +
           std::to_string(nb.threads) + " threads arrived)";
  });
}

// ---- the ordering records of generic accesses -----------------------------------------------------------------
inline uint64_t access_tag() {
  return (uint64_t(ctx.tid) + 1) << 32 | ctx.block->fences[ctx.tid].load(std::memory_order_relaxed);
}
// Whether a record's thread has fenced since (a tag of 0: no access).
inline bool unfenced(uint64_t tag) {
  if (tag == 0) return false;
  int const t = int(tag >> 32) - 1;
  return ctx.block->fences[t].load(std::memory_order_relaxed) == uint32_t(tag);
}
inline void generic_access(void const* p, size_t n, bool write) {
  Block& b = *ctx.block;
  uint32_t const off = smem_offset(p);
  for (uint32_t w = off / 4; w <= (off + uint32_t(n) - 1) / 4; ++w) {
    if (uint8_t const what = b.tma_pending[w].load(std::memory_order_relaxed)) {
      fail(here() + (write ? " wrote" : " read") + " shared byte " + std::to_string(4 * w) + " while a " +
           pending_copy_name(what) + " into it was in flight (its full barrier not waited for)");
      throw Aborted{};
    }
    (write ? b.last_write : b.last_read)[w].store(access_tag(), std::memory_order_relaxed);
  }
}
inline void fence_proxy_async() { ctx.block->fences[ctx.tid].fetch_add(1, std::memory_order_relaxed); }

// ---- TMA -----------------------------------------------------------------------------------------------------
// The project's description of a tiled tensor map, in the 128 bytes of CuTe's TmaDescriptor (the driver's
// cuTensorMapEncodeTiled does not run on the host; emu/sm90_prims.h EmuPrims::make_tma_load fills it from what
// CuTe would have passed to it).
struct TensorMap {
  static constexpr uint64_t kMagic = 0x53494e4b544d4150ull;  // "SINKTMAP"
  uint64_t magic;
  char const* address;
  uint64_t shape[5];
  uint64_t stride[5];  // bytes; stride[0] is the element size (the innermost dimension is contiguous)
  uint32_t box[5];
  uint8_t dims, element_bytes, swizzle_bits;  // swizzle_bits: 0 none, 1 / 2 / 3: 32 / 64 / 128-byte swizzle
};
static_assert(sizeof(TensorMap) <= 128);

// The hardware's swizzle of a shared-memory byte address (1024-byte aligned shared memory): the 16-byte chunk
// index within a 128-byte row XORed with the row's index in its group of 8 (bits [4, 4 + b) ^= bits [7, 7 + b)).
inline uint32_t swizzle(uint32_t addr, int bits) {
  return bits == 0 ? addr : addr ^ (((addr >> 7) & ((1u << bits) - 1)) << 4);
}

// Issue one box load at TMA coordinates crd into shared memory at dst, completing as bytes on the mbarrier at bar.
inline void tma_issue(TensorMap const& m, void* bar_ptr, int const* crd, void* dst) {
  Block& b = *ctx.block;
  if (m.magic != TensorMap::kMagic) {
    fail(here() + " issued a TMA load with a descriptor the host emulation did not make");
    throw Aborted{};
  }
  uint32_t const dst_off = smem_offset(dst);
  uint32_t const eb = m.element_bytes;
  uint32_t elems = 1;
  for (int d = 0; d < m.dims; ++d) elems *= m.box[d];
  uint32_t const bytes = elems * eb;
  if ((m.box[0] * eb) % 16 != 0 || dst_off % 128 != 0) {
    fail(here() + " issued a TMA box whose rows are not whole 16-byte chunks or whose destination is not 128-byte "
                  "aligned");
    throw Aborted{};
  }
  PendingLoad load;
  load.bytes = bytes;
  load.offsets.reserve(bytes / 16);
  load.data.resize(bytes);
  uint32_t idx[5] = {0, 0, 0, 0, 0};
  for (uint32_t lin = 0; lin < elems; lin += 16 / eb) {
    // idx: the box coordinates of element `lin` (dimension 0 fastest: the order the box lands in).
    uint32_t rest = lin;
    for (int d = 0; d < m.dims; ++d) {
      idx[d] = rest % m.box[d];
      rest /= m.box[d];
    }
    unsigned char* chunk = &load.data[load.offsets.size() * 16];
    for (uint32_t e = 0; e < 16 / eb; ++e) {
      bool in = true;
      int64_t addr = 0;
      for (int d = 0; d < m.dims; ++d) {
        int64_t const g = int64_t(crd[d]) + idx[d] + (d == 0 ? e : 0);
        in = in && g >= 0 && uint64_t(g) < m.shape[d];
        addr += g * int64_t(m.stride[d]);
      }
      if (in) std::memcpy(chunk + e * eb, m.address + addr, eb);
      else std::memset(chunk + e * eb, 0, eb);
    }
    load.offsets.push_back(swizzle(dst_off + lin * eb, m.swizzle_bits));
  }
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.aborted) throw Aborted{};
  MBarrier& bar = bar_locked(bar_ptr, "issued a TMA load on");
  for (auto const& f : b.flights) {
    for (auto const& [lo, hi] : f.ranges) {
      if (lo < dst_off + bytes && dst_off < hi) {
        fail_locked(b, here() + " issued a TMA load into shared bytes [" + std::to_string(dst_off) + ", " +
                           std::to_string(dst_off + bytes) + ") that an in-flight wgmma group of warpgroup " +
                           std::to_string(f.warpgroup) + " reads (a stage released before its wgmma_wait)");
        throw Aborted{};
      }
    }
  }
  for (uint32_t off : load.offsets) {
    for (uint32_t w = off / 4; w < off / 4 + 4; ++w) {
      uint64_t const wr = b.last_write[w].load(std::memory_order_relaxed);
      uint64_t const rd = b.last_read[w].load(std::memory_order_relaxed);
      if (unfenced(wr) || unfenced(rd)) {
        int const t = int((unfenced(wr) ? wr : rd) >> 32) - 1;
        fail_locked(b, here() + " issued a TMA load over shared byte " + std::to_string(4 * w) + " that thread " +
                           std::to_string(t) + (unfenced(wr) ? " wrote" : " read") +
                           " through the generic proxy with no fence.proxy.async since");
        throw Aborted{};
      }
      if (uint8_t const what = b.tma_pending[w].load(std::memory_order_relaxed)) {
        fail_locked(b, here() + " issued a TMA load over shared byte " + std::to_string(4 * w) + " while a " +
                           pending_copy_name(what) + " into it was in flight");
        throw Aborted{};
      }
      b.tma_pending[w].store(kTmaPending, std::memory_order_relaxed);
    }
    std::memset(b.smem + off, 0xFF, 16);  // in flight: what a reader would see is undefined
  }
  bar.loads.push_back(std::move(load));
}

// ---- cp.async -------------------------------------------------------------------------------------------------
// One 16-byte copy a thread issued and has not waited for: its group (the thread's commits count them from 0; -1
// until the thread commits it).
struct PendingCopy {
  uint32_t off;
  unsigned char data[16];
  int64_t group = -1;
};
inline thread_local std::vector<PendingCopy> cp_async_pending;
inline thread_local int64_t cp_async_groups = 0;  // the groups this thread committed

// cp.async of 16 bytes from src (zeros when !fill) into shared byte off: the source is read now (the hardware reads it
// some time before the copy completes; nothing writes it during a kernel), the destination poisoned and pending
// until the thread's cp_async_land.
inline void cp_async_issue(uint32_t off, void const* src, bool fill) {
  Block& b = *ctx.block;
  if (off % 16 != 0 || size_t(off) + 16 > b.smem_bytes) {
    fail(here() + " issued a cp.async to shared byte " + std::to_string(off) +
         " (not 16-byte aligned or past the end)");
    throw Aborted{};
  }
  PendingCopy c{off, {}};
  if (fill) std::memcpy(c.data, src, 16);
  else std::memset(c.data, 0, 16);
  {
    std::lock_guard<std::mutex> lock(b.mu);
    if (b.aborted) throw Aborted{};
    for (auto const& f : b.flights) {
      for (auto const& [lo, hi] : f.ranges) {
        if (lo < off + 16 && off < hi) {
          fail_locked(b, here() + " issued a cp.async into shared bytes [" + std::to_string(off) + ", " +
                             std::to_string(off + 16) + ") that an in-flight wgmma group of warpgroup " +
                             std::to_string(f.warpgroup) + " reads (a stage refilled before its release)");
          throw Aborted{};
        }
      }
    }
  }
  for (uint32_t w = off / 4; w < off / 4 + 4; ++w) {
    if (uint8_t const what = b.tma_pending[w].load(std::memory_order_relaxed)) {
      fail(here() + " issued a cp.async over shared byte " + std::to_string(4 * w) + " while a " +
           pending_copy_name(what) + " into it was in flight");
      throw Aborted{};
    }
    b.tma_pending[w].store(kCpAsyncPending, std::memory_order_relaxed);
  }
  std::memset(b.smem + off, 0xFF, 16);  // in flight: what a reader would see is undefined
  cp_async_pending.push_back(c);
}
// cp.async.commit_group: the thread's copies not yet in a group become its newest.
inline void cp_async_commit() {
  for (auto& c : cp_async_pending)
    if (c.group < 0) c.group = cp_async_groups;
  ++cp_async_groups;
}
// cp.async.wait_group n: the copies of every group of the thread but its n newest land, as its own generic-proxy
// writes (copies not committed stay in flight).
inline void cp_async_land(int64_t n) {
  Block& b = *ctx.block;
  std::vector<PendingCopy> still;
  for (auto const& c : cp_async_pending) {
    if (c.group < 0 || c.group >= cp_async_groups - n) {
      still.push_back(c);
      continue;
    }
    std::memcpy(b.smem + c.off, c.data, 16);
    for (uint32_t w = c.off / 4; w < c.off / 4 + 4; ++w) {
      b.tma_pending[w].store(kNotPending, std::memory_order_relaxed);
      b.last_write[w].store(access_tag(), std::memory_order_relaxed);
      b.last_read[w].store(0, std::memory_order_relaxed);
    }
  }
  cp_async_pending.swap(still);
}

// ---- launch --------------------------------------------------------------------------------------------------
inline void end_of_block_checks(Block& b) {
  for (auto& [off, bar] : b.bars) {
    if (!bar.loads.empty()) fail_locked(b, "a TMA load on " + bar.name + " was never waited for");
    if (bar.pending != bar.count || bar.tx != 0) {
      fail_locked(b, "block " + std::to_string(b.index) + " ended with " + bar.name + " in a partial phase: " +
                         std::to_string(bar.count - bar.pending) + " of " + std::to_string(bar.count) +
                         " arrivals, " + std::to_string(bar.tx) + " transaction bytes outstanding");
    }
  }
  for (int i = 0; i < 16; ++i) {
    if (b.named[i].arrived != 0) {
      fail_locked(b, "block " + std::to_string(b.index) + " ended with named barrier " + std::to_string(i) + " at " +
                         std::to_string(b.named[i].arrived) + " of " + std::to_string(b.named[i].threads) +
                         " threads");
    }
  }
  if (!b.flights.empty()) fail_locked(b, "block " + std::to_string(b.index) + " ended with a wgmma group in flight");
}

// Runs body() for every CTA of a 1-D grid of nthreads threads; shared memory (1024-byte aligned, as the sm90
// kernels' extern buffer) is poisoned before each CTA. on_thread_end: each thread's own end-of-CTA check.
inline void launch(int64_t grid, int nthreads, int smem_bytes, std::function<void(char*)> const& body,
                   std::function<void()> const& on_thread_end) {
  if (grid <= 0) return;
  Block b;
  b.nthreads = nthreads;
  b.grid = grid;
  b.block_gate.n = nthreads;
  for (int w = 0; w < (nthreads + 31) / 32; ++w) {
    b.warp_gates.push_back(std::make_unique<Gate>());
    b.warp_gates.back()->n = 32;
  }
  for (int w = 0; w < (nthreads + 127) / 128; ++w) {
    b.wg_gates.push_back(std::make_unique<Gate>());
    b.wg_gates.back()->n = 128;
  }
  b.warp_scratch.assign(size_t(nthreads + 31) / 32 * 64, 0.f);
  b.wg_scratch.resize(b.wg_gates.size());
  b.waiting_on.resize(nthreads);
  std::unique_ptr<char[]> storage(new char[size_t(smem_bytes) + 1024]);
  b.smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.get()) + 1023) & ~uintptr_t(1023));
  b.smem_bytes = size_t(smem_bytes);
  size_t const words = (size_t(smem_bytes) + 3) / 4;
  b.tma_pending.reset(new std::atomic<uint8_t>[words]);
  b.last_write.reset(new std::atomic<uint64_t>[words]);
  b.last_read.reset(new std::atomic<uint64_t>[words]);
  b.fences.reset(new std::atomic<uint32_t>[nthreads]);
  b.at_gate.reset(new std::atomic<int>[nthreads]);
  for (int t = 0; t < nthreads; ++t) b.fences[t] = 0, b.at_gate[t] = 0;

  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      ctx = Ctx{t, &b};
      try {
        for (int64_t i = 0; i < grid; ++i) {
          if (t == 0) {
            std::lock_guard<std::mutex> lock(b.mu);
            b.index = i;
            b.bars.clear();
            b.flights.clear();
            std::memset(b.smem, 0xFF, b.smem_bytes);
            for (size_t w = 0; w < words; ++w) {
              b.tma_pending[w] = 0;
              b.last_write[w] = 0;
              b.last_read[w] = 0;
            }
          }
          sync_threads();
          body(b.smem);
          on_thread_end();
          sync_threads();
          if (t == 0) {
            std::lock_guard<std::mutex> lock(b.mu);
            end_of_block_checks(b);
          }
          sync_threads();
          if (b.aborted) break;
        }
      } catch (Aborted const&) {
      } catch (std::exception const& e) {
        fail(here() + ": " + e.what());
      }
    });
  }
  for (auto& th : threads) th.join();
  if (!b.first_error.empty()) throw std::runtime_error("sinkattn sm90 host emulation: " + b.first_error);
}

}  // namespace sinkattn::emu90
