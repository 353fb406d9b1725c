// emu_runtime.h: the CUDA thread model on the host, for running kernel bodies on the CPU.
//
// One std::thread per CUDA thread of a block; __syncthreads is a block barrier, warp collectives (shuffles,
// emulated ldmatrix and mma.sync) use a per-warp barrier and scratch buffer. Blocks of the grid run one
// after another on the same threads, with the same block and thread indices a real launch would give.
// Shared memory is poisoned with 0xFF bytes (NaN in every float format) before each block, so a read of a
// slot nobody wrote shows up as NaN in the output.
#pragma once
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace sinkattn::emu {

constexpr int kWarpScratchFloats = 512;

struct BlockState {
  int nthreads = 0;
  std::unique_ptr<std::barrier<>> block_bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
  std::vector<float> warp_scratch;              // kWarpScratchFloats per warp
  std::vector<void const*> warp_ptrs;           // 32 per warp (ldmatrix row addresses)
};

struct ThreadCtx {
  int tid = 0;
  BlockState* block = nullptr;
};
inline thread_local ThreadCtx ctx;

inline int lane_id() { return ctx.tid % 32; }
inline int warp_id() { return ctx.tid / 32; }
inline void sync_threads() { ctx.block->block_bar->arrive_and_wait(); }
inline void sync_warp() { ctx.block->warp_bars[warp_id()]->arrive_and_wait(); }
inline float* warp_scratch() { return ctx.block->warp_scratch.data() + warp_id() * kWarpScratchFloats; }
inline void const** warp_ptrs() { return ctx.block->warp_ptrs.data() + warp_id() * 32; }

inline float shfl_xor(float x, int lane_mask) {
  float* buf = warp_scratch();
  buf[lane_id()] = x;
  sync_warp();
  float y = buf[lane_id() ^ lane_mask];
  sync_warp();
  return y;
}

// Runs body(block_index, thread_index, smem) for every block of a 1-D grid with nthreads threads per block.
inline void launch(int64_t nblocks, int nthreads, int smem_bytes,
                   std::function<void(int64_t, int, char*)> const& body) {
  if (nblocks <= 0) return;
  BlockState block;
  block.nthreads = nthreads;
  block.block_bar = std::make_unique<std::barrier<>>(nthreads);
  int nwarps = (nthreads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) block.warp_bars.push_back(std::make_unique<std::barrier<>>(32));
  block.warp_scratch.assign(size_t(nwarps) * kWarpScratchFloats, 0.f);
  block.warp_ptrs.assign(size_t(nwarps) * 32, nullptr);
  // 128-byte aligned like the kernel's extern __shared__ buffer.
  std::unique_ptr<char[]> storage(new char[size_t(smem_bytes) + 128]);
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.get()) + 127) & ~uintptr_t(127));
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      ctx = ThreadCtx{t, &block};
      for (int64_t b = 0; b < nblocks; ++b) {
        if (t == 0) std::memset(smem, 0xFF, size_t(smem_bytes));
        sync_threads();
        body(b, t, smem);
        sync_threads();  // the block is done before the next one poisons shared memory
      }
    });
  }
  for (auto& th : threads) th.join();
}

}  // namespace sinkattn::emu
