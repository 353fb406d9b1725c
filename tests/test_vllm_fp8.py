"""sinkattn's vLLM backend over FP8 KV caches, driven through vLLM 0.33's own modules as
tests/test_vllm_backend.py drives the bf16 cache (tests/vllm_stubs.py loads the wheel's modules).

vLLM allocates an FP8 cache as uint8 (STR_DTYPE_TO_TORCH_DTYPE) in its logical (num_blocks, num_kv_heads, block_size,
2 * head_size) layout; the attention layer holds the scales, `_k_scale` / `_v_scale`: float32, one element (per
tensor) or one per KV head (compressed-tensors' attn_head strategy). The cache must hold x / scale, rounded to the
format and saturated as vLLM's writers do, and attention must run on the dequantized cache. So every test checks
the cache bytes against that formula and every output row against the float64 oracle computed on the dequantized
cache (the attention's own error, apart from the quantization's), for both formats, both scale forms, decode, mixed
chunked prefill over a shared prefix, speculative batches, odd lengths and pages that cut blocks, sinks (one -inf),
sliding and full layers. Selection says why where no kernel reads FP8 (registry feature fp8_kv).

The comparison with vLLM's own Triton attention on the same FP8 cache is tests/test_peer_vllm.py's FP8 batches.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests import vllm_stubs
from tests.oracle import attention_oracle, tolerance_check
from tests.test_vllm_backend import (BLOCK, CASES, D, H, HK, WINDOW, Batch, _config, _HostReads, _selector, _sinks,
                                     _spec, platform, vb, vllm_src)  # noqa: F401  (fixtures)

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
NAN_BYTE = 0x7F  # NaN in both float8_e4m3fn and float8_e5m2: a read of a slot never written poisons the row


def _fp8_batch(ctx, q, dtype, seed, layout="LBNHC", **kw):
    """test_vllm_backend's Batch with vLLM's FP8 allocation: a uint8 cache in the same physical order, NaN bytes.
    K and V are scaled per KV head (head 1 four times head 0), so per-head scales have something to do."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    b = Batch(ctx, q, dtype, seed, layout=layout, **kw)
    order, logical = KVCacheLayout[layout].layer_view_order, tuple(b.kv_cache.shape)
    raw = torch.full([logical[i] for i in order], NAN_BYTE, dtype=torch.uint8)
    b.kv_cache = raw.permute([order.index(i) for i in range(4)])
    assert tuple(b.kv_cache.shape) == logical
    head = torch.tensor([0.5, 2.0], dtype=torch.float64)[None, :, None]
    b.k = [k * head for k in b.k]
    b.v = [v * head * 2 for v in b.v]
    return b


def _scales(form, fmt, batch):
    """vLLM's layer._k_scale / _v_scale of a scale form: 'one' (1.0, vLLM's default without a checkpoint scale),
    'tensor' (calibrated amax / format max, vLLM's 0-dim buffer), 'tensor1' (the same, shape (1,)), 'head' (one per
    KV head, compressed-tensors' attn_head), 'saturate' (a per-tensor scale a quarter of the calibrated one: the
    largest values saturate)."""
    big = torch.finfo(fmt).max
    if form == "one":
        return torch.tensor(1.0), torch.tensor(1.0)
    ks, vs = torch.cat(batch.k), torch.cat(batch.v)
    if form == "head":
        k = ks.abs().amax(dim=(0, 2)) / big
        v = vs.abs().amax(dim=(0, 2)) / big
        return k.float(), v.float()
    k, v = float(ks.abs().max()) / big, float(vs.abs().max()) / big
    if form == "saturate":
        k, v = k / 4, v / 4
    t = (torch.tensor(k), torch.tensor(v)) if form != "tensor1" else (torch.tensor([k]), torch.tensor([v]))
    return t[0].float(), t[1].float()


def _expected_fp8(x, scale, fmt, dtype):
    """What vLLM's writers store: x (in the model dtype) / scale in fp32, saturated to the format's finite range."""
    big = torch.finfo(fmt).max
    s = scale.float().reshape(-1)[None, :, None] if scale.numel() > 1 else scale.float()
    return (x.to(dtype).float() / s).clamp(-big, big).to(fmt)


