// cpu_front.cpp: flash_attn_with_sinks's CPU good case in one C++ call (docs/DESIGN.md section 2, "the CPU front
// end"). The Python path of a tiny CPU forward runs about twenty small steps (argument checks, four layers, layout
// views, the sink's three tensor ops) around PyTorch's fused CPU attention kernel, each a microsecond or more from
// Python; here they are nanoseconds. Measured in bench/studies/cpu_overhead.py (bench/RESULTS.md).
//
// Invariant: this front end serves a call only where the Python path would run the same fused kernel on the same
// views (reference._fused_rows: float32 CPU tensors, one query head per KV head, at most DIRECT_MAX_ROWS query
// rows, no mask tensor: all keys visible, or plain causal with seqlen_q == seqlen_k) and accept every argument
// (sinkattn/_checks.py); for anything else, or any argument it does not recognise exactly, it returns None
// and the caller takes the Python path, which serves the call or raises the error that words what is wrong. So
// the errors keep one owner and this file never decides that an input is invalid. The rules that are not checks
// keep theirs too: the caller passes no s_aux (the sinks' alias rule is _checks.resolve_sinks: a call with s_aux
// takes the Python path) and a resolved scale (the default is _checks.default_scale; None here declines).
//
// The only file besides api.cpp that sees torch (it is host code of the extension module, not a kernel unit).
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cmath>
#include <limits>
#include <optional>

#include "cpu_front.h"

namespace py = pybind11;

