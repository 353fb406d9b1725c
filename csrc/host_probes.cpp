// host_probes.cpp: host entry points into the kernels' shared logic (mask policy, tile tables and orders, the
// softmax finalize, the merge weights, FP8 decoding, sequence extents), for the CPU tests. Each runs the same
// header code the kernels run, on the host, so a test can hold it against the float64 oracle. Not part of the
// attention API (api.cpp holds the op entry points).
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/fp8.h"
#include "common/mask.h"
#include "common/merge.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "common/split.h"
#include "common/tile_order.h"
#include "host_probes.h"
#include "kernel_headdims.h"
#include "params.h"
#include "sm80/bwd_tiles.h"
#include "sm80/fwd_tiles.h"

namespace py = pybind11;

namespace sinkattn {
namespace {

// The host entries' params: a padded problem's lengths and the call's window and sink tokens.
void host_mask_params(AttnParams& p, int sq, int sk, int wl, int wr, int ns) {
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.window_left = wl;
  p.window_right = wr;
  p.sink_tokens = ns;
}

// The host entries' tile mask of a padded problem, built as the kernels build theirs (seq_extent, mask_policy).
TileMask host_tile_mask(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n, int group = 1) {
  AttnParams p;
  host_mask_params(p, sq, sk, wl, wr, ns);
  return TileMask{mask_policy(p, seq_extent(p, 0)), block_m, block_n, group};
}

// (n_block, m_block, needs_mask) for every M tile each key block visits in the backward (TileMask::m_range).
at::Tensor mask_col_blocks(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n) {
  TileMask const tm = host_tile_mask(sq, sk, wl, wr, ns, block_m, block_n);
  std::vector<int32_t> rows;
  int n_blocks = ceil_div(sk, block_n);
  for (int n = 0; n < n_blocks; ++n) {
    int mb, me;
    tm.m_range(n, mb, me);
    for (int m = mb; m < me; ++m) rows.insert(rows.end(), {n, m, tm.needs_mask(m, n) ? 1 : 0});
  }
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 3), 3}, at::kInt).clone();
}

// [lo, hi) of TileMask::key_rows for every key j < seqlen_k + 2 (row0 = 0): the query rows that see key j (the
// sm90 backward masks its transposed score tiles with it).
at::Tensor mask_key_rows(int sq, int sk, int wl, int wr, int ns) {
  TileMask const tm = host_tile_mask(sq, sk, wl, wr, ns, 1, 1);
  std::vector<int32_t> rows;
  for (int j = -1; j < sk + 2; ++j) {
    TileMask::KeyRows const r = tm.key_rows(j, 0);
    rows.insert(rows.end(), {j, r.lo, r.hi});
  }
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 3), 3}, at::kInt).clone();
}

// (m_block, n_block, turn) for every key block that visits each M tile in the backward: BlockRange::rank of the
// tile's range, the deterministic backward's dQ turn (the kernels wait on it).
at::Tensor dq_turns(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n) {
  TileMask const tm = host_tile_mask(sq, sk, wl, wr, ns, block_m, block_n);
  std::vector<int32_t> rows;
  for (int m = 0; m < ceil_div(sq, block_m); ++m) {
    BlockRange const r = tm.range(m);
    for (int t = 0; t < r.count(); ++t) rows.insert(rows.end(), {m, r.block(t), r.rank(r.block(t))});
  }
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 3), 3}, at::kInt).clone();
}

