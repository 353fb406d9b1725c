"""sinkattn.compat: vLLM's flash_attn_varlen_func served by sinkattn, against the float64 oracle."""
import inspect
import sys
import types

import pytest
import torch

from sinkattn import SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from sinkattn import compat
from sinkattn.compat import flash_attn_varlen_func
from tests.oracle import attention_oracle, attention_oracle_varlen

# vllm-project/flash-attention, vllm_flash_attn/flash_attn_interface.py: the parameters, in order.
VLLM_PARAMS = ["q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k", "seqused_k", "q_v",
               "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
               "return_attn_probs", "block_table", "return_softmax_lse", "out", "scheduler_metadata", "q_descale",
               "k_descale", "v_descale", "num_splits", "fa_version", "s_aux", "cp_world_size", "cp_rank",
               "cp_tot_seqused_k"]


def test_signature_is_vllms():
    assert list(inspect.signature(flash_attn_varlen_func).parameters) == VLLM_PARAMS


H, HK, D = 4, 2, 16


def _paged_problem(qlens, kvlens, page, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    batch = len(qlens)
    max_pages = max((n + page - 1) // page for n in kvlens)
    num_pages = batch * max_pages + 3
    k_cache = torch.randn(num_pages, page, HK, D, generator=g, dtype=dtype)
    v_cache = torch.randn(num_pages, page, HK, D, generator=g, dtype=dtype)
    block_table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    q = torch.randn(sum(qlens), H, D, generator=g, dtype=dtype)
    cu_q = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    seqused = torch.tensor(kvlens, dtype=torch.int32)
    sinks = torch.randn(H, generator=g, dtype=torch.float32)
    return q, k_cache, v_cache, block_table, cu_q, seqused, sinks


def _expected_paged(q, k_cache, v_cache, block_table, cu_q, seqused, sinks, **kw):
    page = k_cache.shape[1]
    outs, lses = [], []
    starts = cu_q.tolist()
    for b, n_k in enumerate(seqused.tolist()):
        pos = torch.arange(n_k)
        pages = block_table[b].long()[pos // page]
        k = k_cache[pages, pos % page][None]
        v = v_cache[pages, pos % page][None]
        o, l = attention_oracle(q[None, starts[b]:starts[b + 1]], k, v, sinks, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("kw", [dict(causal=True),
                                dict(causal=True, window_size=[3, 0], softcap=4.0),
                                dict(causal=False, softmax_scale=0.3)], ids=["causal", "window-softcap", "full"])
def test_paged_mixed_prefill_and_decode(kw):
    qlens, kvlens = [1, 5, 1, 0, 3, 5], [9, 7, 1, 4, 3, 12]  # decode, chunked prefill, empty query, ...
    q, kc, vc, bt, cu_q, seqused, sinks = _paged_problem(qlens, kvlens, page=4, seed=3)
    out, lse = flash_attn_varlen_func(q, kc, vc, max(qlens), cu_q, max(kvlens), seqused_k=seqused, block_table=bt,
                                      s_aux=sinks, return_softmax_lse=True, **kw)
    want_kw = {**kw, "window_size": tuple(kw.get("window_size", (-1, -1)))}
    ref, ref_lse = _expected_paged(q, kc, vc, bt, cu_q, seqused, sinks, **want_kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert lse.dtype == torch.float32 and lse.shape == (H, sum(qlens))


def test_paged_pure_decode_writes_into_out():
    """vLLM's decode batch: one query per sequence, output into a preallocated buffer (a view)."""
    qlens, kvlens = [1, 1, 1], [5, 17, 2]
    q, kc, vc, bt, cu_q, seqused, sinks = _paged_problem(qlens, kvlens, page=16, seed=5, dtype=torch.float32)
    buf = torch.full((8, H, D), 7.0)
    out_view = buf[:3]
    got = flash_attn_varlen_func(q=q, k=kc, v=vc, out=out_view, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                 seqused_k=seqused, max_seqlen_k=17, softmax_scale=D ** -0.5, causal=True,
                                 window_size=[127, 0], block_table=bt, softcap=0, fa_version=2,
                                 q_descale=torch.ones(3, HK), k_descale=torch.ones(3, HK),
                                 v_descale=torch.ones(3, HK), num_splits=0, s_aux=sinks)
    assert got.data_ptr() == out_view.data_ptr()
    ref, _ = _expected_paged(q, kc, vc, bt, cu_q, seqused, sinks, causal=True, window_size=(127, 0))
    torch.testing.assert_close(buf[:3].double(), ref, rtol=2e-5, atol=2e-5)
    assert (buf[3:] == 7.0).all()


def test_packed_keys_match_varlen_oracle():
    g = torch.Generator().manual_seed(11)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 15], dtype=torch.int32)
    q = torch.randn(8, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(15, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(15, HK, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    out, lse = flash_attn_varlen_func(q, k, v, 5, cu_q, 8, cu_k, causal=True, window_size=(2, 0), s_aux=sinks,
                                      return_softmax_lse=True)
    ref, ref_lse = attention_oracle_varlen(q, k, v, cu_q, cu_k, sinks, causal=True, window_size=(2, 0))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse)
    plain = flash_attn_varlen_func(q, k, v, 5, cu_q, 8, cu_k)  # no sinks, vLLM's defaults
    torch.testing.assert_close(plain, attention_oracle_varlen(q, k, v, cu_q, cu_k)[0])


def test_batched_keys_with_seqused_k():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 10, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(3, 10, HK, D, generator=g, dtype=torch.float64)
    q = torch.randn(6, H, D, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    seqused = torch.tensor([10, 3, 6], dtype=torch.int32)
    sinks = torch.randn(H, generator=g)
    out = flash_attn_varlen_func(q, k, v, 2, cu_q, 10, seqused_k=seqused, causal=True, s_aux=sinks)
    for b, n in enumerate(seqused.tolist()):
        ref, _ = attention_oracle(q[None, 2 * b:2 * b + 2], k[b:b + 1, :n], v[b:b + 1, :n], sinks, causal=True)
        torch.testing.assert_close(out[2 * b:2 * b + 2], ref[0])


def test_refusals_name_the_argument():
    q, kc, vc, bt, cu_q, seqused, sinks = _paged_problem([1, 2], [3, 4], page=4, seed=1, dtype=torch.float32)
    base = dict(q=q, k=kc, v=vc, max_seqlen_q=2, cu_seqlens_q=cu_q, max_seqlen_k=4)
    cases = [
        (SinkattnValueError, "not both", dict(cu_seqlens_k=cu_q, seqused_k=seqused)),
        (SinkattnValueError, "needs seqused_k", dict(block_table=bt, cu_seqlens_k=cu_q)),
        (SinkattnValueError, "give cu_seqlens_k", dict()),
        (SinkattnValueError, "dropout_p", dict(seqused_k=seqused, block_table=bt, dropout_p=0.1)),
        (SinkattnValueError, "alibi_slopes", dict(seqused_k=seqused, block_table=bt, alibi_slopes=torch.ones(H))),
        (SinkattnValueError, "cp_world_size=2", dict(seqused_k=seqused, block_table=bt, cp_world_size=2)),
        (SinkattnValueError, "return_attn_probs", dict(seqused_k=seqused, block_table=bt, return_attn_probs=True)),
        (SinkattnValueError, "window_size", dict(seqused_k=seqused, block_table=bt, window_size=[1, 2, 3])),
        (SinkattnTypeError, "fp8", dict(k=kc.to(torch.float8_e4m3fn), seqused_k=seqused, block_table=bt)),
        (SinkattnValueError, "out has shape", dict(seqused_k=seqused, block_table=bt, out=torch.empty(2, H, D))),
    ]
    for exc, text, kw in cases:
        with pytest.raises(exc, match=text):
            flash_attn_varlen_func(**{**base, **kw})


def test_patch_vllm_on_a_stand_in_module_tree(monkeypatch):
    """The patching mechanics, on stand-ins shaped like vLLM V1's flash-attention backend modules."""
    fa_utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    fa_utils.flash_attn_supports_sinks = lambda: False
    fa_backend = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    fa_backend.flash_attn_supports_sinks = fa_utils.flash_attn_supports_sinks
    fa_backend.use_cascade_attention = lambda *a, **k: True

    class FlashAttentionBackend:
        @classmethod
        def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                                 device_capability):
            if head_size % 8:
                return "head size"
            if has_sink and device_capability < (9, 0):
                return "sink not supported on compute capability < 9.0"
            return None

    fa_backend.FlashAttentionBackend = FlashAttentionBackend
    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends"], "fa_utils", fa_utils, raising=False)
    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends"], "flash_attn", fa_backend, raising=False)
    monkeypatch.setitem(sys.modules, fa_utils.__name__, fa_utils)
    monkeypatch.setitem(sys.modules, fa_backend.__name__, fa_backend)
    assert FlashAttentionBackend.supports_combination(64, None, None, 16, False, True, False, (8, 0)) is not None
    monkeypatch.setenv("SINKATTN_VLLM", "0")
    compat.vllm_plugin()  # off: nothing patched
    assert fa_backend.flash_attn_supports_sinks() is False
    monkeypatch.setenv("SINKATTN_VLLM", "1")
    compat.vllm_plugin()
    assert fa_backend.flash_attn_varlen_func is flash_attn_varlen_func
    assert fa_utils.flash_attn_varlen_func is flash_attn_varlen_func
    assert fa_backend.flash_attn_supports_sinks() and fa_utils.flash_attn_supports_sinks()
    assert fa_backend.use_cascade_attention() is False
    assert FlashAttentionBackend.supports_combination(64, None, None, 16, False, True, False, (8, 0)) is None
    assert FlashAttentionBackend.supports_combination(60, None, None, 16, False, True, False, (8, 0)) == "head size"
    compat.patch_vllm()  # idempotent
    assert FlashAttentionBackend.supports_combination(64, None, None, 16, False, True, False, (8, 6)) is None


def test_patch_vllm_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SinkattnRuntimeError, match="cannot import vLLM"):
        compat.patch_vllm()
