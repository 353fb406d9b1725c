// params.h: the plain-data contract between api.cpp (torch side) and the kernels (no torch).
//
// Strides are in elements and int64 so batch*seqlen*heads*headdim beyond 2^31 indexes correctly.
// The last dimension of every tensor is contiguous (checked in api.cpp).
#pragma once
#include <cstdint>

namespace sinkattn {

// What every attention kernel reads, forward and backward, filled by one function (api.cpp fill_attn_params).
struct AttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* sinks = nullptr;  // (nheads,) fp32 logits in scaled-score units; null = no learnable sink

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;  // out (and dout in the backward)
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // lse-like buffers; rows are contiguous

  int batch = 0, nheads = 0, nheads_k = 0;
  int seqlen_q = 0, seqlen_k = 0;  // max over the batch when varlen
  int total_q = 0, total_k = 0;    // rows of the packed q and k/v when varlen, else batch * seqlen
  int headdim = 0;                 // the real head dim; the kernel's compiled head dim is >= this
  int headdim_rounded = 0;         // the compiled head dim (64, 128, 256): the fp32 workspaces' row length

  // Varlen: sequence b holds rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of the packed tensors; batch
  // strides are then unused for q/k/v/out, and lse rows are offset by cu_seqlens_q[b].
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;

  float softmax_scale = 1.f;
  float softcap = 0.f;         // > 0: s = softcap * tanh(s / softcap)
  int window_left = -1;        // -1 = unbounded
  int window_right = -1;       // -1 = unbounded; causal is 0
  int sink_tokens = 0;         // keys [0, sink_tokens) relax the left edge of the window

  int max_smem_per_block = 0;  // the device's opt-in limit (or a smaller override); picks the tile
};

struct FwdParams : AttnParams {
  void* out = nullptr;
  float* lse = nullptr;  // (batch, nheads, seqlen_q), or (nheads, total_q) when varlen

  // KV cache (decode and chunked prefill).
  const int* seqused_k = nullptr;    // (batch,): keys in sequence b (cache_seqlens after the append); overrides seqlen_k
  const int* block_table = nullptr;  // (batch, max_pages): k/v are then page pools (num_pages, page_size, nheads_k, d)
  int64_t block_table_batch_stride = 0;  // and k/v_batch_stride are the page strides
  int page_size = 0;
  int num_pages = 0;    // pages in the pool (the sm90 forward's TMA extent: a box past it lands as zeros)
  int page_shift = -1;  // log2(page_size) when it is a power of two (vLLM's 16 to 256 are): a shift, not a division
  // GQA packing: the G = nheads / nheads_k query heads of one KV head share an M tile, so K/V are read once
  // per group. Row r of the packed problem is query r / G of head kv_head * G + r % G.
  int pack_gqa = 0;
  // Varlen queries over a KV cache (the serving call: cu_seqlens_q, seqused_k, no cu_seqlens_k): the grid's M-tile
  // index is packed over every sequence (common/seq_extent.h packed_tile), so the grid depends on the padded sizes
  // (total_q, batch) alone and each CTA finds its sequence on the device. 0: M tiles per sequence (max seqlen_q).
  int packed_tiles = 0;
  // Split-KV: each split writes its partial result (normalised over its own keys, no sink) in fp32, and the
  // combine adds the sink once. out_accum (num_splits, batch, nheads, seqlen_q, headdim_rounded),
  // lse_accum (num_splits, batch, nheads, seqlen_q); varlen queries: (num_splits, nheads, total_q[, headdim_rounded])
  // by packed row (common/combine.h partial_row).
  int num_splits = 1;
  // A persistent kernel with dynamic tiles (a registry feature "tile_counter"): one int, zero at launch, from
  // which CTAs draw their tiles after the first.
  int* tile_counter = nullptr;
  float* out_accum = nullptr;
  float* lse_accum = nullptr;
};

