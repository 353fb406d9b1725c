"""sinkattn.flash_attn_interface: flash-attn 2.8's and vLLM's call forms, against the float64 oracle.

Every call is written the way a flash-attn or vLLM caller writes it, from the peers' documented signatures
(positional order and keyword names), with sinkattn's extras (sinks aliases, sink_tokens, backend) as
keywords. Each case runs on the reference backend (CPU, backend left at its default, as a flash-attn caller
leaves it) and, when the build holds them, on the emulated sm80 kernels (backend="sm80-emulated", bf16).
"""
import inspect
import math

import pytest
import torch

import sinkattn
from sinkattn import _ext, reference
from sinkattn import flash_attn_interface as fai
from sinkattn.errors import SinkattnError, SinkattnTypeError, SinkattnValueError
from oracle import attention_oracle, attention_oracle_varlen, rotary_oracle, tolerance_check
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

_EMU = {(k["headdim"], k["dtype"]) for k in _ext.registry() if k["family"] == "sm80-emulated"}
# (backend, dtype): the default path (CPU -> reference) in float32, and the emulated kernel in bf16.
BACKENDS = [
    pytest.param("auto", torch.float32, id="reference-fp32"),
    pytest.param("sm80-emulated", torch.bfloat16, id="sm80-emulated-bf16",
                 marks=pytest.mark.skipif((64, "bf16") not in _EMU, reason="no emulated hdim64 bf16 kernel in this build")),
]
SINK_ALIASES = ["sinks", "s_aux", "learnable_sink"]


def heads(backend, h, hk):
    """Fewer heads under emulation (each (batch, head) is a CTA run thread by thread on the host; on 2 busy
    cores a case of 16 heads took minutes)."""
    return (h, hk) if backend == "auto" else (2, 1 if hk < h else 2)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(reference, "KEY_TILE", 32)
    monkeypatch.setattr(reference, "ROW_CHUNK", 24)


def extra(backend):
    """sinkattn's backend keyword, left out on the default path (a flash-attn caller never passes it)."""
    return {} if backend == "auto" else {"backend": backend}


def check(name, out, lse, ref_fn, args, kw, dtype, seed):
    """out/lse against the float64 oracle, with FlashAttention's rule (2x the same math at dtype + atol)."""
    ref_out, ref_lse = ref_fn(*args, **kw)
    if dtype == torch.float32:
        base_out = base_lse = None
        atol_out, atol_lse = 1e-5, 1e-4
    else:
        base_out, base_lse = ref_fn(*args, **kw, compute_dtype=dtype)
        base_lse = base_lse.float()
        atol_out, atol_lse = 1e-3, 1e-3
    tolerance_check(f"{name} out", out, ref_out, base_out, atol_out, seed)
    if lse is not None:
        tolerance_check(f"{name} lse", lse, ref_lse, base_lse, atol_lse, seed)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def rand(*shape, dtype):
    return torch.randn(*shape).to(dtype)


# ------------------------------------------------------------------------------------------------ signatures

FLASH_ATTN_28 = {  # flash-attn 2.8.3's positional parameters, in order, with their defaults
    "flash_attn_func": ("q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                        "return_attn_probs", (0.0, None, False, (-1, -1), 0.0, None, False, False)),
    "flash_attn_qkvpacked_func": ("qkv dropout_p softmax_scale causal window_size softcap alibi_slopes "
                                  "deterministic return_attn_probs", (0.0, None, False, (-1, -1), 0.0, None, False,
                                                                      False)),
    "flash_attn_kvpacked_func": ("q kv dropout_p softmax_scale causal window_size softcap alibi_slopes "
                                 "deterministic return_attn_probs", (0.0, None, False, (-1, -1), 0.0, None, False,
                                                                     False)),
    "flash_attn_varlen_func": ("q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                               "causal window_size softcap alibi_slopes deterministic return_attn_probs block_table",
                               (0.0, None, False, (-1, -1), 0.0, None, False, False, None)),
    "flash_attn_varlen_qkvpacked_func": ("qkv cu_seqlens max_seqlen dropout_p softmax_scale causal window_size "
                                         "softcap alibi_slopes deterministic return_attn_probs",
                                         (0.0, None, False, (-1, -1), 0.0, None, False, False)),
    "flash_attn_varlen_kvpacked_func": ("q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                        "softmax_scale causal window_size softcap alibi_slopes deterministic "
                                        "return_attn_probs", (0.0, None, False, (-1, -1), 0.0, None, False, False)),
    "flash_attn_with_kvcache": ("q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens cache_batch_idx "
                                "cache_leftpad block_table softmax_scale causal window_size softcap "
                                "rotary_interleaved alibi_slopes num_splits return_softmax_lse",
                                (None, None, None, None, None, None, None, None, None, False, (-1, -1), 0.0, True,
                                 None, 0, False)),
    # vLLM 0.33's vllm.vllm_flash_attn.flash_attn_varlen_func
    "vllm_flash_attn_varlen_func": (
        "q k v max_seqlen_q cu_seqlens_q max_seqlen_k cu_seqlens_k seqused_k q_v dropout_p softmax_scale causal "
        "window_size softcap alibi_slopes deterministic return_attn_probs block_table return_softmax_lse out "
        "scheduler_metadata q_descale k_descale v_descale num_splits output_scale fa_version s_aux cp_world_size "
        "cp_rank cp_tot_seqused_k mask_mod block_sparse_tensors aux_tensors aux_tensor_leading_dims dynamic_causal "
        "gather_kv_indices gather_kv_valid_length",
        (None, None, None, 0.0, None, False, None, 0.0, None, False, False, None, False, None, None, None, None,
         None, 0, None, 2, None, 1, 0, None, None, None, None, None, None, None, None)),
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_28))
def test_positional_order_and_defaults_match_the_peer(name):
    params = list(inspect.signature(getattr(fai, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    names, defaults = FLASH_ATTN_28[name]
    assert [p.name for p in positional] == names.split()
    got_defaults = tuple(p.default for p in positional if p.default is not p.empty)
    assert got_defaults == defaults
    keyword_only = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    assert {"sink_tokens", "backend"} <= keyword_only
    assert {"sinks", "s_aux", "learnable_sink"} <= keyword_only | {p.name for p in positional}


# ------------------------------------------------------------------------------------------ flash_attn_func

MASKS = [  # (seqlen_q, seqlen_k, flash-attn's causal and window_size, the same mask in sinkattn's contract)
    (37, 37, dict(causal=False, window_size=(-1, -1)), dict()),
    (20, 45, dict(causal=True, window_size=(-1, -1)), dict(causal=True)),
    (33, 33, dict(causal=False, window_size=(7, 3)), dict(window_size=(7, 3))),
    # flash-attn: causal=True sets the right edge to 0 whatever window_size says (transformers passes (w, w)).
    (29, 29, dict(causal=True, window_size=(9, 9)), dict(causal=True, window_size=(9, 0))),
    # flash-attn: an edge >= seqlen_k is unbounded (here right = 3 >= seqlen_k = 2 sees every key).
    (5, 2, dict(causal=False, window_size=(-1, 3)), dict()),
]


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("sq,sk,fa_kw,contract_kw", MASKS)
def test_flash_attn_func_positional(sq, sk, fa_kw, contract_kw, backend, dtype, rng_seed):
    (h, hk), d = heads(backend, 8, 2), 64
    b = 2 if backend == "auto" else 1
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)
    scale = 0.7 / math.sqrt(d)
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
    #                 deterministic, return_attn_probs)
    res = fai.flash_attn_func(q, k, v, 0.0, scale, fa_kw["causal"], fa_kw["window_size"], 0.0, None, False, True,
                              **extra(backend))
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, probs = res
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    # flash-attn 2.8 at dropout_p = 0: S_dmask is an empty tensor of q's dtype.
    assert isinstance(probs, torch.Tensor) and probs.shape == (0,) and probs.dtype == dtype
    check("flash_attn_func", out, lse, attention_oracle, (q, k, v, None), dict(softmax_scale=scale, **contract_kw),
          dtype, rng_seed)
    plain = fai.flash_attn_func(q, k, v, softmax_scale=scale, **fa_kw, **extra(backend))
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("alias", SINK_ALIASES)
def test_flash_attn_func_sinks_by_each_alias(alias, backend, dtype, rng_seed):
    b, s, d = 2 if backend == "auto" else 1, 40, 64
    h, hk = heads(backend, 4, 4)
    q, k, v = (rand(b, s, x, d, dtype=dtype) for x in (h, hk, hk))
    sinks = torch.randn(h) * 2
    sinks[1] = float("-inf")
    out, lse, _ = fai.flash_attn_func(q, k, v, causal=True, window_size=(11, 0), return_attn_probs=True,
                                      sink_tokens=3, **{alias: sinks}, **extra(backend))
    check(f"sinks as {alias}", out, lse, attention_oracle, (q, k, v, sinks),
          dict(causal=True, window_size=(11, 0), sink_tokens=3), dtype, rng_seed)
    # The same computation as sinkattn's own API, bit for bit.
    assert torch.equal(out, sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, window_size=(11, 0),
                                                           sink_tokens=3, backend=backend))
    # The sinks really arrive: without them the answer differs.
    assert not torch.allclose(out, fai.flash_attn_func(q, k, v, causal=True, window_size=(11, 0), sink_tokens=3,
                                                       **extra(backend)))


def test_two_sink_aliases_are_an_error():
    q = torch.randn(1, 4, 2, 16)
    s = torch.zeros(2)
    for pair in (("sinks", "s_aux"), ("s_aux", "learnable_sink"), ("sinks", "learnable_sink")):
        with pytest.raises(SinkattnValueError, match="aliases"):
            fai.flash_attn_func(q, q, q, **{pair[0]: s, pair[1]: s})
    with pytest.raises(SinkattnValueError, match="aliases"):
        fai.vllm_flash_attn_varlen_func(q[0], q[0], q[0], 4, cu([4]), 4, cu([4]), s_aux=s, sinks=s)


def test_empty_rows_and_headdim_padding(rng_seed):
    """seqlen_q > seqlen_k with causal: the first rows see no key: out 0 (as flash-attn), lse -inf without sinks
    (flash-attn 2 writes +inf there; documented) and sinks[h] with them. Head dim 20 is padded to 24, as
    flash-attn pads it, with the default scale of the caller's head dim."""
    b, sq, sk, h, d = 2, 9, 4, 2, 20
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    sinks = torch.tensor([0.5, -1.0])
    for s in (None, sinks):
        out, lse, _ = fai.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=s)
        assert out.shape == q.shape
        check("padded head dim", out, lse, attention_oracle, (q, k, v, s), dict(causal=True), torch.float32,
              rng_seed)
        assert (out[:, : sq - sk] == 0).all()
        want = torch.full((b, h, sq - sk), float("-inf")) if s is None else s.view(1, h, 1).expand(b, h, sq - sk)
        assert torch.equal(lse[:, :, : sq - sk], want)


