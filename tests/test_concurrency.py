"""Concurrency: the ops from several Python threads at once give the serial results bit for
bit (CPU: reference and emulated backends; GPU, marked: one CUDA stream per thread); CUDA-graph capture and
replay of decode while cache_seqlens and the block table change between replays (marked gpu); the capability
report and the dispatch caches answer the same from many threads."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import sinkattn
from sinkattn import _ext, dispatch, registry
from sinkattn._problem import Problem
from sinkattn.mask import Mask
from oracle import attention_oracle, tolerance_check

EMU = any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" for k in _ext.registry())
THREADS = 4


def _inputs(seed, device, dtype):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    return dict(q=r(2, 37, 4, 64), k=r(2, 53, 2, 64), v=r(2, 53, 2, 64), sinks=torch.randn(4, generator=g).to(device),
                qd=r(3, 1, 4, 64), kc=r(3, 64, 2, 64), vc=r(3, 64, 2, 64), kn=r(3, 1, 2, 64), vn=r(3, 1, 2, 64),
                lens=torch.tensor([5, 40, 0], dtype=torch.int32).to(device), do=r(2, 37, 4, 64))


def _work(seed, backend, device, dtype, stream=None):
    """Forward + backward + decode (with append) of one problem; returns every result on the CPU."""
    x = _inputs(seed, device, dtype)
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "sinks")]
        out, lse = sinkattn.flash_attn_with_sinks(*leaves, causal=True, window_size=(20, 0), sink_tokens=3,
                                                  return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, x["do"])
        kc, vc = x["kc"].clone(), x["vc"].clone()
        dec = sinkattn.flash_attn_with_kvcache(x["qd"], kc, vc, x["sinks"], k=x["kn"], v=x["vn"],
                                               cache_seqlens=x["lens"], causal=True, num_splits=3, backend=backend)
        res = [out, lse, *grads, dec, kc, vc]
    if stream is not None:
        stream.synchronize()
    return [t.detach().cpu() for t in res]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _parallel_equals_serial(backend, device, dtype, streams=False, rounds=2):
    seeds = list(range(THREADS * rounds))
    serial = {s: _work(s, backend, device, dtype) for s in seeds}
    barrier = threading.Barrier(THREADS)

    def job(s):
        barrier.wait() if s < THREADS else None  # the first round starts together
        stream = torch.cuda.Stream() if streams else None
        return s, _work(s, backend, device, dtype, stream)

    with ThreadPoolExecutor(THREADS) as pool:
        got = dict(pool.map(job, seeds))
    for s in seeds:
        for i, (a, b) in enumerate(zip(serial[s], got[s])):
            assert torch.equal(a, b), f"seed {s}, result {i}: threaded run differs from the serial one"


def test_threads_reference():
    _parallel_equals_serial("reference", "cpu", torch.float32)


@pytest.mark.skipif(not EMU, reason="no emulated kernels in this build")
def test_threads_sm80_emulated():
    _parallel_equals_serial("sm80-emulated", "cpu", torch.bfloat16, rounds=1)  # each emulated launch is threads too


def test_threads_catch_a_difference():
    """The comparison above can fail: a run with another seed differs."""
    a, b = _work(0, "reference", "cpu", torch.float32), _work(1, "reference", "cpu", torch.float32)
    assert not torch.equal(a[0], b[0])


def test_capabilities_and_dispatch_from_threads():
    want_caps = sinkattn.capabilities()
    problem = Problem.of_call("fwd", torch.empty(1, 1, 4, 64), torch.empty(1, 1, 2, 64), None, Mask(0.125, -1, 0))
    want = {b: dispatch.why_not(b, problem) for b in ("reference", *registry.KERNEL_BACKENDS)}
    barrier = threading.Barrier(8)

    def job(_):
        barrier.wait()
        got = []
        for _ in range(20):
            got.append(sinkattn.capabilities() == want_caps)
            got.append({b: dispatch.why_not(b, problem) for b in want} == want)
            got.append(dispatch.choose(problem, "auto") == "reference")
        return all(got)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(job, range(8)))


def test_registry_cache_is_computed_once_under_threads(monkeypatch):
    """The registry is an lru_cache over the binary's table: many first calls at once all get the same tuple."""
    _ext.registry.cache_clear()
    barrier = threading.Barrier(8)

    def job(_):
        barrier.wait()
        return _ext.registry()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(job, range(8)))
    assert all(r == results[0] for r in results)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_threads_and_streams_sm80():
    _parallel_equals_serial("sm80", "cuda", torch.bfloat16, streams=True)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_graph_decode_replay_with_changing_lengths_and_pages(paged):
    """Capture one decode step (append + attention) once; replay it with new cache_seqlens, new block tables
    and new q/k/v written into the static inputs; each replay matches the oracle over the cache it built."""
    dev, dt = "cuda", torch.bfloat16
    b, h, hk, d, page, pages_per_seq = 3, 8, 2, 64, 16, 8
    cap = page * pages_per_seq
    g = torch.Generator().manual_seed(0)
    num_pages = b * pages_per_seq + 4
    kc = torch.randn(num_pages if paged else b, page if paged else cap, hk, d, generator=g).to(dt).to(dev)
    vc = torch.randn(kc.shape, generator=g).to(dt).to(dev)
    bt = torch.arange(b * pages_per_seq, dtype=torch.int32, device=dev).view(b, pages_per_seq) if paged else None
    q = torch.randn(b, 1, h, d, generator=g).to(dt).to(dev)
    kn, vn = (torch.randn(b, 1, hk, d, generator=g).to(dt).to(dev) for _ in range(2))
    lens = torch.tensor([3, 50, 100], dtype=torch.int32, device=dev)
    sinks = torch.randn(h, generator=g).to(dev)
    kw = dict(k=kn, v=vn, cache_seqlens=lens, block_table=bt, causal=True, window_size=(60, 0), sink_tokens=2,
              num_splits=0, backend="sm80")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sinkattn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), sinks, **kw)  # warm-up (allocator, caches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sinkattn.flash_attn_with_kvcache(q, kc, vc, sinks, **kw)

    for step in range(4):
        new_lens = torch.randint(0, cap - 1, (b,), generator=g, dtype=torch.int32)
        lens.copy_(new_lens)
        if paged:
            bt.copy_(torch.randperm(num_pages, generator=g)[: b * pages_per_seq].view(b, pages_per_seq).to(torch.int32))
        q.copy_(torch.randn(q.shape, generator=g).to(dt))
        kn.copy_(torch.randn(kn.shape, generator=g).to(dt))
        vn.copy_(torch.randn(vn.shape, generator=g).to(dt))
        graph.replay()
        torch.cuda.synchronize()
        for bi, n in enumerate(new_lens.tolist()):
            pos = torch.arange(n + 1)
            if paged:
                rows, slots = bt[bi].cpu().long()[pos // page], pos % page
            else:
                rows, slots = torch.full_like(pos, bi), pos
            kk, vv = kc.cpu()[rows, slots], vc.cpu()[rows, slots]
            assert torch.equal(kk[n], kn[bi, 0].cpu()) and torch.equal(vv[n], vn[bi, 0].cpu()), f"step {step} append"
            want, _ = attention_oracle(q[bi:bi + 1].cpu(), kk[None], vv[None], sinks.cpu(), causal=True,
                                       window_size=(60, 0), sink_tokens=2)
            base, _ = attention_oracle(q[bi:bi + 1].cpu(), kk[None], vv[None], sinks.cpu(), causal=True,
                                       window_size=(60, 0), sink_tokens=2, compute_dtype=dt)
            tolerance_check(f"replay {step} seq {bi} (len {n})", out[bi:bi + 1].cpu(), want, base, 1e-3)
