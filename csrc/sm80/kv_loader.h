// kv_loader.h: the sm80 forward's one K/V loader: key block n of a sequence's keys, contiguous, packed (varlen) or
// in the pages of a paged cache, from global memory into a shared-memory stage with cp.async. One code for a
// cache of the kernel's Element and for FP8 codes alike: the traits name what the cache holds (CacheElement), the
// copy row_loader.h reads (KvLoad) and the stage's layout (SmemLayoutKvLoad); fp8_kv.h's conversion pass is a step
// of its own after the load lands.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "common/seq_extent.h"
#include "sm80/fwd_tiles.h"
#include "sm80/row_loader.h"

namespace sinkattn::sm80 {

using namespace cute;

template <class Kt>
struct KvLoader {
  using Cache = typename Kt::CacheElement;
  using Load = typename Kt::KvLoad;
  using Stage = typename Kt::SmemLayoutKvLoad;
  static constexpr int kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;

  typename Kt::Params const& p;
  Cache const* k_seq;
  Cache const* v_seq;
  int const* pages;  // this sequence's row of the block table, or nullptr
  int seqlen_k;
  int whole_blocks;    // blocks n < whole_blocks hold only keys < seqlen_k, at the kernel's whole head dim
  bool block_in_page;  // a key block never straddles two pages

  // K and V: SeqExtent::k_row's rule, except that a paged cache has no batch term (its batch strides are page
  // strides, applied per key by offset(); k_start is 0: a cache's keys are never packed). Written out here: through
  // k_row with a zero batch stride, or through a SeqExtent member taking the block table, the hd128 tiles took 2-4
  // more registers (ptxas, sm_80 and sm_90).
  SA_DEVICE KvLoader(typename Kt::Params const& p_, SeqExtent const& ext, int bidb, int bidh_k)
      : p(p_),
        k_seq(static_cast<Cache const*>(p_.k) + int64_t(bidh_k) * p_.k_head_stride +
              (p_.block_table || ext.k_varlen ? ext.k_start * p_.k_row_stride : bidb * p_.k_batch_stride)),
        v_seq(static_cast<Cache const*>(p_.v) + int64_t(bidh_k) * p_.v_head_stride +
              (p_.block_table || ext.k_varlen ? ext.k_start * p_.v_row_stride : bidb * p_.v_batch_stride)),
        pages(p_.block_table ? p_.block_table + bidb * p_.block_table_batch_stride : nullptr),
        seqlen_k(ext.seqlen_k),
        whole_blocks(p_.headdim == kHeadDim ? ext.seqlen_k / kBlockN : 0),
        block_in_page(!pages || p_.page_size % kBlockN == 0) {}

  // Key j's offset from *_seq: in a paged cache slot j % page_size of page pages[j / page_size] (shifts for the
  // usual power-of-two page sizes). The contiguous return has a line of its own, apart from the test every call runs:
  // the line counts tools/perf_counts.py weighs SASS blocks by then tell the two sides apart.
  SA_DEVICE int64_t offset(int64_t page_stride, int64_t row_stride, int j) const {
    if (pages) {
      int const page = page_of(j);
      return int64_t(pages[page]) * page_stride + int64_t(slot_of(j)) * row_stride;
    }
    return int64_t(j) * row_stride;
  }
  // Key j's page in the sequence's row of the block table, and its slot in that page.
  SA_DEVICE int page_of(int j) const { return p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size; }
  SA_DEVICE int slot_of(int j) const { return p.page_shift >= 0 ? j & (p.page_size - 1) : j % p.page_size; }