def test_headdim_mismatch_names_the_callers_dims():
    """Checked before the padding to a multiple of 8, so the message has the caller's numbers."""
    q = torch.randn(1, 4, 2, 20)
    with pytest.raises(SinkattnValueError, match="v has head dim 12 but q has 20"):
        fai.flash_attn_func(q, q, torch.randn(1, 4, 2, 12))
    with pytest.raises(SinkattnValueError, match="k has head dim 12 but q has 20"):
        fai.flash_attn_varlen_func(q[0], torch.randn(4, 2, 12), q[0], cu([4]), cu([4]), 4, 4)


# ------------------------------------------------------------------------------------------------ packed forms

@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_qkvpacked_and_kvpacked(backend, dtype, rng_seed):
    b, s, d = 2 if backend == "auto" else 1, 35, 64
    h = heads(backend, 4, 4)[0]
    qkv = rand(b, s, 3, h, d, dtype=dtype)
    sinks = torch.randn(h)
    out, lse, probs = fai.flash_attn_qkvpacked_func(qkv, 0.0, None, True, (-1, -1), 0.0, None, False, True,
                                                    s_aux=sinks, **extra(backend))
    q, k, v = qkv.unbind(2)
    assert probs.numel() == 0
    check("qkvpacked", out, lse, attention_oracle, (q, k, v, sinks), dict(causal=True), dtype, rng_seed)
    hk = heads(backend, 4, 2)[1]
    q = rand(b, s - 5, h, d, dtype=dtype)
    kv = rand(b, s, 2, hk, d, dtype=dtype)
    out, lse, _ = fai.flash_attn_kvpacked_func(q, kv, 0.0, None, False, (6, 2), 0.0, None, False, True,
                                               learnable_sink=sinks, **extra(backend))
    check("kvpacked (GQA)", out, lse, attention_oracle, (q, kv[:, :, 0], kv[:, :, 1], sinks),
          dict(window_size=(6, 2)), dtype, rng_seed)


def test_packed_gradients_reach_the_packed_tensor(rng_seed):
    b, s, h, d = 1, 12, 2, 16
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    out = fai.flash_attn_qkvpacked_func(qkv, causal=True, sinks=sinks)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (qkv, sinks))
    ref_out, _ = attention_oracle(*qkv.unbind(2), sinks, causal=True)
    want = torch.autograd.grad((ref_out * g).sum(), (qkv, sinks))
    tolerance_check("d qkv", got[0], want[0], None, 1e-10, rng_seed)
    tolerance_check("d sinks", got[1], want[1], None, 1e-10, rng_seed)


# ------------------------------------------------------------------------------------------------------ varlen