namespace sinkattn::cpu_front {
namespace {

// reference.DIRECT_MAX_ROWS and layout.HEADDIM_MAX / HEADDIM_MULTIPLE (tests/test_cpu_front.py checks they agree).
constexpr int64_t kDirectMaxRows = 16;
constexpr int64_t kHeaddimMax = 256;
constexpr int64_t kHeaddimMultiple = 8;

// A plain torch.Tensor or nn.Parameter (not a subclass: a subclass may override what ops mean), as ops.direct asks.
std::optional<at::Tensor> plain_tensor(py::handle o) {
  if (!THPVariable_CheckExact(o.ptr())) return std::nullopt;
  return THPVariable_Unpack(o.ptr());
}

// A float32 CPU tensor with a unit last stride and no autograd to record: what the fused path takes as it is.
bool fused_input(at::Tensor const& t, bool grad_mode) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.stride(-1) == 1 && !(grad_mode && t.requires_grad());
}

// A Python int that is not a bool (PyLong_CheckExact excludes bool and int subclasses: the Python checks word those).
std::optional<int64_t> exact_int(py::handle o) {
  if (!PyLong_CheckExact(o.ptr())) return std::nullopt;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
  if (overflow) return std::nullopt;
  return static_cast<int64_t>(v);
}

// A finite Python float or int (not bool), as _checks._check_float accepts it.
std::optional<double> exact_float(py::handle o) {
  double v;
  if (PyFloat_CheckExact(o.ptr())) {
    v = PyFloat_AS_DOUBLE(o.ptr());
  } else if (auto i = exact_int(o)) {
    v = static_cast<double>(*i);
  } else {
    return std::nullopt;
  }
  if (!std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<bool> exact_bool(py::handle o) {
  if (o.ptr() == Py_True) return true;
  if (o.ptr() == Py_False) return false;
  return std::nullopt;
}

// The weight w = sigmoid(x) the keys keep beside the sink (x = lse - sink) and, when asked, log w: stable for every
// x, +-inf included, from one exp (log w as torch's logsigmoid: min(x, 0) - log1p(exp(-|x|))). NaN stays NaN.
inline float sink_weight(float x, float* log_w) {
  float const e = std::exp(-std::fabs(x));
  if (log_w) *log_w = std::fmin(x, 0.f) - std::log1p(e);
  return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

// The whole good case -> out, or (out, lse); None where the Python path must take the call (see the invariant).
py::object fwd(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle sinks_obj, py::handle scale_obj, py::handle causal_obj, py::handle window_obj, py::handle sink_tokens_obj,
               py::handle softcap_obj, py::handle return_lse_obj, py::handle deterministic_obj,
               py::handle backend_obj) {
  py::object none = py::none();
  // ops.direct: no torch function or dispatch mode, no functorch transform (torch.compile is the caller's test).
  // A transform (vmap, grad) is active while its dynamic layer's front key is in the thread's included keys.
  if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return none;
  auto q_t = plain_tensor(q_obj), k_t = plain_tensor(k_obj), v_t = plain_tensor(v_obj);
  if (!q_t || !k_t || !v_t) return none;
  at::Tensor const &q = *q_t, &k = *k_t, &v = *v_t;
  bool const grad_mode = at::GradMode::is_enabled();
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return none;
  if (!fused_input(q, grad_mode) || !fused_input(k, grad_mode) || !fused_input(v, grad_mode)) return none;
  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3), sk = k.size(1);
  // One query head per KV head (GQA takes the Python path's head packing), rows the direct path serves, keys.
  if (b < 1 || sq < 1 || sq > kDirectMaxRows || sk < 1 || h < 1 || k.size(0) != b || k.size(2) != h ||
      k.size(3) != d || v.sizes() != k.sizes() || d < 1 || d > kHeaddimMax || d % kHeaddimMultiple != 0)
    return none;

  std::optional<at::Tensor> sink;
  if (!sinks_obj.is_none()) {
    sink = plain_tensor(sinks_obj);
    if (!sink || sink->dim() != 1 || sink->size(0) != h || !sink->device().is_cpu() ||
        sink->scalar_type() != at::kFloat || (grad_mode && sink->requires_grad()))
      return none;
  }

  // The mask: all keys visible, or plain causal over a square (bottom-right and top-left alignment agree there);
  // sink tokens change nothing without a left edge. Softcap takes the Python path (not the fused kernel).
  auto causal = exact_bool(causal_obj);
  auto return_lse = exact_bool(return_lse_obj);
  auto deterministic = exact_bool(deterministic_obj);
  auto sink_tokens = exact_int(sink_tokens_obj);
  auto softcap = exact_float(softcap_obj);
  if (!causal || !return_lse || !deterministic || !sink_tokens || *sink_tokens < 0 || !softcap || *softcap != 0.0)
    return none;
  if (!(PyTuple_CheckExact(window_obj.ptr()) || PyList_CheckExact(window_obj.ptr())) || py::len(window_obj) != 2)
    return none;
  auto left = exact_int(window_obj[py::int_(0)]), right = exact_int(window_obj[py::int_(1)]);
  if (!left || !right || *left != -1 || *right < -1 || *right > 0) return none;  // (a window: the Python path)
  bool const is_causal = *causal || *right == 0;
  if (is_causal && sq != sk) return none;
  auto const scale = exact_float(scale_obj);
  if (!scale) return none;
  if (!PyUnicode_CheckExact(backend_obj.ptr())) return none;
  std::string const backend = py::cast<std::string>(backend_obj);
  if (backend != "auto" && backend != "reference") return none;

  // The kernel SDPA runs, over (b, h, s, d) views; it writes out and lse in q's (b, s, h, d) memory order.
  auto [out_k, lse_k] = at::_scaled_dot_product_flash_attention_for_cpu(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, is_causal, std::nullopt, *scale);
  at::Tensor out = out_k.transpose(1, 2);  // (b, sq, h, d)
  if (!out.is_contiguous()) out = out.contiguous();
  bool const need_lse = *return_lse;
  if (!sink && !is_causal && !need_lse) return py::cast(out);

  // One pass over the rows: the causal check, the sink's weight, the lse the call returns.
  // - causal: the kernel hides a key by masking its score, so a hidden non-finite K or V can turn a row that does
  //   not see it NaN (inf - inf, 0 * inf); a non-finite row (that, or a visible one) sends the call to the Python
  //   path, whose tiled path keeps hidden keys out exactly (reference._fused_forward checks the same after its
  //   kernel call).
  // - the sink joins keys whose log-sum-exp is lse: w = sigmoid(lse - sink) is the weight the keys keep,
  //   lse' = lse - log w = logaddexp(lse, sink) (reference._sink_weight; w = 0, lse' = +inf at a +inf sink).
  float* const o = out.data_ptr<float>();
  at::Tensor const lse_in = lse_k;  // (b, h, sq), any strides
  float const* const l_in = lse_in.data_ptr<float>();
  int64_t const lsb = lse_in.stride(0), lsh = lse_in.stride(1), lss = lse_in.stride(2);
  at::Tensor lse;
  float* l_out = nullptr;
  if (need_lse) {
    lse = at::empty({b, h, sq}, q.options());
    l_out = lse.data_ptr<float>();
  }
  float const* const s_p = sink ? sink->data_ptr<float>() : nullptr;
  int64_t const s_stride = sink ? sink->stride(0) : 0;
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t si = 0; si < sq; ++si) {
      for (int64_t hi = 0; hi < h; ++hi) {
        float* const row = o + ((bi * sq + si) * h + hi) * d;
        if (is_causal) {
          for (int64_t j = 0; j < d; ++j)
            if (!std::isfinite(row[j])) return none;
        }
        float l = l_in[bi * lsb + hi * lsh + si * lss];
        if (s_p) {
          float log_w;
          float const w = sink_weight(l - s_p[hi * s_stride], l_out ? &log_w : nullptr);
          for (int64_t j = 0; j < d; ++j) row[j] *= w;
          if (l_out) l -= log_w;
        }
        if (l_out) l_out[(bi * h + hi) * sq + si] = l;
      }
    }
  }
  if (need_lse) return py::make_tuple(out, lse);
  return py::cast(out);
}

}  // namespace

void register_functions(py::module_& m) {
  m.def("cpu_fwd", &fwd,
        "flash_attn_with_sinks's CPU good case in one call (float32, no GQA, <= 16 query rows, full or square "
        "causal, no softcap) -> out or (out, lse); None where the Python path must serve the call");
}

}  // namespace sinkattn::cpu_front