// Sequence b's extent and mask as a kernel sees them (seq_extent, mask_policy), and row addresses through
// SeqExtent::q_row / k_row for the strides given ((batch, row, head) of a q-like and a k-like tensor). cu_seqlens
// and seqused_k are host int32 tensors or None; the params hold them as the kernels' would.
py::dict seq_extent_host(int b, int seqlen_q, int seqlen_k, std::optional<at::Tensor> cu_seqlens_q,
                                std::optional<at::Tensor> cu_seqlens_k, std::optional<at::Tensor> seqused_k, int wl,
                                int wr, int ns, std::vector<int64_t> q_strides, std::vector<int64_t> k_strides,
                                int head, int64_t row) {
  TORCH_CHECK(q_strides.size() == 3 && k_strides.size() == 3, "seq_extent: strides are (batch, row, head)");
  TORCH_CHECK(cu_seqlens_q.has_value() || !cu_seqlens_k.has_value(), "seq_extent: cu_seqlens_k needs cu_seqlens_q");
  auto ints = [](std::optional<at::Tensor> const& t) -> at::Tensor {
    if (!t) return {};
    TORCH_CHECK(t->device().is_cpu(), "seq_extent: host tensors");
    return t->to(at::kInt).contiguous();
  };
  at::Tensor const cq = ints(cu_seqlens_q), ck = ints(cu_seqlens_k), su = ints(seqused_k);
  FwdParams p;
  host_mask_params(p, seqlen_q, seqlen_k, wl, wr, ns);
  if (cq.defined()) p.cu_seqlens_q = cq.data_ptr<int>();
  if (ck.defined()) p.cu_seqlens_k = ck.data_ptr<int>();  // absent with cu_seqlens_q: the serving form's cache
  if (su.defined()) p.seqused_k = su.data_ptr<int>();
  SeqExtent const e = seq_extent(p, b);
  MaskPolicy const m = mask_policy(p, e);
  py::dict d;
  d["varlen"] = e.varlen;
  d["k_varlen"] = e.k_varlen;
  d["q_start"] = e.q_start;
  d["k_start"] = e.k_start;
  d["seqlen_q"] = e.seqlen_q;
  d["seqlen_k"] = e.seqlen_k;
  d["mask"] = std::vector<int>{m.seqlen_q, m.seqlen_k, m.window_left, m.window_right, m.sink_tokens};
  d["q_row"] = e.q_row(b, q_strides[0], q_strides[1], q_strides[2], head, row);
  d["k_row"] = e.k_row(b, k_strides[0], k_strides[1], k_strides[2], head, row);
  d["lse_row"] = e.lse_row(b, q_strides[0], q_strides[2], head, int(row));  // q's batch and head strides as lse's
  d["q_rows_before"] = e.q_rows_before(b, seqlen_q);
  d["k_rows_before"] = e.k_rows_before(b, seqlen_k);
  return d;
}

// The serving entry's packed M tiles (common/seq_extent.h): (sequence, M tile) of each of the packed_tile_count
// grid blocks for a host int32 cu_seqlens_q, as the kernel's CTAs find them.
at::Tensor packed_tiles_host(at::Tensor cu_seqlens_q, int group, int block_m, int64_t total_q) {
  TORCH_CHECK(cu_seqlens_q.device().is_cpu() && cu_seqlens_q.numel() >= 2, "packed_tiles: host cu_seqlens_q, batch >= 1");
  at::Tensor const cq = cu_seqlens_q.to(at::kInt).contiguous();
  int const batch = int(cq.numel() - 1);
  int64_t const n = packed_tile_count(total_q, group, block_m, batch);
  at::Tensor out = at::empty({n, 2}, at::kLong);
  auto o = out.accessor<int64_t, 2>();
  for (int64_t t = 0; t < n; ++t) {
    int b = 0, m = 0;
    packed_tile(cq.data_ptr<int>(), batch, group, block_m, t, b, m);
    o[t][0] = b;
    o[t][1] = m;
  }
  return out;
}

// bwd_lse of every element: the lse each backward recomputes P with (a -inf lse becomes +inf).
at::Tensor bwd_lse_host(at::Tensor lse) {
  auto out = lse.to(at::kFloat).contiguous().clone();
  float* x = out.data_ptr<float>();
  for (int64_t i = 0; i < out.numel(); ++i) x[i] = bwd_lse(x[i]);
  return out;
}

int64_t num_splits_heuristic(int64_t ctas, int64_t num_sms, int64_t n_blocks, int64_t max_splits) {
  return choose_num_splits(ctas, int(num_sms), int(n_blocks), int(max_splits));
}

// ---- host entry points to the shared logic, for the CPU tests -----------------------------------------
// (m_block, n_block, needs_mask) for every block each M tile visits, in visiting order. Also checks that
// TileMask::mask_test (the forward's per-tile form) agrees with needs_mask on every block of every tile.
at::Tensor mask_tile_blocks(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n, int group) {
  TileMask const tm = host_tile_mask(sq, sk, wl, wr, ns, block_m, block_n, group);
  std::vector<int32_t> rows;
  int m_blocks = ceil_div(sq * group, block_m);
  for (int m = 0; m < m_blocks; ++m) {
    TileMask::MaskTest const test = tm.mask_test(m);
    for (int n = 0; n <= ceil_div(sk, block_n); ++n) {
      TORCH_CHECK(test.needs(n) == tm.needs_mask(m, n), "mask_tile_blocks: TileMask::mask_test and needs_mask disagree at",
                  " m_block ", m, ", n_block ", n);
    }
    BlockRange r = tm.range(m);
    for (int t = 0; t < r.count(); ++t) {
      int n = r.block(t);
      rows.insert(rows.end(), {m, n, tm.needs_mask(m, n) ? 1 : 0});
    }
  }
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 3), 3}, at::kInt).clone();
}