def _dequantized(x8, scale):
    s = scale.double().reshape(-1)[None, :, None] if scale.numel() > 1 else scale.double()
    return x8.double() * s


def _layer(vb, kv_cache_dtype, sinks, window, dtype):
    from vllm.v1.attention.backend import AttentionType
    return vb.SinkattnImpl(H, D, D ** -0.5, HK, None, window, kv_cache_dtype, None, AttentionType.DECODER, None,
                           sinks=sinks)


def run_step(vb, batch, kv_cache_dtype, layer, window, num_spec=None, seed=0):
    """vLLM's order for one layer and step (as test_vllm_backend.run_step), with the layer holding the scales."""
    dtype = batch.dtype
    sinks = _sinks(seed)
    impl = _layer(vb, kv_cache_dtype, sinks.to(dtype), window, dtype)
    builder = vb.SinkattnMetadataBuilder(_spec(window, torch.uint8), ["model.layers.0.self_attn.attn"],
                                        _config(num_spec), torch.device("cpu"))
    for r, c in enumerate(batch.ctx):
        if c:
            impl.do_kv_cache_update(layer, batch.k[r][:c].to(dtype), batch.v[r][:c].to(dtype), batch.kv_cache,
                                    batch.slots(r, range(c)))
    md = builder.build(0, batch.common_metadata())
    key, value, slot_mapping = batch.step_kv()
    impl.do_kv_cache_update(layer, key.to(dtype), value.to(dtype), batch.kv_cache, slot_mapping)
    output = torch.full((batch.num_tokens, H * D), float("nan"), dtype=dtype)
    impl.forward(layer, batch.query.to(dtype), key.to(dtype), value.to(dtype), batch.kv_cache, md,
                 output.view(-1, H, D))
    return output.view(-1, H, D), sinks


def check_cache_and_output(batch, fmt, layer, out, sinks, window, name):
    """The cache bytes of every request's keys are vLLM's x / scale; every output row matches the float64 oracle on
    the dequantized cache (fp32 queries: 2e-5; bf16: FlashAttention's rule against the same math in bf16)."""
    k_cache, v_cache = (c.view(fmt) for c in batch.kv_cache.transpose(1, 2).split(D, dim=-1))
    w = (-1, -1) if window is None else (window - 1, 0)
    q_in = batch.query.to(batch.dtype)
    starts = batch.qsl.tolist()
    for r, s in enumerate(batch.seq):
        slots = batch.slots(r, range(s))
        k8, v8 = k_cache[slots // BLOCK, slots % BLOCK], v_cache[slots // BLOCK, slots % BLOCK]
        want_k = _expected_fp8(batch.k[r], layer._k_scale, fmt, batch.dtype)
        want_v = _expected_fp8(batch.v[r], layer._v_scale, fmt, batch.dtype)
        assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8)), f"{name}: request {r}'s K bytes"
        assert torch.equal(v8.view(torch.uint8), want_v.view(torch.uint8)), f"{name}: request {r}'s V bytes"
        k, v = _dequantized(want_k, layer._k_scale)[None], _dequantized(want_v, layer._v_scale)[None]
        rows = slice(starts[r], starts[r + 1])
        ref, _ = attention_oracle(q_in[None, rows], k, v, sinks.to(batch.dtype), causal=True, window_size=w)
        assert torch.isfinite(out[rows]).all(), f"{name}: request {r} read a slot it never wrote (NaN)"
        if batch.dtype == torch.float32:
            torch.testing.assert_close(out[rows].double(), ref[0], rtol=0, atol=2e-5, msg=f"{name} request {r}")
        else:
            base, _ = attention_oracle(q_in[None, rows], k, v, sinks.to(batch.dtype), causal=True, window_size=w,
                                       compute_dtype=batch.dtype)
            tolerance_check(f"{name} request {r}", out[rows], ref[0], base[0], atol=1e-2)


