// mask.h: the mask policy. It owns both the key blocks a CTA visits and the per-element mask inside
// them, so the two cannot drift apart (docs/DESIGN.md section 1 for the math, section 3 for the rule).
//
// Visibility of key j to query i, with off = seqlen_k - seqlen_q (bottom-right alignment):
//   right_ok = right < 0 || j <= i + off + right
//   left_ok  = left < 0  || j >= i + off - left || j < sink_tokens
// and j < seqlen_k. Host and device share this code; tests call it through the extension.
#pragma once
#include <cmath>
#include <cstdint>
#include "common/defs.h"
#include "common/seq_extent.h"

namespace sinkattn {

struct MaskPolicy {
  int seqlen_q, seqlen_k;
  int window_left, window_right;  // -1 = unbounded
  int sink_tokens;

  SA_HOST_DEVICE int offset() const { return seqlen_k - seqlen_q; }

  SA_HOST_DEVICE bool visible(int i, int j) const {
    if (j < 0 || j >= seqlen_k) return false;
    int diag = i + offset();
    bool right_ok = window_right < 0 || j <= diag + window_right;
    bool left_ok = window_left < 0 || j >= diag - window_left || j < sink_tokens;
    return right_ok && left_ok;
  }
};

// The one builder of a sequence's MaskPolicy: its extent's lengths (varlen, KV cache) and the call's window and
// sink tokens. Every kernel and the host entries build theirs here.
template <class Params>
SA_HOST_DEVICE MaskPolicy mask_policy(Params const& p, SeqExtent const& e) {
  return MaskPolicy{e.seqlen_q, e.seqlen_k, p.window_left, p.window_right, p.sink_tokens};
}

// The key blocks one M tile visits: the window blocks [win_begin, win_end) and, below them, the blocks
// holding sink tokens [0, sink_end) with sink_end <= win_begin. The union of visible keys over the rows of
// a tile is contiguous apart from the sink tokens, so every block in these ranges holds a visible pair.
struct BlockRange {
  int win_begin, win_end;
  int sink_end;
  SA_HOST_DEVICE int count() const { return (win_end - win_begin) + sink_end; }
  // The t-th block visited, window blocks from the last down (the first visited is the one that may need
  // the right-edge mask and the key tail), then sink blocks from the last down.
  SA_HOST_DEVICE int block(int t) const {
    int nwin = win_end - win_begin;
    return t < nwin ? win_end - 1 - t : sink_end - 1 - (t - nwin);
  }
  // The rank of visited block n among the visited blocks in increasing order (sink blocks, then window blocks):
  // the deterministic backward's dQ turn. The key blocks whose backward adds dQ into M tile m are exactly the
  // blocks of range(m) (docs/DESIGN.md section 4), and they add in increasing order, so block n waits until
  // rank(n) blocks have added. n must be a visited block.
  SA_HOST_DEVICE int rank(int n) const { return n < sink_end ? n : sink_end + (n - win_begin); }
};

// Block sizes are runtime values so host tests can sweep them; in a kernel they are compile-time
// constants at the call site and fold away. `group` > 1 is a GQA-packed tile: row r holds query r / group.
struct TileMask {
  MaskPolicy p;
  int kBlockM, kBlockN;
  int group = 1;

  SA_HOST_DEVICE int query_of_row(int r) const { return group == 1 ? r : r / group; }

  // First and last query of M tile m_block (last < first when the tile is past the end).
  SA_HOST_DEVICE void tile_queries(int m_block, int& m0, int& m_last) const {
    int r0 = m_block * kBlockM;
    int r_last = min_i(r0 + kBlockM, p.seqlen_q * group) - 1;
    m0 = query_of_row(r0);
    m_last = r_last < r0 ? m0 - 1 : query_of_row(r_last);
  }

