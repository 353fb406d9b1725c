"""bench/peer_vllm.py on the CPU: vLLM 0.33's own Triton unified attention, run by Triton's interpreter from
the wheel's source under the bench's stand-ins, against sinkattn's vLLM backend forward on the same paged
cache and metadata, and both against the float64 oracle.

This checks what a GPU lease cannot afford to find out: that the carried peer loads with the stand-ins,
that both comparators compute the same attention from vLLM's layout (so the timing compares like with
like), and vLLM's sink/window semantics against sinkattn's. Small batches: the interpreter is slow.
"""
import importlib.util

import pytest
import torch

from bench import peer_vllm as P
from tests.oracle import attention_oracle
from tests.test_vllm_backend import vllm_src  # noqa: F401  (session fixture: the wheel, fetched once)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it ships with torch's Linux wheels)")


@pytest.fixture(scope="module")
def unified_attention(vllm_src, tmp_path_factory):  # noqa: F811
    import os
    # Triton's interpreter: read when the kernels are decorated (at load) and again when they run.
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        fn = P.load(P.extract(tmp_path_factory.mktemp("peer")))
        assert fn.__module__ == "vllm.v1.attention.ops.triton_unified_attention"
        yield fn
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _oracle(batch, x):
    k_cache, v_cache = x["kv_cache"].transpose(1, 2).split(P.D, dim=-1)
    starts = x["qsl"].tolist()
    w = (batch.window, 0) if batch.window >= 0 else (-1, -1)
    out = []
    for r, s in enumerate(batch.seq):
        pos = torch.arange(s)
        page = x["block_table"][r].long()[pos // P.PAGE]
        k, v = k_cache[page, pos % P.PAGE][None], v_cache[page, pos % P.PAGE][None]
        o, _ = attention_oracle(x["query"][None, starts[r]:starts[r + 1]], k, v, x["sinks"], causal=True,
                                window_size=w)
        out.append(o[0])
    return torch.cat(out)


@pytest.mark.parametrize("batch", [
    P.Batch("decode (vLLM's split-K path)", (37, 3), (1, 1), 7),
    P.Batch("mixed decode + a prefill chunk over a cached prefix (2D path)", (33, 16), (1, 4), -1),
], ids=lambda b: b.name.split(" ")[0])
def test_vllm_triton_and_sinkattn_agree_on_vllms_layout(unified_attention, batch):
    x = P.make(batch, torch.device("cpu"), dtype=torch.float32, seed=1)
    ref = _oracle(batch, x)
    theirs = P.prep_vllm(unified_attention, batch, x)().clone()
    ours = P.prep_sinkattn(batch, x)().clone()
    torch.testing.assert_close(theirs.double(), ref, rtol=0, atol=2e-5, msg="vLLM's Triton kernel vs float64")
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5, msg="sinkattn backend vs float64")


def test_grid_covers_the_issue():
    names = [b.name for b in P.grid()]
    for b in (1, 4, 16, 64, 256):
        for sk in (8192, 16384, 32768):
            assert f"decode/win128/b{b}/sk{sk}" in names and f"decode/full/b{b}/sk{sk}" in names
    assert any(n.startswith("mixed/") for n in names) and any(n.startswith("spec4/") for n in names)
    mixed = next(b for b in P.grid() if b.name.startswith("mixed/"))
    assert mixed.q[-2:] == (2048, 2048) and mixed.ctx[-1] == 8192  # a chunk over a cached prefix
