// fwd_kernel.cuh: the sm90 forward kernel (warp-specialized TMA + wgmma, persistent).
//
// Warpgroup 0 produces: one thread loads, per tile, Q once and the K/V blocks of the mask policy's range
// (window blocks from the last down, then sink-token blocks) through a kStages-deep mbarrier pipeline
// (full barriers: TMA bytes landed; empty barriers: both consumer warpgroups are done with the stage). K/V come from
// q/k/v tensors, a contiguous KV cache, or a page pool (FwdParams::block_table) as boxes of 16 page rows (PageRows);
// pools of smaller (or other) pages, and FP8 caches (decoded in the stage), are gathered by the whole producer
// warpgroup with cp.async (KvGather). The serving call's M tiles are packed over its requests
// (FwdParams::packed_tiles, TileWork).
// The other warpgroups (kConsumerWarpgroups: 1 to 3 by tile, 2 in the default tiles) consume 64 rows each:
//   - S = Q K^T and O += P V on wgmma; within a warpgroup the softmax of block j runs while the P V wgmma of
//     block j-1 is still in flight (FlashAttention-3's intra-warpgroup overlap);
//   - across the two warpgroups, named barriers hand the tensor cores back and forth (ping-pong): one issues
//     its GEMMs while the other does its softmax;
//   - the learnable sink joins once per row in the finalize (common/online_softmax.h), exactly as in the sm80 kernel;
//   - O goes back through Q's shared memory and out in 16-byte stores, predicated on the sequence's rows
//     (varlen rows past the end belong to the next sequence), with the LSE per row;
//   - varlen and KV caches: the V rows of a sequence's last key block past its end (the next sequence's, a cache's
//     stale slots or another request's pages: a TMA box stops only at the tensor's end) are zeroed before a product
//     reads them (VTail below).
// The grid is persistent: CTA c takes tiles c, c + gridDim.x, ... in the forward's tile order
// (common/tile_order.h: last M tiles first; under a causal mask they are the heaviest).
// Every hardware primitive goes through Prims (sm90/prims_gpu.cuh GpuPrims on the GPU), the ring positions, barrier ids
// and warp roles are sm90/pipeline.cuh's: the body says what the protocol is, the seam how it is issued.
#pragma once
#include <cmath>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/mask.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "common/split.h"
#include "common/tile_order.h"
#include "params.h"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_traits.h"
#include "sm90/pipeline.cuh"
#include "sm90/prims_gpu.cuh"
#include "sm90/smem_utils.cuh"
#include "sm90/wgmma_utils.cuh"

namespace sinkattn::sm90 {

using namespace cute;

// What producer and consumers both derive from a tile index, so their barrier sequences match.
// GQA packing (FwdParams::pack_gqa, over KV caches): a tile's rows are the group's query heads of consecutive queries,
// row r of the packed problem being query r / group of query head kv_head * group + r % group, so K and V are read
// once per KV head; `head` is then the KV head (the schedule's heads are the KV heads).
// Split-KV (FwdParams::num_splits > 1): the schedule's blocks are (M block, split) pairs, the split varying fastest, and
// split s visits its share of the M block's visited key blocks (common/split.h split_share: nblocks of them from the
// first-th); its rows' partial results go to the fp32 accumulators (store_split_partials), which the combine merges.
// The share is kept as a range of its own: the mask's range with its window's end moved down by `first`, whose
// block(i) is the M block's (first + i)-th visited block (window blocks from the last down, then sink blocks; with
// first past the window's blocks its window count is negative and block(i) lands among the sink blocks). No field
// more than the unsplit tile's: the producer's 40 registers held the share's first index beside the range only by
// spilling (sm_90a hd64 gather path: 10 spill loads for 4).
template <class Kt>
struct TileWork {
  int m_block, head, batch, split;
  int group;  // query heads per tile row group: p.nheads / p.nheads_k when packed, else 1
  SeqExtent ext;
  TileMask mask;
  BlockRange range;  // the split's share (above); range.count() may exceed it: nblocks is its size
  int nblocks;
  bool valid;  // the tile holds rows of its sequence (varlen batches are sized for the longest)

