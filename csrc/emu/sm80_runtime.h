// sm80_runtime.h: the CUDA thread model on the host, for running the sm80 kernel bodies on the CPU (the primitives on
// top of it are emu/sm80_prims.h; the sm90 kernels' CTA model is emu/sm90_runtime.h).
//
// One std::thread per CUDA thread of a block; __syncthreads is a block barrier, warp collectives (shuffles,
// emulated ldmatrix and mma.sync) use a per-warp barrier and two scratch slots, taken in turn (warp_slot). Blocks
// of the grid run one after another on the same threads, with the same block and thread indices a real launch
// would give.
// Shared memory is poisoned with 0xFF bytes (NaN in every float format) before each block, so a read of a
// slot nobody wrote shows up as NaN in the output.
//
// Ordering check: every shared-memory access the kernel makes through its Prims (cp.async, zero fills,
// ldmatrix, the epilogue's stores and loads) is recorded per 4-byte word with the barrier epoch and thread.
// Two threads touching a word in the same epoch, one of them writing, is a race (a missing __syncthreads);
// reading a cp.async destination before its cp.async.wait is too. cp.async copies land only at the wait
// that covers their group, as late as the hardware may land them. The first violation fails the launch.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sinkattn::emu80 {

constexpr int kWarpScratchFloats = 512;

struct BlockState;
struct EpochBump {
  BlockState* block;
  void operator()() noexcept;
};

struct BlockState {
  int nthreads = 0;
  std::unique_ptr<std::barrier<EpochBump>> block_bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
  std::vector<float> warp_scratch;              // two slots of kWarpScratchFloats per warp

  // Ordering check state. A record is (epoch << 16) | tag, tag = thread + 1, kSeveral for several readers,
  // with kPending set while a cp.async destination has not landed.
  std::atomic<uint64_t> epoch{1};
  char* smem = nullptr;
  size_t smem_bytes = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> last_write, last_read;
  std::mutex error_mutex;
  std::string first_error;
};

inline void EpochBump::operator()() noexcept { block->epoch.fetch_add(1, std::memory_order_relaxed); }

struct ThreadCtx {
  int tid = 0;
  BlockState* block = nullptr;
};
inline thread_local ThreadCtx ctx;

inline int lane_id() { return ctx.tid % 32; }
inline int warp_id() { return ctx.tid / 32; }
inline void sync_threads() { ctx.block->block_bar->arrive_and_wait(); }

constexpr uint64_t kSeveral = 0x7FFF, kPending = 0x8000, kTagMask = 0xFFFF;

inline void report(std::string const& what) {
  std::lock_guard<std::mutex> lock(ctx.block->error_mutex);
  if (ctx.block->first_error.empty()) ctx.block->first_error = what;
}

inline bool word_range(void const* p, size_t n, size_t& first, size_t& last) {
  auto* b = ctx.block;
  char const* c = static_cast<char const*>(p);
  if (c < b->smem || c + n > b->smem + b->smem_bytes) return false;  // not shared memory
  first = size_t(c - b->smem) / 4;
  last = (size_t(c - b->smem) + n - 1) / 4;
  return true;
}

inline void on_smem_read(void const* p, size_t n) {
  size_t first, last;
  if (!word_range(p, n, first, last)) return;
  auto* b = ctx.block;
  uint64_t const e = b->epoch.load(std::memory_order_relaxed), me = uint64_t(ctx.tid) + 1;
  for (size_t i = first; i <= last; ++i) {
    uint64_t w = b->last_write[i].load(std::memory_order_relaxed);
    if (w & kPending) {
      report("thread " + std::to_string(ctx.tid) + " read shared-memory byte " + std::to_string(4 * i) +
             " before the cp.async.wait of thread " + std::to_string((w & kTagMask & ~kPending) - 1) + "'s copy to it");
    } else if ((w >> 16) == e && (w & kTagMask) != me) {
      report("thread " + std::to_string(ctx.tid) + " read shared-memory byte " + std::to_string(4 * i) + " written by thread " +
             std::to_string((w & kTagMask) - 1) + " with no barrier between (missing __syncthreads)");
    }
    uint64_t r = b->last_read[i].load(std::memory_order_relaxed);
    uint64_t tag = ((r >> 16) == e && (r & kTagMask) != me) ? kSeveral : me;
    b->last_read[i].store((e << 16) | tag, std::memory_order_relaxed);
  }
}

// pending: a cp.async issue (the data lands at the wait); false for a plain store or the landing itself.
inline void on_smem_write(void const* p, size_t n, bool pending = false) {
  size_t first, last;
  if (!word_range(p, n, first, last)) return;
  auto* b = ctx.block;
  uint64_t const e = b->epoch.load(std::memory_order_relaxed), me = uint64_t(ctx.tid) + 1;
  for (size_t i = first; i <= last; ++i) {
    uint64_t r = b->last_read[i].load(std::memory_order_relaxed);
    if ((r >> 16) == e && (r & kTagMask) != me) {
      report("thread " + std::to_string(ctx.tid) + " wrote shared-memory byte " + std::to_string(4 * i) +
             " that another thread read with no barrier between (missing __syncthreads)");
    }
    uint64_t w = b->last_write[i].load(std::memory_order_relaxed);
    if ((w >> 16) == e && (w & kTagMask & ~kPending) != me) {
      report("threads " + std::to_string(ctx.tid) + " and " + std::to_string((w & kTagMask & ~kPending) - 1) +
             " wrote shared-memory byte " + std::to_string(4 * i) + " with no barrier between");
    }
    b->last_write[i].store((e << 16) | me | (pending ? kPending : 0), std::memory_order_relaxed);
  }
}

