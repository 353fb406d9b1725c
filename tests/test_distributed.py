"""Context-parallel ring attention (sinkattn.distributed) against the float64 oracle.

Three levels: the chunk-pair cutting against a brute-force mask; the per-rank computation for 1..4
virtual ranks in one process (forward and backward through the merges); and the real thing, two
processes on gloo exchanging chunks around the ring, forward and backward including dsinks.
"""
import itertools
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sinkattn import SinkattnRuntimeError
from sinkattn.distributed import attend_chunks, ring_attention
from sinkattn.mask import visible_rectangle
from tests.oracle import attention_oracle, visible

CASES = {
    "causal": dict(causal=True),
    "full": dict(),
    "causal-window-sinktokens": dict(causal=True, window_size=(4, 0), sink_tokens=3),
    "two-sided-window": dict(window_size=(3, 2)),
    "window-softcap": dict(causal=True, window_size=(6, 0), softcap=2.0, sink_tokens=1),
}


def _brute(sq, sk, d, left, right):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= j - i <= d + right
    if left >= 0:
        ok &= j - i >= d - left
    return ok


def test_rectangle_expresses_every_chunk_pair_mask():
    for sq, sk, d, left, right in itertools.product((1, 3, 5), (1, 4, 6), range(-9, 10, 2), (-1, 0, 2, 5),
                                                    (-1, 0, 1, 3)):
        want = _brute(sq, sk, d, left, right)
        rect = visible_rectangle(sq, sk, d, left, right)
        got = torch.zeros(sq, sk, dtype=torch.bool)
        if rect is not None:
            r0, r1, c0, c1, wl, wr = rect
            got[r0:r1, c0:c1] = visible(r1 - r0, c1 - c0, wl, wr)
            assert got[r0:r1].any(1).all(), "a kept row sees nothing"
            assert got[:, c0:c1].any(0).all(), "a kept column is seen by nobody"
        assert torch.equal(got, want), (sq, sk, d, left, right, rect)


def _problem(world, s, seed, h=4, hk=2, d=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t = world * s
    q = torch.randn(1, t, h, d, generator=g, dtype=dtype)
    k = torch.randn(1, t, hk, d, generator=g, dtype=dtype)
    v = torch.randn(1, t, hk, d, generator=g, dtype=dtype)
    sinks = torch.randn(h, generator=g, dtype=dtype)
    dout = torch.randn(1, t, h, d, generator=g, dtype=dtype)
    dlse = torch.randn(1, h, t, generator=g, dtype=dtype)
    return q, k, v, sinks, dout, dlse


def _oracle_grads(q, k, v, sinks, dout, dlse, kw):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = attention_oracle(*leaves, **kw)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_virtual_ranks_match_oracle(world, case):
    kw = CASES[case]
    s = 5
    q, k, v, sinks, dout, dlse = _problem(world, s, seed=world * 7 + len(case))
    ref_out, ref_lse, ref_grads = _oracle_grads(q, k, v, sinks, dout, dlse, kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    qq, kk, vv, ss = leaves
    opts = dict(softmax_scale=q.shape[-1] ** -0.5, left=kw.get("window_size", (-1, -1))[0],
                right=0 if kw.get("causal") else kw.get("window_size", (-1, -1))[1],
                sink_tokens=kw.get("sink_tokens", 0), softcap=kw.get("softcap", 0.0), deterministic=False,
                backend="auto")
    outs, lses = [], []
    for r in range(world):
        ring = [(kk[:, src * s:(src + 1) * s], vv[:, src * s:(src + 1) * s], src * s)
                for src in ((r - t) % world for t in range(world))]
        o, l = attend_chunks(qq[:, r * s:(r + 1) * s], r * s, ring, ss, **opts)
        outs.append(o)
        lses.append(l)
    out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    for name, g, w in zip("q k v sinks".split(), grads, ref_grads):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"d{name}: {m}")


def test_needs_initialized_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(SinkattnRuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


# ---- two processes on gloo --------------------------------------------------------------------------
S = 6


def _worker(rank, world, init_file, dtype):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)
        for i, case in enumerate(sorted(CASES)):
            kw = CASES[case]
            q, k, v, sinks, dout, dlse = _problem(world, S, seed=100 + i)
            ref_out, ref_lse, (dq, dk, dv, dsinks) = _oracle_grads(q, k, v, sinks, dout, dlse, kw)
            mine = slice(rank * S, (rank + 1) * S)
            leaves = [x[:, mine].to(dtype).requires_grad_() for x in (q, k, v)]
            sk = sinks.to(dtype).requires_grad_()
            out, lse = ring_attention(*leaves, sk, return_lse=True, **kw)
            torch.testing.assert_close(out.double(), ref_out[:, mine], **tol, msg=lambda m: f"{case} out: {m}")
            torch.testing.assert_close(lse.double(), ref_lse[:, :, mine], **tol, msg=lambda m: f"{case} lse: {m}")
            loss = (out * dout[:, mine].to(dtype)).sum() + (lse * dlse[:, :, mine].to(lse.dtype)).sum()
            loss.backward()
            for name, got, want in zip("qkv", leaves, (dq, dk, dv)):
                torch.testing.assert_close(got.grad.double(), want[:, mine], **tol,
                                           msg=lambda m, name=name: f"{case} d{name}: {m}")
            total = sk.grad.clone()
            dist.all_reduce(total)  # the sinks gradient is each rank's share
            torch.testing.assert_close(total.double(), dsinks, **tol, msg=lambda m: f"{case} dsinks: {m}")
            with torch.no_grad():  # inference path (no tie to the ring's backward)
                torch.testing.assert_close(ring_attention(*[t.detach() for t in leaves], sk.detach(), **kw).double(),
                                           ref_out[:, mine], **tol)
        # No rank closes its gloo connections while its neighbour may still be reading from them.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed and the group is down. Leave without the interpreter's finalization: there gloo's
    # worker threads and their pending work objects are torn down in an order that, rarely, aborts the
    # process ("terminate called without an active exception", once in CI; not reproduced in 80 local
    # runs). A failed check raises above and still fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), dtype), nprocs=world, join=True)


def test_ring_attention_two_processes_gloo_float64():
    _spawn(2, torch.float64)


@pytest.mark.slow
def test_ring_attention_three_processes_gloo_float32():
    _spawn(3, torch.float32)