  __device__ TileWork(FwdParams const& p, PersistentTileOrder const& s, int64_t t) {
    s.decode(t, m_block, split, head, batch);  // split 0: the persistent order has no split dimension
    if (p.num_splits > 1) {
      split = m_block % p.num_splits;
      m_block /= p.num_splits;
    }
    group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
    // Packed M blocks (the serving call): block -> (sequence, its M block), found on the device.
    if (p.packed_tiles) packed_tile(p.cu_seqlens_q, p.batch, group, Kt::kBlockM, m_block, batch, m_block);
    ext = seq_extent(p, batch);
    mask = TileMask{mask_policy(p, ext), Kt::kBlockM, Kt::kBlockN, group};
    valid = m_block * Kt::kBlockM < ext.seqlen_q * group;
    range = valid ? mask.range(m_block) : BlockRange{0, 0, 0};
    nblocks = range.count();
    if (p.num_splits > 1) {
      int first, end;
      split_share(nblocks, split, p.num_splits, first, end);
      range.win_end -= first;
      nblocks = end - first;
    }
  }
  __device__ int kv_head(FwdParams const& p) const { return group > 1 ? head : head / (p.nheads / p.nheads_k); }
  // Tile row `row`'s query and query head.
  __device__ int query_of(int row) const { return group > 1 ? (m_block * Kt::kBlockM + row) / group : m_block * Kt::kBlockM + row; }
  __device__ int head_of(int row) const { return group > 1 ? head * group + (m_block * Kt::kBlockM + row) % group : head; }
};

// A GQA-packed tile's Q rows: warpgroup wg loads its own 64 rows (their queries and heads are not one TMA box) into
// this tile's Q buffer in 16-byte loads and stores, zero past the sequence's queries and past the head dim, then
// fences them for wgmma (an async-proxy reader) and syncs its own 128 threads. The buffer's rows are the
// warpgroup's alone (its S = Q K^T reads them, its epilogue writes O through them), so no other warpgroup waits.
template <class Kt, class Prims, class SmemQ>
__device__ void load_packed_q(FwdParams const& p, TileWork<Kt> const& w, SmemQ const& sQ, int wg, int tid) {
  using Element = typename Kt::Element;
  constexpr int kVecsPerRow = Kt::kHeadDim / 8;
  using Ids = FwdNamedBarriers<Kt::kConsumerWarpgroups>;
  // This warpgroup's last epilogue read the same rows (lds128): all of its threads are past it.
  Prims::named_sync(128, Ids::own(wg));
#pragma unroll 1
  for (int v = tid; v < 64 * kVecsPerRow; v += 128) {
    int const row = wg * 64 + v / kVecsPerRow, col = (v % kVecsPerRow) * 8;
    int const i = w.query_of(row);
    uint4 val = make_uint4(0, 0, 0, 0);
    if (i < w.ext.seqlen_q && col < p.headdim)
      val = Prims::ldg128(static_cast<Element const*>(p.q) +
                          w.ext.q_row(w.batch, p.q_batch_stride, p.q_row_stride, p.q_head_stride, w.head_of(row), i) +
                          col);
    Prims::sts128(Prims::smem_address(&sQ(row, col)), val);
  }
  Prims::fence_async_shared();
  Prims::named_sync(128, Ids::own(wg));
}

// The tiles of one CTA, in the order producer and consumers both walk them: blockIdx.x first, then either
// (static) every gridDim.x-th of the tile order, or (kDynamicTiles) the next index drawn from p.tile_counter by
// the producer, which hands each index (the first too) to the consumers through a two-slot ring in shared
// memory; an index >= count ends the walk for all of them.
// The slot's plain accesses stay between the wait and the arrive through Prims::compiler_fence.
template <class Kt, class Prims>
struct TileWalk {
  typename Kt::SharedStorage& ss;
  int64_t count;
  PipelineState<2> round{};  // the two-slot ring's position (one step per round, dynamic or not)

  // Producer: the index of this round (published to the consumers when dynamic).
  __device__ int64_t publish(int64_t t) {
    if constexpr (Kt::kDynamicTiles) {
      wait_empty<Prims>(ss.tile_empty, round, BarrierId::kTileEmpty);
      Prims::compiler_fence();
      ss.tile_index[round.index()] = t;
      Prims::compiler_fence();
      Prims::arrive(&ss.tile_full[round.index()]);
    }
    round.advance();
    return t;
  }
  __device__ int64_t producer_next(FwdParams const& p, int64_t t) const {
    if constexpr (Kt::kDynamicTiles) return int64_t(Prims::grid_size()) + Prims::fetch_add(p.tile_counter, 1);
    return t + Prims::grid_size();
  }
  // Consumers: the index of this round (t is the static walk's).
  __device__ int64_t consumer_next(int64_t t) {
    if constexpr (Kt::kDynamicTiles) {
      wait_full<Prims>(ss.tile_full, round, BarrierId::kTileFull);
      Prims::compiler_fence();
      t = ss.tile_index[round.index()];
      Prims::compiler_fence();
      Prims::arrive(&ss.tile_empty[round.index()]);
    }
    round.advance();
    return t;
  }
};

// Where a key row of sequence b lives in a page pool (FwdParams::block_table): a box of kPageRows rows starting at
// key row j (a multiple of kPageRows, and the page size one too, so the box stays in one page) is rows
// [slot, slot + kPageRows) of pool page `page`. Rows at or past the sequence's keys come from its last page (any of
// its rows: the consumers mask them in S and zero them in V, VTail), so no block-table entry past the sequence's
// pages is read, and every box still lands its bytes. Prims::page_entry reads the table (the emulation's planted
// bug can misread it).
template <class Kt, class Prims>
struct PageRows {
  int const* pages = nullptr;  // the sequence's row of the block table; null when not paged
  int page_size = 0, page_shift = -1, last_page = 0;
  struct Box {
    int page, slot;
  };
  __device__ PageRows(FwdParams const& p, int b, int seqlen_k) {
    if (p.block_table == nullptr) return;
    pages = p.block_table + int64_t(b) * p.block_table_batch_stride;
    page_size = p.page_size;
    page_shift = p.page_shift;
    last_page = seqlen_k > 0 ? (seqlen_k - 1) / p.page_size : 0;
  }
  __device__ Box box(int j) const {
    int logical = page_shift >= 0 ? j >> page_shift : j / page_size;
    int slot = j - logical * page_size;
    if (logical > last_page) {
      logical = last_page;
      slot = 0;
    }
    return Box{Prims::page_entry(pages, logical), slot};
  }
};

// A page pool whose page size is not a multiple of kPageRows (any size from 1): a key block's rows may come from
// kBlockN pages, too many boxes for one thread, so the producer warpgroup's 128 threads gather the block
// (FlashAttention-3's paged path does so with cp.async too; here every other load stays the one thread's TMA). A
// thread takes whole rows (kThreadsPerRow of them share one where the block's rows divide 128; hd256's 48 rows take
// one thread each, the other 80 threads idle but for their arrival): one
// block-table read per row serves its K and its V, and the row's 16-byte chunks go out as cp.async from one row
// address with constant offsets (no register holds data, so a block's copies are all in flight at once:
// 2 * kBlockN * kHeadDim * 2 bytes per CTA). A warp instruction then reads half of 32 rows' 32-byte sectors, the
// lane's next one the other halves, from L1 (cp.async.ca keeps the sector there); two threads per row, reading whole
// sectors, spilled the producer's 40 registers at hd128 (sm_90a: 16 spill loads). Rows at or past the sequence's
// keys and columns past the head dim land as zeros (cp.async's zero fill: no byte is read, no table entry past the
// sequence's pages). A block's copies are one cp.async group of the thread; once it landed (produce_gathered keeps
// the next block's group in flight meanwhile where the tile has the stages), the thread fences them for wgmma (an
// async-proxy reader of generic-proxy writes) and arrives on both full barriers, which count the 128 arrivals and no
// bytes (fwd_cta).
template <class Kt, class Prims>
struct KvGather {
  using Element = typename Kt::Element;
  static constexpr int kChunksPerRow = Kt::kHeadDim / 8;  // 16-byte chunks of a row
  // Rows per thread: a multiple of 128 rows spread whole over the 128 threads; fewer rows, either shared by
  // 128 / kBlockN threads each (kBlockN divides 128) or one per thread, the threads past them idle (hd256's 48).
  static constexpr int kThreadsPerRow = Kt::kBlockN >= 128 || 128 % Kt::kBlockN != 0 ? 1 : 128 / Kt::kBlockN;
  static constexpr int kRowsPerThread = (Kt::kBlockN * kThreadsPerRow + 127) / 128;
  static constexpr bool kIdleThreads = Kt::kBlockN * kThreadsPerRow % 128 != 0;
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;
  static_assert(Kt::kBlockN % 128 == 0 || Kt::kBlockN < 128);
  static_assert(kChunksPerRow % kThreadsPerRow == 0);
  int const* pages;  // the sequence's row of the block table; null over a contiguous cache
  int b, seqlen_k, hk;

