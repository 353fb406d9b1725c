// api.cpp: the kernels' side of the extension module, its op entry points: argument checks that protect the
// kernels (the Python layer has already given the user a clear error), params filling, dispatch through the kernel
// registry. The other files that see torch: cpu_front.cpp (the CPU good case of flash_attn_with_sinks) and
// host_probes.cpp (host entry points to the shared mask/softmax/merge logic, for the CPU tests).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <tuple>

#include "build_info.h"
#include "cpu_front.h"
#include "host_probes.h"
#include "kernel_headdims.h"
#include "common/bwd_prepost.h"
#include "common/fp8.h"
#include "common/mask.h"
#include "common/merge.h"
#include "common/online_softmax.h"
#include "common/seq_extent.h"
#include "common/split.h"
#include "common/tile_order.h"
#include "emu/emu_launch.h"
#include "params.h"
#include "sm80/bwd_tiles.h"
#include "sm90/bwd_tiles.h"
#include "sm80/fwd_tiles.h"
#include "sm90/fwd_tiles.h"

namespace sinkattn {

using MergeFn = void (*)(MergeParams const&, cudaStream_t);
// An attention kernel's registry entry points: a GPU launcher, or the same body under host emulation.
template <class Params>
using KernelFn = void (*)(Params const&, cudaStream_t);
template <class Params>
using EmuKernelFn = void (*)(Params const&, EmuLaunch const&);

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
    d["smem_bytes"] = k.smem_bytes;
    d["archs"] = k.archs;
    out.append(d);
  }
  return out;
}

#ifndef SINKATTN_NATIVE_GPUS
#define SINKATTN_NATIVE_GPUS ""
#endif

static py::dict build_info() {
  py::dict d;
  d["nvcc_version"] = nvcc_version();
  d["cutlass_version"] = cutlass_version();
  d["cuda_arch_list"] = cuda_arch_list();
  d["torch_version_at_build"] = SINKATTN_TORCH_VERSION_AT_BUILD;
  d["requested_archs"] = SINKATTN_REQUESTED_ARCHS;
  d["native_gpus"] = SINKATTN_NATIVE_GPUS;  // SINKATTN_CUDA_ARCHS=native: the GPUs the archs came from
  d["requested_headdims"] = SINKATTN_REQUESTED_HEADDIMS;
  d["kernel_headdims"] = kernel_headdims();  // build_info.h kKernelHeadDims (sinkattn/layout.py reads it)
  // The head dims the FP8-cache decode tiles exist for (sm80/fwd_tiles.h FwdFp8TilesOf; dispatch words its refusal
  // with them), whichever of them this build compiled.
  d["fp8_kv_headdims"] = table_headdims<sm80::FwdFp8TilesOf>();
  d["requested_dtypes"] = SINKATTN_REQUESTED_DTYPES;
  // SINKATTN_GPU_HEADDIMS / _DTYPES: the GPU units' subset of the grid (the whole grid unless narrowed, as CI does).
  d["gpu_headdims"] = SINKATTN_GPU_HEADDIMS;
  d["gpu_dtypes"] = SINKATTN_GPU_DTYPES;
  d["emulation"] = bool(SINKATTN_EMULATION_BUILT);
  d["diagnostic"] = bool(SINKATTN_DIAGNOSTIC_BUILT);  // bounded sm90 barrier waits (sm90/pipeline.cuh)
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

// ---- attention forward --------------------------------------------------------------------------------
// Writes out (like q) and lse (fp32: (batch, nheads, seqlen_q), or (nheads, total_q) when varlen) in place.
// backend: "sm90" / "sm80" (CUDA tensors) or "sm80-emulated" / "sm90-emulated" (CPU tensors, the same kernel bodies
// under host emulation).
// max_smem: the shared-memory limit that picks the tile configuration; 0 = the device's (GPU) or sm80's (emulated).
static void check_kernel_tensors(std::vector<at::Tensor const*> const& ts, bool emulated, std::string const& backend) {
  for (auto const* t : ts) {
    TORCH_CHECK(t->stride(-1) == 1, "sinkattn fwd: tensors need a contiguous last dimension");
    TORCH_CHECK(emulated ? t->device().is_cpu() : t->is_cuda(), "sinkattn fwd: backend ", backend,
                emulated ? " takes CPU tensors" : " takes CUDA tensors");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "sinkattn fwd: tensors must be 16-byte aligned");
    for (int i = 0; i < t->dim() - 1; ++i)
      TORCH_CHECK(t->stride(i) % 8 == 0 || t->size(i) == 1, "sinkattn fwd: strides must be multiples of 8 elements");
  }
}

