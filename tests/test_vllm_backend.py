"""sinkattn's vLLM backend, driven through vLLM 0.33's own code (tests/vllm_stubs.py loads the wheel's modules).

A gpt-oss-like attention layer (sinks, GQA 8:1, head dim 64, a sliding-window layer and a full layer, block
size 16) runs batches as vLLM's model runner hands them over: vLLM's CommonAttentionMetadata into the
backend's builder (a subclass of vLLM's AttentionMetadataBuilder, reorder threshold set by vLLM's own
_init_reorder_batch_threshold), then impl.do_kv_cache_update and impl.forward in the order vLLM's
unified_kv_cache_update / unified_attention_with_output call them, on a KV cache in vLLM's logical layout
(num_blocks, num_kv_heads, block_size, 2 * head_size) over both physical layouts vLLM allocates. Every real
output row is checked against the float64 oracle; the cache starts as NaN, so a read of any slot the batch
did not write fails. Selection goes through vLLM's CudaPlatform.get_attn_backend_cls and registry.
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from tests import vllm_stubs
from tests.oracle import attention_oracle, tolerance_check

H, HK, D, BLOCK = 16, 2, 64, 16   # gpt-oss: 64 q heads over 8 KV heads, head dim 64 (8:1 kept, fewer heads)
WINDOW = 8                       # gpt-oss slides 128; 8 lets the window bite at these context lengths


@pytest.fixture(scope="session")
def vllm_src(request):
    """The wheel's source, fetched once (tests/vllm_stubs.py; only with SINKATTN_FETCH_VLLM=1, announced first)."""
    t = time.time()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    announce = (lambda line: reporter.write_line(line)) if reporter is not None else None  # not captured
    try:
        root = vllm_stubs.vllm_root(announce=announce)
    except vllm_stubs.NotFetched as e:
        pytest.skip(str(e))
    except RuntimeError as e:
        pytest.skip(f"vLLM {vllm_stubs.VLLM_VERSION} wheel could not be fetched: {e}")
    print(f"\nvLLM {vllm_stubs.VLLM_VERSION} source ready in {time.time() - t:.1f} s at {root}")
    return root


@pytest.fixture(scope="module")
def vb(vllm_src):
    """sinkattn.integrations.vllm_backend imported over the real vLLM modules (taken out again after)."""
    vllm_stubs.install(vllm_src)
    import sinkattn.integrations.vllm_backend as mod
    yield mod
    vllm_stubs.park()


def test_the_wheel_is_fetched_only_when_asked_and_announced(tmp_path, monkeypatch):
    """The first run used to download the 336 MB wheel silently: now only with SINKATTN_FETCH_VLLM=1, said first."""
    monkeypatch.setenv("SINKATTN_CACHE", str(tmp_path))
    monkeypatch.delenv(vllm_stubs.FETCH_ENV, raising=False)
    calls, lines = [], []

    def fake_pip(cmd, **kw):
        calls.append((list(cmd), list(lines)))
        return SimpleNamespace(returncode=1, stdout="", stderr="no network here")

    monkeypatch.setattr(vllm_stubs.subprocess, "run", fake_pip)
    with pytest.raises(vllm_stubs.NotFetched) as e:
        vllm_stubs.vllm_root(announce=lines.append)
    msg = str(e.value)
    assert calls == [] and lines == []
    assert "336 MB" in msg and "SINKATTN_FETCH_VLLM=1" in msg and str(tmp_path) in msg
    monkeypatch.setenv(vllm_stubs.FETCH_ENV, "1")
    with pytest.raises(RuntimeError, match="no network here") as e:
        vllm_stubs.vllm_root(announce=lines.append)
    assert not isinstance(e.value, vllm_stubs.NotFetched)
    [(cmd, said_before)] = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and f"vllm=={vllm_stubs.VLLM_VERSION}" in cmd
    assert len(said_before) == 1 and "336 MB" in said_before[0] and "downloading" in said_before[0]
    # a wheel already in the cache needs no opt-in (nothing is downloaded)
    monkeypatch.delenv(vllm_stubs.FETCH_ENV)
    base = tmp_path / f"vllm-{vllm_stubs.VLLM_VERSION}"
    import zipfile
    with zipfile.ZipFile(base / f"vllm-{vllm_stubs.VLLM_VERSION}-py3-none-any.whl", "w") as z:
        z.writestr("vllm/v1/attention/backend.py", "# stand-in\n")
    assert (vllm_stubs.vllm_root() / "vllm" / "v1" / "attention" / "backend.py").exists() and len(calls) == 1


