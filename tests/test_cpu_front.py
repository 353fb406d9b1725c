"""The C++ front end of flash_attn_with_sinks's CPU good case (csrc/cpu_front.cpp, sinkattn.interface._CPU_FRONT).

It must serve exactly what the Python path would serve with the same fused kernel, with the same results, and
decline (None) everything else so the Python path serves it or raises its worded error. Every served case is
checked against the float64 oracle and against the Python path; every declined case is called directly and must
answer None; the public calls that decline must still give the Python path's answer or error.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import sinkattn
from sinkattn import _checks, _ext, interface, layout, reference
from sinkattn.errors import SinkattnError
from oracle import attention_oracle, single_thread  # noqa: F401

pytestmark = pytest.mark.needs_ext
FRONT = getattr(_ext._C, "cpu_fwd", None)
if _ext._C is not None and FRONT is None:  # a stale build from before the front end: say so, do not pass silently
    pytest.fail("sinkattn._C has no cpu_fwd: rebuild the extension (pip install --no-build-isolation -e .)",
                pytrace=False)

SRC = Path(__file__).resolve().parents[1] / "csrc" / "cpu_front.cpp"
DEFAULTS = dict(sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1), sink_tokens=0,
                softcap=0.0, return_lse=False, deterministic=False, backend="auto")


def front(q, k, v, **kw):
    """The front end called as interface.flash_attn_with_sinks calls it: the default scale resolved by its owner."""
    a = {**DEFAULTS, **kw}
    given = a["softmax_scale"]
    scale = given if given is not None or not isinstance(q, torch.Tensor) else _checks.default_scale(q.shape[-1])
    return FRONT(q, k, v, a["sinks"], scale, a["causal"], a["window_size"], a["sink_tokens"], a["softcap"],
                 a["return_lse"], a["deterministic"], a["backend"])


def qkv(b=2, sq=5, sk=7, h=3, d=64, dtype=torch.float32, hk=None):
    hk = h if hk is None else hk
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def python_path(monkeypatch, *args, **kw):
    monkeypatch.setattr(interface, "_CPU_FRONT", None)
    try:
        return sinkattn.flash_attn_with_sinks(*args, **kw)
    finally:
        monkeypatch.undo()


def test_constants_agree_with_the_python_layers():
    text = SRC.read_text()
    consts = {name: int(val) for name, val in re.findall(r"constexpr int64_t (k\w+) = (\d+);", text)}
    assert consts == {"kDirectMaxRows": reference.DIRECT_MAX_ROWS, "kHeaddimMax": layout.HEADDIM_MAX,
                      "kHeaddimMultiple": layout.HEADDIM_MULTIPLE}


SERVED = [
    dict(),
    dict(causal=True),
    dict(window_size=(-1, 0)),                      # causal by its window
    dict(causal=True, window_size=(-1, 0), sink_tokens=4),  # sink tokens change nothing without a left edge
    dict(softmax_scale=0.3),
    dict(softmax_scale=2),                           # an int scale, as the checks accept
    dict(return_lse=True),
    dict(causal=True, return_lse=True),
    dict(backend="reference"),
    dict(deterministic=True),
]
SINKS = [None, 0.0, -math.inf, 30.0, math.inf, "random"]


@pytest.mark.parametrize("kw", SERVED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("sink", SINKS, ids=str)
@pytest.mark.parametrize("shape", [(1, 16, 16, 4, 64), (2, 5, 5, 3, 32), (3, 1, 1, 2, 8), (1, 3, 3, 1, 256),
                                   (2, 4, 9, 2, 128)], ids=lambda s: "b%d-sq%d-sk%d-h%d-d%d" % s)
def test_served_cases_match_the_oracle_and_the_python_path(monkeypatch, kw, sink, shape):
    b, sq, sk, h, d = shape
    if kw.get("causal") or kw.get("window_size") == (-1, 0):
        sk = sq  # causal is served over a square only (below: the non-square case declines)
    q, k, v = qkv(b, sq, sk, h, d)
    sinks = None if sink is None else (torch.randn(h) * 2 if sink == "random" else torch.full((h,), sink))
    call = {**kw, "sinks": sinks}
    got = front(q, k, v, **call)
    assert got is not None, "the front end declined a case it serves"
    out, lse = got if kw.get("return_lse") else (got, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    causal = bool(kw.get("causal")) or kw.get("window_size") == (-1, 0)
    ref_out, ref_lse = attention_oracle(q, k, v, sinks, softmax_scale=kw.get("softmax_scale"), causal=causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    py_ = python_path(monkeypatch, q, k, v, **call)
    py_out, py_lse = py_ if kw.get("return_lse") else (py_, None)
    torch.testing.assert_close(out, py_out, atol=1e-6, rtol=1e-5)
    if lse is not None:
        assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse, py_lse, atol=1e-6, rtol=1e-6)


def test_s_aux_takes_the_python_path_with_the_same_answer(monkeypatch):
    """The alias rule has one owner (_checks.resolve_sinks): a call with s_aux never reaches the front end, and gives
    what the front end gives for sinks=."""
    calls = []
    monkeypatch.setattr(interface, "_CPU_FRONT", lambda *a: calls.append(a) or FRONT(*a))
    q, k, v = qkv()
    sinks = torch.randn(3)
    a = sinkattn.flash_attn_with_sinks(q, k, v, sinks)
    assert len(calls) == 1
    b = sinkattn.flash_attn_with_sinks(q, k, v, s_aux=sinks)
    assert len(calls) == 1
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(a, sinkattn.flash_attn_with_sinks(q, k, v))


def test_a_scale_left_to_the_front_end_declines():
    """The default scale has one owner (_checks.default_scale): the caller resolves it; None here is declined."""
    q, k, v = qkv()
    assert FRONT(q, k, v, None, None, False, (-1, -1), 0, 0.0, False, False, "auto") is None
    assert FRONT(q, k, v, None, 0.125, False, (-1, -1), 0, 0.0, False, False, "auto") is not None


def test_the_public_call_goes_through_the_front_end(monkeypatch):
    calls = []

    def counting(*args):
        calls.append(args)
        return FRONT(*args)

    monkeypatch.setattr(interface, "_CPU_FRONT", counting)
    q, k, v = qkv(1, 16, 16, 4, 64)
    out = sinkattn.flash_attn_with_sinks(q, k, v, torch.zeros(4), causal=True)
    assert len(calls) == 1 and out.shape == q.shape
    # a call it declines is served by the Python path with the oracle's answer (GQA here)
    q, k, v = qkv(1, 4, 6, 4, 64, hk=2)
    out = sinkattn.flash_attn_with_sinks(q, k, v)
    assert len(calls) == 2
    torch.testing.assert_close(out.double(), attention_oracle(q, k, v)[0], atol=2e-5, rtol=1e-4)


class _Sub(torch.Tensor):
    pass


def _declined():
    q, k, v = qkv()
    sq = qkv(sq=7)
    cases = {
        "gqa": (qkv(hk=1), {}),
        "17 rows": (qkv(sq=17, sk=17), {}),
        "left window": ((q, k, v), dict(window_size=(3, 0))),
        "right window": ((q, k, v), dict(window_size=(-1, 2))),
        "causal non-square": ((q, k, v), dict(causal=True)),
        "softcap": ((q, k, v), dict(softcap=5.0)),
        "negative softcap": ((q, k, v), dict(softcap=-1.0)),
        "bf16": (qkv(dtype=torch.bfloat16), {}),
        "fp16": (qkv(dtype=torch.float16), {}),
        "fp64": (qkv(dtype=torch.float64), {}),
        "mixed dtypes": ((q, k.double(), v), {}),
        "bf16 sinks": ((q, k, v), dict(sinks=torch.zeros(3, dtype=torch.bfloat16))),
        "sinks wrong shape": ((q, k, v), dict(sinks=torch.zeros(4))),
        "sinks 2-D": ((q, k, v), dict(sinks=torch.zeros(1, 3))),
        "causal int": ((q, k, v), dict(causal=1)),
        "return_lse str": ((q, k, v), dict(return_lse="yes")),
        "deterministic None": ((q, k, v), dict(deterministic=None)),
        "scale nan": ((q, k, v), dict(softmax_scale=float("nan"))),
        "scale inf": ((q, k, v), dict(softmax_scale=float("inf"))),
        "scale bool": ((q, k, v), dict(softmax_scale=True)),
        "scale tensor": ((q, k, v), dict(softmax_scale=torch.tensor(0.5))),
        "window 3 items": ((q, k, v), dict(window_size=(-1, -1, 0))),
        "window floats": ((q, k, v), dict(window_size=(-1.0, -1))),
        "sink_tokens negative": ((q, k, v), dict(sink_tokens=-1)),
        "sink_tokens bool": ((q, k, v), dict(sink_tokens=True)),
        "backend sm80": ((q, k, v), dict(backend="sm80")),
        "backend bad": ((q, k, v), dict(backend="cuda")),
        "3-D q": ((q[0], k, v), {}),
        "k seqlen != v": ((q, k, v[:, :5]), {}),
        "batch differs": ((q, k[:1], v[:1]), {}),
        "head dim differs": ((q, k[..., :32], v[..., :32]), {}),
        "head dim 12": (qkv(d=12), {}),
        "head dim 264": (qkv(d=264), {}),
        "zero heads": (qkv(h=0), {}),
        "zero head dim": (qkv(d=0), {}),
        "empty queries": (qkv(sq=0), {}),
        "empty keys": (qkv(sk=0), {}),
        "empty batch": (qkv(b=0), {}),
        "strided last dim": ((q[..., ::2], k[..., ::2], v[..., ::2]), {}),
        "subclass": ((q.as_subclass(_Sub), k, v), {}),
        "not a tensor": ((q.tolist(), k, v), {}),
        "sq 7 causal over 7 keys, but left window": ((sq[0], sq[1], sq[2]), dict(causal=True, window_size=(2, 0))),
    }
    return cases


@pytest.mark.parametrize("name", list(_declined()))
def test_declines_what_it_does_not_serve(name):
    (q, k, v), kw = _declined()[name]
    assert front(q, k, v, **kw) is None


def test_declines_under_autograd_and_serves_without_it():
    q, k, v = qkv()
    for name in ("q", "k", "v", "sinks"):
        args = {"q": q, "k": k, "v": v, "sinks": torch.zeros(3)}
        args[name] = args[name].clone().requires_grad_()
        assert front(args["q"], args["k"], args["v"], sinks=args["sinks"]) is None, name
        with torch.no_grad():
            assert front(args["q"], args["k"], args["v"], sinks=args["sinks"]) is not None, name
    # and the public call still differentiates (the Python path's autograd op)
    qq, sinks = q.clone().requires_grad_(), torch.zeros(3, requires_grad=True)
    sinkattn.flash_attn_with_sinks(qq, k, v, sinks).sum().backward()
    assert qq.grad is not None and sinks.grad is not None and torch.isfinite(qq.grad).all()


def test_declines_under_modes_and_transforms():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = qkv()

    class FnMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class DispMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with FnMode():
        assert front(q, k, v) is None
    with DispMode():
        assert front(q, k, v) is None
    seen = []

    def one(qi):
        seen.append(front(qi[None], k[:1], v[:1]))
        return qi

    torch.vmap(one)(q)
    assert seen == [None]
    assert front(q, k, v) is not None  # and outside them it serves


def test_hidden_non_finite_keys_go_to_the_exact_path():
    """Causal on the fused kernel hides keys by masking their scores: a hidden inf/NaN in K or V may turn a row that
    does not see it NaN. The front end checks every row after the kernel and declines a call with a non-finite
    row; then the Python path's exact tiled path serves it. Rows that do not see the poisoned key must come out as
    the oracle's, finite, whichever path served them."""
    q, k, v = qkv(1, 6, 6, 2, 32)
    for poison in ("k", "v"):
        for value in (float("inf"), float("-inf"), float("nan")):
            kk, vv = k.clone(), v.clone()
            (kk if poison == "k" else vv)[0, 5, 0, 3] = value  # key 5: only the last query row sees it
            served = front(q, kk, vv, causal=True)
            out = sinkattn.flash_attn_with_sinks(q, kk, vv, causal=True)
            ref, _ = attention_oracle(q[:, :5], kk[:, :5], vv[:, :5], causal=True)
            for got in (out,) if served is None else (out, served):
                assert torch.isfinite(got[0, :5]).all(), (poison, value)
                torch.testing.assert_close(got[:, :5].double(), ref, atol=2e-5, rtol=1e-4)
            if served is not None:
                assert torch.isfinite(served).all(), "served a non-finite row"
    # a visible NaN in V makes the last row NaN: the front end declines, the Python path gives the NaN row
    vv = v.clone()
    vv[0, 5, 0, 3] = float("nan")
    assert front(q, k, vv, causal=True) is None
    assert torch.isnan(sinkattn.flash_attn_with_sinks(q, k, vv, causal=True)[0, 5, 0, 3])


def test_public_errors_still_come_from_the_checks():
    q, k, v = qkv()
    with pytest.raises(SinkattnError, match="causal must be a bool"):
        sinkattn.flash_attn_with_sinks(q, k, v, causal=1)
    with pytest.raises(SinkattnError, match="sinks= and s_aux= were both given"):
        sinkattn.flash_attn_with_sinks(q, k, v, torch.zeros(3), s_aux=torch.zeros(3))
    with pytest.raises(SinkattnError, match="sinks has shape"):
        sinkattn.flash_attn_with_sinks(q, k, v, torch.zeros(4))
    with pytest.raises(SinkattnError, match="softmax_scale is nan"):
        sinkattn.flash_attn_with_sinks(q, k, v, softmax_scale=float("nan"))


def test_outputs_are_fresh_each_call():
    q, k, v = qkv()
    a = front(q, k, v, sinks=torch.zeros(3))
    b = front(q, k, v, sinks=torch.zeros(3))
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    for t in (q, k, v):
        assert t.data_ptr() not in (a.data_ptr(), b.data_ptr())
