"""Whole random attention problems for property-based fuzzing (Hypothesis), and their check against the oracle.

One generator serves every backend: `problems(backend)` draws a FuzzProblem (shapes, GQA ratio, masks, windows,
sink tokens, sinks incl. +-inf and +-30, varlen lengths incl. 0, contiguous and paged caches, dtypes, strides),
restricted to what that backend serves and sized to what it can run quickly; `check(problem, backend, device)`
builds the tensors from the problem's seed, runs the public API and holds out, lse (and, when drawn, the
gradients) to the float64 oracle with the project's tolerance rule. tests/test_fuzz.py runs it on the CPU
(reference, sm80-emulated), tests/test_fuzz.py::test_fuzz_gpu (marked gpu) on the real kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import sinkattn
from sinkattn import reference
from oracle import attention_oracle, attention_oracle_varlen, tolerance_check

INF = math.inf
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FuzzProblem:
    mode: str                    # "batched", "varlen" or "kvcache"
    dtype: str                   # key of DTYPES
    headdim: int
    nheads_k: int
    group: int                   # query heads per KV head
    lens: tuple                  # batched: ((sq, sk),) * batch; varlen: per sequence; kvcache: (cached, ...)
    seqlen_new: int = 0          # kvcache: tokens appended (and queries = max(1, seqlen_new) ... see sq)
    seqlen_q: int = 1            # kvcache: query rows per sequence
    page_size: int = 0           # kvcache: 0 = contiguous cache
    causal: bool = False
    window: tuple = (-1, -1)
    sink_tokens: int = 0
    sinks: tuple | None = None   # one logit per query head, or None
    softcap: float = 0.0
    strided: bool = False        # q/k/v as non-contiguous views (last dim contiguous)
    grad: bool = False           # also check dq, dk, dv, dsinks (batched / varlen)
    scale: float = 1.0           # input magnitude (large: sharp softmax, tests the running max)
    seed: int = 0
    key_tile: int = 512          # reference tiling (small tiles exercise the online softmax)
    row_chunk: int = 256

    @property
    def nheads(self) -> int:
        return self.nheads_k * self.group


# What each backend serves and how big a problem it runs quickly (the emulation runs one std::thread per CUDA
# thread: its cost grows with the number of CTAs and key blocks, so its problems stay small).
LIMITS = {
    "reference": dict(dtypes=("fp32", "bf16", "fp16"), headdims=(8, 16, 24, 40, 64), max_q=48, max_k=80, max_batch=3,
                      max_hk=3, max_group=4, grad=True),
    # Measured here: about 0.9 s per problem at max_q 40, max_k 140, 8 query heads; these bounds give about 0.35 s.
    "sm80-emulated": dict(dtypes=("bf16", "fp16"), headdims=(40, 64), max_q=33, max_k=100, max_batch=2, max_hk=2,
                          max_group=3, grad=True),
    # GPU problems are bounded by the float64 oracle on the host's CPU (a few hundred ms at most each).
    "sm80": dict(dtypes=("bf16", "fp16"), headdims=(40, 64, 96, 128, 256), max_q=160, max_k=300, max_batch=2,
                 max_hk=2, max_group=8, grad=True),
    "sm90": dict(dtypes=("bf16", "fp16"), headdims=(64, 128, 256), max_q=160, max_k=300, max_batch=2, max_hk=2,
                 max_group=8, grad=False),
}
SINK_VALUES = st.one_of(st.floats(-4, 4, allow_nan=False), st.sampled_from([30.0, -30.0, INF, -INF]))


@st.composite
def problems(draw, backend: str = "reference", modes=("batched", "varlen", "kvcache")):
    lim = LIMITS[backend]
    if backend == "sm90":
        modes = tuple(m for m in modes if m != "kvcache")  # the sm90 kernel serves q/k/v tensors only
    mode = draw(st.sampled_from(modes))
    hk = draw(st.integers(1, lim["max_hk"]))
    group = draw(st.integers(1, lim["max_group"]))
    nheads = hk * group
    qlen = st.integers(0, lim["max_q"])
    klen = st.integers(0, lim["max_k"])
    batch = draw(st.integers(1, lim["max_batch"]))
    seqlen_new = seqlen_q = page_size = 0
    if mode == "batched":
        sq, sk = draw(qlen), draw(klen)
        lens = ((sq, sk),) * batch
    elif mode == "varlen":
        lens = tuple((draw(qlen), draw(klen)) for _ in range(batch))
    else:
        seqlen_new = draw(st.integers(0, 4))
        seqlen_q = draw(st.integers(1, 5))
        page_size = draw(st.sampled_from([0, 0, 1, 5, 16]))
        lens = tuple(draw(st.integers(0 if seqlen_new else 1, lim["max_k"])) for _ in range(batch))
    causal = draw(st.booleans())
    left = draw(st.one_of(st.just(-1), st.integers(0, 50)))
    right = 0 if causal else draw(st.one_of(st.just(-1), st.integers(0, 20)))
    sink_tokens = draw(st.sampled_from([0, 0, 1, 4, 9]))
    sinks = draw(st.one_of(st.none(), st.lists(SINK_VALUES, min_size=nheads, max_size=nheads).map(tuple)))
    grad = mode != "kvcache" and lim["grad"] and draw(st.integers(0, 3 if backend == "reference" else 5)) == 0
    if grad and sinks is not None and any(s == INF for s in sinks):
        grad = False  # the oracle's own autograd is NaN through a +inf logit
    return FuzzProblem(
        mode=mode, dtype=draw(st.sampled_from(lim["dtypes"])), headdim=draw(st.sampled_from(lim["headdims"])),
        nheads_k=hk, group=group, lens=lens, seqlen_new=seqlen_new, seqlen_q=seqlen_q, page_size=page_size,
        causal=causal, window=(left, right), sink_tokens=sink_tokens, sinks=sinks,
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])), strided=draw(st.booleans()), grad=grad,
        scale=draw(st.sampled_from([1.0, 1.0, 4.0])), seed=draw(st.integers(0, 2**31 - 1)),
        key_tile=draw(st.sampled_from([8, 16, 512])), row_chunk=draw(st.sampled_from([3, 256])))


def _rand(gen, shape, p: FuzzProblem, device, strided: bool):
    """Random values in the problem's dtype; strided: a permuted view of a (heads-first) allocation."""
    dtype = DTYPES[p.dtype]
    if not strided or len(shape) < 3:
        return (torch.randn(shape, generator=gen) * p.scale).to(dtype).to(device)
    # Swap the two modes before the head dim in storage, then view back: same shape, non-contiguous strides.
    perm = list(range(len(shape)))
    perm[-3], perm[-2] = perm[-2], perm[-3]
    store = (torch.randn([shape[i] for i in perm], generator=gen) * p.scale).to(dtype).to(device)
    return store.permute(perm)