def _config(num_spec=None):
    # vllm.config's VllmConfig is a pydantic model; the builder reads these fields of it.
    spec = None if num_spec is None else SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False)
    return SimpleNamespace(speculative_config=spec, use_v2_model_runner=True,
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))


class Batch:
    """One scheduler step: requests with `ctx` tokens already cached and `q` new tokens, on pages handed out
    like vLLM's block pool does (block 0 is the null block; shared prefixes share physical pages)."""

    def __init__(self, ctx, q, dtype, seed, pad_reqs=0, pad_tokens=0, share_prefix=None, layout="LBNHC"):
        from vllm.v1.kv_cache_layout import KVCacheLayout
        g = torch.Generator().manual_seed(seed)
        self.ctx, self.q, self.dtype = list(ctx), list(q), dtype
        self.seq = [c + n for c, n in zip(ctx, q)]
        per_req = [math.ceil(s / BLOCK) for s in self.seq]
        num_blocks = 1 + sum(per_req) + 3
        pages = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never block 0
        self.block_table = torch.zeros(len(ctx) + pad_reqs, max(per_req) + 1, dtype=torch.int32)
        for r, n in enumerate(per_req):
            self.block_table[r, :n] = torch.tensor([pages.pop() for _ in range(n)], dtype=torch.int32)
        # Full K/V of every request (cached prefix + this step), in float64 for the oracle.
        self.k = [torch.randn(s, HK, D, generator=g, dtype=torch.float64) for s in self.seq]
        self.v = [torch.randn(s, HK, D, generator=g, dtype=torch.float64) for s in self.seq]
        if share_prefix is not None:  # prefix caching: request b reuses request a's first n full pages
            a, b, n = share_prefix
            self.block_table[b, :n] = self.block_table[a, :n]
            self.k[b][: n * BLOCK] = self.k[a][: n * BLOCK]
            self.v[b][: n * BLOCK] = self.v[a][: n * BLOCK]
        # vLLM's logical cache view over a physical allocation in `layout` order, poisoned with NaN.
        order = KVCacheLayout[layout].layer_view_order
        logical = (num_blocks, HK, BLOCK, 2 * D)
        phys = torch.full([logical[i] for i in order], float("nan"), dtype=dtype)
        self.kv_cache = phys.permute([order.index(i) for i in range(4)])
        assert tuple(self.kv_cache.shape) == logical
        lens = self.q + [0] * pad_reqs
        self.qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.num_tokens = sum(self.q) + pad_tokens
        self.query = torch.randn(self.num_tokens, H, D, generator=g, dtype=torch.float64)
        self.seq_lens = torch.tensor(self.seq + [0] * pad_reqs, dtype=torch.int32)
        self.pad_tokens = pad_tokens

    def slots(self, r, positions):
        pos = torch.as_tensor(positions)
        return self.block_table[r].long()[pos // BLOCK] * BLOCK + pos % BLOCK

    def step_kv(self):
        """This step's new keys/values packed like the query, and slot_mapping (-1 on padding tokens)."""
        ks = [self.k[r][c:] for r, c in enumerate(self.ctx)]
        vs = [self.v[r][c:] for r, c in enumerate(self.ctx)]
        slots = [self.slots(r, range(c, s)) for r, (c, s) in enumerate(zip(self.ctx, self.seq))]
        pad = torch.full((self.pad_tokens, HK, D), 5.0, dtype=torch.float64)  # padded rows hold stale values
        slot_mapping = torch.cat(slots + [torch.full((self.pad_tokens,), -1, dtype=torch.long)])
        return torch.cat(ks + [pad]), torch.cat(vs + [pad]), slot_mapping

    def common_metadata(self):
        from vllm.v1.attention.backend import CommonAttentionMetadata
        _, _, slot_mapping = self.step_kv()
        return CommonAttentionMetadata(
            query_start_loc=self.qsl.clone(), query_start_loc_cpu=self.qsl.clone(), seq_lens=self.seq_lens,
            num_reqs=len(self.seq_lens), num_actual_tokens=self.num_tokens, max_query_len=max(self.q),
            max_seq_len=max(self.seq), block_table_tensor=self.block_table, slot_mapping=slot_mapping)


def _layer(vb, sinks, window, dtype):
    from vllm.v1.attention.backend import AttentionType
    return vb.SinkattnImpl(H, D, D ** -0.5, HK, None, window, "auto", None, AttentionType.DECODER, None,
                           sinks=sinks)


def _spec(window, dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    if window is None:
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HK, head_size=D, dtype=dtype)
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HK, head_size=D, dtype=dtype, sliding_window=window)


