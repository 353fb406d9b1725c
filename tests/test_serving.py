"""The serving call: flash_attn_with_kvcache(..., cu_seqlens_q=..., max_seqlen_q=...), packed queries of a mixed
batch over a paged cache holding every key, in one kernel launch (docs/DESIGN.md section 4, the serving entry).

Against the float64 oracle on the reference and on the sm80 kernels under host emulation (tests/serving_cases.py);
one call into the compiled module per batch whatever its mix; nothing read on the host with the value checks off;
the refusals of what the form does not take.
"""
import pytest
import torch

import sinkattn
from serving_cases import FP8_SERVING_CASES, SERVING_CASES, PagedBatch, run_serving
from sinkattn import _ext
from sinkattn.errors import SinkattnValueError

EMU = sorted({(k["headdim"], k["dtype"], k["op"]) for k in _ext.registry() if k["family"] == "sm80-emulated"}) \
    if _ext.loaded() else []
needs_emu = pytest.mark.skipif(not any(h == 64 and d == "bf16" and op == "fwd" for h, d, op in EMU),
                               reason="no emulated hdim64 bf16 kernel in this build")
needs_emu_fp8 = pytest.mark.skipif(not any(h == 64 and d == "bf16" and op == "fwd_fp8" for h, d, op in EMU),
                                   reason="no emulated hdim64 bf16 FP8-cache kernel in this build")


@pytest.mark.parametrize("name,reqs,kw", SERVING_CASES, ids=[c[0] for c in SERVING_CASES])
def test_reference_serving_matches_oracle(name, reqs, kw, rng_seed):
    run_serving("reference", "cpu", rng_seed, reqs, **kw)


@needs_emu
@pytest.mark.parametrize("name,reqs,kw", SERVING_CASES, ids=[c[0] for c in SERVING_CASES])
def test_emulated_serving_matches_oracle(name, reqs, kw, rng_seed):
    run_serving("sm80-emulated", "cpu", rng_seed, reqs, **kw)


@needs_emu_fp8
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scales", ["per_head", "tensor"])
@pytest.mark.parametrize("name,reqs,kw", FP8_SERVING_CASES, ids=[c[0] for c in FP8_SERVING_CASES])
def test_emulated_serving_fp8(name, reqs, kw, fmt, scales, rng_seed):
    run_serving("sm80-emulated", "cpu", rng_seed, reqs, fp8=fmt, scales=scales, **kw)


@needs_emu
def test_emulated_serving_gpt_oss_shape(rng_seed):
    """gpt-oss-20b's attention on one rank: 64 query heads over 8 KV heads, head dim 64, vLLM's page 16, a sliding
    layer (window 128 with the query's own key: (127, 0)); decodes at long contexts beside two prefill chunks."""
    reqs = [(1, 1500), (1, 900), (1, 130), (2, 400), (48, 300), (33, 33)]
    run_serving("sm80-emulated", "cpu", rng_seed, reqs, h=64, hk=8, causal=True, window_size=(127, 0))


class _CountingModule:
    """The compiled module with its fwd_kvcache calls counted (every other attribute passed through)."""

    def __init__(self, inner):
        self._inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != "fwd_kvcache":
            return attr

        def counted(*args):
            self.calls.append(args)
            return attr(*args)
        return counted


@needs_emu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_call_per_batch_whatever_its_mix(monkeypatch, num_splits, rng_seed):
    """Decodes, speculative rows, prefill chunks and an empty request: one call into the compiled module (the
    kernel and, split, its combine, launched inside it), where the grouped form made one per query length."""
    counting = _CountingModule(_ext.require())
    monkeypatch.setattr(_ext, "require", lambda: counting)
    run_serving("sm80-emulated", "cpu", rng_seed, [(1, 100), (1, 50), (4, 80), (0, 0), (30, 60), (7, 90)],
                causal=True, num_splits=num_splits)
    assert len(counting.calls) == 1
    args = counting.calls[0]
    assert args[-2] is not None and args[-1] == 30  # cu_seqlens_q and max_seqlen_q reach the module