// The element mask TileMask::apply gives for tile (m_block, n_block): true where a pair is hidden, (block_m,
// block_n), rows and keys past the problem included (the kernels' tails). Also checks, element by element, that
// TileMask::row_keys (the backward's form of the same bounds) agrees.
at::Tensor mask_apply(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n, int group, int m_block,
                             int n_block) {
  TileMask const tm = host_tile_mask(sq, sk, wl, wr, ns, block_m, block_n, group);
  auto out = at::zeros({block_m, block_n}, at::kBool);
  auto a = out.accessor<bool, 2>();
  for (int r = 0; r < block_m; ++r) {
    auto const keys = tm.row_keys(m_block * block_m + r, n_block * block_n);
    for (int c = 0; c < block_n; ++c) a[r][c] = !keys.visible(c);
  }
  auto const by_rows = out.clone();
  out.zero_();
  constexpr int kCols = 16;  // the kernels apply it to a thread's columns; here 16 columns at a time
  for (int c0 = 0; c0 < block_n; c0 += kCols) {
    for (int r = 0; r < block_m; ++r) {
      auto coords = [&](int, int c) { return std::pair<int, int>{r, c0 + c}; };
      tm.apply<1, kCols>(coords, m_block * block_m, n_block * block_n, [&](int, int c) {
        if (c0 + c < block_n) a[r][c0 + c] = true;
      });
    }
  }
  TORCH_CHECK(out.equal(by_rows), "mask_apply: TileMask::apply and TileMask::row_keys disagree");
  return out;
}

// Tile t of the sm80 forward's (last_block_first, with splits) or the backward's order (splits must be 1) ->
// (block, split, head, batch), every t.
at::Tensor tile_order(int blocks, int splits, int heads, int batch, bool last_block_first) {
  TORCH_CHECK(last_block_first || splits == 1, "tile_order: the backward's order has no splits");
  std::vector<int32_t> rows;
  auto run = [&](auto order) {
    for (int64_t t = 0; t < order.count(); ++t) {
      int b, s, h, n;
      order.decode(t, b, s, h, n);
      rows.insert(rows.end(), {b, s, h, n});
    }
  };
  if (last_block_first) run(FwdTileOrder{blocks, splits, heads, batch});
  else run(BwdTileOrder{blocks, splits, heads, batch});
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 4), 4}, at::kInt).clone();
}

// The sm80 tile a problem gets (sm80/fwd_tiles.h, bwd_tiles.h): what the launchers run and the split heuristic
// counts.
py::dict tile_dict(int head_dim, int block_m, int block_n, int stages, int smem_bytes) {
  py::dict d;
  d["head_dim"] = head_dim;
  d["block_m"] = block_m;
  d["block_n"] = block_n;
  d["stages"] = stages;
  d["smem_bytes"] = smem_bytes;
  return d;
}
py::dict fwd_tile(int headdim, int64_t rows, bool split_kv, int max_smem) {
  sm80::FwdTile const t = sm80::choose_fwd_tile(served_headdim(headdim), {rows, split_kv}, max_smem);
  py::dict d = tile_dict(t.head_dim, t.block_m, t.block_n, t.stages, t.smem_bytes());
  d["warps"] = t.warps;
  d["key_groups"] = t.key_groups;
  d["branch_free_loads"] = t.branch_free_loads;
  d["ctas_per_sm"] = t.ctas_per_sm;
  return d;
}
py::dict bwd_tile(int headdim, int max_smem, bool softcap) {
  sm80::BwdTile const t = sm80::choose_bwd_tile(served_headdim(headdim), max_smem, softcap);
  return tile_dict(t.head_dim, t.block_m, t.block_n, t.stages, t.smem_bytes());
}

at::Tensor mask_visible(int sq, int sk, int wl, int wr, int ns) {
  MaskPolicy const p = host_tile_mask(sq, sk, wl, wr, ns, 1, 1).p;
  auto out = at::zeros({sq, sk}, at::kBool);
  auto a = out.accessor<bool, 2>();
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) a[i][j] = p.visible(i, j);
  return out;
}

std::vector<at::Tensor> finalize_rows(at::Tensor row_max, at::Tensor row_sum, at::Tensor sink) {
  auto mx = row_max.to(at::kFloat).contiguous(), sm = row_sum.to(at::kFloat).contiguous();
  auto sk = sink.to(at::kFloat).expand_as(mx).contiguous();
  auto scale = at::empty_like(mx), lse = at::empty_like(mx);
  for (int64_t i = 0; i < mx.numel(); ++i) {
    RowFinal f = finalize_row(mx.data_ptr<float>()[i], sm.data_ptr<float>()[i], sk.data_ptr<float>()[i]);
    scale.data_ptr<float>()[i] = f.out_scale;
    lse.data_ptr<float>()[i] = f.lse;
  }
  return {scale, lse};
}