  __device__ KvGather(FwdParams const& p, int b_, int seqlen_k_, int hk_)
      : pages(p.block_table ? p.block_table + int64_t(b_) * p.block_table_batch_stride : nullptr), b(b_),
        seqlen_k(seqlen_k_), hk(hk_) {}

  // Where key row `key` (< seqlen_k) of this KV head starts in k or v, in elements (FP8: bytes): in its pool page, or
  // at its row of a contiguous cache.
  __device__ int64_t row_offset(FwdParams const& p, int key, int64_t batch_stride, int64_t row_stride,
                                int64_t head_stride) const {
    if (pages == nullptr) return int64_t(b) * batch_stride + int64_t(key) * row_stride + int64_t(hk) * head_stride;
    int const logical = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
    int64_t const page = Prims::page_entry(pages, logical), slot = key - logical * p.page_size;
    return page * batch_stride + slot * row_stride + int64_t(hk) * head_stride;
  }

  // Key row `key` of K and V as T (the cache's element: Element, or uint8_t codes), and whether it is one of the
  // sequence's keys; past them both point at the tensors' starts (any valid address: the copies zero-fill, reading
  // nothing).
  template <class T>
  struct RowSource {
    bool in;
    T const *k, *v;
  };
  template <class T>
  __device__ RowSource<T> row_source(FwdParams const& p, int key) const {
    bool const in = key < seqlen_k;
    int64_t koff = 0, voff = 0;
    if (in) {
      koff = row_offset(p, key, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
      voff = row_offset(p, key, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    }
    return {in, static_cast<T const*>(p.k) + koff, static_cast<T const*>(p.v) + voff};
  }

  // Byte offset of element (row, col) of stage st in a K or V buffer: the stage layout's position, then the 128-byte
  // swizzle as TMA and wgmma apply it to the shared address (16-byte chunk bits [4, 7) ^= bits [7, 10); the buffers
  // are 1024-byte aligned). Not the layout's own evaluation: CuTe applies these atoms' swizzle to the pointer, and
  // evaluating the composed layout on a coordinate XORs element-index bits instead (checked on the host: 3072 of
  // 4096 chunk offsets of a (128, 128, 2) bf16 stage differ). Not a generic pointer per chunk either: its
  // conversion to a shared address cost the head dim 64 producer a spilled register.
  static __device__ uint32_t stage_offset(int row, int col, int st) {
    uint32_t const off = uint32_t(typename Kt::SmemLayoutKV{}.layout_b()(row, col, st)) * sizeof(Element);
    return off ^ (((off >> 7) & 7u) << 4);
  }

  // Key block n into stage st of K and V, at shared addresses k_smem / v_smem (the caller waited for both stages'
  // release): this thread's cp.async (an FP8 cache's codes, which decode() then converts once they landed).
  // ptid: the thread's index in the producer warpgroup.
  __device__ void copy(FwdFp8Params const& p, uint32_t k_smem, uint32_t v_smem, int st, int n, int ptid) const {
    if constexpr (Kt::kCanGatherFp8) {
      if (p.kv_fp8 != kFp8None) {
        copy_fp8(p, k_smem, v_smem, st, n, ptid);
        return;
      }
    }
    int const first_chunk = ptid % kThreadsPerRow;
    CUTE_UNROLL
    for (int j = 0; j < kRowsPerThread; ++j) {
      int const row = ptid / kThreadsPerRow + j * (128 / kThreadsPerRow);
      if (kIdleThreads && row >= Kt::kBlockN) break;
      auto const [in, k, v] = row_source<Element>(p, n * Kt::kBlockN + row);
      CUTE_UNROLL
      for (int c = 0; c < kChunksPerThread; ++c) {
        int const col = (first_chunk + c * kThreadsPerRow) * 8;
        bool const fill = in && col < p.headdim;
        uint32_t const off = stage_offset(row, col, st);
        Prims::cp_async16(k_smem + off, k + col, fill);
        Prims::cp_async16(v_smem + off, v + col, fill);
      }
    }
  }

  // FP8 caches (FwdFp8Params::kv_fp8): wgmma reads no FP8 beside a bf16/fp16 Q, so the codes are decoded in the
  // stage. Each thread owns whole rows (kThreadsPerRow 1: Kt::kCanGatherFp8), and a row's codes take half the bytes
  // of its elements: they land by cp.async (no register holds them, the block's DRAM latency paid once, as for
  // elements) in the upper half of the row's own chunks, and are then (decode_fp8, once they landed) decoded in place
  // from the lowest vector up,
  // 16 codes into 16 elements, each vector read before the two chunks written over it (vector c of the row's codes is
  // chunk kChunksPerRow / 2 + c, its elements chunks 2c and 2c + 1: a chunk is written only after every vector in it
  // was read). Every byte a thread reads or writes is its own row's: no other thread waits. Exact (every code of
  // both formats is a bf16 and an fp16 value: Prims::fp8x8_decode). The descales stay out of the stage: the
  // consumers fold k_descale into the tile's softmax scale and v_descale into its output scale, as the sm80 kernels.
  // The elements are generic stores, published by the caller's fence and arrival like the copies.
  __device__ void copy_fp8(FwdFp8Params const& p, uint32_t k_smem, uint32_t v_smem, int st, int n, int ptid) const {
    static_assert(kThreadsPerRow == 1 && kChunksPerRow % 2 == 0);
    constexpr int kVecs = kChunksPerRow / 2;  // 16-code vectors of a row
    CUTE_UNROLL
    for (int j = 0; j < kRowsPerThread; ++j) {
      int const row = ptid + j * 128;
      if (kIdleThreads && row >= Kt::kBlockN) break;
      auto const [in, k, v] = row_source<uint8_t>(p, n * Kt::kBlockN + row);
      CUTE_UNROLL
      for (int c = 0; c < kVecs; ++c) {
        bool const fill = in && c * 16 < p.headdim;  // code 0 is +0 in both formats
        uint32_t const off = stage_offset(row, (kVecs + c) * 8, st);
        Prims::cp_async16(k_smem + off, k + c * 16, fill);
        Prims::cp_async16(v_smem + off, v + c * 16, fill);
      }
    }
  }
  // The landed codes of this thread's rows of stage st, decoded in place (an FP8 cache; nothing otherwise).
  __device__ void decode(FwdFp8Params const& p, uint32_t k_smem, uint32_t v_smem, int st, int ptid) const {
    if constexpr (Kt::kCanGatherFp8) {
      if (p.kv_fp8 != kFp8None) decode_fp8(p, k_smem, v_smem, st, ptid);
    }
  }
  __device__ void decode_fp8(FwdFp8Params const& p, uint32_t k_smem, uint32_t v_smem, int st, int ptid) const {
    constexpr int kVecs = kChunksPerRow / 2;
    if (kIdleThreads && ptid >= Kt::kBlockN) return;  // one row per thread at most there
    // One vector in registers at a time: more (both tensors' vectors, or the loop unrolled) spilled the producer's
    // 40 registers and cost the consumers' paired P conversion (sm_90a hd64: F2FP 32 -> 64 per key block).
#pragma unroll 1
    for (int i = 0; i < 2 * kRowsPerThread * kVecs; ++i) {
      int const c = i % kVecs, row = ptid + (i / (2 * kVecs)) * 128;
      uint32_t const base = (i / kVecs) % 2 ? v_smem : k_smem;
      uint4 const codes = Prims::lds128(base + stage_offset(row, (kVecs + c) * 8, st));
      Prims::sts128(base + stage_offset(row, 2 * c * 8, st),
                    Prims::template fp8x8_decode<Element>(codes.x, codes.y, p.kv_fp8));
      Prims::sts128(base + stage_offset(row, (2 * c + 1) * 8, st),
                    Prims::template fp8x8_decode<Element>(codes.z, codes.w, p.kv_fp8));
    }
  }
};

// The producer (one thread): every TMA load of this CTA's tiles, in schedule order, from (rows, d, heads,
// batch) views of q, k and v.
template <class Kt, class Prims>
SA90_DEVICE void produce(FwdParams const& p, TmaParams<Kt> const& tma, PersistentTileOrder const& sched,
                         typename Kt::SharedStorage& ss) {
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim, kStages = Kt::kStages;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQs{});  // (M, d, Q buffer)
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Kt::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Kt::SmemLayoutKV{});
  GmemExtent const eq = q_extent(p), ekv = kv_extent(p);  // the shapes the launcher encoded (sm90/tma_gmem.h)
  Tensor mQ = tma.q.get_tma_tensor(make_shape(eq.rows, p.headdim, p.nheads, eq.batch));
  Tensor mK = tma.k.get_tma_tensor(make_shape(ekv.rows, p.headdim, p.nheads_k, ekv.batch));
  Tensor mV = tma.v.get_tma_tensor(make_shape(ekv.rows, p.headdim, p.nheads_k, ekv.batch));
  Tensor mKp = tma.k_page.get_tma_tensor(make_shape(ekv.rows, p.headdim, p.nheads_k, ekv.batch));
  Tensor mVp = tma.v_page.get_tma_tensor(make_shape(ekv.rows, p.headdim, p.nheads_k, ekv.batch));
  bool const paged = p.block_table != nullptr;

