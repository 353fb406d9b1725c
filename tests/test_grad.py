"""Gradients of the reference backward (dq, dk, dv, dsinks, and through a returned lse) against
autograd on the oracle; gradcheck in float64; determinism."""
import pytest
import torch

import sinkattn
from sinkattn import reference
from oracle import attention_oracle, tolerance_check
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(reference, "KEY_TILE", 16)
    monkeypatch.setattr(reference, "ROW_CHUNK", 12)


def leaves(b, sq, sk, h, hk, d, dtype, sinks="random"):
    q = torch.randn(b, sq, h, d).to(dtype).requires_grad_()
    k = torch.randn(b, sk, hk, d).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hk, d).to(dtype).requires_grad_()
    s = None
    if sinks is not None:
        s = torch.randn(h) * 2
        if sinks == "mixed":
            s[0], s[-1] = float("-inf"), 30.0
        s = s.to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
    return q, k, v, s


GRAD_CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(7, 0), sink_tokens=2),
    dict(window_size=(3, 4), softcap=3.0),
    dict(causal=True, sq=50, sk=20),            # rows with no visible key
    dict(sinks="mixed", causal=True, window_size=(5, 0)),
    dict(sinks=None, window_size=(10, -1), sink_tokens=30),
    dict(h=8, hk=1, sq=1, sk=45, causal=True),   # decode-shaped, MQA
    dict(d=80, h=4, hk=4, softcap=1.5, sq=31, sk=31, causal=True),
]


def _run(case, dtype, with_lse, seed):
    c = dict(b=2, sq=37, sk=41, h=8, hk=2, d=32, sinks="random")
    c.update(case)
    kw = {k: c.pop(k) for k in list(c) if k in ("causal", "window_size", "sink_tokens", "softcap")}
    q, k, v, s = leaves(c["b"], c["sq"], c["sk"], c["h"], c["hk"], c["d"], dtype, c["sinks"])
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, **kw, return_lse=True)
    gout = torch.randn_like(out)
    glse = torch.randn_like(lse) if with_lse else torch.zeros_like(lse)
    inputs = [t for t in (q, k, v, s) if t is not None]
    got = torch.autograd.grad((out.double() * gout.double()).sum() + (lse.double() * glse.double()).sum(), inputs)
    ref_out, ref_lse = attention_oracle(q, k, v, s, **kw)
    # A -inf or +inf lse row contributes no gradient; keep inf*0 from turning into NaN in the oracle's loss.
    lse_term = torch.where(torch.isfinite(ref_lse), ref_lse * glse.double(), torch.zeros_like(ref_lse))
    want = torch.autograd.grad((ref_out * gout.double()).sum() + lse_term.sum(), inputs)
    base = [None] * len(inputs)
    if dtype not in (torch.float32, torch.float64):
        b_out, b_lse = attention_oracle(q, k, v, s, **kw, compute_dtype=dtype)
        b_term = torch.where(torch.isfinite(b_lse), b_lse * glse.to(dtype), torch.zeros_like(b_lse))
        base = torch.autograd.grad((b_out * gout).sum() + b_term.sum(), inputs)
    atol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 1e-2)
    for name, a, w, bl in zip(["dq", "dk", "dv", "dsinks"], got, want, base):
        assert a.dtype == (dtype if name != "dsinks" else s.dtype) and a.shape == w.shape
        tolerance_check(name, a, w, bl, atol, seed)
    return got, s


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "base")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grads_vs_oracle(case, dtype, rng_seed):
    _run(case, dtype, with_lse=True, seed=rng_seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads(dtype, rng_seed):
    _run(dict(causal=True, window_size=(9, 0), sink_tokens=1), dtype, with_lse=True, seed=rng_seed)


def test_minus_inf_sink_has_zero_grad(rng_seed):
    got, s = _run(dict(sinks="mixed", causal=True), torch.float32, with_lse=True, seed=rng_seed)
    assert got[3][0].item() == 0.0


def test_dsinks_closed_form(rng_seed):
    """dsinks[h] = sum_i p_i (dlse_i - D_i), p_i = exp(sink - lse_i), D_i = dO_i . out_i (docs/DESIGN.md 1)."""
    q, k, v, s = leaves(2, 20, 25, 4, 4, 16, torch.float64)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, return_lse=True)
    gout, glse = torch.randn_like(out), torch.randn_like(lse)
    (ds,) = torch.autograd.grad((out * gout).sum() + (lse * glse).sum(), (s,))
    p = torch.exp(s.view(1, -1, 1) - lse)
    D = (gout * out).sum(-1).transpose(1, 2)
    tolerance_check("dsinks", ds, (p * (glse - D)).sum((0, 2)), None, 1e-12, rng_seed)