// cp.async groups of this thread: issued copies wait in the open group until a fence commits it.
struct PendingCopy {
  void* dst;
  unsigned char data[16];
};
inline thread_local std::vector<PendingCopy> cp_open;
inline thread_local std::deque<std::vector<PendingCopy>> cp_committed;

inline void cp_async_issue(void const* src, void* dst) {
  on_smem_write(dst, 16, /*pending=*/true);
  PendingCopy c{dst, {}};
  std::memcpy(c.data, src, 16);
  cp_open.push_back(c);
}
inline void cp_async_fence() {
  cp_committed.push_back(std::move(cp_open));
  cp_open.clear();
}
inline void cp_async_wait(int newest_pending) {
  while (int(cp_committed.size()) > newest_pending) {
    for (auto& c : cp_committed.front()) {
      std::memcpy(c.dst, c.data, 16);
      on_smem_write(c.dst, 16);
    }
    cp_committed.pop_front();
  }
}
inline void sync_warp() { ctx.block->warp_bars[warp_id()]->arrive_and_wait(); }

// The scratch slot of this thread's next warp collective: each collective's lanes publish into it, meet at one
// barrier, then read. Two slots per warp taken in turn make a second barrier (readers done before the next
// collective writes) unnecessary: a lane writes a slot again two collectives later, past the barrier of the one
// in between, which every lane reaches only after its reads of this one. Every lane of a warp runs the same
// sequence of collectives (a real warp's would deadlock or be undefined otherwise), so the turns agree. Halving
// the warp barriers took the sm80 emulated kernel tests from 179 s to 124 s (docs/build.md).
inline thread_local unsigned warp_collectives = 0;
inline float* warp_slot() {
  unsigned const turn = warp_collectives++ & 1u;
  return ctx.block->warp_scratch.data() + (size_t(warp_id()) * 2 + turn) * kWarpScratchFloats;
}

inline float shfl_xor(float x, int lane_mask) {
  float* buf = warp_slot();
  buf[lane_id()] = x;
  sync_warp();
  return buf[lane_id() ^ lane_mask];
}

// __any_sync over the whole warp: whether any lane's x is true.
inline bool any_sync(bool x) {
  float* buf = warp_slot();
  buf[lane_id()] = x ? 1.f : 0.f;
  sync_warp();
  for (int lane = 0; lane < 32; ++lane) {
    if (buf[lane] != 0.f) return true;
  }
  return false;
}

// Runs body(block_index, thread_index, smem) for every block of a 1-D grid with nthreads threads per block.
inline void launch(int64_t nblocks, int nthreads, int smem_bytes,
                   std::function<void(int64_t, int, char*)> const& body) {
  if (nblocks <= 0) return;
  BlockState block;
  block.nthreads = nthreads;
  block.block_bar = std::make_unique<std::barrier<EpochBump>>(nthreads, EpochBump{&block});
  int nwarps = (nthreads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) block.warp_bars.push_back(std::make_unique<std::barrier<>>(32));
  block.warp_scratch.assign(size_t(nwarps) * 2 * kWarpScratchFloats, 0.f);
  // 128-byte aligned like the kernel's extern __shared__ buffer.
  std::unique_ptr<char[]> storage(new char[size_t(smem_bytes) + 128]);
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.get()) + 127) & ~uintptr_t(127));
  block.smem = smem;
  block.smem_bytes = size_t(smem_bytes);
  size_t words = (size_t(smem_bytes) + 3) / 4;
  block.last_write.reset(new std::atomic<uint64_t>[words]);
  block.last_read.reset(new std::atomic<uint64_t>[words]);
  for (size_t i = 0; i < words; ++i) { block.last_write[i] = 0; block.last_read[i] = 0; }
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      ctx = ThreadCtx{t, &block};
      for (int64_t b = 0; b < nblocks; ++b) {
        if (t == 0) std::memset(smem, 0xFF, size_t(smem_bytes));
        sync_threads();
        body(b, t, smem);
        if (!cp_open.empty() || !cp_committed.empty()) {
          report("thread " + std::to_string(t) + " ended its block with cp.async copies never waited for");
          cp_open.clear();
          cp_committed.clear();
        }
        sync_threads();  // the block is done before the next one poisons shared memory
      }
    });
  }
  for (auto& th : threads) th.join();
  if (!block.first_error.empty()) throw std::runtime_error("sinkattn host emulation: " + block.first_error);
}

}  // namespace sinkattn::emu80