@pytest.mark.parametrize("form", ["tensor", "head", "one"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layer_step_matches_oracle_on_the_dequantized_cache(vb, case, window, kv_cache_dtype, form):
    ctx, q, kw, num_spec = CASES[case]
    layout = "LBHNC" if case == "prefill" else "LBNHC"  # vLLM allocates either order
    batch = _fp8_batch(ctx, q, torch.float32, seed=len(case), layout=layout, **kw)
    fmt = FORMATS[kv_cache_dtype]
    k_scale, v_scale = _scales(form, fmt, batch)
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale)
    out, sinks = run_step(vb, batch, kv_cache_dtype, layer, window, num_spec, seed=len(case))
    check_cache_and_output(batch, fmt, layer, out, sinks, window, f"{case}/{kv_cache_dtype}/{form}")


@pytest.mark.parametrize("kv_cache_dtype, form", [("fp8_e4m3", "tensor1"), ("fp8_e4m3", "saturate"),
                                                  ("fp8_e5m2", "head"), ("fp8", "saturate")])
def test_fp8_bf16_model_and_saturation(vb, kv_cache_dtype, form):
    """bf16 queries and K/V (gpt-oss serves in bf16), odd lengths over pages that cut blocks, and a scale small
    enough that the largest keys saturate to the format's largest finite value (vLLM's writers saturate)."""
    batch = _fp8_batch([37, 5, 63, 0], [1, 1, 3, 19], torch.bfloat16, seed=11, pad_tokens=2)
    fmt = FORMATS[kv_cache_dtype]
    k_scale, v_scale = _scales(form, fmt, batch)
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale)
    out, sinks = run_step(vb, batch, kv_cache_dtype, layer, WINDOW, seed=11)
    check_cache_and_output(batch, fmt, layer, out, sinks, WINDOW, f"bf16/{kv_cache_dtype}/{form}")
    if form == "saturate":
        k_cache = batch.kv_cache.transpose(1, 2).split(D, dim=-1)[0].view(fmt)
        written = k_cache[~torch.isnan(k_cache.float())]
        assert (written.float().abs() == torch.finfo(fmt).max).any(), "no key saturated: the case tests nothing"