def test_only_lse_used(rng_seed):
    q, k, v, s = leaves(1, 9, 9, 2, 1, 16, torch.float64)
    _, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, return_lse=True)
    got = torch.autograd.grad(lse.sum(), (q, k, s))
    _, ref_lse = attention_oracle(q, k, v, s, causal=True)
    want = torch.autograd.grad(ref_lse.sum(), (q, k, s))
    for name, a, w in zip(["dq", "dk", "dsinks"], got, want):
        tolerance_check(name, a, w, None, 1e-10, rng_seed)


def test_no_grad_to_sinks_without_sinks(rng_seed):
    q, k, v, _ = leaves(1, 5, 5, 2, 2, 16, torch.float32, sinks=None)
    s = torch.randn(2)  # no requires_grad
    out = sinkattn.flash_attn_with_sinks(q, k, v, s)
    out.sum().backward()
    assert q.grad is not None and s.grad is None


GRADCHECK_CASES = [
    dict(),
    dict(causal=True, window_size=(2, 0), sink_tokens=1, softcap=2.0),
    dict(window_size=(1, 2), sq=7, sk=4),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=["plain", "causal-window-sinktok-softcap", "window-sq>sk"])
def test_gradcheck_float64(case, rng_seed):
    c = dict(sq=5, sk=6)
    c.update(case)
    sq, sk = c.pop("sq"), c.pop("sk")
    q, k, v, s = leaves(1, sq, sk, 4, 2, 8, torch.float64)

    def f(q, k, v, s):
        out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, **c, return_lse=True)
        # gradcheck needs finite outputs: empty rows have lse = sink, which is finite here.
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, s), eps=1e-6, atol=1e-6)


def test_gradcheck_varlen_float64(rng_seed):
    cq = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    ck = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q = torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(11, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(11, 1, 8, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, s):
        return sinkattn.flash_attn_varlen_with_sinks(q, k, v, cq, ck, 4, 5, s, causal=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, s), eps=1e-6, atol=1e-6)


def test_backward_is_deterministic(rng_seed):
    q, k, v, s = leaves(2, 60, 70, 8, 2, 32, torch.bfloat16)
    gout = torch.randn(2, 60, 8, 32).to(torch.bfloat16)
    runs = []
    for _ in range(2):
        out = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, window_size=(20, 0), deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v, s), gout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---- every public op: a backward, or a sinkattn error at call time that names what to use for training -------
# (flash_attn_with_kvcache returned an output with requires_grad=True whose .backward() died inside
# torch's "please use register_autograd" message). A public callable added to sinkattn.__all__ must be sorted here.
DIFFERENTIABLE = {"flash_attn_with_sinks", "flash_attn_varlen_with_sinks", "merge_attn_states"}
INFERENCE_ONLY = {"flash_attn_with_kvcache", "SinkKVCache"}
NOT_OPS = {"capabilities", "sm80_smem_limit", "get_sm80_smem_limit", "ReferenceFallbackWarning", "SinkattnError",
           "SinkattnValueError", "SinkattnTypeError", "SinkattnRuntimeError"}


