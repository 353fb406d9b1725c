"""bench/harness/peer_vllm.py on the CPU: vLLM 0.33's own Triton unified attention, run by Triton's interpreter from
the wheel's source under the bench's stand-ins, against sinkattn's vLLM backend forward on the same paged
cache and metadata, and both against the float64 oracle.

This checks what a GPU lease cannot afford to find out: that the carried peer loads with the stand-ins,
that both comparators compute the same attention from vLLM's layout (so the timing compares like with
like), and vLLM's sink/window semantics against sinkattn's. Small batches: the interpreter is slow.
Triton reads TRITON_INTERPRET when it is first imported (its standard library is decorated then), and
other tests may have imported it already, so the comparison runs in a child process.
"""
import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch

from bench.harness import peer_vllm as P
from tests import vllm_stubs
from tests.test_vllm_backend import vllm_src  # noqa: F401  (session fixture: the wheel, fetched once)

BATCHES = {
    "decode": P.Batch("decode (vLLM's split-K path), window 8", (37, 3), (1, 1), 7),
    "mixed": P.Batch("decode + a prefill chunk over a cached prefix (2D path), full", (33, 16), (1, 4), -1),
}


def _child(src: str) -> None:
    """In a process started with TRITON_INTERPRET=1: both comparators and the oracle on each batch."""
    fn = P.load(Path(src))
    for which, batch in BATCHES.items():
        _compare(fn, which, batch)


def _compare(fn, which, batch) -> None:
    from tests.oracle import attention_oracle
    x = P.make(batch, torch.device("cpu"), dtype=torch.float32, seed=1)
    k_cache, v_cache = x["kv_cache"].transpose(1, 2).split(P.D, dim=-1)
    starts, w = x["qsl"].tolist(), ((batch.window, 0) if batch.window >= 0 else (-1, -1))
    refs = []
    for r, s in enumerate(batch.seq):
        pos = torch.arange(s)
        page = x["block_table"][r].long()[pos // P.PAGE]
        k, v = k_cache[page, pos % P.PAGE][None], v_cache[page, pos % P.PAGE][None]
        refs.append(attention_oracle(x["query"][None, starts[r]:starts[r + 1]], k, v, x["sinks"], causal=True,
                                     window_size=w)[0][0])
    ref = torch.cat(refs)
    theirs = P.prep_vllm(fn, batch, x)().clone()
    ours = P.prep_sinkattn(batch, x)().clone()
    torch.testing.assert_close(theirs.double(), ref, rtol=0, atol=2e-5, msg=f"{which}: vLLM's kernel vs float64")
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5, msg=f"{which}: sinkattn backend vs float64")
    print(f"ok {which}: |vllm - oracle| {(theirs.double() - ref).abs().max():.2e}, "
          f"|sinkattn - oracle| {(ours.double() - ref).abs().max():.2e}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (it ships with torch's Linux wheels)")
def test_vllm_triton_and_sinkattn_agree_on_vllms_layout(vllm_src, tmp_path):  # noqa: F811
    out = vllm_stubs.run_interpreted("tests.test_peer_vllm", "_child", tmp_path, timeout=300)
    assert all(f"ok {which}:" in out for which in BATCHES), out


def test_grid_covers_the_issue():
    names = [b.name for b in P.grid()]
    for b in (1, 4, 16, 64, 256):
        for sk in (8192, 16384, 32768):
            assert f"decode/win128/b{b}/sk{sk}" in names and f"decode/full/b{b}/sk{sk}" in names
    assert any(n.startswith("mixed/") for n in names) and any(n.startswith("spec4/") for n in names)
    mixed = next(b for b in P.grid() if b.name.startswith("mixed/"))
    assert mixed.q[-2:] == (2048, 2048) and mixed.ctx[-1] == 8192  # a chunk over a cached prefix


def test_fa3_call_names_every_argument_of_the_wheels_op(vllm_src):  # noqa: F811
    """The Hopper peer (prep_vllm_fa3: vLLM's FlashAttention-3 build from the same wheel) calls its fwd op by keyword:
    every argument of the schema the wheel's library registers (read from its bytes: the library itself loads only
    beside a GPU driver), the sinks in bf16 (the only s_aux dtype it takes) and the cache as its paged K/V views."""
    with zipfile.ZipFile(P._wheel()) as z:
        names = P.fa3_schema(z.read(P.FA3_SO))
    assert names[:3] == ["q", "k", "v"] and "s_aux" in names and "scheduler_metadata" in names
    batch = BATCHES["mixed"]
    x = P.make(batch, torch.device("cpu"), seed=1)
    kw = P.fa3_call(batch, x, torch.empty_like(x["query"]), None)
    assert sorted(kw) == sorted(names)
    assert kw["s_aux"].dtype == torch.bfloat16 and kw["s_aux"].shape == (P.H,)
    blocks = x["kv_cache"].shape[0]
    for t in (kw["k"], kw["v"]):  # (num_pages, page_size, num_heads_k, head_size), last dim contiguous
        assert t.shape == (blocks, P.PAGE, P.HK, P.D) and t.stride(-1) == 1
    assert kw["page_table"].dtype == torch.int32 and kw["seqused_k"].dtype == torch.int32