static KernelInfo const* fwd_kernel_for(std::string const& backend, at::Tensor const& q) {
  int const d = q.size(-1);
  TORCH_CHECK(d % 8 == 0 && d <= 256, "sinkattn fwd: head dim must be a multiple of 8 up to 256");
  int const hd = served_headdim(d);
  std::string const dt = dtype_name(q.scalar_type());
  auto const* info = find_kernel(backend, "fwd", hd, dt);
  TORCH_CHECK(info, "sinkattn fwd: no ", backend, " kernel for head dim ", hd, " ", dt, " in this build");
  return info;
}

// A tuning-grid variant (sweep_grid.py SWEEP_*; bench/sweep/runner.py runs them): backend "variant:<registry name>"
// of a "*-sweep" family, which dispatch never picks. It serves its own head dim and dtype, only the features its
// registry entry lists, and only where its one tile fits the shared memory (a variant has no fallback tile).
static constexpr char kVariantPrefix[] = "variant:";

// Whether a registry entry lists `feature` in its comma-separated features.
static bool has_feature(KernelInfo const* info, std::string const& feature) {
  return (std::string(",") + info->features + ",").find("," + feature + ",") != std::string::npos;
}

static bool is_variant(std::string const& backend) { return backend.rfind(kVariantPrefix, 0) == 0; }

static KernelInfo const* variant_kernel(std::string const& backend, at::Tensor const& q, double softcap) {
  std::string const name = backend.substr(sizeof(kVariantPrefix) - 1);
  KernelInfo const* info = nullptr;
  for (auto const& k : kernel_registry())
    if (name == k.name) info = &k;
  std::string const family = info ? info->family : "";
  TORCH_CHECK(info && std::string(info->op) == "fwd" && family.size() > 6 && family.ends_with("-sweep"),
              "sinkattn fwd: no tuning-grid forward variant named '", name, "' in this build (build with SINKATTN_SWEEP; "
              "sinkattn._C.registry() lists what it holds)");
  int const d = q.size(-1);
  TORCH_CHECK(d % 8 == 0 && served_headdim(d) == info->headdim && dtype_name(q.scalar_type()) == info->dtype,
              "sinkattn fwd: variant ", name, " serves head dim ", info->headdim, " ", info->dtype, ", not ", d, " ",
              dtype_name(q.scalar_type()));
  TORCH_CHECK(!(softcap > 0) || has_feature(info, "softcap"), "sinkattn fwd: variant ", name,
              " is compiled without softcap");
  return info;
}

static bool variant_emulated(KernelInfo const* info) { return std::string(info->family).ends_with("-emulated-sweep"); }
static bool variant_sm90(KernelInfo const* info) { return std::string(info->family).starts_with("sm90"); }

// The shared-memory limit per block that picks the tiles (p.max_smem_per_block): the device's opt-in limit, or
// under emulation an A100's (EmuLaunch); max_smem > 0 overrides it (tests: the sm86 / sm89 tiles), on a GPU
// never above the device's.
// The sm90 kernels under emulation get an H100's 227 KB (their one tile per kernel is not picked by the limit; a
// variant is checked against it).
static int smem_limit(bool emulated, int64_t max_smem, at::Device device, bool sm90 = false) {
  if (emulated && sm90) return 227 * 1024;
  if (emulated) return max_smem > 0 ? int(max_smem) : EmuLaunch{}.max_smem_per_block;
  int smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index()));
  return max_smem > 0 ? int(std::min<int64_t>(max_smem, smem)) : smem;
}