class _HostReads:
    """Records every tensor-to-host read made at the Python level, by wrapping torch.Tensor's reading methods (a
    TorchFunctionMode would not do: it makes the call take torch.ops, inside whose custom op it sees nothing)."""
    READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu", "nonzero", "any",
             "all")

    def __init__(self, monkeypatch):
        self.seen = []
        for name in self.READS:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, _name=name, **kw):
                self.seen.append(_name)
                return _orig(t, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, wrapped)


@needs_emu
def test_no_host_read_with_the_value_checks_off(monkeypatch):
    """With the value checks off (SINKATTN_VALUE_CHECKS=0, as under CUDA-graph capture) the serving call reads no
    index tensor on the host; with them on it does (the checks are the only reads)."""
    pb = PagedBatch([(1, 70), (5, 40), (0, 0)], h=8, hk=1, d=64, page_size=16, dtype=torch.bfloat16, pad_rows=2)

    def call():
        return sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, torch.randn(8),
                                                cache_seqlens=pb.seqused_k, block_table=pb.block_table,
                                                cu_seqlens_q=pb.cu_seqlens_q, max_seqlen_q=5, causal=True,
                                                backend="sm80-emulated")
    call()  # first-call work (registry reads, warnings) out of the way
    reads = _HostReads(monkeypatch)
    monkeypatch.setenv("SINKATTN_VALUE_CHECKS", "0")
    call()
    assert reads.seen == []
    monkeypatch.setenv("SINKATTN_VALUE_CHECKS", "1")
    call()
    assert "tolist" in reads.seen  # the recorder sees the value checks' reads


def test_serving_form_refusals():
    pb = PagedBatch([(1, 20), (2, 10)], h=4, hk=1, d=64, page_size=16, dtype=torch.float32)
    kw = dict(cache_seqlens=pb.seqused_k, block_table=pb.block_table, cu_seqlens_q=pb.cu_seqlens_q)
    with pytest.raises(SinkattnValueError, match="max_seqlen_q"):
        sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, **kw)
    with pytest.raises(SinkattnValueError, match="already hold every key"):
        sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, k=pb.q[:, :1], v=pb.q[:, :1],
                                         max_seqlen_q=2, **kw)
    with pytest.raises(SinkattnValueError, match=r"\(total_q, nheads, headdim\)"):
        sinkattn.flash_attn_with_kvcache(pb.q[None], pb.k_cache, pb.v_cache, max_seqlen_q=2, **kw)
    bad = torch.tensor([0, 2, 1], dtype=torch.int32)
    with pytest.raises(SinkattnValueError, match="non-decreasing"):
        sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, max_seqlen_q=2,
                                         **{**kw, "cu_seqlens_q": bad})
    with pytest.raises(SinkattnValueError, match="cache_seqlens"):
        sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, max_seqlen_q=2,
                                         **{**kw, "cache_seqlens": torch.tensor([20, 10_000], dtype=torch.int32)})


@needs_emu
def test_contiguous_cache_serves_as_the_paged_one(rng_seed):
    """The serving form over a contiguous cache (batch, capacity, hk, d): the same keys as a paged cache of the same
    capacity give the same bits (the same tile and split count; only the address of a key differs)."""
    reqs = [(1, 90), (4, 33), (0, 0), (20, 50)]
    pb = PagedBatch(reqs, h=8, hk=1, d=64, page_size=16, dtype=torch.bfloat16, pad_rows=2)
    cap = pb.block_table.shape[1] * 16
    pos = torch.arange(cap)
    pages = pb.block_table.long()[:, pos // 16]
    k_dense = pb.k_cache[pages, pos % 16].contiguous()  # (batch, capacity, hk, d)
    v_dense = pb.v_cache[pages, pos % 16].contiguous()
    s = torch.randn(8)
    kw = dict(cache_seqlens=pb.seqused_k, cu_seqlens_q=pb.cu_seqlens_q, max_seqlen_q=20, causal=True,
              return_lse=True, backend="sm80-emulated")
    for splits in (1, 3):
        paged = sinkattn.flash_attn_with_kvcache(pb.q, pb.k_cache, pb.v_cache, s, block_table=pb.block_table,
                                                 num_splits=splits, **kw)
        dense = sinkattn.flash_attn_with_kvcache(pb.q, k_dense, v_dense, s, num_splits=splits, **kw)
        assert torch.equal(paged[0], dense[0]) and torch.equal(paged[1], dense[1]), f"splits {splits}"