def _kw(p: FuzzProblem) -> dict:
    return dict(causal=p.causal, window_size=p.window, sink_tokens=p.sink_tokens, softcap=p.softcap)


def check(p: FuzzProblem, backend: str, device: str = "cpu") -> None:
    """Raises AssertionError (naming the problem) when the backend disagrees with the oracle."""
    old = reference.KEY_TILE, reference.ROW_CHUNK
    reference.KEY_TILE, reference.ROW_CHUNK = p.key_tile, p.row_chunk
    try:
        {"batched": _check_batched, "varlen": _check_varlen, "kvcache": _check_kvcache}[p.mode](p, backend, device)
    except AssertionError as e:
        raise AssertionError(f"{backend}: {e}\n  problem: {p!r}") from None
    finally:
        reference.KEY_TILE, reference.ROW_CHUNK = old


def _sinks(p: FuzzProblem, device):
    return None if p.sinks is None else torch.tensor(p.sinks, dtype=torch.float32, device=device)


def _atol(p: FuzzProblem):
    # Out and lse: the project's atol (kernel_cases.run_case). fp32 problems get a tighter one.
    return (1e-4, 1e-5) if p.dtype == "fp32" else (1e-3, 1e-4)


def _compare(p, got, inputs, sinks, oracle, tag):
    """got = (out, lse[, grads]) against oracle(*inputs, sinks, compute_dtype) in float64 and in the dtype."""
    dtype = DTYPES[p.dtype]
    cpu = [t.detach().cpu() for t in inputs]
    s = None if sinks is None else sinks.detach().cpu()
    want = oracle(*cpu, s, compute_dtype=torch.float64)
    base = oracle(*cpu, s, compute_dtype=dtype)
    ao, al = _atol(p)
    tolerance_check(f"{tag} out", got[0].detach().cpu(), want[0], base[0], ao)
    tolerance_check(f"{tag} lse", got[1].detach().cpu(), want[1], base[1].float(), al)
    if len(got) > 2:
        _compare_grads(p, got, cpu, s, oracle, tag)