// common/fp8.h's decode of FP8 codes (uint8) as the FP8 kernels convert them: format 1 e4m3fn, 2 e5m2; float32 out.
at::Tensor fp8_decode_host(at::Tensor codes, int64_t format) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && format >= kFp8E4M3 && format <= kFp8E5M2,
              "fp8_decode: uint8 codes and format 1 (e4m3fn) or 2 (e5m2)");
  auto c = codes.contiguous();
  auto out = at::empty(c.sizes(), at::kFloat);
  for (int64_t i = 0; i < c.numel(); ++i) out.data_ptr<float>()[i] = fp8_to_float(c.data_ptr<uint8_t>()[i], int(format));
  return out;
}

std::vector<at::Tensor> merge_weights_host(at::Tensor lse_a, at::Tensor lse_b, at::Tensor sink) {
  auto a = lse_a.to(at::kFloat).contiguous(), b = lse_b.to(at::kFloat).contiguous();
  auto s = sink.to(at::kFloat).expand_as(a).contiguous();
  auto wa = at::empty_like(a), wb = at::empty_like(a), lse = at::empty_like(a);
  for (int64_t i = 0; i < a.numel(); ++i) {
    MergeWeights w = merge_weights(a.data_ptr<float>()[i], b.data_ptr<float>()[i], s.data_ptr<float>()[i]);
    wa.data_ptr<float>()[i] = w.wa;
    wb.data_ptr<float>()[i] = w.wb;
    lse.data_ptr<float>()[i] = w.lse;
  }
  return {wa, wb, lse};
}

}  // namespace

void register_host_probes(py::module_& m) {
  m.def("mask_col_blocks", &mask_col_blocks, "host entry: M tiles each key block visits in the backward",
        py::arg("sq"), py::arg("sk"), py::arg("wl"), py::arg("wr"), py::arg("ns"), py::arg("block_m"), py::arg("block_n"));
  m.def("num_splits_heuristic", &num_splits_heuristic, "host entry: the split-KV count num_splits=0 picks");
  m.def("mask_tile_blocks", &mask_tile_blocks, "host entry: blocks each M tile visits and whether they need a mask",
        py::arg("sq"), py::arg("sk"), py::arg("wl"), py::arg("wr"), py::arg("ns"), py::arg("block_m"), py::arg("block_n"),
        py::arg("group") = 1);
  m.def("mask_key_rows", &mask_key_rows, "host entry: the query rows [lo, hi) that see each key (TileMask::key_rows)",
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("window_left"), py::arg("window_right"), py::arg("sink_tokens"));
  m.def("mask_visible", &mask_visible, "host entry: the element visibility of the mask policy");
  m.def("dq_turns", &dq_turns, "host entry: (m_block, n_block, turn) of the deterministic backward's dQ order",
        py::arg("sq"), py::arg("sk"), py::arg("wl"), py::arg("wr"), py::arg("ns"), py::arg("block_m"), py::arg("block_n"));
  m.def("packed_tiles", &packed_tiles_host, "host entry: (sequence, M tile) of each block of the serving entry's "
        "packed grid");
  m.def("seq_extent", &seq_extent_host, "host entry: sequence b's extent, mask policy and row addresses",
        py::arg("b"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("seqused_k"), py::arg("wl"), py::arg("wr"), py::arg("ns"), py::arg("q_strides"), py::arg("k_strides"),
        py::arg("head"), py::arg("row"));
  m.def("bwd_lse", &bwd_lse_host, "host entry: the lse the backward recomputes P with (bwd_lse)");
  m.def("mask_apply", &mask_apply, "host entry: the element mask TileMask::apply gives one tile (true = hidden)",
        py::arg("sq"), py::arg("sk"), py::arg("wl"), py::arg("wr"), py::arg("ns"), py::arg("block_m"), py::arg("block_n"),
        py::arg("group"), py::arg("m_block"), py::arg("n_block"));
  m.def("tile_order", &tile_order, "host entry: (block, split, head, batch) of every tile in a kernel's order",
        py::arg("blocks"), py::arg("splits"), py::arg("heads"), py::arg("batch"), py::arg("last_block_first"));
  m.def("fwd_tile", &fwd_tile, "host entry: the sm80 forward tile for a head dim, rows per head, split-KV and smem limit",
        py::arg("headdim"), py::arg("rows"), py::arg("split_kv"), py::arg("max_smem"));
  m.def("bwd_tile", &bwd_tile, "host entry: the sm80 backward tile for a head dim, smem limit and softcap",
        py::arg("headdim"), py::arg("max_smem"), py::arg("softcap") = false);
  m.def("fp8_decode", &fp8_decode_host, "host entry: FP8 codes decoded as the FP8-cache kernels do (common/fp8.h)",
        py::arg("codes"), py::arg("format"));
  m.def("finalize_rows", &finalize_rows, "host entry: the softmax finalize with the sink");
  m.def("merge_weights", &merge_weights_host, "host entry: merge weights of two partial states with the sink");
}

}  // namespace sinkattn
