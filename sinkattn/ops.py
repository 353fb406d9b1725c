"""torch.library registration of the sinkattn ops (namespace `sinkattn`).

    sinkattn::fwd          plain and varlen forward -> (out, lse); autograd via sinkattn::bwd
    sinkattn::bwd          -> (dq, dk, dv, dsinks)
    sinkattn::kvcache_fwd  KV-cache attention, appends k/v into k_cache/v_cache in place -> (out, lse)

The second layer: interface (validation) -> ops (here) -> dispatch -> kernels | reference. Each op has a
fake implementation (shapes and dtypes only), so torch.compile(fullgraph=True) traces through the calls;
autograd is registered on the op, so compiled graphs get the same backward. The real implementations are
dispatch.run_fwd / run_bwd / run_kvcache, which choose the backend at run time, never while tracing.
Inputs arrive validated by sinkattn.interface; the ops trust their metadata.

The mask travels as one value (sinkattn.mask.Mask) everywhere but in the op schemas, which take scalars: `call_*`
flattens it with Mask.kernel_args() and each op body rebuilds it with `_mask`, the one conversion each way.

`call_fwd` / `call_kvcache` are how the interface calls the ops: through torch.ops where the op layer has
something to do (autograd, torch.compile's tracing, fake tensors, a torch function / dispatch mode, a functorch
transform), else straight into the op's body (`direct`): eager inference on plain tensors, where the op wrapper
only costs time (tens of microseconds a call on a CPU, more than a decode step's attention; bench/studies/cpu_overhead.py).
The body is the same function either way, so the results are the same.
"""
# No `from __future__ import annotations`: custom_op reads the annotations to build the schema.
from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .layout import acc_dtype, lse_shape
from .mask import Mask


def _mask(softmax_scale: float, window_left: int, window_right: int, sink_tokens: int, softcap: float) -> Mask:
    """The op schemas' mask scalars (Mask.kernel_args order) as the Mask the layers below take."""
    return Mask(softmax_scale, window_left, window_right, sink_tokens, softcap)


@torch.library.custom_op("sinkattn::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
        window_left: int, window_right: int, sink_tokens: int, softcap: float, deterministic: bool,
        backend: str) -> tuple[Tensor, Tensor]:
    return dispatch.run_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            _mask(softmax_scale, window_left, window_right, sink_tokens, softcap), deterministic,
                            backend)


@fwd.register_fake
def _(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, sink_tokens, softcap, deterministic, backend):
    out = q.new_empty(q.shape)
    lse = q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=acc_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("sinkattn::bwd", mutates_args=())
def bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
        out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
        sink_tokens: int, softcap: float, deterministic: bool,
        backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return dispatch.run_bwd(dout, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, _mask(softmax_scale, window_left, window_right, sink_tokens, softcap),
                            deterministic, backend)


@bwd.register_fake
def _(dout, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, sink_tokens, softcap, deterministic, backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((q.shape[-2],), dtype=sinks.dtype if sinks is not None else acc_dtype(q.dtype)))


def _setup_fwd(ctx, inputs, output):
    (q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
     window_right, sink_tokens, softcap, deterministic, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.params = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, sink_tokens, softcap,
                  deterministic, backend)


def _backward_fwd(ctx, dout, dlse):
    q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = torch.ops.sinkattn.bwd(dout, dlse, q, k, v, sinks, out, lse, cu_seqlens_q,
                                                cu_seqlens_k, *ctx.params)
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * 11


torch.library.register_autograd("sinkattn::fwd", _backward_fwd, setup_context=_setup_fwd)


@torch.library.custom_op("sinkattn::kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, sinks: Optional[Tensor], k: Optional[Tensor],
                v: Optional[Tensor], cache_seqlens: Tensor, block_table: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                softmax_scale: float, window_left: int, window_right: int, sink_tokens: int, softcap: float,
                num_splits: int, backend: str, k_descale: Optional[Tensor] = None,
                v_descale: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                max_seqlen_q: int = 0) -> tuple[Tensor, Tensor]:
    return dispatch.run_kvcache(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos,
                                rotary_sin, rotary_interleaved,
                                _mask(softmax_scale, window_left, window_right, sink_tokens, softcap), num_splits,
                                backend, k_descale, v_descale, cu_seqlens_q, max_seqlen_q)


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved,
      softmax_scale, window_left, window_right, sink_tokens, softcap, num_splits, backend, k_descale=None,
      v_descale=None, cu_seqlens_q=None, max_seqlen_q=0):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=acc_dtype(q.dtype))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*tensors) -> bool:
    """Whether a call on `tensors` (None entries ignored) may run the op's body without torch.ops: eager (not
    traced by torch.compile), no torch function or dispatch mode (fake tensors, make_fx, FlopCounterMode, a
    `with torch.device(...)` block) and no functorch transform (vmap, grad) active, plain tensors (nn.Parameter
    included), and no autograd to record (grad mode off, or no input requiring grad)."""
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled() \
            or torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def call_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask: Mask, deterministic,
             backend, need_lse=True):
    """sinkattn::fwd, or its body where `direct` allows -> (out, lse). need_lse=False: the caller drops lse, so the
    body may skip it (lse None); the op itself always returns it (autograd and the schema need it)."""
    if direct(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k):
        return dispatch.run_fwd(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
                                deterministic, backend, need_lse)
    return torch.ops.sinkattn.fwd.default(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          *mask.kernel_args(), deterministic, backend)


def call_kvcache(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                 rotary_interleaved, mask: Mask, num_splits, backend, k_descale=None, v_descale=None,
                 cu_seqlens_q=None, max_seqlen_q=0):
    """sinkattn::kvcache_fwd, or its body where `direct` allows -> (out, lse). (The op has no autograd: the
    interface refuses inputs that need it before calling.) k_descale/v_descale: an FP8 cache's (batch, nheads_k)
    float32 descales (sinkattn.fp8), else None. cu_seqlens_q: packed queries over a cache holding every key (the
    serving form, one launch per batch)."""
    if direct(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, k_descale,
              v_descale, cu_seqlens_q):
        return dispatch.run_kvcache(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table, rotary_cos,
                                    rotary_sin, rotary_interleaved, mask, num_splits, backend, k_descale, v_descale,
                                    cu_seqlens_q, max_seqlen_q)
    return torch.ops.sinkattn.kvcache_fwd.default(q, k_cache, v_cache, sinks, k, v, cache_seqlens, block_table,
                                                  rotary_cos, rotary_sin, rotary_interleaved, *mask.kernel_args(),
                                                  num_splits, backend, k_descale, v_descale, cu_seqlens_q,
                                                  int(max_seqlen_q))