def _compare_grads(p, got, cpu, s, oracle, tag):
    dtype = DTYPES[p.dtype]
    gout, glse = got[2]
    results = []
    for cdt in (torch.float64, dtype):
        leaves = [t.to(cdt).requires_grad_() for t in cpu]
        sl = None if s is None else s.double().requires_grad_()
        o, lse = oracle(*leaves, sl, compute_dtype=cdt)
        term = torch.where(torch.isfinite(lse), lse * glse.to(lse.dtype), torch.zeros_like(lse))
        ins = leaves + ([sl] if sl is not None else [])
        results.append(torch.autograd.grad((o * gout.to(o.dtype)).sum() + term.sum(), ins, allow_unused=True))
    atol = 1e-3 if p.dtype == "fp32" else 2e-2
    for name, a, w, b in zip(("dq", "dk", "dv", "dsinks"), got[3], results[0], results[1]):
        w = torch.zeros_like(a.double()) if w is None else w
        # Plus 4 units in the last place of the largest gradient: the backends round P and dS to the input dtype
        # (as the kernels' MMAs take them), the low-precision oracle rounds elsewhere, and with large inputs (scale
        # 4: gradients near 5 in bf16, an ulp 0.03) the two land a few ulps apart.
        ulps = 4 * torch.finfo(dtype).eps * float(w.abs().max()) if w.numel() and p.dtype != "fp32" else 0.0
        tolerance_check(f"{tag} {name}", a.detach().cpu(), w, b, atol + ulps)


def _run_grad(out, lse, leaves, gen):
    gout = torch.randn(out.shape, generator=gen).to(out.dtype)
    glse = torch.randn(lse.shape, generator=gen)
    glse_dev = torch.where(torch.isfinite(lse.detach().cpu()), glse, torch.zeros_like(glse)).to(lse.device)
    grads = torch.autograd.grad([out, lse], leaves, [gout.to(out.device), glse_dev])
    return (gout, glse), grads


def _leaves(p: FuzzProblem, q, k, v, sinks):
    """(q, k, v, sinks, leaves): the inputs, made leaves that require grad when the problem checks gradients."""
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    if p.grad:
        leaves = [t.detach().requires_grad_() for t in leaves]
    return (*leaves[:3], leaves[3] if sinks is not None else None, leaves)


def _check_batched(p: FuzzProblem, backend: str, device: str):
    gen = torch.Generator().manual_seed(p.seed)
    b, (sq, sk) = len(p.lens), p.lens[0]
    q = _rand(gen, (b, sq, p.nheads, p.headdim), p, device, p.strided)
    k = _rand(gen, (b, sk, p.nheads_k, p.headdim), p, device, p.strided)
    v = _rand(gen, (b, sk, p.nheads_k, p.headdim), p, device, p.strided)
    q, k, v, sinks, leaves = _leaves(p, q, k, v, _sinks(p, device))
    out, lse = sinkattn.flash_attn_with_sinks(q, k, v, sinks, return_lse=True, backend=backend, **_kw(p))
    got = (out, lse)
    if p.grad:
        g, grads = _run_grad(out, lse, leaves, gen)
        got = (out, lse, g, grads)
    _compare(p, got, (q, k, v), sinks, lambda q_, k_, v_, s_, compute_dtype: attention_oracle(
        q_, k_, v_, s_, compute_dtype=compute_dtype, **_kw(p)), "batched")