@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_varlen_positional(backend, dtype, rng_seed):
    lq, lk = [5, 0, 33, 1, 17], [9, 3, 40, 0, 60]
    (h, hk), d = heads(backend, 8, 2), 64
    q = rand(sum(lq) + 2, h, d, dtype=dtype)  # 2 padding rows past cu_seqlens_q[-1]
    k, v = rand(sum(lk), hk, d, dtype=dtype), rand(sum(lk), hk, d, dtype=dtype)
    cq, ck = cu(lq), cu(lk)
    sinks = torch.randn(h)
    # flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    #                        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    #                        return_attn_probs, block_table)
    out, lse, probs = fai.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), 0.0, None, True, (12, 0), 0.0,
                                                 None, False, True, None, sinks=sinks, sink_tokens=2,
                                                 **extra(backend))
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32 and probs.numel() == 0
    check("varlen", out, lse, attention_oracle_varlen, (q, k, v, cq, ck, sinks),
          dict(causal=True, window_size=(12, 0), sink_tokens=2), dtype, rng_seed)
    assert (out[-2:] == 0).all() and (lse[:, -2:] == float("-inf")).all()


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_varlen_packed_forms(backend, dtype, rng_seed):
    lens = [7, 0, 30, 12]
    h, d = heads(backend, 4, 4)[0], 64
    cs = cu(lens)
    qkv = rand(sum(lens), 3, h, d, dtype=dtype)
    out, lse, _ = fai.flash_attn_varlen_qkvpacked_func(qkv, cs, max(lens), 0.0, None, True, (-1, -1), 0.0, None,
                                                       False, True, **extra(backend))
    q, k, v = qkv.unbind(1)
    check("varlen qkvpacked", out, lse, attention_oracle_varlen, (q, k, v, cs, cs, None), dict(causal=True), dtype,
          rng_seed)
    lk = [10, 4, 30, 1]
    ck = cu(lk)
    kv = rand(sum(lk), 2, heads(backend, 4, 2)[1], d, dtype=dtype)
    sinks = torch.randn(h)
    out, lse, _ = fai.flash_attn_varlen_kvpacked_func(q, kv, cs, ck, max(lens), max(lk), 0.0, None, False, (5, 5),
                                                      0.0, None, False, True, s_aux=sinks, **extra(backend))
    check("varlen kvpacked", out, lse, attention_oracle_varlen, (q, kv[:, 0], kv[:, 1], cs, ck, sinks),
          dict(window_size=(5, 5)), dtype, rng_seed)


# ------------------------------------------------------------------------------------------- paged KV caches

