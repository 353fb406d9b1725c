"""Backend choice (DESIGN.md section 2) without a GPU: the device's capability and the kernels'
answers are faked, so every branch of "auto", forcing, the fallback warning and the kernel extension
points runs on the CPU."""
import dataclasses
import warnings

import pytest
import torch

import sinkattn
from sinkattn import _kernels, dispatch
from sinkattn._problem import Problem
from sinkattn.errors import SinkattnRuntimeError
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

CUDA_PROBLEM = Problem(kind="fwd", device_type="cuda", dtype=torch.bfloat16, headdim=128, headdim_v=128, nheads=8,
                       nheads_k=8, window_left=-1, window_right=0, sink_tokens=0, softcap=0.0, has_sinks=True,
                       varlen=False, device_index=0)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be a GPU of a given capability whose kernels serve what `served` lists."""
    monkeypatch.setattr(dispatch, "_warned", set())
    state = {"cap": (9, 0), "served": set()}
    monkeypatch.setattr(dispatch, "_capability", lambda index: state["cap"])
    monkeypatch.setattr(_kernels, "why_not", lambda backend, problem, capability=None:
                        None if backend in state["served"] else f"{backend} is not built for this test")
    return state


def test_auto_prefers_sm90_on_hopper(gpu):
    gpu["served"] = {"sm90", "sm80"}
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm90"


def test_auto_uses_sm80_when_sm90_cannot(gpu):
    gpu["served"] = {"sm80"}
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm80"


def test_auto_on_ampere_and_ada(gpu):
    gpu["served"] = {"sm90", "sm80"}
    for cap in [(8, 0), (8, 6), (8, 9)]:
        gpu["cap"] = cap
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm80"


def test_auto_falls_back_with_one_warning_per_reason(gpu):
    gpu["cap"] = (8, 6)
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="sm80 is not built for this test"):
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"  # same reason: silent
    gpu["cap"] = (7, 5)
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="7.5"):
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"


def test_forced_backend_that_cannot_serve_says_why_and_what_would(gpu):
    gpu["cap"] = (8, 6)
    gpu["served"] = {"sm80"}
    with pytest.raises(SinkattnRuntimeError) as info:
        dispatch.choose(CUDA_PROBLEM, "sm90")
    msg = str(info.value)
    assert "sm90 is not built" in msg and "backend='sm80'" in msg and "reference" in msg
    assert dispatch.choose(CUDA_PROBLEM, "sm80") == "sm80"
    assert dispatch.choose(CUDA_PROBLEM, "reference") == "reference"


def test_cpu_auto_is_reference_and_silent():
    q = torch.randn(1, 4, 2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sinkattn.flash_attn_with_sinks(q, q, q)
    problem = dataclasses.replace(CUDA_PROBLEM, device_type="cpu", device_index=None)
    assert dispatch.choose(problem, "auto") == "reference"


def test_emulated_is_never_auto_and_cpu_only(gpu):
    gpu["served"] = {"sm80-emulated"}
    problem = dataclasses.replace(CUDA_PROBLEM, device_type="cpu", device_index=None)
    assert dispatch.choose(problem, "auto") == "reference"
    assert dispatch.choose(problem, "sm80-emulated") == "sm80-emulated"
    with pytest.raises(SinkattnRuntimeError, match="CPU tensors only"):
        dispatch.choose(CUDA_PROBLEM, "sm80-emulated")


def test_backward_of_a_forced_kernel_falls_back_with_warning(gpu):
    gpu["cap"] = (8, 0)
    gpu["served"] = {"sm80"}
    bwd = dataclasses.replace(CUDA_PROBLEM, kind="bwd")
    if not hasattr(_kernels, "backward"):
        with pytest.warns(sinkattn.ReferenceFallbackWarning, match="backward"):
            assert dispatch.choose_backward(bwd, "sm80") == "reference"


def test_kernel_extension_points_are_called(gpu, monkeypatch):
    """Forward and backward reach _kernels.forward / _kernels.backward with preallocated outputs."""
    gpu["served"] = {"sm80-emulated"}
    calls = {}

    def fake_forward(backend, q, k, v, sinks, out, lse, **kw):
        calls["fwd"] = (backend, out.shape, out.dtype, lse.shape, lse.dtype, kw)
        out.fill_(1.0)
        lse.fill_(2.0)

    def fake_backward(backend, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, **kw):
        calls["bwd"] = (backend, dlse is None, kw["deterministic"])
        for t in (dq, dk, dv, dsinks):
            t.fill_(3.0)

    monkeypatch.setattr(_kernels, "forward", fake_forward)
    monkeypatch.setattr(_kernels, "backward", fake_backward, raising=False)
    q = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    s = torch.zeros(4, requires_grad=True)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, k, s, causal=True, window_size=(3, 0), return_lse=True,
                                              deterministic=True, backend="sm80-emulated")
    backend, oshape, odtype, lshape, ldtype, kw = calls["fwd"]
    assert (backend, oshape, odtype, lshape, ldtype) == ("sm80-emulated", q.shape, q.dtype, (2, 4, 5), torch.float32)
    assert kw["window_left"] == 3 and kw["window_right"] == 0 and kw["softmax_scale"] == pytest.approx(64 ** -0.5)
    assert (out == 1).all() and (lse == 2).all()
    out.float().sum().backward()
    assert calls["bwd"] == ("sm80-emulated", False, True)
    assert (q.grad == 3).all() and (k.grad == 6).all() and (s.grad == 3).all()  # k used as k and v: 3 + 3