def _check_varlen(p: FuzzProblem, backend: str, device: str):
    gen = torch.Generator().manual_seed(p.seed)
    lq, lk = [a for a, _ in p.lens], [b for _, b in p.lens]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = _rand(gen, (sum(lq), p.nheads, p.headdim), p, device, p.strided)
    k = _rand(gen, (sum(lk), p.nheads_k, p.headdim), p, device, p.strided)
    v = _rand(gen, (sum(lk), p.nheads_k, p.headdim), p, device, p.strided)
    q, k, v, sinks, leaves = _leaves(p, q, k, v, _sinks(p, device))
    out, lse = sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, max(lq), max(lk), sinks, return_lse=True,
                                                     backend=backend, **_kw(p))
    got = (out, lse)
    if p.grad:
        g, grads = _run_grad(out, lse, leaves, gen)
        got = (out, lse, g, grads)
    cq, ck = cu_q.cpu(), cu_k.cpu()
    _compare(p, got, (q, k, v), sinks, lambda q_, k_, v_, s_, compute_dtype: attention_oracle_varlen(
        q_, k_, v_, cq, ck, s_, compute_dtype=compute_dtype, **_kw(p)), "varlen")


def _check_kvcache(p: FuzzProblem, backend: str, device: str):
    gen = torch.Generator().manual_seed(p.seed)
    b, hk, d, sn = len(p.lens), p.nheads_k, p.headdim, p.seqlen_new
    need = max(n + sn for n in p.lens)
    dense_k = _rand(gen, (b, max(need, 1), hk, d), p, "cpu", False)
    dense_v = _rand(gen, (b, max(need, 1), hk, d), p, "cpu", False)
    if p.page_size:
        per = (max(need, 1) + p.page_size - 1) // p.page_size
        pages = b * per + 2
        perm = torch.randperm(pages, generator=gen)[: b * per]
        bt = perm.view(b, per).to(torch.int32)
        kc = _rand(gen, (pages, p.page_size, hk, d), p, "cpu", False)
        vc = _rand(gen, (pages, p.page_size, hk, d), p, "cpu", False)
        for bi in range(b):
            for j in range(per):
                n = min(p.page_size, dense_k.shape[1] - j * p.page_size)
                kc[bt[bi, j], :n] = dense_k[bi, j * p.page_size: j * p.page_size + n]
                vc[bt[bi, j], :n] = dense_v[bi, j * p.page_size: j * p.page_size + n]
    else:
        kc, vc, bt = dense_k.clone(), dense_v.clone(), None
    q = _rand(gen, (b, p.seqlen_q, p.nheads, d), p, device, p.strided)
    kn = _rand(gen, (b, sn, hk, d), p, device, p.strided) if sn else None
    vn = _rand(gen, (b, sn, hk, d), p, device, p.strided) if sn else None
    sinks = _sinks(p, device)
    dev = (lambda t: None if t is None else t.to(device))  # noqa: E731
    out, lse = sinkattn.flash_attn_with_kvcache(
        q, dev(kc), dev(vc), sinks, k=kn, v=vn, cache_seqlens=dev(torch.tensor(p.lens, dtype=torch.int32)),
        block_table=dev(bt), return_lse=True, backend=backend, **_kw(p))
    out, lse = out.cpu(), lse.cpu()
    for bi, n in enumerate(p.lens):
        wk, wv = dense_k[bi, : n + sn].clone(), dense_v[bi, : n + sn].clone()
        if sn:
            wk[n:], wv[n:] = kn[bi].cpu(), vn[bi].cpu()
        _compare(p, (out[bi:bi + 1], lse[bi:bi + 1]), (q[bi:bi + 1], wk[None], wv[None]), sinks,
                 lambda q_, k_, v_, s_, compute_dtype: attention_oracle(q_, k_, v_, s_, compute_dtype=compute_dtype,
                                                                       **_kw(p)), f"kvcache seq {bi} (cached {n})")