// Runs a forward or backward kernel: under host emulation (CPU tensors; an A100's resources, or the smaller
// shared-memory limit the params picked their tile with) or on the current stream of `device`.
template <class Params>
static void launch_kernel(KernelInfo const* info, Params const& p, bool emulated, at::Device device) {
  if (emulated) {
    EmuLaunch launch;
    launch.max_smem_per_block = p.max_smem_per_block;
    py::gil_scoped_release no_gil;  // the emulation runs for a while on its own threads
    reinterpret_cast<EmuKernelFn<Params>>(info->fn)(p, launch);
    return;
  }
  c10::cuda::CUDAGuard guard(device);
  reinterpret_cast<KernelFn<Params>>(info->fn)(p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The mask and scale of a call, as Python's sinkattn.mask.Mask hands them over in one tuple (Mask.kernel_args:
// scale, window_left, window_right, sink_tokens, softcap).
using MaskTuple = std::tuple<double, int64_t, int64_t, int64_t, double>;
struct MaskArgs {
  double softmax_scale;
  int64_t window_left, window_right, sink_tokens;
  double softcap;
  MaskArgs(MaskTuple const& t)  // NOLINT: implicit, so an entry point's tuple argument is one
      : softmax_scale(std::get<0>(t)), window_left(std::get<1>(t)), window_right(std::get<2>(t)),
        sink_tokens(std::get<3>(t)), softcap(std::get<4>(t)) {}
};

// Everything AttnParams holds, filled in one place for the forward, the backward and the KV-cache forward.
// q/k/v/out: padded (batch, seqlen, heads, d), or varlen (total, heads, d) with cu_seqlens (batch + 1,) int32
// on the tensors' device and max_seqlen sizing the grid; a KV cache passes its caches as k/v (kv_cache: rank 4,
// never packed, so varlen queries come without cu_seqlens_k; the caller then sets batch and seqlen_k from its
// seqused_k and capacity). lse: contiguous (batch, nheads, seqlen_q), or (nheads, total_q) when varlen.
// The kernels read the sink logits as fp32: p.sinks points into a contiguous fp32 copy, which is returned and
// which the caller keeps alive through the launch (undefined, and p.sinks null, without sinks).
[[nodiscard]] static at::Tensor fill_attn_params(AttnParams& p, at::Tensor const& q, at::Tensor const& k,
                                                 at::Tensor const& v, at::Tensor const& out, at::Tensor const& lse,
                                                 std::optional<at::Tensor> const& cu_seqlens_q,
                                                 std::optional<at::Tensor> const& cu_seqlens_k, int64_t max_seqlen_q,
                                                 int64_t max_seqlen_k, std::optional<at::Tensor> const& sinks,
                                                 MaskArgs const& m, int max_smem_per_block, char const* op,
                                                 bool kv_cache = false) {
  bool const varlen = cu_seqlens_q.has_value();
  TORCH_CHECK(varlen == cu_seqlens_k.has_value() || (kv_cache && !cu_seqlens_k), "sinkattn ", op,
              ": cu_seqlens_q and cu_seqlens_k go together");
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  at::Tensor const sinks_f32 = sinks ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  p.sinks = sinks ? sinks_f32.data_ptr<float>() : nullptr;
  p.headdim = q.size(-1);
  p.headdim_rounded = served_headdim(p.headdim);
  p.nheads = q.size(-2);
  p.nheads_k = k.size(-2);
  TORCH_CHECK(p.nheads_k > 0 && p.nheads % p.nheads_k == 0, "sinkattn ", op, ": nheads must be a multiple of nheads_k");
  int const r = varlen ? 0 : 1;  // index of the row dimension
  int const rk = varlen && !kv_cache ? 0 : 1;  // of k and v's (a cache is (batch or pages, rows, heads, d))
  if (varlen) {
    auto const& cq = *cu_seqlens_q;
    TORCH_CHECK(cq.scalar_type() == at::kInt && cq.is_contiguous() && cq.numel() >= 1,
                "sinkattn ", op, ": cu_seqlens_q must be contiguous int32 (batch + 1,)");
    p.batch = cq.numel() - 1;
    p.cu_seqlens_q = cq.data_ptr<int>();
    p.seqlen_q = max_seqlen_q;
    p.total_q = q.size(0);
    if (kv_cache) {
      p.k_batch_stride = k.stride(0); p.v_batch_stride = v.stride(0);
    } else {
      auto const& ck = *cu_seqlens_k;
      TORCH_CHECK(ck.scalar_type() == at::kInt && ck.is_contiguous(), "sinkattn ", op, ": cu_seqlens must be contiguous int32");
      TORCH_CHECK(cq.numel() == ck.numel(), "sinkattn ", op, ": cu_seqlens_q/k lengths differ");
      p.cu_seqlens_k = ck.data_ptr<int>();
      p.seqlen_k = max_seqlen_k;
      p.total_k = k.size(0);
    }
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == p.nheads && lse.size(1) == q.size(0) && lse.is_contiguous(),
                "sinkattn ", op, ": varlen lse must be contiguous (nheads, total_q)");
    p.lse_batch_stride = 0;
    p.lse_head_stride = lse.stride(0);
  } else {
    p.batch = q.size(0);
    p.seqlen_q = q.size(1);
    p.seqlen_k = k.size(1);
    p.total_q = p.batch * p.seqlen_q;
    p.total_k = p.batch * p.seqlen_k;
    p.q_batch_stride = q.stride(0); p.k_batch_stride = k.stride(0); p.v_batch_stride = v.stride(0);
    p.o_batch_stride = out.stride(0);
    TORCH_CHECK(lse.dim() == 3 && lse.size(0) == p.batch && lse.size(1) == p.nheads && lse.size(2) == p.seqlen_q &&
                    lse.is_contiguous(), "sinkattn ", op, ": lse must be contiguous (batch, nheads, seqlen_q)");
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  p.q_row_stride = q.stride(r); p.q_head_stride = q.stride(r + 1);
  p.k_row_stride = k.stride(rk); p.k_head_stride = k.stride(rk + 1);
  p.v_row_stride = v.stride(rk); p.v_head_stride = v.stride(rk + 1);
  p.o_row_stride = out.stride(r); p.o_head_stride = out.stride(r + 1);
  p.softmax_scale = float(m.softmax_scale);
  p.softcap = float(m.softcap);
  p.window_left = int(m.window_left);
  p.window_right = int(m.window_right);
  p.sink_tokens = int(m.sink_tokens);
  p.max_smem_per_block = max_smem_per_block;
  return sinks_f32;
}

static void fwd(std::string const& backend, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> sinks,
                at::Tensor out, at::Tensor lse, std::optional<at::Tensor> cu_seqlens_q,
                std::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, MaskTuple mask_tuple,
                int64_t max_smem) {
  MaskArgs const mask(mask_tuple);
  auto const* variant = is_variant(backend) ? variant_kernel(backend, q, mask.softcap) : nullptr;
  bool const emulated = variant ? variant_emulated(variant) : backend == "sm80-emulated" || backend == "sm90-emulated";
  bool const sm90 = variant ? variant_sm90(variant) : backend == "sm90" || backend == "sm90-emulated";
  TORCH_CHECK(variant || emulated || backend == "sm80" || backend == "sm90", "sinkattn fwd: unknown backend '", backend,
              "'");
  int const rank = cu_seqlens_q.has_value() ? 3 : 4;
  TORCH_CHECK(q.dim() == rank && k.dim() == rank && v.dim() == rank, "sinkattn fwd: q/k/v rank must be ", rank);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() && out.scalar_type() == q.scalar_type(),
              "sinkattn fwd: q, k, v and out must share a dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "sinkattn fwd: lse must be float32");
  check_kernel_tensors({&q, &k, &v, &out}, emulated, backend);
  int const d = q.size(-1);
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, "sinkattn fwd: q, k and v head dims must match");
  auto const* info = variant ? variant : fwd_kernel_for(backend, q);

  FwdParams p;
  at::Tensor const sinks_f = fill_attn_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, sinks, mask, smem_limit(emulated, max_smem, q.device(), sm90),
                                              "fwd");
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  TORCH_CHECK(!variant || variant->smem_bytes <= p.max_smem_per_block, "sinkattn fwd: variant ", variant->name,
              " needs ", variant->smem_bytes, " bytes of shared memory per block; the limit is ", p.max_smem_per_block);
  // A persistent kernel drawing its tiles from a counter (registry feature "tile_counter") gets a zeroed int
  // (a memset on the stream: graph-capturable); the caching allocator keeps it until the kernel is done.
  at::Tensor tile_counter;
  if (has_feature(info, "tile_counter")) {
    tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  launch_kernel(info, p, emulated, q.device());
}

// The sm90 backward's M tile for a head dim: its tile table (sm90/bwd_tiles.h BwdTileOf) defines the head dims it
// serves (dispatch sends it no other).
static int sm90_bwd_block_m(int hd) {
  int block_m = 0;
  for_each_table_headdim<sm90::BwdTileOf>([&]<int H>() {
    if (hd == H) block_m = sm90::BwdTileOf<H>::tile.block_m;
  });
  TORCH_CHECK(block_m > 0, "sinkattn bwd: the sm90 backward has no tile for head dim ", hd);
  return block_m;
}

// ---- attention backward --------------------------------------------------------------------------------
// dout/out like q, lse (and dlse, when given) like the forward's lse; writes dq, dk, dv (like q, k, v) and
// dsinks (fp32 (nheads,), when sinks are given) in place. Workspace through the caching allocator.
static void bwd(std::string const& backend, at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v,
                std::optional<at::Tensor> sinks, at::Tensor out, at::Tensor lse, std::optional<at::Tensor> dlse,
                at::Tensor dq, at::Tensor dk, at::Tensor dv, std::optional<at::Tensor> dsinks,
                std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k, MaskTuple mask, bool deterministic, int64_t max_smem) {
  bool const emulated = backend == "sm80-emulated" || backend == "sm90-emulated";
  bool const sm90 = backend == "sm90" || backend == "sm90-emulated";
  TORCH_CHECK(emulated || backend == "sm80" || backend == "sm90", "sinkattn bwd: unknown backend '", backend, "'");
  int const rank = cu_seqlens_q.has_value() ? 3 : 4;
  for (auto const* t : {&dout, &q, &k, &v, &out, &dq, &dk, &dv})
    TORCH_CHECK(t->dim() == rank && t->scalar_type() == q.scalar_type(), "sinkattn bwd: dout/q/k/v/out/dq/dk/dv must be rank ",
                rank, " and share a dtype");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dq.sizes() == q.sizes() &&
                  dk.sizes() == k.sizes() && dv.sizes() == v.sizes() && v.sizes() == k.sizes(),
              "sinkattn bwd: dout/out/dq like q, v/dk/dv like k");
  TORCH_CHECK(out.strides() == dout.strides(), "sinkattn bwd: out and dout must have the same strides");
  check_kernel_tensors({&dout, &q, &k, &v, &out, &dq, &dk, &dv}, emulated, backend);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "sinkattn bwd: lse must be contiguous float32");
  if (dlse) TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->is_contiguous() && dlse->scalar_type() == at::kFloat,
                        "sinkattn bwd: dlse must be contiguous float32 like lse");
  TORCH_CHECK(sinks.has_value() == dsinks.has_value(), "sinkattn bwd: dsinks is given exactly when sinks are");
  int const d = q.size(-1);
  int const hd = served_headdim(d);
  TORCH_CHECK(d % 8 == 0 && hd > 0, "sinkattn bwd: head dim must be a multiple of 8 up to 256");
  auto const* info = find_kernel(backend, "bwd", hd, dtype_name(q.scalar_type()));
  TORCH_CHECK(info, "sinkattn bwd: no ", backend, " backward kernel for head dim ", hd, " ", dtype_name(q.scalar_type()),
              " in this build");

  BwdParams p;
  at::Tensor const sinks_f = fill_attn_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, sinks, mask, smem_limit(emulated, max_smem, q.device(), sm90),
                                              "bwd");
  p.out = out.data_ptr(); p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dlse = dlse ? dlse->data_ptr<float>() : nullptr;
  p.dq = dq.data_ptr(); p.dk = dk.data_ptr(); p.dv = dv.data_ptr();
  TORCH_CHECK(backend != "sm90" || info->smem_bytes <= p.max_smem_per_block, "sinkattn bwd: the ", backend, " backward for head dim ", hd,
              " needs ", info->smem_bytes, " bytes of shared memory per block; the limit is ", p.max_smem_per_block);
  if (sinks) {
    TORCH_CHECK(dsinks->scalar_type() == at::kFloat && dsinks->is_contiguous() && dsinks->numel() == q.size(-2),
                "sinkattn bwd: dsinks must be contiguous float32 (nheads,)");
    p.dsinks = dsinks->data_ptr<float>();
  }
  int const r = cu_seqlens_q.has_value() ? 0 : 1;  // index of the row dimension
  if (r == 1) {
    p.dq_batch_stride = dq.stride(0); p.dk_batch_stride = dk.stride(0); p.dv_batch_stride = dv.stride(0);
  }
  p.dq_row_stride = dq.stride(r); p.dq_head_stride = dq.stride(r + 1);
  p.dk_row_stride = dk.stride(r); p.dk_head_stride = dk.stride(r + 1);
  p.dv_row_stride = dv.stride(r); p.dv_head_stride = dv.stride(r + 1);

  // Workspace. Deterministic mode adds one int counter per (sequence, head, M tile).
  auto f32 = q.options().dtype(at::kFloat);
  auto dq_accum = at::zeros({int64_t(p.total_q), p.nheads, hd}, f32);
  at::Tensor dq_semaphore;
  if (deterministic) {
    // The counters are per M tile of the kernel that runs (its tile table's block_m).
    int const block_m = sm90 ? sm90_bwd_block_m(hd) : sm80::choose_bwd_tile(hd, p.max_smem_per_block, p.softcap > 0.f).block_m;
    p.dq_m_blocks = std::max(1, ceil_div(p.seqlen_q, block_m));
    dq_semaphore = at::zeros({p.batch, p.nheads, p.dq_m_blocks}, q.options().dtype(at::kInt));
    p.dq_semaphore = dq_semaphore.data_ptr<int>();
  }
  auto dk_accum = at::zeros({int64_t(p.total_k), p.nheads, hd}, f32);
  auto dv_accum = at::zeros({int64_t(p.total_k), p.nheads, hd}, f32);
  auto delta = at::zeros_like(lse);
  auto dsink_rows = at::zeros_like(lse);
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dk_accum = dk_accum.data_ptr<float>();
  p.dv_accum = dv_accum.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dsink_rows = dsink_rows.data_ptr<float>();

  launch_kernel(info, p, emulated, q.device());
}