def test_fp8_cache_update_writes_only_its_slots_and_keeps_nan(vb):
    """Padding tokens land, as zeros, in vLLM's null block; a NaN key stays NaN (vLLM's SATFINITE keeps NaN),
    +-inf saturates to the largest finite value."""
    batch = _fp8_batch([0, 0], [5, 18], torch.float32, seed=4, pad_tokens=3)
    impl = _layer(vb, "fp8_e4m3", None, None, torch.float32)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.05), _v_scale=torch.tensor(0.02))
    key, value, slot_mapping = batch.step_kv()
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    impl.do_kv_cache_update(layer, key.float(), value.float(), batch.kv_cache, slot_mapping)
    k_cache, v_cache = (c.view(torch.float8_e4m3fn) for c in batch.kv_cache.transpose(1, 2).split(D, dim=-1))
    s = batch.slots(0, [0])
    first = k_cache[s // BLOCK, s % BLOCK][0, 0, :3].float()
    assert torch.isnan(first[0]) and first[1] == 448 and first[2] == -448
    written = batch.kv_cache.transpose(1, 2)[..., :D].ne(NAN_BYTE).any(-1).any(-1)  # (blocks, slots) touched
    expected = torch.zeros_like(written)
    for r, n in enumerate(batch.q):
        s = batch.slots(r, range(n))
        expected[s // BLOCK, s % BLOCK] = True
    expected[0, 0] = True
    assert torch.equal(written, expected)
    assert (k_cache[0, 0].float() == 0).all() and (v_cache[0, 0].float() == 0).all()


def test_fp8_forward_reads_nothing_on_the_host_and_passes_the_layers_scales(vb, monkeypatch):
    """The graph-captured part passes views of the layer's own scale tensors (a replay re-reads them): per tensor
    and per KV head alike as (batch, nheads_k) descales with stride 0 over the batch (and over the heads for a
    per-tensor scale)."""
    from sinkattn import dispatch
    batch = _fp8_batch([12, 30, 47], [4, 4, 4], torch.float32, seed=3, pad_reqs=1, pad_tokens=4)
    builder = vb.SinkattnMetadataBuilder(_spec(WINDOW, torch.uint8), ["l"], _config(3), torch.device("cpu"))
    md = builder.build(0, batch.common_metadata())
    calls = []

    def serve(q, k_cache, v_cache, sinks, seqused_k, block_table, cu_seqlens_q, max_seqlen_q, mask, backend,
              descales, out=None, check_values=True):
        calls.append((k_cache.dtype, descales))
        return out, None

    monkeypatch.setattr(dispatch, "run_kvcache_serving", serve)
    key, value, slot_mapping = batch.step_kv()
    for dtype_name, scales in (("fp8", (torch.tensor(0.5), torch.tensor(0.25))),
                               ("fp8_e5m2", (torch.tensor([0.5, 0.75]), torch.tensor([0.25, 0.125])))):
        impl = _layer(vb, dtype_name, _sinks(0), WINDOW, torch.float32)
        layer = SimpleNamespace(_k_scale=scales[0], _v_scale=scales[1])
        calls.clear()
        with _HostReads() as mode:
            impl.do_kv_cache_update(layer, key.float(), value.float(), batch.kv_cache, slot_mapping)
            impl.forward(layer, batch.query.float(), key.float(), value.float(), batch.kv_cache, md,
                         torch.empty(batch.num_tokens, H, D))
        assert mode.seen == []
        [(cache_dtype, descales)] = calls
        assert cache_dtype == FORMATS[dtype_name]
        for got, want in zip(descales, scales):
            assert got.shape == (4, HK) and got.stride(0) == 0 and got.data_ptr() == want.data_ptr()
            assert got.stride(1) == (0 if want.numel() == 1 else 1)


def test_fp8_refusals_say_why(vb):
    from sinkattn import SinkattnValueError
    from vllm.v1.attention.backend import AttentionType
    for name in ("fp8_per_token_head", "int8_per_token_head", "fp8_inc", "fp8_ds_mla"):
        with pytest.raises(SinkattnValueError, match=f"kv_cache_dtype='{name}'.*accepted.*'fp8_e5m2'"):
            vb.SinkattnImpl(H, D, 0.1, HK, None, None, name, None, AttentionType.DECODER, None)
    impl = _layer(vb, "fp8", None, None, torch.float32)
    batch = _fp8_batch([0], [3], torch.float32, seed=1)
    key, value, slot_mapping = batch.step_kv()
    with pytest.raises(SinkattnValueError, match="needs the attention layer's _k_scale"):
        impl.do_kv_cache_update(SimpleNamespace(), key.float(), value.float(), batch.kv_cache, slot_mapping)
    with pytest.raises(SinkattnValueError, match=r"layer._k_scale has shape \(3,\); accepted: one element .*\(2,\)"):
        impl.do_kv_cache_update(SimpleNamespace(_k_scale=torch.ones(3), _v_scale=torch.ones(1)), key.float(),
                                value.float(), batch.kv_cache, slot_mapping)
    with pytest.raises(SinkattnValueError, match="must be allocated as uint8"):
        impl.do_kv_cache_update(SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(())), key.float(),
                                value.float(), torch.zeros(batch.kv_cache.shape, dtype=torch.bfloat16), slot_mapping)


# ---- selection: an FP8 cache needs a kernel that reads FP8 (registry feature fp8_kv) -------------------------
_KV_FEATURES = "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,paged16,split_kv,broadcast_strides"


@pytest.fixture
def fake_build(monkeypatch):
    """A build whose sm80 decode kernels (head dim 64, bf16, every arch from sm_80) list `features`."""
    from sinkattn import _ext

    def install(features):
        reg = tuple(dict(name=f"{op}_sm80_hdim64_bf16", family="sm80", op=op, headdim=64, dtype="bf16",
                         features=features, archs="sm_80,sm_90,compute_80", smem_bytes=0) for op in ("fwd",))
        monkeypatch.setattr(_ext, "registry", lambda: reg)
    monkeypatch.setattr(_ext, "loaded", lambda: True)
    monkeypatch.setattr(_ext, "build_info", lambda: {})
    return install


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_fp8_selection_needs_a_kernel_that_reads_fp8(platform, fake_build, kv_cache_dtype):
    """Where the build's decode kernels do not read FP8, selection refuses and names dispatch's reason (never a
    silent reference fallback); the same build serves the bf16 cache; a build that reads FP8 is selected, with
    per-head scales too."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    fake_build(_KV_FEATURES)
    for cap in ((8, 0), (8, 6), (9, 0)):
        vllm_stubs.Platform.capability = cap
        with pytest.raises(ValueError, match=f"not valid.*over an FP8 KV cache \\(kv_cache_dtype='{kv_cache_dtype}'\\)"
                                             f".*do not serve FP8 KV caches"):
            platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(kv_cache_dtype=kv_cache_dtype),
                                          num_heads=64)
        assert platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(),
                                             num_heads=64).endswith("SinkattnBackend")
    fake_build(_KV_FEATURES + ",fp8_kv")
    for per_head in (False, True):
        path = platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(
            kv_cache_dtype=kv_cache_dtype, use_per_head_quant_scales=per_head), num_heads=64)
        assert path == "sinkattn.integrations.vllm_backend.SinkattnBackend"


def test_fp8_selection_with_this_build(platform):
    """This build's answer, whatever it holds: no extension, or kernels without fp8_kv -> refused with dispatch's
    reason; a build whose sm80 decode kernels read FP8 (cc 8.0 runs sm_80 code) -> selected."""
    from sinkattn import _ext, registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    get = lambda: platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(kv_cache_dtype="fp8"),
                                                num_heads=64)
    if not _ext.loaded():
        with pytest.raises(ValueError, match="over an FP8 KV cache.*compiled extension is not available"):
            get()
        return
    # FP8-cache decode runs on the FP8 decode kernels (op fwd_fp8, csrc/sm80/fp8_kv.h), or on forward kernels that
    # list fp8_kv (registry.op_of)
    kv = [k for op in ("fwd_fp8", "fwd") for k in registry.kernels("sm80", op)
          if k["headdim"] == 64 and k["dtype"] == "bf16" and "fp8_kv" in registry.features(k)]
    if kv:
        assert get().endswith("SinkattnBackend")
    else:
        with pytest.raises(ValueError, match="over an FP8 KV cache"):
            get()


def test_fp8_names_map_as_vllm_maps_them(vb):
    """vLLM's own tables: every FP8 name is a uint8 allocation, "fp8" is e4m3 (its kv-cache dtype alias), and the
    CUDA platform's FP8 type is float8_e4m3fn."""
    from sinkattn.integrations.vllm_paged import FP8_KV_DTYPES
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils
    assert all(torch_utils.STR_DTYPE_TO_TORCH_DTYPE[n] == torch.uint8 for n in FP8_KV_DTYPES)
    assert current_platform.fp8_dtype() == torch.float8_e4m3fn == FP8_KV_DTYPES["fp8"] == FP8_KV_DTYPES["fp8_e4m3"]
    assert FP8_KV_DTYPES["fp8_e5m2"] == torch.float8_e5m2
    assert set(vb.SinkattnBackend.supported_kv_cache_dtypes) == {"auto", "float16", "bfloat16", *FP8_KV_DTYPES}
    # vLLM's Attention layer quantizes the query to FP8 only for impls that ask (AttentionImpl's default False):
    # sinkattn takes q in the model dtype over an FP8 cache.
    assert vb.SinkattnImpl.supports_quant_query_input is False


# ---- vLLM's own Triton attention on the same FP8 cache (bench/harness/peer_vllm.py, Triton's interpreter) -------
TRITON_BATCHES = {
    # vLLM's Triton kernel reads the first element of its k/v descales (per tensor only: TRITON_ATTN declares no
    # per-head scales), so these are per-tensor, calibrated as amax / the format's largest value (peer_vllm).
    "decode-e4m3": ("decode, window 8, odd lengths over pages that cut blocks", (37, 3, 20), (1, 1, 1), 7,
                    "fp8_e4m3"),
    "mixed-e5m2": ("decode + a chunk over a cached prefix (vLLM's 2D path), full", (33, 16), (1, 5), -1, "fp8_e5m2"),
    "mixed-e4m3": ("the same over e4m3", (33, 16), (1, 5), -1, "fp8_e4m3"),
}


def _triton_child(src: str) -> None:
    """In a process started with TRITON_INTERPRET=1: vLLM's kernel and sinkattn's backend forward on one FP8 cache
    (written by the backend's writer), both against the float64 oracle on the dequantized cache."""
    from pathlib import Path
    from bench.harness import peer_vllm as P
    fn = P.load(Path(src))
    for which, (name, ctx, q, window, kv) in TRITON_BATCHES.items():
        batch = P.Batch(name, ctx, q, window, kv)
        x = P.make(batch, torch.device("cpu"), dtype=torch.float32, seed=1)
        assert x["kv_cache"].dtype == torch.uint8
        k8, v8 = (c.view(x["fp8_dtype"]) for c in x["kv_cache"].transpose(1, 2).split(P.D, dim=-1))
        k_scale, v_scale = x["scales"]
        starts, w = x["qsl"].tolist(), ((window, 0) if window >= 0 else (-1, -1))
        refs = []
        for r, s in enumerate(batch.seq):
            pos = torch.arange(s)
            page = x["block_table"][r].long()[pos // P.PAGE]
            k = k8[page, pos % P.PAGE].double() * k_scale.double()
            v = v8[page, pos % P.PAGE].double() * v_scale.double()
            refs.append(attention_oracle(x["query"][None, starts[r]:starts[r + 1]], k[None], v[None], x["sinks"],
                                         causal=True, window_size=w)[0][0])
        ref = torch.cat(refs)
        theirs = P.prep_vllm(fn, batch, x)().clone()
        ours = P.prep_sinkattn(batch, x)().clone()
        torch.testing.assert_close(theirs.double(), ref, rtol=0, atol=2e-5, msg=f"{which}: vLLM's kernel vs float64")
        torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5, msg=f"{which}: sinkattn vs float64")
        # The scales matter here (the same cache read as if scale were 1 is far from the answer).
        unscaled = P.prep_sinkattn(batch, dict(x, scales=(torch.ones(()), torch.ones(()))))().clone()
        assert (unscaled.double() - ref).abs().max() > 1e-2, f"{which}: the scales change nothing; weak case"
        print(f"ok {which}: |vllm - oracle| {(theirs.double() - ref).abs().max():.2e}, "
              f"|sinkattn - oracle| {(ours.double() - ref).abs().max():.2e}, scales {float(k_scale):.4g} "
              f"{float(v_scale):.4g}")


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                    reason="triton is not installed (it ships with torch's Linux wheels)")
def test_vllm_triton_and_sinkattn_agree_on_one_fp8_cache(vllm_src, tmp_path):  # noqa: F811
    out = _run_interpreted("_triton_child", tmp_path)
    assert all(f"ok {which}:" in out for which in TRITON_BATCHES), out
    print(out)


