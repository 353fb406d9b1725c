// api.cpp: the only translation unit that sees torch. Argument checks that protect the kernels (the
// Python layer has already given the user a clear error), params filling, dispatch through the kernel
// registry, and host entry points to the shared mask/softmax/merge logic for the CPU tests.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "build_info.h"
#include "common/mask.h"
#include "common/merge.h"
#include "common/softmax.h"
#include "params.h"

namespace sinkattn {

using MergeFn = void (*)(MergeParams const&, cudaStream_t);

static std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    default: return c10::toString(t);
  }
}

static py::list registry() {
  py::list out;
  for (auto const& k : kernel_registry()) {
    py::dict d;
    d["name"] = k.name;
    d["family"] = k.family;
    d["op"] = k.op;
    d["headdim"] = k.headdim;
    d["dtype"] = k.dtype;
    d["features"] = k.features;
    d["archs"] = k.archs;
    out.append(d);
  }
  return out;
}

static py::dict build_info() {
  py::dict d;
  d["nvcc_version"] = nvcc_version();
  d["cutlass_version"] = cutlass_version();
  d["cuda_arch_list"] = cuda_arch_list();
  d["torch_version_at_build"] = SINKATTN_TORCH_VERSION_AT_BUILD;
  d["requested_archs"] = SINKATTN_REQUESTED_ARCHS;
  d["cutlass_version_header"] = SINKATTN_CUTLASS_VERSION;
  return d;
}

static py::dict runtime_info() {
  py::dict d;
  int rt = 0, drv = 0;
  // Neither call creates a context; with no driver installed the driver version reads 0.
  if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  cudaGetLastError();
  d["cuda_runtime_version"] = rt;
  d["cuda_driver_version"] = drv;
  return d;
}

// ---- merge of partial states --------------------------------------------------------------------------
static std::vector<at::Tensor> merge_states(at::Tensor out_a, at::Tensor lse_a, at::Tensor out_b, at::Tensor lse_b,
                                            std::optional<at::Tensor> sinks) {
  TORCH_CHECK(out_a.is_cuda(), "sinkattn merge kernel: tensors must be on a CUDA device");
  TORCH_CHECK(out_a.dim() == 4 && out_b.sizes() == out_a.sizes(), "out_a/out_b must be (batch, seqlen, nheads, headdim)");
  TORCH_CHECK(lse_a.dim() == 3 && lse_b.sizes() == lse_a.sizes(), "lse_a/lse_b must be (batch, nheads, seqlen)");
  TORCH_CHECK(out_a.stride(-1) == 1 && out_b.stride(-1) == 1, "out_a/out_b need a contiguous last dimension");
  TORCH_CHECK(lse_a.scalar_type() == at::kFloat && lse_b.scalar_type() == at::kFloat, "lse must be float32");
  auto fn_info = find_kernel("common", "merge", 0, dtype_name(out_a.scalar_type()));
  TORCH_CHECK(fn_info, "sinkattn: no merge kernel compiled for dtype ", dtype_name(out_a.scalar_type()));
  c10::cuda::CUDAGuard guard(out_a.device());
  at::Tensor sink_f;
  if (sinks) sink_f = sinks->to(at::kFloat).contiguous();
  auto out = at::empty_like(out_a, out_a.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::empty_like(lse_a, lse_a.options().memory_format(at::MemoryFormat::Contiguous));
  MergeParams p;
  p.out_a = out_a.data_ptr(); p.lse_a = lse_a.data_ptr<float>();
  p.out_b = out_b.data_ptr(); p.lse_b = lse_b.data_ptr<float>();
  p.out = out.data_ptr(); p.lse = lse.data_ptr<float>();
  p.sinks = sinks ? sink_f.data_ptr<float>() : nullptr;
  p.batch = out_a.size(0); p.seqlen = out_a.size(1); p.nheads = out_a.size(2); p.headdim = out_a.size(3);
  p.oa_batch_stride = out_a.stride(0); p.oa_row_stride = out_a.stride(1); p.oa_head_stride = out_a.stride(2);
  p.ob_batch_stride = out_b.stride(0); p.ob_row_stride = out_b.stride(1); p.ob_head_stride = out_b.stride(2);
  p.o_batch_stride = out.stride(0); p.o_row_stride = out.stride(1); p.o_head_stride = out.stride(2);
  p.la_batch_stride = lse_a.stride(0); p.la_head_stride = lse_a.stride(1); p.la_row_stride = lse_a.stride(2);
  p.lb_batch_stride = lse_b.stride(0); p.lb_head_stride = lse_b.stride(1); p.lb_row_stride = lse_b.stride(2);
  p.l_batch_stride = lse.stride(0); p.l_head_stride = lse.stride(1); p.l_row_stride = lse.stride(2);
  reinterpret_cast<MergeFn>(fn_info->fn)(p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

// ---- host entry points to the shared logic, for the CPU tests -----------------------------------------
// (m_block, n_block, needs_mask) for every block each M tile visits, in visiting order.
static at::Tensor mask_tile_blocks(int sq, int sk, int wl, int wr, int ns, int block_m, int block_n) {
  TileMask tm{MaskPolicy{sq, sk, wl, wr, ns}, block_m, block_n};
  std::vector<int32_t> rows;
  int m_blocks = ceil_div(sq, block_m);
  for (int m = 0; m < m_blocks; ++m) {
    BlockRange r = tm.range(m);
    for (int t = 0; t < r.count(); ++t) {
      int n = r.block(t);
      rows.insert(rows.end(), {m, n, tm.needs_mask(m, n) ? 1 : 0});
    }
  }
  return torch::from_blob(rows.data(), {int64_t(rows.size() / 3), 3}, at::kInt).clone();
}

static at::Tensor mask_visible(int sq, int sk, int wl, int wr, int ns) {
  MaskPolicy p{sq, sk, wl, wr, ns};
  auto out = at::zeros({sq, sk}, at::kBool);
  auto a = out.accessor<bool, 2>();
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) a[i][j] = p.visible(i, j);
  return out;
}

static std::vector<at::Tensor> finalize_rows(at::Tensor row_max, at::Tensor row_sum, at::Tensor sink) {
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

static std::vector<at::Tensor> merge_weights_host(at::Tensor lse_a, at::Tensor lse_b, at::Tensor sink) {
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

}  // namespace sinkattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sinkattn;
  m.doc() = "sinkattn kernels (see sinkattn/_kernels.py for the Python side)";
  m.def("registry", &registry, "the kernels compiled into this binary");
  m.def("build_info", &build_info, "versions baked in at build time");
  m.def("runtime_info", &runtime_info, "CUDA runtime and driver versions now");
  m.def("merge_states", &merge_states, "merge two partial (out, lse) states, adding the sink once (CUDA)");
  m.def("mask_tile_blocks", &mask_tile_blocks, "host entry: blocks each M tile visits and whether they need a mask");
  m.def("mask_visible", &mask_visible, "host entry: the element visibility of the mask policy");
  m.def("finalize_rows", &finalize_rows, "host entry: the softmax finalize with the sink");
  m.def("merge_weights", &merge_weights_host, "host entry: merge weights of two partial states with the sink");
}