  // Key block n into stage s of the K stages at stage_k and the V stages at stage_v, by thread tid. Interior
  // blocks in a contiguous cache or inside one page load as whole tiles (load_tile): a block offset and
  // unpredicated copies. Decode tiles over pages smaller than a block load them row by row from their pages,
  // still without bounds or zero-fill (load_paged_rows; in the 255-register prefill tiles this third path made
  // ptxas spill, so they take the checked load_rows there). The last block and a head dim below the kernel's go
  // through load_rows, row by row with bounds and zero-fill.
  SA_DEVICE void operator()(int n, int s, Cache* stage_k, Cache* stage_v, int tid) const {
    load<true, true>(n, s, stage_k, stage_v, tid);
  }
  // Whether block n is an interior block of a contiguous (or packed) cache: whole, no page table.
  SA_DEVICE bool whole_contiguous(int n) const { return !pages && n < whole_blocks; }
  // K (kK) or V of block n into stage s, if pred, which implies whole_contiguous(n): no branch (load_tile_if).
  template <bool kK>
  SA_DEVICE void load_whole_if(bool pred, int n, int s, Cache* stage_kv, int tid) const {
    typename Load::GmemTiledCopyLoad copy;
    auto thr = copy.get_thread_slice(tid);
    Tensor tKVcKV = thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    auto tXsX = thr.partition_D(make_tensor(make_smem_ptr(stage_kv + s * cosize_v<Stage>), Stage{}));
    int64_t const row_stride = kK ? p.k_row_stride : p.v_row_stride;
    load_tile_if<Load>(pred, tXsX, tKVcKV, kK ? k_seq : v_seq, n * kBlockN, row_stride);
  }
  // Interior block n (first key j0) of a paged cache whose pages are smaller than a block (decode tiles; a
  // contiguous cache's interior blocks load as whole tiles): every row valid, each in a slot of its own page. A
  // thread's rows are a pass of kNThreads / (threads per row) rows apart, so at pages of 16 each is in another page.
  // Their page numbers are read first, all of them, then K's and V's copies use them: one block-table latency per
  // block, where a lookup per row and tensor (offset()) put each row's copy behind its own load of the block table,
  // 16 of them in a row at hd64 (a branch between each: ptxas could not hoist them).
  template <bool kK, bool kV, class TK, class TV, class TC, class Vec>
  SA_DEVICE void load_paged_rows(int j0, TK&& tKsK, TV&& tVsV, TC const& tKVcKV, Vec const& vec) const {
    typename Load::GmemTiledCopyLoad copy_atom;
    constexpr int kRows = decltype(size<1>(tKVcKV))::value;
    int page[kRows], slot[kRows];
    CUTE_UNROLL
    for (int m = 0; m < kRows; ++m) {
      int const j = j0 + get<0>(tKVcKV(0, m, 0));
      page[m] = pages[page_of(j)];
      slot[m] = slot_of(j);
    }
    auto rows = [&](auto&& tXsX, Cache const* seq, int64_t page_stride, int64_t row_stride) {
      CUTE_UNROLL
      for (int m = 0; m < kRows; ++m) {
        Cache const* row = seq + int64_t(page[m]) * page_stride + int64_t(slot[m]) * row_stride;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tXsX); ++k) {
          copy(copy_atom, make_tensor(make_gmem_ptr(row + get<1>(tKVcKV(0, m, k))), vec), tXsX(_, m, k));
        }
      }
    };
    if constexpr (kK) rows(tKsK, k_seq, p.k_batch_stride, p.k_row_stride);
    if constexpr (kV) rows(tVsV, v_seq, p.v_batch_stride, p.v_row_stride);
  }
  // K only, or V only: the staggered tiles (fwd_tiles.h, stages 1) load a block's K and V at different points of
  // the loop (fwd_kernel.h).
  template <bool kK, bool kV>
  SA_DEVICE void load(int n, int s, Cache* stage_k, Cache* stage_v, int tid) const {
    typename Load::GmemTiledCopyLoad copy;
    auto thr = copy.get_thread_slice(tid);
    Tensor tKVcKV = thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    auto const vec = gmem_vector<Cache, kBlockN, kHeadDim>(thr);
    auto tKsK = thr.partition_D(make_tensor(make_smem_ptr(stage_k + s * cosize_v<Stage>), Stage{}));
    auto tVsV = thr.partition_D(make_tensor(make_smem_ptr(stage_v + s * cosize_v<Stage>), Stage{}));
    int const j0 = n * kBlockN;
    auto k_row = [&](int r) { return k_seq + offset(p.k_batch_stride, p.k_row_stride, j0 + r); };
    auto v_row = [&](int r) { return v_seq + offset(p.v_batch_stride, p.v_row_stride, j0 + r); };
    if (n < whole_blocks && block_in_page) {
      if constexpr (kK) load_tile<Load>(tKsK, tKVcKV, vec, k_row(0), p.k_row_stride);
      if constexpr (kV) load_tile<Load>(tVsV, tKVcKV, vec, v_row(0), p.v_row_stride);
    } else if (!kPrefill<typename Kt::TileTag> && n < whole_blocks) {
      load_paged_rows<kK, kV>(j0, tKsK, tVsV, tKVcKV, vec);
    } else {
      if constexpr (kK) load_rows<Load>(tKsK, tKVcKV, vec, seqlen_k - j0, p.headdim, k_row);
      if constexpr (kV) load_rows<Load>(tVsV, tKVcKV, vec, seqlen_k - j0, p.headdim, v_row);
    }
  }
};

}  // namespace sinkattn::sm80