// Decode / chunked prefill over a KV cache that already holds the new keys: q (batch, seqlen_q, nheads, d), or
// packed (total_q, nheads, d) with cu_seqlens_q (batch + 1,) int32 and max_seqlen_q (the serving call: one launch for
// a batch of any mix, each sequence's queries the last of its keys; out likewise, lse (nheads, total_q));
// k_cache/v_cache (batch, capacity, nheads_k, d), or page pools (num_pages, page_size, nheads_k, d) with
// block_table (batch, max_pages) int32; seqused_k (batch,) int32 keys per sequence. GQA heads are packed
// into one tile per KV head; num_splits 0 picks the split-KV count from the SM count and the work.
static void fwd_kvcache(std::string const& backend, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        std::optional<at::Tensor> sinks, at::Tensor out, at::Tensor lse, at::Tensor seqused_k,
                        std::optional<at::Tensor> block_table, MaskTuple mask, int64_t num_splits, int64_t max_smem,
                        std::optional<at::Tensor> k_descale, std::optional<at::Tensor> v_descale,
                        std::optional<at::Tensor> cu_seqlens_q, int64_t max_seqlen_q) {
  bool const emulated = backend == "sm80-emulated" || backend == "sm90-emulated";
  bool const sm90 = backend == "sm90" || backend == "sm90-emulated";
  bool const varlen = cu_seqlens_q.has_value();
  TORCH_CHECK(emulated || backend == "sm80" || backend == "sm90", "sinkattn fwd_kvcache: unknown backend '", backend,
              "'");
  TORCH_CHECK(q.dim() == (varlen ? 3 : 4) && out.dim() == q.dim() && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "sinkattn fwd_kvcache: q and out must be rank 4 (rank 3 with cu_seqlens_q), the caches rank 4 and alike");
  TORCH_CHECK(!varlen || (cu_seqlens_q->device() == q.device() && max_seqlen_q >= 0),
              "sinkattn fwd_kvcache: cu_seqlens_q must be on q's device, with max_seqlen_q >= 0");
  // FP8 caches (sm80/fp8_kv.h): q and out bf16/fp16, both caches of one FP8 dtype, run on the "fwd_fp8" kernels.
  auto const cache_type = k_cache.scalar_type();
  int const kv_fp8 = cache_type == at::kFloat8_e4m3fn ? kFp8E4M3 : cache_type == at::kFloat8_e5m2 ? kFp8E5M2 : kFp8None;
  TORCH_CHECK((kv_fp8 ? v_cache.scalar_type() == cache_type : q.scalar_type() == cache_type &&
                                                                  v_cache.scalar_type() == cache_type) &&
                  out.scalar_type() == q.scalar_type() && lse.scalar_type() == at::kFloat,
              "sinkattn fwd_kvcache: q, caches and out share a dtype (or the caches share an FP8 dtype); lse is float32");
  check_kernel_tensors({&q, &k_cache, &v_cache, &out}, emulated, backend);
  int const d = q.size(-1);
  TORCH_CHECK(k_cache.size(-1) == d, "sinkattn fwd_kvcache: q and cache head dims must match");
  TORCH_CHECK(!kv_fp8 || !k_descale == !v_descale, "sinkattn fwd_kvcache: k_descale and v_descale go together");
  TORCH_CHECK(kv_fp8 || (!k_descale && !v_descale), "sinkattn fwd_kvcache: descales apply to FP8 caches only");
  if (kv_fp8) {
    // 16 codes per 16-byte vector: head dim and cache strides in multiples of 16.
    TORCH_CHECK(d % 16 == 0, "sinkattn fwd_kvcache: FP8 caches need a head dim that is a multiple of 16 (got ", d, ")");
    for (auto const* t : {&k_cache, &v_cache})
      for (int i = 0; i < t->dim() - 1; ++i)
        TORCH_CHECK(t->stride(i) % 16 == 0 || t->size(i) == 1,
                    "sinkattn fwd_kvcache: FP8 cache strides must be multiples of 16 elements");
  }
  KernelInfo const* info = nullptr;
  if (kv_fp8) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                "sinkattn fwd_kvcache: over an FP8 cache the kernels take bf16 or fp16 q");
    info = find_kernel(backend, "fwd_fp8", served_headdim(d), dtype_name(q.scalar_type()));
    TORCH_CHECK(info, "sinkattn fwd_kvcache: no ", backend, " FP8-cache kernel for head dim ", served_headdim(d), " ",
                dtype_name(q.scalar_type()), " in this build");
  } else {
    info = fwd_kernel_for(backend, q);
  }
  int64_t const batch = varlen ? cu_seqlens_q->numel() - 1 : q.size(0);
  TORCH_CHECK(seqused_k.scalar_type() == at::kInt && seqused_k.is_contiguous() && seqused_k.numel() == batch &&
                  seqused_k.device() == q.device(),
              "sinkattn fwd_kvcache: seqused_k must be contiguous int32 (batch,) on q's device");

  FwdFp8Params p;  // the FP8 fields stay unset (and unread) for a cache in q's dtype
  // Page pools fill the batch strides with the page strides.
  at::Tensor const sinks_f = fill_attn_params(p, q, k_cache, v_cache, out, lse, cu_seqlens_q, std::nullopt,
                                              max_seqlen_q, 0, sinks, mask,
                                              smem_limit(emulated, max_smem, q.device(), sm90), "fwd_kvcache",
                                              /*kv_cache=*/true);
  if (p.batch == 0 || p.total_q == 0) return;  // varlen: no sequence, or no query row (out and lse are empty)
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.seqused_k = seqused_k.data_ptr<int>();
  int64_t capacity = k_cache.size(1);
  if (block_table) {
    TORCH_CHECK(block_table->scalar_type() == at::kInt && block_table->dim() == 2 && block_table->size(0) == p.batch &&
                    block_table->stride(1) == 1, "sinkattn fwd_kvcache: block_table must be int32 (batch, max_pages)");
    p.block_table = block_table->data_ptr<int>();
    p.block_table_batch_stride = block_table->stride(0);
    p.page_size = k_cache.size(1);
    p.num_pages = k_cache.size(0);
    for (int s = 0; s < 31; ++s)
      if (p.page_size == (1 << s)) p.page_shift = s;
    capacity = block_table->size(1) * p.page_size;
  }
  p.seqlen_k = int(capacity);
  p.kv_fp8 = kv_fp8;
  auto descale = [&](std::optional<at::Tensor> const& t, char const* name, const float*& ptr, int64_t& sb, int64_t& sh) {
    if (!t) return;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == p.batch && t->size(1) == p.nheads_k &&
                    t->device() == q.device(),
                "sinkattn fwd_kvcache: ", name, " must be float32 (batch, nheads_k) on q's device");
    ptr = t->data_ptr<float>();
    sb = t->stride(0);
    sh = t->stride(1);
  };
  descale(k_descale, "k_descale", p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride);
  descale(v_descale, "v_descale", p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride);
  // One launch (plus the combine when the keys are split), its grid from the padded sizes alone (packed M tiles when
  // varlen: common/seq_extent.h), each CTA finding its sequence on the device, so a CUDA graph's launch serves every
  // batch of its padded size. GQA packing: the group's query heads share a tile, so K and V are read once per KV head
  // (a decode row fills group rows of a tile instead of one row of a tile per query head).
  p.packed_tiles = varlen;
  p.pack_gqa = p.nheads > p.nheads_k;
  int const group = p.pack_gqa ? p.nheads / p.nheads_k : 1;
  int64_t const rows = int64_t(p.seqlen_q) * group;
  // Split-KV: decode launches one CTA (or one persistent tile) per (sequence, KV head); splitting the keys fills the
  // SMs. CTAs are counted with the tile's rows and key blocks with its keys: the sm90 forward's one tile per head dim
  // (sm90/fwd_tiles.h: any page size, 16-row TMA boxes or the producer warpgroup's gather, FP8 caches decoded there);
  // for the sm80 kernels the table the launcher reads (sm80/fwd_tiles.h), the unsplit tile's rows and the split
  // tile's keys, so no split count exceeds the blocks there are.
  int block_m = 0, block_n = 0;
  if (sm90) {
    TORCH_CHECK(info->smem_bytes <= p.max_smem_per_block, "sinkattn fwd_kvcache: the ", backend, " forward for head "
                "dim ", info->headdim, " needs ", info->smem_bytes, " bytes of shared memory per block; the limit is ",
                p.max_smem_per_block);
    sm90::FwdTile const tile = sm90::fwd_tile_for(info->headdim);
    block_m = tile.block_m;
    block_n = tile.block_n;
  } else {
    sm80::FwdTile const whole = kv_fp8 ? sm80::choose_fwd_fp8_tile(p.headdim_rounded, rows, p.max_smem_per_block)
                                       : sm80::choose_fwd_tile(p.headdim_rounded, {rows, false}, p.max_smem_per_block);
    block_m = whole.block_m;
    block_n = kv_fp8 ? whole.block_n
                     : sm80::choose_fwd_tile(p.headdim_rounded, {rows, true}, p.max_smem_per_block).block_n;
  }
  int64_t const m_tiles = varlen ? packed_tile_count(p.total_q, group, block_m, p.batch)
                                 : (rows + block_m - 1) / block_m * p.batch;
  int64_t const ctas = m_tiles * (p.pack_gqa ? p.nheads_k : p.nheads);
  int sms = sm90 ? 132 : 108;  // the emulation pretends to be an H100 / an A100
  if (!emulated) C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  int const n_blocks = int((capacity + block_n - 1) / block_n);
  p.num_splits = num_splits > 0 ? int(std::min<int64_t>(num_splits, 128))
                                : choose_num_splits(ctas, sms, n_blocks, 64);
  at::Tensor out_accum, lse_accum;
  if (p.num_splits > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    // common/combine.h partial_row's layout: (splits, batch, heads, seqlen_q) padded, (splits, heads, total_q) varlen
    std::vector<int64_t> const shape = varlen ? std::vector<int64_t>{p.num_splits, p.nheads, p.total_q}
                                              : std::vector<int64_t>{p.num_splits, p.batch, p.nheads, p.seqlen_q};
    out_accum = at::empty([&] { auto s = shape; s.push_back(p.headdim_rounded); return s; }(), f32);
    lse_accum = at::empty(shape, f32);
    p.out_accum = out_accum.data_ptr<float>();
    p.lse_accum = lse_accum.data_ptr<float>();
  }
  if (kv_fp8) launch_kernel<FwdFp8Params>(info, p, emulated, q.device());
  else launch_kernel<FwdParams>(info, p, emulated, q.device());
}

}  // namespace sinkattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sinkattn;
  m.doc() = "sinkattn kernels (sinkattn/kernels.py is the Python side)";
  m.def("registry", &registry, "the kernels compiled into this binary");
  m.def("build_info", &build_info, "versions baked in at build time");
  m.def("runtime_info", &runtime_info, "CUDA runtime and driver versions now");
  m.def("merge_states", &merge_states, "merge two partial (out, lse) states, adding the sink once (CUDA)");
  m.def("fwd", &fwd, "attention forward on a kernel backend (sm90, sm80, sm80-emulated, sm90-emulated, "
        "variant:<tuning-grid name>)");
  m.def("bwd", &bwd, "attention backward on a kernel backend (sm90, sm80, sm80-emulated, sm90-emulated): dq, dk, dv, "
        "dsinks");
  m.def("fwd_kvcache", &fwd_kvcache, "attention over a KV cache (paged or not) with split-KV and GQA packing");
  cpu_front::register_functions(m);
  register_host_probes(m);
}