def test_every_public_callable_is_sorted():
    public = {n for n in sinkattn.__all__ if callable(getattr(sinkattn, n))}
    assert public == DIFFERENTIABLE | INFERENCE_ONLY | NOT_OPS, (
        "sort each public callable into DIFFERENTIABLE (with a gradient test below), INFERENCE_ONLY (with a "
        "call-time refusal test) or NOT_OPS")


def test_differentiable_public_ops_have_a_backward(rng_seed):
    """One gradient through each differentiable public op, against the oracle (float64)."""
    q, k, v, s = leaves(2, 5, 7, 4, 2, 16, torch.float64)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, s, causal=True, return_lse=True)
    got = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, s))
    ref, ref_lse = attention_oracle(q, k, v, s, causal=True)
    for name, a, w in zip(["dq", "dk", "dv", "dsinks"], got, torch.autograd.grad(ref.sum() + ref_lse.sum(),
                                                                                 (q, k, v, s))):
        tolerance_check(f"flash_attn_with_sinks {name}", a, w, None, 1e-9, rng_seed)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cuk = torch.tensor([0, 7, 14], dtype=torch.int32)
    qp, kp, vp = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
    out = sinkattn.flash_attn_varlen_with_sinks(qp, kp, vp, cu, cuk, 5, 7, s, causal=True)
    got = torch.autograd.grad(out.sum(), (qp, kp, vp, s))
    ref, _ = attention_oracle(q, k, v, s, causal=True)
    want = torch.autograd.grad(ref.sum(), (q, k, v, s))
    for name, a, w in zip(["dq", "dk", "dv", "dsinks"], got, want):
        tolerance_check(f"flash_attn_varlen_with_sinks {name}", a.view_as(w), w, None, 1e-9, rng_seed)
    oa, ob = torch.randn(2, 3, 4, 8, requires_grad=True), torch.randn(2, 3, 4, 8, requires_grad=True)
    la, lb = torch.randn(2, 4, 3, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True)
    ms = torch.randn(4, requires_grad=True)
    out, lse = sinkattn.merge_attn_states(oa, la, ob, lb, ms)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (oa, la, ob, lb, ms))


@pytest.mark.parametrize("needs_grad", ["q", "k_cache", "sinks", "k"])
def test_kvcache_refuses_inputs_that_need_grad(needs_grad):
    """flash_attn_with_kvcache has no backward: with grad mode on and an input requiring grad it raises at call
    time (naming the input and the differentiable ops), and writes nothing; under no_grad it runs."""
    t = dict(q=torch.randn(1, 1, 4, 16), k_cache=torch.randn(1, 8, 2, 16), v_cache=torch.randn(1, 8, 2, 16),
             sinks=torch.randn(4), k=torch.randn(1, 1, 2, 16), v=torch.randn(1, 1, 2, 16))
    t[needs_grad].requires_grad_()
    before = t["k_cache"].detach().clone()
    with pytest.raises(sinkattn.SinkattnRuntimeError, match=f"no backward.*{needs_grad} requires grad.*no_grad.*"
                                                            f"flash_attn_with_sinks.*flash_attn_varlen_with_sinks"):
        sinkattn.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["sinks"], k=t["k"], v=t["v"],
                                         cache_seqlens=3)
    assert torch.equal(t["k_cache"].detach(), before)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out = sinkattn.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["sinks"], k=t["k"],
                                                   v=t["v"], cache_seqlens=3)
        assert out.shape == (1, 1, 4, 16) and not out.requires_grad


def test_sink_kv_cache_refuses_inputs_that_need_grad():
    """SinkKVCache.attend runs on flash_attn_with_kvcache: the same call-time refusal."""
    cache = sinkattn.SinkKVCache(8, 2, num_layers=1, batch_size=1, num_kv_heads=2, head_dim=16)
    q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    sinks = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(sinkattn.SinkattnRuntimeError, match="no backward.*flash_attn_with_sinks"):
        cache.attend(0, q, k, v, sinks)
    with torch.no_grad():
        assert cache.attend(0, q, k, v, sinks).shape == (1, 1, 4, 16)