// The forward over FP8 KV caches (float8_e4m3fn / float8_e5m2; sm80/fp8_kv.h, docs/DESIGN.md sections 1 and 4):
// k/v point at the FP8 caches (strides in elements, i.e. bytes), q and out stay bf16/fp16. A struct of its own so
// the kernels over caches in q's dtype keep their parameter block as it is.
struct FwdFp8Params : FwdParams {
  int kv_fp8 = 0;  // common/fp8.h Fp8Format: kFp8E4M3 or kFp8E5M2
  // Dequantization scales per (batch, KV head) (a per-tensor scale is one with zero strides); null = 1.
  // k_descale folds into the softmax scale of its (batch, KV head), v_descale into the output's 1 / row sum.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t k_descale_batch_stride = 0, k_descale_head_stride = 0;
  int64_t v_descale_batch_stride = 0, v_descale_head_stride = 0;
};

// Backward (docs/DESIGN.md section 1; sm80 kernels in sm80/bwd_*.h). Three steps:
//   preprocess (common/bwd_prepost.h): per row, delta_i = rowsum(dO_i * O_i) - dlse_i, and the row's dsinks
//     term -exp(sink - lse_i) * delta_i into dsink_rows (same layout as lse);
//   main kernel, one CTA per (n-block, query head, sequence): dK, dV of the block in registers (written to
//     the fp32 dk_accum / dv_accum per query head), dQ = dS K added in fp32 into dq_accum (unscaled);
//   postprocess: dq = softmax_scale * dq_accum, dk/dv = sum over the query-head group, dsinks[h] = sum of its rows,
//     every sum in a fixed order.
// Accumulators: dq_accum (q_rows, nheads, headdim_rounded) zero-filled, q_rows = batch * seqlen_q (or
// total_q when varlen); fp32 atomics, in any order unless deterministic. Deterministic: dq_semaphore
// (batch, nheads, m_blocks) zero-filled int counters; the key blocks that visit an M tile add their dQ tile in
// increasing n-block order, each waiting for the counter to reach its rank among them (the rank comes from
// the forward's block range of that M tile, the same set). dk_accum/dv_accum (k_rows, nheads,
// headdim_rounded) zero-filled.
struct BwdParams : AttnParams {
  const void* out = nullptr;
  const void* dout = nullptr;    // strides of out
  const float* lse = nullptr;    // like FwdParams::lse
  const float* dlse = nullptr;   // like lse, or null (no gradient through a returned lse)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dsinks = nullptr;       // (nheads,) fp32, or null without sinks

  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // Workspace (api.cpp allocates it through the caching allocator).
  float* delta = nullptr;       // like lse
  float* dsink_rows = nullptr;  // like lse, zero-filled
  float* dq_accum = nullptr;
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  int* dq_semaphore = nullptr;  // deterministic mode only (else null)
  int dq_m_blocks = 0;          // M tiles per (sequence, head) in dq_semaphore: ceil(seqlen_q / the tile's block_m)
};

// Merge of two partial attention states computed over disjoint key sets (neither including the sink).
struct MergeParams {
  const void* out_a = nullptr;
  const float* lse_a = nullptr;
  const void* out_b = nullptr;
  const float* lse_b = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const float* sinks = nullptr;  // (nheads,) or null

  // out tensors: (batch, seqlen, nheads, headdim); lse: (batch, nheads, seqlen)
  int64_t oa_batch_stride = 0, oa_row_stride = 0, oa_head_stride = 0;
  int64_t ob_batch_stride = 0, ob_row_stride = 0, ob_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t la_batch_stride = 0, la_head_stride = 0, la_row_stride = 0;
  int64_t lb_batch_stride = 0, lb_head_stride = 0, lb_row_stride = 0;
  int64_t l_batch_stride = 0, l_head_stride = 0, l_row_stride = 0;
  int batch = 0, seqlen = 0, nheads = 0, headdim = 0;
};

}  // namespace sinkattn