  PipelineState<Kt::kQBuffers> qs;  // Q buffers, one step per tile
  PipelineState<kStages> kv;        // K/V stages, one step per key block
  TileWalk<Kt, Prims> walk{ss, sched.count()};
  for (int64_t t = walk.publish(Prims::block_index()); t < walk.count; t = walk.publish(walk.producer_next(p, t))) {
    TileWork<Kt> const w(p, sched, t);
    if (!w.valid) continue;
    // The batch-mode index of q (0 when packed) and of k/v (0 when packed; a cache's sequence; unused when paged).
    int const bq = eq.batch > 1 ? w.batch : 0, bk = paged || ekv.batch == 1 ? 0 : w.batch, hk = w.kv_head(p);
    // (a packed tile's Q is not loaded from this view: its head is then the KV head, any valid index)
    Tensor gQ = local_tile(domain_offset(make_coord(int(w.ext.q_start), _0{}), mQ(_, _, w.head, bq)),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
    Tensor gK = local_tile(domain_offset(make_coord(int(w.ext.k_start), _0{}), mK(_, _, hk, bk)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(int(w.ext.k_start), _0{}), mV(_, _, hk, bk)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    auto [tQgQ, tQsQ] = tma_partition(tma.q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(tma.k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(tma.v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    PageRows<Kt, Prims> const pages(p, w.batch, w.ext.seqlen_k);
    // Key block n of K or V into stage st: one box of the whole block, or from a page pool kBlockN / kPageRows boxes
    // of page rows. Either way the stage's kKVBytes arrive on its full barrier.
    auto load_block = [&](auto const& tma_block, auto const& tg, auto const& ts, auto const& tma_page,
                          auto const& mPool, auto const& sStages, uint64_t& bar, int n, int st) {
      if (!paged) {
        Prims::tma_load(tma_block, bar, tg(_, n), ts(_, st));
        return;
      }
      // Not unrolled: unrolled (8 boxes at hd64), the consumers' key-block loop lost its paired P conversion
      // (sm_90a hd64 bf16: 32 F2FP -> 64 F2FP + 33 PRMT per block, path 449 -> 513 instructions); rolled, their
      // SASS path is the q/k/v kernel's (449).
#pragma unroll 1
      for (int r = 0; r < kBlockN / Kt::kPageRows; ++r) {
        auto const box = pages.box(n * kBlockN + r * Kt::kPageRows);
        Tensor g = local_tile(domain_offset(make_coord(box.slot, _0{}), mPool(_, _, hk, box.page)),
                              Shape<Int<Kt::kPageRows>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
        Tensor s = local_tile(sStages(_, _, st), Shape<Int<Kt::kPageRows>, Int<kHeadDim>>{}, make_coord(r, _0{}));
        auto [tg_page, ts_page] = tma_partition(tma_page, _0{}, Layout<_1>{}, group_modes<0, 2>(s),
                                                group_modes<0, 2>(g));
        Prims::tma_load(tma_page, bar, tg_page, ts_page);
      }
    };

    int const nblocks = w.nblocks;
    auto load_k = [&](int i, PipelineState<kStages> const& s) {  // block i of the range into stage s
      int const st = s.index();
      wait_empty<Prims>(ss.k_empty, s, BarrierId::kKEmpty);
      Prims::arrive_expect_tx(&ss.k_full[st], Kt::kKVBytes);
      load_block(tma.k, tKgK, tKsK, tma.k_page, mKp, sK, ss.k_full[st], w.range.block(i), st);
    };
    // The first K block goes out before the wait for Q's buffer, which also carries an earlier tile's O out
    // (with one buffer the previous tile's: this K load then overlaps the consumers' epilogue).
    if (nblocks > 0) load_k(0, kv);
    int const qb = qs.index();
    wait_empty<Prims>(ss.q_empty, qs, BarrierId::kQEmpty);
    if (w.group > 1) {
      Prims::arrive(&ss.q_full[qb]);  // the consumers load a packed tile's Q themselves (load_packed_q)
    } else {
      Prims::arrive_expect_tx(&ss.q_full[qb], Kt::kQBytes);
      Prims::tma_load(tma.q, ss.q_full[qb], tQgQ, tQsQ(_, qb));
    }
    qs.advance();

    for (int i = 0; i < nblocks; ++i, kv.advance()) {
      int const n = w.range.block(i), st = kv.index();
      if (i > 0) load_k(i, kv);
      wait_empty<Prims>(ss.v_empty, kv, BarrierId::kVEmpty);
      Prims::arrive_expect_tx(&ss.v_full[st], Kt::kKVBytes);
      load_block(tma.v, tVgV, tVsV, tma.v_page, mVp, sV, ss.v_full[st], n, st);
    }
  }
}

// The producer over a page pool or FP8 cache that gathers (Kt::gathers): all 128 threads of the warpgroup walk the
// tiles (the static walk) and copy each key block's K and V (KvGather); the first also issues each tile's Q, as
// produce() does. A loop of its own, not a branch in produce(): within the producer's 40 registers the two paths'
// values together spilled, the TMA path's too. ptid: the thread's index in the warpgroup.
template <class Kt, class Prims>
SA90_DEVICE void produce_gathered(FwdFp8Params const& p, TmaParams<Kt> const& tma, PersistentTileOrder const& sched,
                                  typename Kt::SharedStorage& ss, int ptid) {
  constexpr int kBlockM = Kt::kBlockM, kHeadDim = Kt::kHeadDim, kStages = Kt::kStages;
  // Blocks in flight per thread: block i - kLag is published once block i's copies are out (kLag 1: two blocks) where
  // the tile has three stages. Not more: issuing block i waits for its stages to be released from block i - kStages,
  // whose V the consumers read in the product that follows block i - kStages + 1's S, so that block must already be
  // published: kLag <= kStages - 2. With two stages (hd128, hd256) each block is published before the next is issued.
  constexpr int kLag = kStages >= 3 ? 1 : 0;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQs{});
  uint32_t const k_smem = Prims::smem_address(ss.k), v_smem = Prims::smem_address(ss.v);
  GmemExtent const eq = q_extent(p);
  Tensor mQ = tma.q.get_tma_tensor(make_shape(eq.rows, p.headdim, p.nheads, eq.batch));
  bool const issuer = WarpRoles::tma_thread(unsigned(ptid));

  PipelineState<Kt::kQBuffers> qs;
  PipelineState<kStages> kv;
  TileWalk<Kt, Prims> walk{ss, sched.count()};
  for (int64_t t = walk.publish(Prims::block_index()); t < walk.count; t = walk.publish(walk.producer_next(p, t))) {
    TileWork<Kt> const w(p, sched, t);
    if (!w.valid) continue;
    KvGather<Kt, Prims> const gather(p, w.batch, w.ext.seqlen_k, w.kv_head(p));
    // Block i of the range into stage kv, K and V together: each thread waits for both stages' release, issues its
    // copies and commits them as one group.
    auto issue_block = [&](int i) {
      wait_empty<Prims>(ss.k_empty, kv, BarrierId::kKEmpty);
      wait_empty<Prims>(ss.v_empty, kv, BarrierId::kVEmpty);
      gather.copy(p, k_smem, v_smem, kv.index(), w.range.block(i), ptid);
      Prims::cp_async_commit();
    };
    // The block in stage st, whose copies landed (the caller waited for its group): decoded (FP8), fenced for wgmma,
    // then this thread's arrival on both full barriers.
    auto publish = [&](int st) {
      gather.decode(p, k_smem, v_smem, st, ptid);
      Prims::fence_async_shared();
      Prims::arrive(&ss.k_full[st]);
      Prims::arrive(&ss.v_full[st]);
    };
    int const nblocks = w.nblocks;
    if (nblocks > 0) issue_block(0);  // before Q's buffer, as in produce()
    if (issuer) {
      int const qb = qs.index();
      wait_empty<Prims>(ss.q_empty, qs, BarrierId::kQEmpty);
      if (w.group > 1) {
        Prims::arrive(&ss.q_full[qb]);  // the consumers load a packed tile's Q themselves (load_packed_q)
      } else {
        int const bq = eq.batch > 1 ? w.batch : 0;
        Tensor gQ = local_tile(domain_offset(make_coord(int(w.ext.q_start), _0{}), mQ(_, _, w.head, bq)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
        auto [tQgQ, tQsQ] = tma_partition(tma.q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        Prims::arrive_expect_tx(&ss.q_full[qb], Kt::kQBytes);
        Prims::tma_load(tma.q, ss.q_full[qb], tQgQ, tQsQ(_, qb));
      }
    }
    qs.advance();
    // kLag blocks stay in flight behind the one published: block i - kLag is published once block i's copies are out.
    for (int i = 0; i < nblocks; ++i, kv.advance()) {
      if (i > 0) issue_block(i);
      if (i >= kLag) {
        Prims::template cp_async_wait_group<kLag>();
        publish((kv.count - kLag) % kStages);
      }
    }
    if constexpr (kLag > 0) {  // the tile's last kLag blocks
      if (nblocks > 0) {
        Prims::template cp_async_wait_group<0>();
        for (int j = nblocks < kLag ? nblocks : kLag; j > 0; --j) publish((kv.count - j) % kStages);
      }
    }
  }
}

// Ping-pong: a consumer warpgroup waits for its turn at the tensor cores, issues its GEMMs, then hands
// the turn to the next (round robin over kWarpgroups; two in the default tiles). Per tile each warpgroup
// takes nblocks + 1 turns; the last warpgroup gives warpgroup 0 the first turn up front and skips handing
// over after its last, so every barrier is balanced per tile. kOn false: no turns (each issues when ready).
template <class Prims, int kWarpgroups, bool kOn>
struct PingPong {
  using Ids = FwdNamedBarriers<kWarpgroups>;
  int wg;
  static constexpr bool kActive = kOn && kWarpgroups > 1;
  __device__ void begin() const {
    if constexpr (kActive) Prims::named_sync(256, Ids::turn(wg));
  }
  __device__ void end(bool last_of_tile) const {
    if constexpr (kActive) {
      if (wg + 1 < kWarpgroups) Prims::named_arrive(256, Ids::turn(wg + 1));
      else if (!last_of_tile) Prims::named_arrive(256, Ids::turn(0));
    }
  }
  __device__ void tile_start() const {
    if constexpr (kActive) {
      if (wg == kWarpgroups - 1) Prims::named_arrive(256, Ids::turn(0));
    }
  }
};

// Varlen and KV caches: the key block that holds a sequence's end also holds rows that are not its keys: the next
// sequence's first rows (a TMA box stops only at the packed tensor's end), a contiguous cache's stale slots, or a
// paged cache's other rows (PageRows). Their scores are masked, so K is harmless (the score becomes -inf whatever it was),
// but P = 0 does not survive 0 * inf in P V: one request's inf or NaN values would reach another's output. So the
// rows past the end are zeroed in the V stage before any product reads it, as the sm80 kernels' loads zero-fill
// them and the sm90 backward zeroes its tails. The block is a tile's first (the range runs from the last block
// down), read first by its P V product one turn later. Warpgroup 0 zeroes (its 128 threads, then its own barrier,
// so all of them are done before its product) and arrives on each other warpgroup's v_tail barrier; warpgroup w
// syncs on its own before its product. No warpgroup waits for another that needs the turn it holds: warpgroup 0
// only arrives, and warpgroup w waits for warpgroup 0 alone, which (with ping-pong) had its turn before.
template <class Kt, class Prims>
struct VTail {
  using Ids = FwdNamedBarriers<Kt::kConsumerWarpgroups>;
  int valid;  // rows of the stage that are the sequence's; kBlockN when the block does not cross its end
  // rows_loaded_past_end: a box reads real rows past the sequence's keys (packed keys, a KV cache's stale slots or
  // another sequence's pages); padded q/k/v tensors end each sequence at the descriptor's extent (zero fill).
  __device__ VTail(bool rows_loaded_past_end, int first_block, int seqlen_k)
      : valid(rows_loaded_past_end ? min_i(Kt::kBlockN, seqlen_k - first_block * Kt::kBlockN) : Kt::kBlockN) {}
  template <class StageV>
  __device__ void zero(StageV const& sv, int wg, int ctid) const {
    if (valid >= Kt::kBlockN) return;
    if (wg == 0) {
      zero_tail_rows<Prims, 128>(sv, valid, WarpRoles::thread_in_warpgroup(ctid));
      Prims::fence_async_shared();
      Prims::named_sync(128, Ids::own(0));
      CUTE_UNROLL
      for (int w = 1; w < Kt::kConsumerWarpgroups; ++w) Prims::named_arrive(256, Ids::v_tail(w));
    } else {
      Prims::named_sync(256, Ids::v_tail(wg));
    }
  }
};

template <class Kt, class Prims>
SA90_DEVICE void consume(FwdFp8Params const& p, PersistentTileOrder const& sched, typename Kt::SharedStorage& ss,
                         int ctid) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim, kStages = Kt::kStages;
  int const wg = WarpRoles::consumer_warpgroup(ctid);
  PingPong<Prims, Kt::kConsumerWarpgroups, Kt::kPingPong> const turn{wg};

  typename Kt::TiledMmaS mma_s;
  typename Kt::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Kt::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Kt::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), typename Kt::SmemLayoutVt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Kt::SmemLayoutKV{});  // (N, d, stage): the V tail's rows
  bool const rows_past_end = p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;  // VTail
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // wgmma descriptors (MMA, MMA_M, MMA_K, Q buffer)
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tScS = rowcol_view(thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  Tensor tOcO = rowcol_view(thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  // P: the registers of a copy of S in the input precision, read by the P V wgmma as its A operand.
  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor scores = rowcol_view(tSrS);
  Tensor out_rows = rowcol_view(tOrO);
  constexpr int kRows = decltype(size<0>(scores))::value;
  constexpr int kCols = decltype(size<1>(scores))::value;
  static_assert(kRows == 2);

  PipelineState<Kt::kQBuffers> qs;
  PipelineState<kStages> kv;
  TileWalk<Kt, Prims> walk{ss, sched.count()};
  for (int64_t t = walk.consumer_next(Prims::block_index()); t < walk.count;
       t = walk.consumer_next(t + Prims::grid_size())) {
    TileWork<Kt> const w(p, sched, t);
    if (!w.valid) continue;
    int const m0 = w.m_block * kBlockM;
    // FP8 caches: the tile's (sequence, KV head) descales, k_descale into the softmax scale (the scores of the codes
    // times it are those of the dequantized keys), v_descale into the output's scale (common/fp8.h; as the sm80
    // kernels). 1 otherwise.
    float k_descale = 1.f, v_descale = 1.f;
    if (p.k_descale) {
      k_descale = p.k_descale[w.batch * p.k_descale_batch_stride + w.kv_head(p) * p.k_descale_head_stride];
      v_descale = p.v_descale[w.batch * p.v_descale_batch_stride + w.kv_head(p) * p.v_descale_head_stride];
    }
    ScoreScale<> const score{p.softmax_scale * k_descale, p.softcap};
    OnlineSoftmax<kRows, Prims> softmax;  // its quad reductions: Prims::shfl_xor
    clear(tOrO);

    // The element mask's per-block question, the rule the sm80 forward asks too (common/mask.h mask_test): the
    // tile's part once, then a few compares per key block. Measured against needs_mask per block (sm_90a, hd128
    // bf16): the key-block loop's SASS 1014 -> 957 instructions, the kernel's 4384 -> 4456 (the tile's part, run
    // once per tile), registers, stack and the HGMMA / UTMALDG / BAR counts unchanged.
    TileMask::MaskTest const mtest = w.mask.mask_test(w.m_block);
    // Each of this thread's rows' visible keys, once per tile (a GQA-packed row's query is a division by the group;
    // per masked block that cost the hd64 kernel's masked path 714 -> 907 instructions).
    TileMask::RowBounds<kRows> rows_seen;
    w.mask.template row_bounds<kRows>(tScS, m0, rows_seen);
    // Scores of key block n -> unnormalised probabilities in place (exp2 units), the running max and sum
    // updated; `correction` gets each row's rescale factor for what O held before.
    float correction[kRows];
    auto softmax_block = [&](int n) {
      score.bound(tSrS);
      if (mtest.needs(n)) {
        w.mask.template apply_bounds<kRows, kCols>(rows_seen, tScS, n * kBlockN,
                                                   [&](int r, int c) { scores(r, c) = -INFINITY; });
      }
      softmax.rescale(scores, score.log2, correction);
    };
    auto convert_p = [&]() {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) rP(i) = Element(tSrS(i));
    };

    int const qb = qs.index();
    wait_full<Prims>(ss.q_full, qs, BarrierId::kQFull);
    if (w.group > 1) load_packed_q<Kt, Prims>(p, w, sQ(_, _, qb), wg, WarpRoles::thread_in_warpgroup(ctid));
    int const nblocks = w.nblocks;
    if (nblocks > 0) {
      VTail<Kt, Prims> const tail(rows_past_end, w.range.block(0), w.ext.seqlen_k);
      turn.tile_start();
      wait_full<Prims>(ss.k_full, kv, BarrierId::kKFull);
      turn.begin();
      Prims::template wgmma<true>(mma_s, tSrQ(_, _, _, qb), tSrK(_, _, _, kv.index()), tSrS);
      turn.end(false);
      Prims::template wgmma_wait<0>();
      Prims::fence_operand(tSrS);
      Prims::arrive(&ss.k_empty[kv.index()]);
      softmax_block(w.range.block(0));
      convert_p();

      for (int i = 1; i < nblocks; ++i) {
        PipelineState<kStages> const prev = kv;  // block i - 1's stage: its V is read below
        kv.advance();
        wait_full<Prims>(ss.k_full, kv, BarrierId::kKFull);
        turn.begin();
        Prims::template wgmma<true>(mma_s, tSrQ(_, _, _, qb), tSrK(_, _, _, kv.index()), tSrS);
        wait_full<Prims>(ss.v_full, prev, BarrierId::kVFull);
        if (i == 1) tail.zero(sV(_, _, prev.index()), wg, ctid);
        Prims::fence_operand(tOrP);
        Prims::template wgmma<false>(mma_o, tOrP, tOrV(_, _, _, prev.index()), tOrO);
        turn.end(false);
        Prims::template wgmma_wait<1>();  // S of block i is in; P V of block i-1 may still run
        Prims::fence_operand(tSrS);
        Prims::arrive(&ss.k_empty[kv.index()]);
        softmax_block(w.range.block(i));
        Prims::template wgmma_wait<0>();
        Prims::fence_operand(tOrO);
        Prims::fence_operand(tOrP);
        Prims::arrive(&ss.v_empty[prev.index()]);
        softmax.rescale_rows(out_rows, correction);
        convert_p();
      }

      wait_full<Prims>(ss.v_full, kv, BarrierId::kVFull);
      turn.begin();
      if (nblocks == 1) tail.zero(sV(_, _, kv.index()), wg, ctid);
      Prims::fence_operand(tOrP);
      Prims::template wgmma<false>(mma_o, tOrP, tOrV(_, _, _, kv.index()), tOrO);
      turn.end(true);
      Prims::template wgmma_wait<0>();
      Prims::fence_operand(tOrO);
      Prims::fence_operand(tOrP);
      Prims::arrive(&ss.v_empty[kv.index()]);
      kv.advance();
    }

    // ---- finalize: the sink joins the denominator once per row (in the combine when the keys are split) ----
    softmax.reduce_sums();
    bool const split_kv = p.num_splits > 1;
    float lse[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // a packed tile's rows belong to the group's query heads, each with its own sink
      int const sink_head = w.group > 1 ? w.head_of(get<0>(tOcO(r, 0))) : w.head;
      float const sink = split_kv || !p.sinks ? -INFINITY : p.sinks[sink_head];
      RowFinal const f = softmax.finalize(r, sink, score.natural);
      lse[r] = f.lse;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(out_rows); ++c) out_rows(r, c) *= f.out_scale * v_descale;
    }
    if (split_kv) {
      store_split_partials(p, out_rows, tOcO, lse, w);
    } else {
      store_out_lse<Kt, Prims>(p, ss.q + qb * cosize_v<typename Kt::SmemLayoutQ>, thr_o, tOrO, tOcO, lse, w, wg,
                               WarpRoles::thread_in_warpgroup(ctid));
    }
    // Every read of O's shared memory is done before the producer's next Q load (an async-proxy write)
    // may land there.
    Prims::fence_async_shared();
    Prims::arrive(&ss.q_empty[qb]);
    qs.advance();
  }
}

// One CTA of the forward, on whatever implements the primitives (Prims). Full barriers count the producer's one
// arrival (with its expected TMA bytes; tile_full: its plain store of the index), or, where the producer warpgroup
// gathers K and V (Kt::gathers), each of its 128 threads' arrival after its own copies; empty barriers count one
// arrival per consumer thread.
template <class Kt, class Prims>
SA_DEVICE void fwd_cta(FwdFp8Params const& p, TmaParams<Kt> const& tma, PersistentTileOrder const& sched,
                       char* smem) {
  auto& ss = *reinterpret_cast<typename Kt::SharedStorage*>(smem);
  unsigned const tid = Prims::thread_index();
  bool const gathering = Kt::gathers(p);
  if (WarpRoles::initializer(tid)) {
    CUTE_UNROLL
    for (int b = 0; b < Kt::kQBuffers; ++b) {
      Prims::barrier_init(&ss.q_full[b], 1);
      Prims::barrier_init(&ss.q_empty[b], 128 * Kt::kConsumerWarpgroups);
    }
    CUTE_UNROLL
    for (int s = 0; s < Kt::kStages; ++s) {
      Prims::barrier_init(&ss.k_full[s], gathering ? WarpRoles::kProducerThreads : 1);
      Prims::barrier_init(&ss.v_full[s], gathering ? WarpRoles::kProducerThreads : 1);
      Prims::barrier_init(&ss.k_empty[s], 128 * Kt::kConsumerWarpgroups);
      Prims::barrier_init(&ss.v_empty[s], 128 * Kt::kConsumerWarpgroups);
    }
    if constexpr (Kt::kDynamicTiles) {
      for (int s = 0; s < 2; ++s) {
        Prims::barrier_init(&ss.tile_full[s], 1);
        Prims::barrier_init(&ss.tile_empty[s], 128 * Kt::kConsumerWarpgroups);
      }
    }
    Prims::prefetch_tma(tma.q);
    Prims::prefetch_tma(tma.k);
    Prims::prefetch_tma(tma.v);
    if (p.block_table != nullptr && !gathering) {
      Prims::prefetch_tma(tma.k_page);
      Prims::prefetch_tma(tma.v_page);
    }
  }
  Prims::fence_barrier_init();
  Prims::sync_threads();

  if (WarpRoles::producer(tid)) {
    Prims::template setmaxnreg_dec<Kt::kProducerRegs>();
    if constexpr (Kt::kCanGather) {
      if (gathering) {
        produce_gathered<Kt, Prims>(p, tma, sched, ss, int(tid));
        return;
      }
    }
    if (WarpRoles::tma_thread(tid)) produce<Kt, Prims>(p, tma, sched, ss);
  } else {
    Prims::template setmaxnreg_inc<Kt::kConsumerRegs>();
    consume<Kt, Prims>(p, sched, ss, WarpRoles::consumer_thread(tid));
  }
}

#if defined(__CUDACC__)  // the GPU's kernel; the host emulation runs fwd_cta<Kt, EmuPrims> (emu/fwd_sm90_emu.h)
template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    fwd_kernel(__grid_constant__ const FwdFp8Params p, __grid_constant__ const TmaParams<Kt> tma,
               PersistentTileOrder const sched) {
  extern __shared__ __align__(1024) char smem[];
  fwd_cta<Kt, GpuPrims>(p, tma, sched, smem);
}
#endif

}  // namespace sinkattn::sm90