  // The keys row r sees, as bounds: j is visible iff j < hi and (j >= lo or j < sink_tokens), the same
  // answer as p.visible(query_of_row(r), j) for every j >= 0, with the per-row work done once (kernels mask a row's
  // columns with two compares each).
  SA_HOST_DEVICE void visible_cols(int r, int& lo, int& hi) const {
    int64_t const diag = int64_t(query_of_row(r)) + p.offset();
    int64_t h = p.seqlen_k;
    if (p.window_right >= 0 && diag + p.window_right + 1 < h) h = diag + p.window_right + 1;
    int64_t l = p.window_left >= 0 ? diag - p.window_left : 0;
    hi = int(h < 0 ? 0 : h);
    lo = int(l < 0 ? 0 : l > hi ? hi : l);
  }

  // The element mask of one tile: calls hide(r, c) for every element whose pair is not visible. coords(r, c) is
  // element (r, c)'s (row, key) within the tile, as get<0> / get<1> (a CuTe identity-tensor view in the kernels,
  // std::pair in the host tests); row0 and col0 place the tile: tile row row0 + row, key col0 + key. Per row the
  // visible keys are [lo, hi) plus the sink tokens below hi (visible_cols), compared in the tile's own columns:
  // two compares per element, the row's bounds computed once. (Comparing each element with MaskPolicy::visible
  // instead spilled 24-32 bytes in the sm80 forward on sm_90, and took a third of the sm90 forward's
  // instructions.) Exact for any tile: callers skip it where needs_mask() is false only to save the work.
  template <int kRows, int kCols, class Coords, class Hide>
  SA_DEVICE void apply(Coords const& coords, int row0, int col0, Hide&& hide) const {
    int const sink_hi = p.sink_tokens - col0;
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int lo, hi;
      visible_cols(row0 + int(get<0>(coords(r, 0))), lo, hi);
      lo -= col0;
      hi -= col0;
      SA_UNROLL
      for (int c = 0; c < kCols; ++c) {
        int const j = int(get<1>(coords(r, c)));
        if (!(j < hi && (j >= lo || j < sink_hi))) hide(r, c);
      }
    }
  }
  // The same in two steps, for a kernel that masks several key blocks of one tile: each row's [lo, hi) once per tile
  // (row_bounds: a GQA-packed row's query is a division by the group), then per block only the column compares.
  // (apply is left in one piece: written through these two, the sm80 forward's SASS changed at every tile.)
  template <int kRows>
  struct RowBounds {
    int lo[kRows], hi[kRows];
  };
  template <int kRows, class Coords>
  SA_DEVICE void row_bounds(Coords const& coords, int row0, RowBounds<kRows>& b) const {
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) visible_cols(row0 + int(get<0>(coords(r, 0))), b.lo[r], b.hi[r]);
  }
  template <int kRows, int kCols, class Coords, class Hide>
  SA_DEVICE void apply_bounds(RowBounds<kRows> const& b, Coords const& coords, int col0, Hide&& hide) const {
    int const sink_hi = p.sink_tokens - col0;
    SA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const lo = b.lo[r] - col0, hi = b.hi[r] - col0;
      SA_UNROLL
      for (int c = 0; c < kCols; ++c) {
        int const j = int(get<1>(coords(r, c)));
        if (!(j < hi && (j >= lo || j < sink_hi))) hide(r, c);
      }
    }
  }

  // The same bounds for a kernel that decides each element's visibility inside a pass of its own (the sm80
  // backward computes P and dS of an element together; a separate masking pass there cost the hd256 tile on
  // sm_90 24 more bytes of stack): column j of a tile whose column 0 is key col0 is visible to tile row `row`
  // iff visible(j). Host tests check it against apply and the contract (mask_apply).
  struct RowKeys {
    int lo, hi, sink_hi;
    SA_HOST_DEVICE bool visible(int j) const { return j < hi && (j >= lo || j < sink_hi); }
  };
  SA_HOST_DEVICE RowKeys row_keys(int row, int col0) const {
    int lo, hi;
    visible_cols(row, lo, hi);
    return RowKeys{lo - col0, hi - col0, p.sink_tokens - col0};
  }

  // The transposed bounds, for a kernel whose accumulator rows are keys (the sm90 backward computes S^T = K Q^T,
  // so a thread holds two keys and many queries): query row i of a tile whose row 0 is query row0 sees key j iff
  // visible(i). The rows that see key j (group == 1) are one interval:
  //   right: i >= j - off - right      left: i <= j - off + left, unless j < sink_tokens      and i < seqlen_q;
  // none when j is past seqlen_k. Host tests check it against MaskPolicy::visible for every pair (mask_key_rows).
  struct KeyRows {
    int lo, hi;
    SA_HOST_DEVICE bool visible(int i) const { return i >= lo && i < hi; }
  };
  SA_HOST_DEVICE KeyRows key_rows(int j, int row0) const {
    int64_t const off = p.offset();
    int64_t lo = 0, hi = p.seqlen_q;
    if (j < 0 || j >= p.seqlen_k) hi = 0;
    if (p.window_right >= 0 && j - off - p.window_right > lo) lo = j - off - p.window_right;
    if (p.window_left >= 0 && j >= p.sink_tokens && j - off + p.window_left + 1 < hi) hi = j - off + p.window_left + 1;
    if (hi <= lo) lo = hi = 0;  // no row: an empty interval (lo may lie past seqlen_q, hi below 0)
    return KeyRows{int(lo) - row0, int(hi) - row0};
  }

  SA_HOST_DEVICE BlockRange range(int m_block) const {
    BlockRange r{0, 0, 0};
    int m0, m_last;
    tile_queries(m_block, m0, m_last);
    if (m_last < m0 || p.seqlen_k <= 0) return r;
    int hi = p.seqlen_k;  // one past the last visible key of any row in the tile
    if (p.window_right >= 0) hi = min_i(hi, m_last + p.offset() + p.window_right + 1);
    if (hi <= 0) return r;  // every row of the tile sees nothing (causal with seqlen_q > seqlen_k)
    int lo = 0;
    if (p.window_left >= 0) lo = max_i(0, m0 + p.offset() - p.window_left);
    if (lo >= hi) lo = hi;  // window entirely left of the keys: only sink tokens may remain
    r.win_end = ceil_div(hi, kBlockN);
    r.win_begin = lo >= hi ? r.win_end : lo / kBlockN;
    int sink_keys = min_i(p.sink_tokens, hi);
    r.sink_end = min_i(ceil_div(sink_keys, kBlockN), r.win_begin);
    return r;
  }

  // The transposed range, for the backward (an N tile visits M tiles): the M tiles [m_begin, m_end) holding
  // the query rows that see some key of n-block n_block. Rows that see key j satisfy
  //   right: i >= j - off - right          left: i <= j - off + left, unless j < sink_tokens
  // so over the block's keys [j0, j1] the rows form one contiguous range: from the first row whose right
  // edge reaches j0 to the last row whose left edge reaches j1 (to the end when the block holds a sink
  // token). Every row in it sees a key of the block, so every M tile in the range holds a visible pair.
  SA_HOST_DEVICE void m_range(int n_block, int& m_begin, int& m_end) const {
    m_begin = m_end = 0;
    int const j0 = n_block * kBlockN, j1 = min_i(j0 + kBlockN, p.seqlen_k) - 1;
    if (j1 < j0 || p.seqlen_q <= 0) return;
    int lo = 0, hi = p.seqlen_q;  // query rows [lo, hi)
    if (p.window_right >= 0) lo = max_i(0, j0 - p.offset() - p.window_right);
    if (p.window_left >= 0 && j0 >= p.sink_tokens) hi = min_i(hi, j1 - p.offset() + p.window_left + 1);
    if (lo >= hi) return;
    m_begin = lo * group / kBlockM;
    m_end = ceil_div(hi * group, kBlockM);
  }

  // True when some pair of the block (valid rows x block columns) is not visible, so the kernel must apply
  // the element mask. Exact: a block reported false has every pair visible.
  //
  // The rule has two forms, which the host entry mask_tile_blocks checks agree on every block of every tile the
  // tests sweep (they are kept apart, not one built on the other, for what each costs in the kernel that asks):
  // - needs_mask(m, n): one question, no state. It works out the tile's first and last query and the window's
  //   edges there on every call: ~40 instructions per key block in the sm80 forward's loop, nothing held across
  //   blocks. Right for a kernel that asks once per (M tile, key block) pair with the M tile changing: the
  //   backwards (sm80 and sm90), where an N tile walks M tiles.
  // - mask_test(m).needs(n): the tile's part worked out once (64-bit, clamped), then three ints held across
  //   the key-block loop and two or three compares per block. Right for a kernel that asks every key block of
  //   one M tile: both forwards (the sm90 forward's key-block loop took 1014 -> 957 SASS instructions with it,
  //   sm_90a hd128, registers unchanged; csrc/sm90/fwd_kernel.cuh). Were needs_mask built on it, the backwards'
  //   per-(m, n) question would redo the 64-bit tile part for every M tile.
  SA_HOST_DEVICE bool needs_mask(int m_block, int n_block) const {
    int m0, m_last;
    tile_queries(m_block, m0, m_last);
    int j0 = n_block * kBlockN, j1 = j0 + kBlockN - 1;
    if (j1 >= p.seqlen_k) return true;
    if (p.window_right >= 0 && j1 > m0 + p.offset() + p.window_right) return true;
    if (p.window_left >= 0) {
      int first_non_sink = max_i(j0, p.sink_tokens);
      if (first_non_sink <= j1 && first_non_sink < m_last + p.offset() - p.window_left) return true;
    }
    return false;
  }

  // needs_mask for the blocks of one M tile as block-index bounds, the tile's part (its first and last query,
  // the window's edges there) worked out once: the forward asks it every key block (needs_mask took ~40
  // instructions per block in the sm80 forward's loop), and three ints keep it light on registers. The host
  // entry mask_tile_blocks checks it against needs_mask for every block of every tile the tests sweep. Block n
  // needs the mask iff n >= hi (it holds a key past seqlen_k, or past the first row's right edge) or
  // lo_a <= n < lo_b (a non-sink key of it lies left of the last row's left edge; blocks below lo_a hold only
  // sink tokens).
  struct MaskTest {
    int hi, lo_a, lo_b;
    SA_HOST_DEVICE bool needs(int n_block) const { return n_block >= hi || (n_block >= lo_a && n_block < lo_b); }
  };
  SA_HOST_DEVICE MaskTest mask_test(int m_block) const {
    int m0, m_last;
    tile_queries(m_block, m0, m_last);
    int64_t const off = p.offset(), B = kBlockN;
    auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
    auto clamp = [](int64_t v) { return int(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v); };
    // j1 = nB + B - 1 >= seqlen_k  <=>  n >= seqlen_k / B;  j1 > right  <=>  n >= floor((right + 1) / B).
    int64_t hi = p.seqlen_k / B;
    if (p.window_right >= 0) {
      int64_t const right = m0 + off + p.window_right;
      int64_t const h = floor_div(right + 1, B);
      hi = h < hi ? h : hi;
    }
    // The first non-sink key of block n is max(nB, sink_tokens) (blocks n < sink_tokens / B hold none); it lies
    // left of `left` iff sink_tokens < left and nB < left.
    int const lo_a = p.sink_tokens / kBlockN;
    int lo_b = lo_a;
    if (p.window_left >= 0) {
      int64_t const left = m_last + off - p.window_left;
      if (p.sink_tokens < left) lo_b = clamp(-floor_div(-left, B));  // ceil(left / B)
    }
    return MaskTest{clamp(hi), lo_a, lo_b};
  }
};

}  // namespace sinkattn