def _run_interpreted(child: str, tmp_path) -> str:
    return vllm_stubs.run_interpreted("tests.test_vllm_fp8", child, tmp_path)


# ---- bench: the decode grid's FP8 cases ---------------------------------------------------------------------------
def test_bench_decode_grid_holds_fp8_cases_beside_bf16():
    from bench.harness import grids
    from bench.harness import peer_vllm as P
    dec = grids.get("decode")
    fp8_cases = [c for c in dec if c.kv_dtype != "auto"]
    assert {c.kv_dtype for c in fp8_cases} == {"fp8_e4m3", "fp8_e5m2"} and {c.paged for c in fp8_cases} == {True, False}
    ids = {c.id for c in dec}
    for c in fp8_cases:  # each right beside the same case over the bf16 cache
        import dataclasses
        assert dataclasses.replace(c, kv_dtype="auto").id in ids and c.kv_elem_bytes == 1
    assert any(c.seqlen_k >= 32768 for c in fp8_cases)  # the FP8 decode target is set at >= 32k keys
    pairs = P.fp8_pairs(P.grid())
    assert "decode/full/b64/sk32768/fp8_e4m3" in pairs and "decode/full/b64/sk32768/fp8_e5m2" in pairs
    assert all(v in {b.name for b in P.grid()} for v in pairs.values())
    fp8_batch = next(b for b in P.grid() if b.kv_cache_dtype == "fp8_e4m3")
    bf16_batch = next(b for b in P.grid() if b.name == P.fp8_pairs(P.grid())[fp8_batch.name])
    assert P.kv_bytes(fp8_batch) - 2 * P.H * P.D * 2 * sum(fp8_batch.q) == \
        (P.kv_bytes(bf16_batch) - 2 * P.H * P.D * 2 * sum(bf16_batch.q)) // 2


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("paged", [True, False])
def test_bench_fp8_inputs_and_sinkattn_column_match_the_oracle(kv_dtype, paged):
    """The bench's FP8 inputs: caches quantized with amax scales, x.k/x.v their dequantized copies; the sinkattn
    column (on the CPU: the reference backend) reads the FP8 caches and matches the float64 oracle on them."""
    import dataclasses
    from bench.harness import comparators as C
    from bench.harness.grids import Case
    case = Case("t", "decode", "fwd", 2, 1, 300, 8, 2, 64, "fp32", causal=True, window_right=0, sinks=True,
                paged=paged, page_size=64, kv_dtype=kv_dtype)
    x = C.make_inputs(case, torch.device("cpu"), torch.Generator().manual_seed(0))
    fmt = C.FP8_TYPES[kv_dtype]
    assert x.k_cache.dtype == fmt and x.v_cache.dtype == fmt and x.k_scale.dim() == 0
    assert float(x.k_cache.float().abs().max()) == torch.finfo(fmt).max  # amax calibration reaches the top
    ref, _ = attention_oracle(x.q, x.k.double(), x.v.double(), x.sinks, causal=True)
    prep = C.COMPARATORS["sinkattn"](case, x, torch.device("cpu"))
    torch.testing.assert_close(prep.output().double(), ref, rtol=0, atol=2e-5)
    plain = C.make_inputs(dataclasses.replace(case, kv_dtype="auto"), torch.device("cpu"),
                          torch.Generator().manual_seed(0))
    assert (x.k.double() - plain.k.double()).abs().max() > 0  # the FP8 step is in the keys the oracle sees


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_peer_fp8_cache_is_the_bf16_cache_quantized(kv):
    """bench/harness/peer_vllm.make: the FP8 cache (written in chunks by the backend's writer) holds the same random
    K/V as the bf16 case's cache, x / (amax / format max), in vLLM's uint8 allocation and physical order."""
    from bench.harness import peer_vllm as P
    bf = P.Batch("t", (37, 3), (1, 1), 7)
    f8 = P.Batch("t", (37, 3), (1, 1), 7, kv)
    torch.manual_seed(5)
    x_bf = P.make(bf, torch.device("cpu"), dtype=torch.bfloat16, seed=1)
    torch.manual_seed(5)
    x_f8 = P.make(f8, torch.device("cpu"), dtype=torch.bfloat16, seed=1)
    fmt = FORMATS[kv]
    assert x_f8["kv_cache"].dtype == torch.uint8 and x_f8["kv_cache"].stride() == x_bf["kv_cache"].stride()
    big = torch.finfo(fmt).max
    ks, vs = x_f8["scales"]
    k_bf, v_bf = x_bf["kv_cache"].transpose(1, 2).split(P.D, dim=-1)
    assert ks == k_bf.abs().max().float() / big and ks.dim() == 0
    k8, v8 = (c.view(fmt) for c in x_f8["kv_cache"].transpose(1, 2).split(P.D, dim=-1))
    want_k = (k_bf.float() / ks).clamp(-big, big).to(fmt)
    want_v = (v_bf.float() / vs).clamp(-big, big).to(fmt)
    assert torch.equal(k8.contiguous().view(torch.uint8), want_k.contiguous().view(torch.uint8))
    assert torch.equal(v8.contiguous().view(torch.uint8), want_v.contiguous().view(torch.uint8))
    assert P._to_fp8.__defaults__ == (4096,)  # the chunked path; one more with tiny chunks must agree
    x2 = dict(x_bf)
    P._to_fp8(x2, kv, chunk_blocks=1)
    assert torch.equal(x2["kv_cache"], x_f8["kv_cache"])