class PagedCache:
    """Sequences of the given key lengths stored in shuffled pages; dense(b) reads sequence b back."""

    def __init__(self, lens, hk, d, page_size, dtype, spare=3):
        self.lens, self.page_size = list(lens), page_size
        pages = [max(1, -(-n // page_size)) for n in self.lens]
        num_pages = sum(pages) + spare
        perm = torch.randperm(num_pages)
        self.block_table = torch.zeros(len(self.lens), max(pages), dtype=torch.int32)
        used = 0
        for b, p in enumerate(pages):
            self.block_table[b, :p] = perm[used:used + p].to(torch.int32)
            used += p
        self.k = rand(num_pages, page_size, hk, d, dtype=dtype)
        self.v = rand(num_pages, page_size, hk, d, dtype=dtype)

    def dense(self, b):
        pos = torch.arange(self.lens[b])
        page = self.block_table[b].long()[pos // self.page_size]
        return self.k[page, pos % self.page_size], self.v[page, pos % self.page_size]


def check_paged(name, out, lse, q, cache, lq, sinks, kw, dtype, seed):
    """Request b's queries are its last lq[b] positions over its cache.lens[b] keys (bottom-right)."""
    t = 0
    for b, L in enumerate(lq):
        if L:
            kb, vb = cache.dense(b)
            check(f"{name} request {b}", out[None, t:t + L], lse[None, :, t:t + L], attention_oracle,
                  (q[None, t:t + L], kb[None], vb[None], sinks), kw, dtype, seed)
        t += L
    assert (out[t:] == 0).all() and (lse[:, t:] == float("-inf")).all()


# Odd lengths: decodes beside chunked prefills, an empty request, a query run longer than a page, keys = queries.
PAGED = [(16, [1, 5, 1, 0, 17, 3, 3], [9, 40, 1, 0, 17, 100, 33]),
         (5, [2, 1, 1, 9], [2, 70, 6, 23])]


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("page_size,lq,lk", PAGED)
def test_vllm_paged_with_block_table_and_seqused_k(page_size, lq, lk, backend, dtype, rng_seed):
    """The call vLLM's FlashAttention backend makes (keywords as it writes them), into out=, in place."""
    (h, hk), d = heads(backend, 8, 2), 64
    cache = PagedCache(lk, hk, d, page_size, dtype)
    q = rand(sum(lq) + 3, h, d, dtype=dtype)  # vLLM pads the token count beyond the scheduled tokens
    output = torch.full_like(q, float("nan"))
    sinks = torch.randn(h)
    seq_lens = torch.tensor(lk, dtype=torch.int32)
    ones = torch.ones(len(lq), hk)
    res = fai.vllm_flash_attn_varlen_func(
        q=q, k=cache.k, v=cache.v, out=output, cu_seqlens_q=cu(lq), max_seqlen_q=max(lq), seqused_k=seq_lens,
        max_seqlen_k=max(lk), softmax_scale=d ** -0.5, causal=True, alibi_slopes=None, window_size=[24, 0],
        block_table=cache.block_table, softcap=0, scheduler_metadata=None, fa_version=3, q_descale=None,
        k_descale=ones, v_descale=ones, num_splits=0, s_aux=sinks, return_softmax_lse=True, **extra(backend))
    out, lse = res
    assert out is output, "out= is written in place and returned"
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    check_paged("vllm paged", out, lse, q, cache, lq, sinks, dict(causal=True, window_size=(24, 0)), dtype,
                rng_seed)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_flash_attn_28_varlen_with_block_table(backend, dtype, rng_seed):
    """flash-attn 2.8's varlen paged form: k/v are pages, cu_seqlens_k's differences are the key lengths."""
    lq, lk = [3, 1, 6], [30, 7, 6]
    (h, hk), d = heads(backend, 4, 1), 64
    cache = PagedCache(lk, hk, d, 8, dtype)
    q = rand(sum(lq), h, d, dtype=dtype)
    sinks = torch.randn(h)
    out, lse, _ = fai.flash_attn_varlen_func(q, cache.k, cache.v, cu(lq), cu(lk), max(lq), max(lk), 0.0, None, True,
                                             (-1, -1), 0.0, None, False, True, cache.block_table, sinks=sinks,
                                             **extra(backend))
    check_paged("flash-attn varlen paged", out, lse, q, cache, lq, sinks, dict(causal=True), dtype, rng_seed)


def test_vllm_contiguous_cache_with_seqused_k(rng_seed):
    """seqused_k without block_table: k/v are a (batch, capacity, nheads_k, headdim) cache."""
    lq, lk = [2, 1, 4], [10, 1, 30]
    h, hk, d, cap = 4, 2, 32, 32
    kc, vc = torch.randn(3, cap, hk, d), torch.randn(3, cap, hk, d)
    q = torch.randn(sum(lq), h, d)
    out = fai.vllm_flash_attn_varlen_func(q, kc, vc, max(lq), cu(lq), max(lk), None,
                                          torch.tensor(lk, dtype=torch.int32), causal=True)
    t = 0
    for b, L in enumerate(lq):
        check(f"contiguous request {b}", out[None, t:t + L], None, attention_oracle,
              (q[None, t:t + L], kc[b:b + 1, :lk[b]], vc[b:b + 1, :lk[b]], None), dict(causal=True), torch.float32,
              rng_seed)
        t += L


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_vllm_varlen_with_cu_seqlens_k_positional(backend, dtype, rng_seed):
    lq, lk = [4, 0, 21], [4, 5, 30]
    (h, hk), d = heads(backend, 4, 2), 64
    q = rand(sum(lq), h, d, dtype=dtype)
    k, v = rand(sum(lk), hk, d, dtype=dtype), rand(sum(lk), hk, d, dtype=dtype)
    cq, ck = cu(lq), cu(lk)
    output = torch.empty_like(q)
    sinks = torch.randn(h)
    # vLLM: flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
    #                              q_v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
    #                              deterministic, return_attn_probs, block_table, return_softmax_lse, out)
    out, lse = fai.vllm_flash_attn_varlen_func(q, k, v, max(lq), cq, max(lk), ck, None, None, 0.0, None, True,
                                               [7, 0], 0.0, None, False, False, None, True, output, s_aux=sinks,
                                               **extra(backend))
    assert out is output and lse.shape == (h, q.shape[0])
    check("vllm varlen", out, lse, attention_oracle_varlen, (q, k, v, cq, ck, sinks),
          dict(causal=True, window_size=(7, 0)), dtype, rng_seed)
    # Without return_softmax_lse: out alone.
    alone = fai.vllm_flash_attn_varlen_func(q, k, v, max(lq), cq, max(lk), ck, causal=True, window_size=[7, 0],
                                            s_aux=sinks, **extra(backend))
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)


def test_vllm_ignored_arguments_change_nothing():
    """scheduler_metadata, fa_version, cp_rank, return_attn_probs and the descales of non-FP8 inputs are
    accepted and ignored: bit-identical results, the same return form."""
    lq, lk = [1, 3], [17, 9]
    h, hk, d = 4, 2, 32
    cache = PagedCache(lk, hk, d, 4, torch.float32)
    q = torch.randn(sum(lq), h, d)
    base = dict(cu_seqlens_q=cu(lq), max_seqlen_q=3, seqused_k=torch.tensor(lk, dtype=torch.int32), max_seqlen_k=17,
                block_table=cache.block_table, causal=True, return_softmax_lse=True)
    want_out, want_lse = fai.vllm_flash_attn_varlen_func(q, cache.k, cache.v, **base)
    descale = torch.full((2, hk), 3.0)
    for extra_kw in (dict(scheduler_metadata=torch.zeros(7, dtype=torch.int32)), dict(fa_version=3),
                     dict(fa_version=4), dict(cp_rank=0), dict(return_attn_probs=True),
                     dict(q_descale=descale, k_descale=descale, v_descale=descale), dict(num_splits=3)):
        got = fai.vllm_flash_attn_varlen_func(q, cache.k, cache.v, **base, **extra_kw)
        assert isinstance(got, tuple) and len(got) == 2, extra_kw
        assert torch.equal(got[0], want_out) and torch.equal(got[1], want_lse), extra_kw


@pytest.mark.parametrize("kw,match", [
    (dict(q_v=torch.zeros(3, 4, 32)), "q_v"),
    (dict(output_scale=torch.ones(1)), "output_scale"),
    (dict(cp_world_size=2), "cp_world_size"),
    (dict(cp_tot_seqused_k=torch.ones(1, dtype=torch.int32)), "cp_tot_seqused_k"),
    (dict(mask_mod=lambda *a: True), "mask_mod"),
    (dict(block_sparse_tensors=object()), "block_sparse_tensors"),
    (dict(aux_tensors=[torch.ones(1)]), "aux_tensors"),
    (dict(dynamic_causal=torch.ones(1)), "dynamic_causal"),
    (dict(gather_kv_indices=torch.zeros(3, 128, dtype=torch.int32)), "gather_kv_indices"),
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(cu_seqlens_k=cu([3])), "exactly one"),
])
def test_vllm_unsupported_arguments_raise(kw, match):
    q = torch.randn(3, 4, 32)
    kc = torch.randn(2, 4, 4, 32)
    base = dict(max_seqlen_q=3, cu_seqlens_q=cu([3]), max_seqlen_k=5, seqused_k=torch.tensor([5], dtype=torch.int32),
                block_table=torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(SinkattnError, match=match):
        fai.vllm_flash_attn_varlen_func(q, kc, kc.clone(), **{**base, **kw})


def test_vllm_argument_combinations_raise():
    q = torch.randn(3, 4, 32)
    k = torch.randn(3, 2, 32)
    with pytest.raises(SinkattnValueError, match="exactly one"):
        fai.vllm_flash_attn_varlen_func(q, k, k, 3, cu([3]), 3)
    with pytest.raises(SinkattnValueError, match="block_table needs seqused_k"):
        fai.vllm_flash_attn_varlen_func(q, k, k, 3, cu([3]), 3, cu([3]), block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(SinkattnValueError, match="out must be"):
        fai.vllm_flash_attn_varlen_func(q, k, k, 3, cu([3]), 3, cu([3]), out=torch.empty(3, 4, 16))
    with pytest.raises(SinkattnValueError, match="contiguous cache"):
        fai.vllm_flash_attn_varlen_func(q, k, k, 3, cu([3]), 3, seqused_k=torch.tensor([3], dtype=torch.int32))


FP8_BACKENDS = [
    pytest.param("auto", torch.float32, id="reference-fp32"),
    pytest.param("sm80-emulated", torch.bfloat16, id="sm80-emulated-bf16",
                 marks=pytest.mark.skipif(not any(k["op"] == "fwd_fp8" and k["family"] == "sm80-emulated"
                                                  and k["headdim"] == 64 for k in _ext.registry()),
                                          reason="no emulated FP8-cache decode kernel in this build")),
]


@pytest.mark.parametrize("backend,dtype", FP8_BACKENDS)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_vllm_paged_over_an_fp8_cache_with_fa3_descales(fmt, backend, dtype, rng_seed):
    """The call vLLM's FlashAttention backend makes over an FP8 KV cache: k/v are the FP8 pages (x / scale), the
    descales (batch, nheads_k) as FA3 takes them (vLLM expands its layer scales to that shape), q unquantized with
    q_descale ones. Against the oracle on the dequantized cache, request by request."""
    fp8 = getattr(torch, fmt)
    lq, lk, page_size = [1, 3, 1, 0, 2], [9, 40, 1, 0, 17], 16
    (h, hk), d = heads(backend, 8, 2), 64
    cache = PagedCache(lk, hk, d, page_size, torch.float32)
    k_desc = torch.rand(len(lq), hk) * 0.02 + 0.01
    v_desc = torch.rand(len(lq), hk) * 0.02 + 0.01
    # every request writes its own pages, so each page's FP8 values hold its request's scale
    kq, vq = cache.k.to(fp8), cache.v.to(fp8)
    for b, n in enumerate(lk):
        pages = cache.block_table[b, :max(1, -(-n // page_size))].long()
        kq[pages] = (cache.k[pages] / k_desc[b][None, None, :, None]).to(fp8)
        vq[pages] = (cache.v[pages] / v_desc[b][None, None, :, None]).to(fp8)
    deq = PagedCache.__new__(PagedCache)
    deq.lens, deq.page_size, deq.block_table = cache.lens, page_size, cache.block_table
    deq.k, deq.v = kq.to(torch.float32), vq.to(torch.float32)
    for b, n in enumerate(lk):  # the oracle's keys: the FP8 values times their request's descale
        pages = cache.block_table[b, :max(1, -(-n // page_size))].long()
        deq.k[pages] = kq[pages].to(torch.float32) * k_desc[b][None, None, :, None]
        deq.v[pages] = vq[pages].to(torch.float32) * v_desc[b][None, None, :, None]
    # (kept in float32: the kernels apply the descales in fp32, so the exact dequantized values are the reference;
    #  the bf16 baseline of check() rounds them itself)
    q = rand(sum(lq) + 2, h, d, dtype=dtype)
    sinks = torch.randn(h)
    output = torch.full_like(q, float("nan"))
    out, lse = fai.vllm_flash_attn_varlen_func(
        q=q, k=kq, v=vq, out=output, cu_seqlens_q=cu(lq), max_seqlen_q=max(lq), seqused_k=torch.tensor(lk, dtype=torch.int32),
        max_seqlen_k=max(lk), softmax_scale=d ** -0.5, causal=True, window_size=[-1, -1],
        block_table=cache.block_table, softcap=0, fa_version=3, q_descale=torch.ones(len(lq), hk), k_descale=k_desc,
        v_descale=v_desc, num_splits=0, s_aux=sinks, return_softmax_lse=True, **extra(backend))
    assert out is output
    check_paged("vllm paged fp8", out, lse, q, deq, lq, sinks, dict(causal=True), dtype, rng_seed)
    # the descales are applied: the same cache read as scale 1 is far off
    wrong = fai.vllm_flash_attn_varlen_func(q, kq, vq, max(lq), cu(lq), max(lk), seqused_k=torch.tensor(lk, dtype=torch.int32),
                                            block_table=cache.block_table, causal=True, s_aux=sinks, **extra(backend))
    assert (wrong[:sum(lq)].float() - out[:sum(lq)].float()).abs().max() > 1e-2


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_vllm_fp8_inputs_outside_a_cache_raise_naming_the_fix():
    q = torch.randn(3, 4, 32)
    kc = torch.randn(2, 4, 4, 32).to(torch.float8_e4m3fn)
    paged = dict(seqused_k=torch.tensor([5], dtype=torch.int32), block_table=torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(SinkattnTypeError, match="FP8 inputs \\(q torch.float8_e4m3fn\\)"):  # FP8 q: not even over a cache
        fai.vllm_flash_attn_varlen_func(q.to(torch.float8_e4m3fn), kc, kc.clone(), 3, cu([3]), 5, **paged)
    kp = torch.randn(5, 4, 32).to(torch.float8_e4m3fn)
    with pytest.raises(SinkattnTypeError, match="Dequantize first"):  # packed FP8 keys
        fai.vllm_flash_attn_varlen_func(q, kp, kp.clone(), 3, cu([3]), 5, cu_seqlens_k=cu([5]))
    with pytest.raises(SinkattnValueError, match="q_descale other than ones"):
        fai.vllm_flash_attn_varlen_func(q, kc, kc.clone(), 3, cu([3]), 5, q_descale=torch.full((1, 4), 0.5), **paged)


# ---------------------------------------------------------------------------------------- flash_attn_with_kvcache

def rotary_tables(max_pos, rot_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_positional(paged, backend, dtype, rng_seed):
    (h, hk), (b, d, cap, sq) = heads(backend, 8, 2), (3, 64, 64, 4)
    lens = [0, 21, 57]
    dense_k, dense_v = rand(b, cap, hk, d, dtype=dtype), rand(b, cap, hk, d, dtype=dtype)
    if paged:
        cache = PagedCache([cap] * b, hk, d, 16, dtype)
        for bi in range(b):
            for p in range(cap // 16):
                cache.k[cache.block_table[bi, p]] = dense_k[bi, p * 16:(p + 1) * 16]
                cache.v[cache.block_table[bi, p]] = dense_v[bi, p * 16:(p + 1) * 16]
        k_cache, v_cache, block_table = cache.k, cache.v, cache.block_table
    else:
        k_cache, v_cache, block_table = dense_k.clone(), dense_v.clone(), None
    q = rand(b, sq, h, d, dtype=dtype)
    k_new, v_new = rand(b, sq, hk, d, dtype=dtype), rand(b, sq, hk, d, dtype=dtype)
    cos, sin = rotary_tables(cap + sq, 32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    sinks = torch.randn(h)
    # flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    #                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
    #                         rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
    out, lse = fai.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, None, None,
                                           block_table, None, True, (30, 0), 0.0, False, None, 0, True,
                                           learnable_sink=sinks, sink_tokens=2, **extra(backend))
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    for bi, n in enumerate(lens):
        pos = n + torch.arange(sq)[None]
        qb = rotary_oracle(q[bi:bi + 1], cos, sin, pos, False)
        kb = dense_k[bi, :n + sq].double().clone()
        vb = dense_v[bi, :n + sq].double().clone()
        kb[n:] = rotary_oracle(k_new[bi:bi + 1], cos, sin, pos, False)[0]
        vb[n:] = v_new[bi].double()
        check(f"kvcache[{bi}]", out[bi:bi + 1], lse[bi:bi + 1], attention_oracle, (qb, kb[None], vb[None], sinks),
              dict(causal=True, window_size=(30, 0), sink_tokens=2), dtype, rng_seed)
        # The append landed in the caller's cache, in place.
        if paged:
            page = block_table[bi].long()[(n + torch.arange(sq)) // 16]
            got_v = v_cache[page, (n + torch.arange(sq)) % 16]
        else:
            got_v = v_cache[bi, n:n + sq]
        assert torch.equal(got_v, v_new[bi])


def test_kvcache_cache_batch_idx(rng_seed):
    """Sequence b reads and appends to k_cache row cache_batch_idx[b]; other rows stay untouched."""
    rows, b, h, d, cap = 5, 3, 4, 32, 40
    kc, vc = torch.randn(rows, cap, h, d), torch.randn(rows, cap, h, d)
    k0, v0 = kc.clone(), vc.clone()
    idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    lens = torch.tensor([10, 0, 33], dtype=torch.int32)
    q, kn, vn = torch.randn(b, 2, h, d), torch.randn(b, 2, h, d), torch.randn(b, 2, h, d)
    out = fai.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    for bi in range(b):
        r, n = int(idx[bi]), int(lens[bi])
        assert torch.equal(kc[r, n:n + 2], kn[bi]) and torch.equal(vc[r, n:n + 2], vn[bi])
        check(f"cache_batch_idx[{bi}]", out[bi:bi + 1], None, attention_oracle,
              (q[bi:bi + 1], kc[r:r + 1, :n + 2], vc[r:r + 1, :n + 2], None), dict(causal=True), torch.float32,
              rng_seed)
    for r in (1, 2):
        assert torch.equal(kc[r], k0[r]) and torch.equal(vc[r], v0[r])


def test_kvcache_int_cache_seqlens_and_full_cache(rng_seed):
    b, h, d = 2, 4, 32
    kc, vc, q = torch.randn(b, 20, h, d), torch.randn(b, 20, h, d), torch.randn(b, 1, h, d)
    out = fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7)
    check("int cache_seqlens", out, None, attention_oracle, (q, kc[:, :7], vc[:, :7], None), {}, torch.float32,
          rng_seed)
    out = fai.flash_attn_with_kvcache(q, kc, vc)
    check("full cache", out, None, attention_oracle, (q, kc, vc, None), {}, torch.float32, rng_seed)


def test_kvcache_rotary_noncausal_puts_every_query_at_cache_seqlens(rng_seed):
    """flash-attn: without causal and window, all of q is rotated at position cache_seqlens (new key i at
    cache_seqlens + i)."""
    b, h, d, cap, sq = 2, 2, 32, 24, 3
    kc, vc = torch.randn(b, cap, h, d), torch.randn(b, cap, h, d)
    dense_k, dense_v = kc.clone(), vc.clone()
    q, kn, vn = torch.randn(b, sq, h, d), torch.randn(b, sq, h, d), torch.randn(b, sq, h, d)
    cos, sin = rotary_tables(cap, 16)
    lens = [4, 11]
    out = fai.flash_attn_with_kvcache(q, kc, vc, kn, vn, cos, sin, torch.tensor(lens, dtype=torch.int32),
                                      rotary_interleaved=True)
    for bi, n in enumerate(lens):
        qb = rotary_oracle(q[bi:bi + 1], cos, sin, torch.full((1, sq), n), True)
        kb = dense_k[bi, :n + sq].double().clone()
        kb[n:] = rotary_oracle(kn[bi:bi + 1], cos, sin, n + torch.arange(sq)[None], True)[0]
        vb = dense_v[bi, :n + sq].double().clone()
        vb[n:] = vn[bi].double()
        check(f"rotary non-causal[{bi}]", out[bi:bi + 1], None, attention_oracle, (qb, kb[None], vb[None], None), {},
              torch.float32, rng_seed)
        tolerance_check(f"rotated k in cache[{bi}]", kc[bi, n:n + sq], kb[n:], None, 1e-6, rng_seed)


def test_kvcache_refusals():
    q = torch.randn(2, 1, 4, 32)
    kc = torch.randn(2, 16, 4, 32)
    with pytest.raises(SinkattnValueError, match="cache_leftpad"):
        fai.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=3, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(SinkattnValueError, match="alibi_slopes"):
        fai.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=3, alibi_slopes=torch.ones(4))
    with pytest.raises(SinkattnValueError, match="cache_batch_idx and block_table"):
        fai.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=3, cache_batch_idx=torch.zeros(2, dtype=torch.int32),
                                    block_table=torch.zeros(2, 1, dtype=torch.int32))


# ------------------------------------------------------------------------------------------ dropout and ALiBi

def _calls():
    q4, kv5, qkv5 = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 2, 16), torch.randn(1, 4, 3, 2, 16)
    q3, kv4, qkv4 = torch.randn(4, 2, 16), torch.randn(4, 2, 2, 16), torch.randn(4, 3, 2, 16)
    c = cu([4])
    return {
        "flash_attn_func": lambda **kw: fai.flash_attn_func(q4, q4, q4, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: fai.flash_attn_qkvpacked_func(qkv5, **kw),
        "flash_attn_kvpacked_func": lambda **kw: fai.flash_attn_kvpacked_func(q4, kv5, **kw),
        "flash_attn_varlen_func": lambda **kw: fai.flash_attn_varlen_func(q3, q3, q3, c, c, 4, 4, **kw),
        "flash_attn_varlen_qkvpacked_func": lambda **kw: fai.flash_attn_varlen_qkvpacked_func(qkv4, c, 4, **kw),
        "flash_attn_varlen_kvpacked_func": lambda **kw: fai.flash_attn_varlen_kvpacked_func(q3, kv4, c, c, 4, 4,
                                                                                             **kw),
        "vllm_flash_attn_varlen_func": lambda **kw: fai.vllm_flash_attn_varlen_func(q3, q3, q3, 4, c, 4, c, **kw),
    }


@pytest.mark.parametrize("name", sorted(_calls()))
def test_dropout_and_alibi_raise_naming_what_to_do(name):
    call = _calls()[name]
    assert call(dropout_p=0.0) is not None  # the accepted value runs
    with pytest.raises(SinkattnValueError, match=r"dropout_p=0\.1 is not supported.*dropout_p=0\.0"):
        call(dropout_p=0.1)
    with pytest.raises(SinkattnValueError, match="alibi_slopes is not supported.*alibi_slopes=None"):
        call(alibi_slopes=torch.ones(2))


# ------------------------------------------------------------------------------------------------ transformers

def test_transformers_flash_kwargs_reach_the_drop_in(rng_seed):
    """transformers builds flash-attn's kwargs from the function's signature (its own code, run here): for
    gpt-oss's sliding layers that is causal=True, window_size=(w - 1, w - 1) and s_aux=sinks."""
    mfa = pytest.importorskip("transformers.modeling_flash_attention_utils")
    if not hasattr(mfa, "_lazy_define_process_function"):
        pytest.skip("this transformers release builds flash-attn kwargs differently")
    process = mfa._lazy_define_process_function(fai.flash_attn_func)
    b, s, h, hk, d, w = 2, 40, 8, 2, 64, 16
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    sinks = torch.randn(h)
    kw = process(query_length=s, key_length=s, is_causal=True, dropout=0.0, softmax_scale=d ** -0.5,
                 sliding_window=w, s_aux=sinks)
    assert kw["s_aux"] is sinks and tuple(kw["window_size"]) == (w - 1, w - 1) and kw["causal"] is True
    out = fai.flash_attn_func(q, k, v, **kw)
    check("transformers kwargs", out, None, attention_oracle, (q, k, v, sinks),
          dict(softmax_scale=d ** -0.5, causal=True, window_size=(w - 1, 0)), torch.float32, rng_seed)


# ------------------------------------------------------------------------------- flash-attn's lenient call forms

def _window_forms(left, right):
    import numpy as np
    return {"tuple": (left, right), "list": [left, right], "tensor": torch.tensor([left, right]),
            "int32 tensor": torch.tensor([left, right], dtype=torch.int32),
            "numpy": np.array([left, right]), "numpy scalars": (np.int64(left), np.int32(right)),
            "0-d tensors": (torch.tensor(left), torch.tensor(right))}


@pytest.mark.parametrize("form", sorted(_window_forms(0, 0)))
def test_window_size_as_any_two_element_sequence(form, rng_seed):
    """flash-attn indexes window_size, so any 2-element sequence works there (its own tests draw it as
    torch.randint(0, seqlen_k, (2,))); the drop-in takes the same forms, in every function."""
    b, sq, sk, h, d = 2, 21, 30, 2, 16
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    w = _window_forms(6, 2)[form]
    out = fai.flash_attn_func(q, k, v, window_size=w)
    check(f"flash_attn_func window {form}", out, None, attention_oracle, (q, k, v, None),
          dict(window_size=(6, 2)), torch.float32, rng_seed)
    # causal=True still sets the right edge to 0, and an edge >= seqlen_k is unbounded, whatever the form.
    out = fai.flash_attn_func(q, k, v, causal=True, window_size=_window_forms(sk, 5)[form])
    check(f"causal window {form}", out, None, attention_oracle, (q, k, v, None), dict(causal=True), torch.float32,
          rng_seed)
    lq, lk = [3, 9], [12, 9]
    qv, kv_, vv = torch.randn(sum(lq), h, d), torch.randn(sum(lk), h, d), torch.randn(sum(lk), h, d)
    out = fai.flash_attn_varlen_func(qv, kv_, vv, cu(lq), cu(lk), max(lq), max(lk), window_size=w)
    check(f"varlen window {form}", out, None, attention_oracle_varlen, (qv, kv_, vv, cu(lq), cu(lk), None),
          dict(window_size=(6, 2)), torch.float32, rng_seed)
    out = fai.vllm_flash_attn_varlen_func(qv, kv_, vv, max(lq), cu(lq), max(lk), cu(lk), window_size=w)
    check(f"vllm varlen window {form}", out, None, attention_oracle_varlen, (qv, kv_, vv, cu(lq), cu(lk), None),
          dict(window_size=(6, 2)), torch.float32, rng_seed)
    kc, vc = torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    out = fai.flash_attn_with_kvcache(q[:, :4], kc, vc, cache_seqlens=sk, window_size=w)
    check(f"kvcache window {form}", out, None, attention_oracle, (q[:, :4], kc, vc, None),
          dict(window_size=(6, 2)), torch.float32, rng_seed)


def test_window_size_as_flash_attn_tests_draw_it(rng_seed):
    b, s, h, d = 1, 40, 2, 32
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    w = torch.randint(0, s, (2,))
    out = fai.flash_attn_func(q, k, v, 0.0, None, False, w)
    check("randint window", out, None, attention_oracle, (q, k, v, None),
          dict(window_size=tuple(w.tolist())), torch.float32, rng_seed)


@pytest.mark.parametrize("bad,error,match", [
    ((1, 2, 3), SinkattnValueError, "window_size must be a pair"),
    (torch.tensor([1, 2, 3]), SinkattnValueError, "window_size must be a pair"),
    (torch.tensor([[1, 2]]), SinkattnValueError, "window_size must be a pair"),
    (5, SinkattnValueError, "window_size must be a pair"),
    ((1.5, 2), SinkattnTypeError, "two integers"),
    (torch.tensor([1.0, 2.0]), SinkattnTypeError, "two integers"),
    ((True, 2), SinkattnTypeError, "two integers"),
])
def test_window_size_refusals_name_the_form(bad, error, match):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(error, match=match):
        fai.flash_attn_func(q, q, q, window_size=bad)


def test_odd_headdim_gradients_flow_through_the_padding(rng_seed):
    """Head dim 59 (flash-attn's tests use 59 and 111): zero-padded to 64 inside, sliced back; the gradients of
    q, k, v (and sinks) are the caller's shape and match the oracle's, batched and varlen."""
    b, sq, sk, h, hk, d = 2, 13, 17, 4, 2, 59
    q = torch.randn(b, sq, h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, sk, hk, d, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    out = fai.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), sinks=sinks)
    assert out.shape == (b, sq, h, d)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v, sinks))
    ref, _ = attention_oracle(q, k, v, sinks, causal=True, window_size=(5, 0))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v, sinks))
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert a.shape == w.shape
        tolerance_check(f"d=59 {name}", a, w, None, 1e-10, rng_seed)
    lq, lk = [5, 8], [9, 8]
    qv = torch.randn(sum(lq), h, 111, dtype=torch.float64, requires_grad=True)
    kv_ = torch.randn(sum(lk), hk, 111, dtype=torch.float64, requires_grad=True)
    vv = torch.randn(sum(lk), hk, 111, dtype=torch.float64, requires_grad=True)
    out = fai.flash_attn_varlen_func(qv, kv_, vv, cu(lq), cu(lk), max(lq), max(lk), causal=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (qv, kv_, vv))
    ref, _ = attention_oracle_varlen(qv, kv_, vv, cu(lq), cu(lk), None, causal=True)
    want = torch.autograd.grad((ref * g).sum(), (qv, kv_, vv))
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        tolerance_check(f"varlen d=111 {name}", a, w, None, 1e-10, rng_seed)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_odd_headdim(paged, rng_seed):
    """flash_attn_with_kvcache with head dim 59: served (a padded copy of the cache; the appended, rotated keys
    and the values land in the caller's cache in place), the default scale of the caller's head dim."""
    b, h, hk, d, cap, sq = 2, 4, 2, 59, 48, 3
    lens = [7, 30]
    dense_k, dense_v = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
    if paged:
        cache = PagedCache([cap] * b, hk, d, 16, torch.float32)
        for bi in range(b):
            for p in range(cap // 16):
                cache.k[cache.block_table[bi, p]] = dense_k[bi, p * 16:(p + 1) * 16]
                cache.v[cache.block_table[bi, p]] = dense_v[bi, p * 16:(p + 1) * 16]
        k_cache, v_cache, block_table = cache.k, cache.v, cache.block_table
    else:
        k_cache, v_cache, block_table = dense_k.clone(), dense_v.clone(), None
    untouched = k_cache.clone()
    q, kn, vn = torch.randn(b, sq, h, d), torch.randn(b, sq, hk, d), torch.randn(b, sq, hk, d)
    cos, sin = rotary_tables(cap + sq, 32)
    sinks = torch.randn(h)
    out, lse = fai.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cos, sin, torch.tensor(lens, dtype=torch.int32),
                                           block_table=block_table, causal=True, rotary_interleaved=False,
                                           return_softmax_lse=True, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    for bi, n in enumerate(lens):
        pos = n + torch.arange(sq)[None]
        qb = rotary_oracle(q[bi:bi + 1], cos, sin, pos, False)
        kb = dense_k[bi, :n + sq].double().clone()
        vb = dense_v[bi, :n + sq].double().clone()
        kb[n:] = rotary_oracle(kn[bi:bi + 1], cos, sin, pos, False)[0]
        vb[n:] = vn[bi].double()
        check(f"kvcache d=59 [{bi}]", out[bi:bi + 1], lse[bi:bi + 1], attention_oracle,
              (qb, kb[None], vb[None], sinks), dict(causal=True), torch.float32, rng_seed)
        slots = n + torch.arange(sq)
        if paged:
            page = block_table[bi].long()[slots // 16]
            got_k, got_v = k_cache[page, slots % 16], v_cache[page, slots % 16]
        else:
            got_k, got_v = k_cache[bi, slots], v_cache[bi, slots]
        assert torch.equal(got_v, vn[bi])
        tolerance_check(f"rotated k in cache d=59 [{bi}]", got_k, kb[n:], None, 1e-6, rng_seed)
    # Only the appended slots changed.
    changed = (k_cache != untouched).flatten(2).any(-1)
    assert int(changed.sum()) == b * sq


def test_paged_varlen_forms_odd_headdim(rng_seed):
    """flash-attn 2.8's varlen paged form and vLLM's, with head dim 59: output sliced back to 59."""
    lq, lk = [3, 1, 6], [30, 7, 6]
    h, hk, d = 4, 2, 59
    cache = PagedCache(lk, hk, d, 8, torch.float32)
    q = torch.randn(sum(lq), h, d)
    sinks = torch.randn(h)
    out, lse, _ = fai.flash_attn_varlen_func(q, cache.k, cache.v, cu(lq), cu(lk), max(lq), max(lk), causal=True,
                                             return_attn_probs=True, block_table=cache.block_table, sinks=sinks)
    assert out.shape == q.shape
    check_paged("flash-attn varlen paged d=59", out, lse, q, cache, lq, sinks, dict(causal=True), torch.float32,
                rng_seed)
    output = torch.full_like(q, float("nan"))
    out, lse = fai.vllm_flash_attn_varlen_func(q, cache.k, cache.v, max(lq), cu(lq), max(lk),
                                               seqused_k=torch.tensor(lk, dtype=torch.int32), causal=True,
                                               block_table=cache.block_table, return_softmax_lse=True, out=output,
                                               s_aux=sinks)
    assert out is output
    check_paged("vllm paged d=59", out, lse, q, cache, lq, sinks, dict(causal=True), torch.float32, rng_seed)


def _forward_only_calls():
    """Each forward-only form, called with a q that requires grad (grad mode on) -> its output (and lse)."""
    lq, lk = [3, 1, 6], [30, 7, 6]
    h, hk, d = 4, 2, 32
    torch.manual_seed(1)
    cache = PagedCache(lk, hk, d, 8, torch.float32)
    qv = torch.randn(sum(lq), h, d)
    q4, kc, vc = torch.randn(2, 3, h, d), torch.randn(2, 20, hk, d), torch.randn(2, 20, hk, d)
    kn, vn = torch.randn(2, 3, hk, d), torch.randn(2, 3, hk, d)
    lens = torch.tensor([4, 9], dtype=torch.int32)
    return {
        "flash_attn_with_kvcache": lambda grad: fai.flash_attn_with_kvcache(
            q4.clone().requires_grad_(grad), kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, causal=True,
            return_softmax_lse=True),
        "flash_attn_with_kvcache (paged)": lambda grad: fai.flash_attn_with_kvcache(
            q4[:1].clone().requires_grad_(grad), cache.k.clone(), cache.v.clone(), cache_seqlens=lens[:1],
            block_table=cache.block_table[:1], causal=True, return_softmax_lse=True),
        "flash_attn_varlen_func (block_table)": lambda grad: fai.flash_attn_varlen_func(
            qv.clone().requires_grad_(grad), cache.k, cache.v, cu(lq), cu(lk), max(lq), max(lk), causal=True,
            return_attn_probs=True, block_table=cache.block_table)[:2],
        "vllm_flash_attn_varlen_func (paged)": lambda grad: fai.vllm_flash_attn_varlen_func(
            qv.clone().requires_grad_(grad), cache.k, cache.v, max(lq), cu(lq), max(lk),
            seqused_k=torch.tensor(lk, dtype=torch.int32), block_table=cache.block_table, causal=True,
            return_softmax_lse=True),
    }


@pytest.mark.parametrize("name", sorted(_forward_only_calls()))
def test_forward_only_forms_run_with_a_grad_requiring_q_and_refuse_backward(name):
    """flash-attn runs these forwards when q requires grad (only a backward fails: there is none); the drop-in
    returns the same values as without grad, and a backward through them raises a sinkattn error saying why."""
    call = _forward_only_calls()[name]
    with torch.no_grad():
        want = call(False)
    got = call(True)
    for g, w in zip(got, want):
        assert g.requires_grad and torch.equal(g, w)
    with pytest.raises(SinkattnError, match=r"has no backward: the KV-cache and paged forms are forward-only.*"
                                            r"flash_attn_func or flash_attn_varlen_func without block_table"):
        got[0].sum().backward()
    with pytest.raises(SinkattnError, match="has no backward"):  # the lse too
        got[1].sum().backward()


def test_vllm_paged_with_out_under_grad_runs_and_writes_out():
    lq, lk = [2, 5], [9, 5]
    cache = PagedCache(lk, 2, 32, 4, torch.float32)
    q = torch.randn(sum(lq), 4, 32, requires_grad=True)
    out = torch.empty(sum(lq), 4, 32)
    res = fai.vllm_flash_attn_varlen_func(q, cache.k, cache.v, max(lq), cu(lq), max(lk),
                                          seqused_k=torch.tensor(lk, dtype=torch.int32),
                                          block_table=cache.block_table, causal=True, out=out)
    assert res is out
    with torch.no_grad():
        want = fai.vllm_flash_attn_varlen_func(q, cache.k, cache.v, max(lq), cu(lq), max(lk),
                                               seqused_k=torch.tensor(lk, dtype=torch.int32),
                                               block_table=cache.block_table, causal=True)
    assert torch.equal(out, want)


# vLLM 0.33's vllm/vllm_flash_attn/flash_attn_interface.py get_scheduler_metadata: parameters and defaults.
VLLM_SCHEDULER_METADATA = (
    "batch_size max_seqlen_q max_seqlen_k num_heads_q num_heads_kv headdim cache_seqlens qkv_dtype headdim_v "
    "cu_seqlens_q cu_seqlens_k_new cache_leftpad page_size max_seqlen_k_new causal window_size has_softcap "
    "num_splits pack_gqa sm_margin",
    (torch.bfloat16, None, None, None, None, None, 0, False, (-1, -1), False, 0, None, 0))


def test_get_scheduler_metadata_has_vllms_signature_and_returns_none():
    params = list(inspect.signature(fai.get_scheduler_metadata).parameters.values())
    names, defaults = VLLM_SCHEDULER_METADATA
    assert [p.name for p in params] == names.split()
    assert tuple(p.default for p in params if p.default is not p.empty) == defaults
    # As vLLM's FlashAttention backend calls it (keywords as it writes them).
    seqlens = torch.tensor([9, 5], dtype=torch.int32)
    assert fai.get_scheduler_metadata(
        batch_size=2, max_seqlen_q=5, max_seqlen_k=9, num_heads_q=4, num_heads_kv=2, headdim=32,
        cache_seqlens=seqlens, qkv_dtype=torch.bfloat16, cu_seqlens_q=cu([2, 5]), page_size=16, causal=True,
        window_size=(-1, -1), num_splits=0) is None
    assert "get_scheduler_metadata" in fai.__all__


def test_scheduler_metadata_is_accepted_and_changes_nothing(rng_seed):
    b, h, d = 2, 4, 32
    kc, vc, q = torch.randn(b, 20, h, d), torch.randn(b, 20, h, d), torch.randn(b, 2, h, d)
    lens = torch.tensor([7, 18], dtype=torch.int32)
    meta = fai.get_scheduler_metadata(b, 2, 20, h, h, d, lens)
    plain = fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    for m in (meta, torch.zeros(8, dtype=torch.int32)):  # vLLM's FA3 passes its own int32 schedule tensor
        got = fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, scheduler_metadata=m)
        assert torch.equal(got, plain)
    for bi in range(b):
        n = int(lens[bi])
        check(f"scheduler_metadata [{bi}]", plain[bi:bi + 1], None, attention_oracle,
              (q[bi:bi + 1], kc[bi:bi + 1, :n], vc[bi:bi + 1, :n], None), dict(causal=True), torch.float32,
              rng_seed)