def _sinks(seed):
    s = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2
    s[3] = float("-inf")  # vLLM pads sinks with -inf (make_attention_sink): plain attention for that head
    return s


def run_step(vb, batch, window, num_spec=None, seed=0, capture=False, drop_outside_window=False):
    """What vLLM does for one layer in one step: prior steps' cache writes, build, kv update, forward.
    drop_outside_window: what vLLM's sliding-window KV manager does to pages no query can see any more:
    free them (here: poisoned with NaN, as if reused) and point the block table at the null block 0."""
    dtype = batch.dtype
    sinks = _sinks(seed)
    impl = _layer(vb, sinks.to(dtype), window, dtype)
    builder = vb.SinkattnMetadataBuilder(_spec(window, dtype), ["model.layers.0.self_attn.attn"],
                                        _config(num_spec), torch.device("cpu"))
    for r, c in enumerate(batch.ctx):  # earlier steps cached the prefix (same writer as this step)
        if c:
            impl.do_kv_cache_update(None, batch.k[r][:c].to(dtype), batch.v[r][:c].to(dtype), batch.kv_cache,
                                    batch.slots(r, range(c)))
    if drop_outside_window:
        batch.kv_cache[0] = 0  # vLLM allocates the cache zeroed; block 0 is never handed out
        for r, c in enumerate(batch.ctx):
            first_visible = max(0, c - (window - 1))  # the step's first query sees keys from here on
            for page in range(first_visible // BLOCK):
                batch.kv_cache[batch.block_table[r, page].long()] = float("nan")
                batch.block_table[r, page] = 0
    common = batch.common_metadata()
    md = builder.build_for_cudagraph_capture(common) if capture else builder.build(0, common)
    key, value, slot_mapping = batch.step_kv()
    impl.do_kv_cache_update(None, key.to(dtype), value.to(dtype), batch.kv_cache, slot_mapping)
    output = torch.full((batch.num_tokens, H * D), float("nan"), dtype=dtype)
    impl.forward(None, batch.query.to(dtype), key.to(dtype), value.to(dtype), batch.kv_cache, md,
                 output.view(-1, H, D))
    return output.view(-1, H, D), md, builder, sinks


def check_against_oracle(batch, out, sinks, window, name):
    w = (-1, -1) if window is None else (window - 1, 0)
    q_in = batch.query.to(batch.dtype)
    starts = batch.qsl.tolist()
    for r in range(len(batch.seq)):
        rows = slice(starts[r], starts[r + 1])
        k, v = batch.k[r].to(batch.dtype)[None], batch.v[r].to(batch.dtype)[None]
        ref, _ = attention_oracle(q_in[None, rows], k, v, sinks.to(batch.dtype), causal=True, window_size=w)
        if batch.dtype == torch.float32:
            torch.testing.assert_close(out[rows].double(), ref[0], rtol=0, atol=2e-5, msg=f"{name} request {r}")
        else:
            base, _ = attention_oracle(q_in[None, rows], k, v, sinks.to(batch.dtype), causal=True, window_size=w,
                                       compute_dtype=batch.dtype)
            tolerance_check(f"{name} request {r}", out[rows], ref[0], base[0], atol=1e-2)


CASES = {
    # name: (context lengths, query lengths, extra Batch kwargs, num speculative tokens)
    "decode": ([0, 16, 39, 63, 5], [1, 1, 1, 1, 1], {}, None),
    "mixed": ([17, 40, 2, 32, 0], [1, 1, 1, 20, 23], dict(pad_tokens=5, share_prefix=(1, 3, 2)), None),
    "prefill": ([0, 0, 32], [19, 37, 21], dict(share_prefix=(1, 2, 2)), None),
    "speculative": ([12, 30, 47, 3], [4, 4, 4, 4], dict(pad_reqs=2, pad_tokens=8), 3),
    "spec-ragged": ([12, 30, 47, 3], [4, 2, 4, 1], {}, 3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_step_matches_oracle(vb, case, window, dtype):
    ctx, q, kw, num_spec = CASES[case]
    layout = "LBHNC" if case == "prefill" else "LBNHC"  # vLLM allocates either order; the views read both
    batch = Batch(ctx, q, dtype, seed=len(case), layout=layout, **kw)
    out, md, builder, sinks = run_step(vb, batch, window, num_spec, seed=len(case))
    check_against_oracle(batch, out, sinks, window, f"{case}/{'sliding' if window else 'full'}/{dtype}")
    if num_spec is not None:  # vLLM's own threshold logic put 1 + k query tokens on the decode side
        assert builder.reorder_batch_threshold == 1 + num_spec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sliding_layer_with_dropped_pages(vb, dtype):
    """gpt-oss's sliding layers after vLLM dropped the pages left of the window (long contexts, decode and a
    chunk over a cached prefix): nothing may reach past the window into the null block or freed pages."""
    batch = Batch([100, 63, 50, 200], [1, 1, 20, 1], dtype, seed=7, pad_tokens=3)
    out, _, _, sinks = run_step(vb, batch, WINDOW, seed=7, drop_outside_window=True)
    assert (batch.block_table[:, 0] == 0).all()  # pages were dropped
    check_against_oracle(batch, out, sinks, WINDOW, f"sliding-dropped/{dtype}")


def test_metadata_is_vllms_buffers(vb):
    """The metadata holds vLLM's own device tensors (what a CUDA graph replay re-reads), no plan made on the host."""
    batch = Batch([12, 30, 0, 47], [1, 4, 20, 1], torch.float32, seed=5, pad_reqs=1, pad_tokens=4)
    builder = vb.SinkattnMetadataBuilder(_spec(WINDOW, torch.float32), ["l"], _config(3), torch.device("cpu"))
    common = batch.common_metadata()
    md = builder.build(0, common)
    assert md.query_start_loc.data_ptr() == common.query_start_loc.data_ptr()
    assert md.seq_lens.data_ptr() == batch.seq_lens.data_ptr()
    assert md.block_table.data_ptr() == batch.block_table.data_ptr()
    assert md.max_query_len == 20


@pytest.mark.parametrize("reqs", [([12, 30, 47, 3], [4, 4, 4, 4]), ([12, 30, 5, 47], [1, 1, 19, 4])],
                         ids=["uniform-spec", "mixed"])
def test_cudagraph_capture_metadata_serves_every_batch(vb, reqs):
    """vLLM builds capture metadata through build_for_cudagraph_capture; one launch whose shape depends on the
    padded sizes alone serves mixed batches as well as uniform ones (AttentionCGSupport.ALWAYS)."""
    batch = Batch(*reqs, torch.float32, seed=9, pad_reqs=2, pad_tokens=8)
    out, md, builder, sinks = run_step(vb, batch, WINDOW, num_spec=3, capture=True)
    assert md.seq_lens.data_ptr() == batch.seq_lens.data_ptr()
    assert md.block_table.data_ptr() == batch.block_table.data_ptr()
    assert builder.get_cudagraph_support(None, None).name == "ALWAYS"
    check_against_oracle(batch, out, sinks, WINDOW, "capture")


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every tensor-to-host read (what a CUDA graph cannot capture) made at the Python level."""
    READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu", "nonzero",
             "any", "all", "equal", "allclose"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_forward_and_cache_update_read_nothing_on_the_host(vb, monkeypatch):
    """The graph-captured part (do_kv_cache_update + forward) must not read device values; sinkattn's op is
    replaced by a recorder so that only the backend's own code is observed (the op's CUDA path has its own
    capture guards, sinkattn._checks.value_checks_on)."""
    batch = Batch([12, 30, 47], [4, 4, 4], torch.float32, seed=3, pad_reqs=1, pad_tokens=4)
    impl = _layer(vb, _sinks(0), WINDOW, torch.float32)
    builder = vb.SinkattnMetadataBuilder(_spec(WINDOW, torch.float32), ["l"], _config(3), torch.device("cpu"))
    md = builder.build(0, batch.common_metadata())
    calls = []

    def serve(q, k_cache, v_cache, sinks, seqused_k, block_table, cu_seqlens_q, max_seqlen_q, mask, backend,
              descales, out=None, check_values=True):
        calls.append((q.shape, seqused_k.data_ptr(), block_table.data_ptr(), cu_seqlens_q.data_ptr(), max_seqlen_q,
                      (mask.window_left, mask.window_right), check_values, out.data_ptr()))
        return out, None

    from sinkattn import dispatch
    monkeypatch.setattr(dispatch, "run_kvcache_serving", serve)
    key, value, slot_mapping = batch.step_kv()
    q = batch.query.float()
    output = torch.empty(batch.num_tokens, H, D)
    with _HostReads() as mode:
        impl.do_kv_cache_update(None, key.float(), value.float(), batch.kv_cache, slot_mapping)
        impl.forward(None, q, key.float(), value.float(), batch.kv_cache, md, output)
    assert mode.seen == []
    # one call for the whole batch, on vLLM's buffers, into vLLM's output, without the value checks' host reads
    assert calls == [(q.shape, batch.seq_lens.data_ptr(), batch.block_table.data_ptr(), md.query_start_loc.data_ptr(),
                      4, (WINDOW - 1, 0), False, output.data_ptr())]


def test_mixed_step_on_the_emulated_kernel(vb, monkeypatch):
    """A mixed step (decodes, speculative rows, a prefill chunk, an empty padding request) through the backend's
    forward on the sm80 kernel under host emulation: one serving call per layer, every row against the oracle."""
    from sinkattn import _ext, dispatch
    if not any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16" and k["op"] == "fwd"
               for k in (_ext.registry() if _ext.loaded() else [])):
        pytest.skip("no emulated hdim64 bf16 kernel in this build")
    serve, calls = dispatch.run_kvcache_serving, []

    def on_the_emulated_kernel(*args, **kw):
        calls.append(args[9])
        return serve(*args[:9], "sm80-emulated", *args[10:], **kw)
    monkeypatch.setattr(dispatch, "run_kvcache_serving", on_the_emulated_kernel)
    batch = Batch([40, 200, 31, 70], [1, 1, 4, 25], torch.bfloat16, seed=11, pad_reqs=1, pad_tokens=5)
    for window in (WINDOW, None):
        calls.clear()
        out, md, _, sinks = run_step(vb, batch, window, num_spec=3, seed=11)
        assert calls == ["auto"]
        check_against_oracle(batch, out, sinks, window, f"emulated mixed/{window}")


def test_cache_update_uses_vllms_writer_where_vllm_has_it(vb, monkeypatch):
    """Where vLLM's build has torch.ops._C_cache_ops.reshape_and_cache_flash (CUDA), the backend hands it the step as
    vLLM's FlashAttention backend does: key, value, the K and V views, slot_mapping, kv_cache_dtype and the layer's
    own scale tensors; per-KV-head FP8 scales, CPU tensors and builds without the op take sinkattn's writer."""
    from types import SimpleNamespace as NS
    op = object()
    monkeypatch.setattr(torch, "ops", NS(_C_cache_ops=NS(reshape_and_cache_flash=op)))
    cuda_key, cpu_key = NS(is_cuda=True), NS(is_cuda=False)
    one, per_head = (torch.tensor(0.5), torch.tensor(0.25)), (torch.ones(HK), torch.ones(HK))
    assert vb._vllm_cache_writer(cuda_key, None) is op
    assert vb._vllm_cache_writer(cuda_key, one) is op
    assert vb._vllm_cache_writer(cuda_key, per_head) is None
    assert vb._vllm_cache_writer(cpu_key, None) is None
    monkeypatch.setattr(torch, "ops", NS(_C_cache_ops=NS()))
    assert vb._vllm_cache_writer(cuda_key, None) is None

    calls = []
    monkeypatch.setattr(vb, "_vllm_cache_writer", lambda key, scales: lambda *a: calls.append(a))
    batch = Batch([0, 0], [5, 18], torch.float32, seed=4, pad_tokens=3)
    impl = _layer(vb, None, None, torch.float32)
    key, value, slot_mapping = batch.step_kv()
    layer = NS(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    impl.do_kv_cache_update(layer, key, value, batch.kv_cache, slot_mapping)
    [(k, v, kc, vc, slots, dtype, ks, vs)] = calls
    want_k, want_v = batch.kv_cache.transpose(1, 2).split(D, dim=-1)
    assert k is key and v is value and slots is slot_mapping and dtype == "auto"
    assert ks is layer._k_scale and vs is layer._v_scale
    assert (kc.data_ptr(), kc.shape, kc.stride()) == (want_k.data_ptr(), want_k.shape, want_k.stride())
    assert (vc.data_ptr(), vc.shape, vc.stride()) == (want_v.data_ptr(), want_v.shape, want_v.stride())


def test_cache_update_writes_only_its_slots(vb):
    batch = Batch([0, 0], [5, 18], torch.float32, seed=4, pad_tokens=3)
    impl = _layer(vb, None, None, torch.float32)
    key, value, slot_mapping = batch.step_kv()
    impl.do_kv_cache_update(None, key.float(), value.float(), batch.kv_cache, slot_mapping)
    k_cache, v_cache = batch.kv_cache.transpose(1, 2).split(D, dim=-1)
    for r, n in enumerate(batch.q):
        s = batch.slots(r, range(n))
        torch.testing.assert_close(k_cache[s // BLOCK, s % BLOCK].double(), batch.k[r].float().double())
        torch.testing.assert_close(v_cache[s // BLOCK, s % BLOCK].double(), batch.v[r].float().double())
    written = ~torch.isnan(k_cache).all(-1).all(-1)  # (blocks, slots) touched
    expected = torch.zeros_like(written)
    for r, n in enumerate(batch.q):
        s = batch.slots(r, range(n))
        expected[s // BLOCK, s % BLOCK] = True
    expected[0, 0] = True  # padding tokens (slot -1) land in vLLM's null block, as zeros
    assert torch.equal(written, expected)
    assert (k_cache[0, 0] == 0).all() and (v_cache[0, 0] == 0).all()


def test_no_sinks_layer_is_plain_attention(vb):
    batch = Batch([20, 0], [1, 9], torch.float32, seed=5)
    impl = _layer(vb, None, None, torch.float32)
    builder = vb.SinkattnMetadataBuilder(_spec(None, torch.float32), ["l"], _config(), torch.device("cpu"))
    key, value, slot_mapping = batch.step_kv()
    impl.do_kv_cache_update(None, batch.k[0][:20].float(), batch.v[0][:20].float(), batch.kv_cache,
                            batch.slots(0, range(20)))
    impl.do_kv_cache_update(None, key.float(), value.float(), batch.kv_cache, slot_mapping)
    out = torch.empty(batch.num_tokens, H, D)
    impl.forward(None, batch.query.float(), key.float(), value.float(), batch.kv_cache,
                 builder.build(0, batch.common_metadata()), out)
    starts = batch.qsl.tolist()
    for r in range(2):
        ref, _ = attention_oracle(batch.query.float()[None, starts[r]:starts[r + 1]], batch.k[r].float()[None],
                                  batch.v[r].float()[None], None, causal=True)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]].double(), ref[0], rtol=0, atol=2e-5)


def test_profiling_run_and_refusals(vb):
    from sinkattn import SinkattnValueError
    from vllm.v1.attention.backend import AttentionType
    impl = _layer(vb, None, None, torch.float32)
    out = torch.full((3, H, D), 7.0)
    assert impl.forward(None, out, None, None, None, None, out) is out and (out == 0).all()
    with pytest.raises(SinkattnValueError, match="kv_cache_dtype='int8_per_token_head'"):  # FP8: test_vllm_fp8.py
        vb.SinkattnImpl(H, D, 0.1, HK, None, None, "int8_per_token_head", None, AttentionType.DECODER, None)
    with pytest.raises(SinkattnValueError, match="attn_type"):
        vb.SinkattnImpl(H, D, 0.1, HK, None, None, "auto", None, AttentionType.ENCODER_DECODER, None)
    with pytest.raises(SinkattnValueError, match=r"sinks has shape \(4,\)"):
        vb.SinkattnImpl(H, D, 0.1, HK, None, None, "auto", None, AttentionType.DECODER, None, sinks=torch.zeros(4))


# ---- selection, through vLLM's CudaPlatform.get_attn_backend_cls and registry ----------------------------
def _selector(**kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig
    base = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, has_sink=True,
                has_sliding_window=True)
    return AttentionSelectorConfig(**{**base, **kw})


@pytest.fixture
def platform(vb):
    from sinkattn import compat
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    AttentionBackendEnum.CUSTOM.clear_override()
    compat.vllm_plugin()
    yield current_platform
    AttentionBackendEnum.CUSTOM.clear_override()
    vllm_stubs.Platform.capability = (8, 0)


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_selected_when_asked(platform, vb, monkeypatch, cap):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    monkeypatch.setattr(vb, "kernel_gap", lambda *a: None)  # as with a build that has the kernel
    vllm_stubs.Platform.capability = cap
    path = platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(), num_heads=64)
    assert path == "sinkattn.integrations.vllm_backend.SinkattnBackend"
    assert AttentionBackendEnum.CUSTOM.get_class().get_name() == "CUSTOM"


def test_selected_with_adaptive_verification(platform, vb, monkeypatch):
    """vLLM's adaptive verification trims drafts on the device, so the host's query lengths can disagree with the
    device's: forward reads only the device's query_start_loc (max_query_len only picks the tile), so it serves."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    monkeypatch.setattr(vb, "kernel_gap", lambda *a: None)
    path = platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(use_adaptive_verification=True),
                                         num_heads=64)
    assert path == "sinkattn.integrations.vllm_backend.SinkattnBackend"


def test_selection_needs_a_compiled_kernel(platform):
    """Selecting the backend where only the PyTorch reference would run (slow, not graphable) is refused."""
    from sinkattn import _ext
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    if _ext.loaded():  # CI's build holds head dim 64 bf16 for sm_80, which serves cc 8.0
        path = platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(), num_heads=64)
        assert path.endswith("SinkattnBackend")
    else:
        with pytest.raises(ValueError, match="no compiled sinkattn kernel .*compiled extension is not available"):
            platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(), num_heads=64)


@pytest.mark.parametrize("kw, text", [
    (dict(dtype=torch.float32), "dtype=torch.float32"),
    (dict(use_dcp=True), "decode context parallelism"),
    (dict(kv_cache_dtype="fp8_per_token_head"), "kv_cache_dtype='fp8_per_token_head' is not served"),
    # no FP8-cache kernel has head dim 256 (csrc/sm80/fwd_tiles.h FwdFp8TilesOf; test_vllm_fp8.py: the served ones)
    (dict(kv_cache_dtype="fp8", head_size=256), "over an FP8 KV cache"),
    (dict(attn_type="encoder_decoder"), "encoder or cross attention"),
    (dict(attn_type="encoder_only"), "encoder or cross attention"),
    (dict(head_size=72 + 4), "head_size=76"),
])
def test_refused_at_selection_with_a_reason(platform, kw, text):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    with pytest.raises(ValueError, match=f"Selected backend .*CUSTOM.* not valid.*{text}"):
        platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(**kw), num_heads=64)


def test_refused_below_sm80(platform):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    vllm_stubs.Platform.capability = (7, 5)
    with pytest.raises(ValueError, match="compute capability 8.0 or newer"):
        platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(), num_heads=64)


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
def test_automatic_selection_never_considers_it(platform, cap):
    """vLLM's own priority lists (every arch, MLA or not) hold no CUSTOM: registering it changes no choice."""
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    for use_mla in (False, True):
        prio = _get_backend_priorities(use_mla, DeviceCapability(*cap))
        assert AttentionBackendEnum.CUSTOM not in prio and prio
    vllm_stubs.Platform.capability = cap
    _, rejected = platform.get_valid_backends(DeviceCapability(*cap), _selector(), 64)
    assert AttentionBackendEnum.CUSTOM not in rejected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_cpu_mode_accepts_float32_without_a_capability(vb, dtype, kv_cache_dtype):
    """vLLM's CPU platform has no compute capability: there the reference serves float32 and FP8 caches
    (tests/test_vllm_engine.py serves it through vLLM's CPU engine); with a capability float32 stays refused."""
    from vllm.platforms.interface import DeviceCapability
    sel = _selector(dtype=dtype, kv_cache_dtype=kv_cache_dtype)._asdict()
    assert vb.SinkattnBackend.validate_configuration(device_capability=None, **sel) == []
    on_gpu = vb.SinkattnBackend.validate_configuration(device_capability=DeviceCapability(8, 0), **sel)
    assert any("dtype=torch.float32" in r for r in on_gpu) == (dtype == torch.float32)
    sel.update(head_size=76)  # what no path serves is refused on the CPU too
    assert any("head_size=76" in r for r in vb.SinkattnBackend.validate_configuration(device_capability=None, **sel))
