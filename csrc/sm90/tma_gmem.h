// tma_gmem.h: the global tensors the sm90 kernels' TMA descriptors are made from (forward and backward): q, k, v
// (and dout) as (rows, head dim, heads, batch), the head dim contiguous; varlen packs every sequence in the rows
// with batch 1. Host code of the launchers; the traits take the type.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <cute/tensor.hpp>

#include "common/defs.h"
#include "params.h"

namespace sinkattn::sm90 {

using TmaGmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                   cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
template <class Element>
using TmaGmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                 TmaGmemLayout{}));

// One tensor of the problem in p: rows (seqlen, or the packed total when varlen), heads, and its strides in
// elements. A TMA descriptor wants every extent >= 1 and every stride a multiple of 16 bytes; an extent-1 mode's
// stride is never used, so any such value serves. Never over an empty tensor (its pointer may be null or point
// at nothing): the launchers return before encoding when there is no query row, and the forward encodes K and V
// over a stand-in when there is no key (its tiles then visit no key block).
// bdim: the batch mode's extent (the sequences of a padded tensor, 1 when packed, a page pool's pages).
template <class Element>
TmaGmemTensor<Element> tma_gmem_tensor(AttnParams const& p, void const* ptr, int rows, int heads, int64_t row_stride,
                                       int64_t head_stride, int64_t batch_stride, int bdim) {
  using namespace cute;
  if (ptr == nullptr || rows < 1 || heads < 1 || bdim < 1 || p.headdim < 1)
    throw std::logic_error("sinkattn sm90: a TMA descriptor over an empty tensor (the launcher must not encode one)");
  auto stride_of = [](int64_t stride, int extent) { return extent > 1 ? stride : int64_t(8); };
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     TmaGmemLayout{make_shape(rows, p.headdim, heads, bdim),
                                   make_stride(stride_of(row_stride, rows), _1{}, stride_of(head_stride, heads),
                                               stride_of(batch_stride, bdim))});
}
// The q-like tensors (q, dout) and the k-like ones of attention over q/k/v: packed rows when varlen.
template <class Element>
TmaGmemTensor<Element> tma_gmem_tensor(AttnParams const& p, void const* ptr, int rows, int heads, int64_t row_stride,
                                       int64_t head_stride, int64_t batch_stride) {
  return tma_gmem_tensor<Element>(p, ptr, rows, heads, row_stride, head_stride, batch_stride,
                                  p.cu_seqlens_q != nullptr ? 1 : p.batch);
}

// The (rows, batch) extents of the forward's TMA tensors, which the launcher encodes and the producer views
// (get_tma_tensor needs the same shape). q: packed (total_q, 1) when varlen, else (seqlen_q, batch). k and v:
// packed (total_k, 1) with cu_seqlens_k; a contiguous KV cache (capacity, batch) (p.seqlen_k is its capacity); a
// page pool (page_size, num_pages), read in boxes of whole page rows (sm90/fwd_kernel.cuh PageRows; KvGather reads
// other page sizes without TMA). At least one row: no descriptor is encoded over an empty tensor (sm90/fwd_host.h
// says what stands in).
struct GmemExtent {
  int rows, batch;
};
SA_HOST_DEVICE GmemExtent q_extent(FwdParams const& p) {
  return p.cu_seqlens_q != nullptr ? GmemExtent{max_i(p.total_q, 1), 1} : GmemExtent{max_i(p.seqlen_q, 1), p.batch};
}
SA_HOST_DEVICE GmemExtent kv_extent(FwdParams const& p) {
  if (p.block_table != nullptr) return GmemExtent{max_i(p.page_size, 1), max_i(p.num_pages, 1)};
  if (p.cu_seqlens_k != nullptr) return GmemExtent{max_i(p.total_k, 1), 1};
  return GmemExtent{max_i(p.seqlen_k, 1), p.batch};
}

// The TMA copy make_tma_copy built, checked: CuTe reports a failed cuTensorMapEncodeTiled only by printing to
// stderr and assert(false), which the build's NDEBUG compiles out, so the kernel would get a zeroed descriptor (a
// fault, or loads from address 0). A descriptor the driver encoded holds the tensor's address and extents, never
// 128 zero bytes; `what` names the tensor in the error.
template <class TmaCopy>
TmaCopy checked_tma(TmaCopy const& tma, char const* what) {
  auto const* bytes = reinterpret_cast<unsigned char const*>(tma.get_tma_descriptor());
  for (size_t i = 0; i < sizeof(cute::TmaDescriptor); ++i)
    if (bytes[i] != 0) return tma;
  throw std::runtime_error(std::string("sinkattn sm90: encoding the TMA descriptor of ") + what +
                           " failed (cuTensorMapEncodeTiled; CuTe printed its arguments to stderr)");
}

}  // namespace sinkattn::sm90