def _writer_child(src: str) -> None:
    """In a process started with TRITON_INTERPRET=1: vLLM's cache writer (its Triton backend's, the bytes of the
    reshape_and_cache_flash op its FlashAttention backend calls) and sinkattn's fallback writer (vllm_paged.write_kv)
    on the same step, into two zeroed caches in vLLM's layout: the same bytes, bf16 and FP8 (e4m3) with per-tensor
    scales (for FP8, except where the interpreter's own cast is off: see below). Padding tokens (slot -1): vLLM's
    writers skip them, sinkattn's writes zeros into the null block's slot 0, which holds zeros already, so the caches
    still match byte for byte."""
    from pathlib import Path
    from bench.harness import peer_vllm as P
    from sinkattn.integrations import vllm_paged
    writer = P.load_writer(Path(src))
    g = torch.Generator().manual_seed(0)
    blocks, page, hk, d, n = 9, 16, 2, 64, 40
    for kv_cache_dtype, fmt in (("auto", None), ("fp8", torch.float8_e4m3fn)):
        key = (torch.randn(n, hk, d, generator=g) * 3).to(torch.bfloat16)
        value = (torch.randn(n, hk, d, generator=g) * 3).to(torch.bfloat16)
        slots = torch.randperm((blocks - 1) * page, generator=g)[:n] + page  # block 0: vLLM's null block
        slots[[3, 17]] = -1
        scales = (torch.tensor(0.05), torch.tensor(0.125))
        caches = []
        for write in ("vllm", "sinkattn"):
            alloc = torch.uint8 if fmt is not None else torch.bfloat16
            phys = torch.zeros(blocks, page, hk, 2 * d, dtype=alloc)
            kv = phys.permute(0, 2, 1, 3)  # the logical (num_blocks, hk, page, 2d) view vLLM hands a backend
            if write == "vllm":
                kc, vc = kv.transpose(1, 2).split(d, dim=-1)
                writer(key, value, kc, vc, slots, kv_cache_dtype, *scales)
            else:
                kc, vc = vllm_paged.cache_views(kv, d, fmt)
                vllm_paged.write_kv(kc, vc, key, value, slots, scales if fmt is not None else None)
            caches.append(phys.view(torch.uint8))
        written = (caches[0] != 0).sum().item()
        assert written > n * hk * d, f"{kv_cache_dtype}: vLLM's writer wrote almost nothing; weak case"
        differ = caches[0] != caches[1]
        if fmt is not None and differ.any():
            # TRITON_INTERPRET's float -> fp8 cast is not the GPU's round-to-nearest-even: it rounds ties away from
            # zero (100.0 -> 104, not 96) and drops the carry when rounding reaches the next power of two (31.4 ->
            # 16, not 32). vLLM's writer on a GPU rounds as torch does. So every differing byte must be one of those
            # two faults at a quotient x / scale (fp32, as both writers compute it) whose nearest-even code is
            # sinkattn's.
            live = slots >= 0
            block, off = slots[live] // page, slots[live] % page
            quot = torch.zeros(blocks, page, hk, 2 * d)
            quot[block, off, :, :d] = key[live].float() / scales[0]
            quot[block, off, :, d:] = value[live].float() / scales[1]
            q = quot.view(-1)[differ.view(-1)]
            ours = caches[1].view(fmt).view(-1)[differ.view(-1)].float()
            theirs = caches[0].view(fmt).view(-1)[differ.view(-1)].float()
            assert torch.equal(ours, q.to(fmt).float()), "sinkattn's code is not the nearest-even one"
            tie = (ours + theirs) / 2 == q
            carry = (ours.abs() == 2 * theirs.abs()) & (ours.abs() == 2 ** ours.abs().log2().round())
            assert (tie | carry).all(), \
                f"{kv_cache_dtype}: {(~(tie | carry)).sum().item()} bytes differ beyond the interpreter's faults"
            print(f"interpreter faults at {differ.sum().item()} of {written} codes: {tie.sum().item()} ties, "
                  f"{carry.sum().item()} carries")
        else:
            assert not differ.any(), f"{kv_cache_dtype}: {differ.sum().item()} bytes differ"
        print(f"ok writer {kv_cache_dtype}: {caches[0].numel()} bytes compared")


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                    reason="triton is not installed (it ships with torch's Linux wheels)")
def test_sinkattn_writer_writes_vllms_bytes(vllm_src, tmp_path):  # noqa: F811
    out = _run_interpreted("_writer_child", tmp_path)
    assert "ok writer auto" in out and "ok writer fp8" in out, out
