"""Backend choice (docs/DESIGN.md section 2) without a GPU: the device's capability and the binary's registry are
faked, so every branch of "auto", forcing, the fallback warning and the kernel launch points runs on the CPU,
and every "can this kernel serve this call" answer is dispatch.why_not deciding from the registry."""
import dataclasses
import warnings

import pytest
import torch

import sinkattn
from sinkattn import _device, _ext, dispatch, kernels
from sinkattn._problem import Problem
from sinkattn.mask import Mask
from sinkattn.errors import SinkattnRuntimeError
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

CUDA_PROBLEM = Problem(kind="fwd", device_type="cuda", dtype=torch.bfloat16, headdim=128, nheads=8, nheads_k=8,
                       mask=Mask(0.125, -1, 0), has_sinks=True, device_index=0)
# The families' registry features as the binary lists them (csrc: SINKATTN_FWD_FEATURES and friends; the sm90
# forward's per tile, csrc/sm90/fwd_tiles.h fwd_features: "paged" (its producer gathers small pages) but at head
# dim 256, which entry() drops).
FEATURES = {("sm80", "fwd"): "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,paged16,split_kv,"
                             "broadcast_strides",
            ("sm90", "fwd"): "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged16,split_kv,paged",
            ("sm80", "bwd"): "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic,broadcast_strides",
            ("sm90", "bwd"): "sinks,sink_tokens,causal,window,softcap,gqa,varlen,deterministic",
            ("sm80", "fwd_fp8"): "sinks,sink_tokens,causal,window,softcap,gqa,kvcache,paged,paged16,split_kv,fp8_kv,"
                                 "broadcast_strides"}
ARCHS = {"sm80": "sm_80,sm_90,compute_80", "sm90": "sm_90a", "sm80-emulated": "host"}


def entry(family, op, headdim=128, dtype="bf16", **changes):
    """One registry entry of a build; `changes` overrides its fields (features=, smem_bytes=, ...)."""
    features = changes.pop("features", None) or FEATURES[(family.replace("-emulated", ""), op)]
    e = dict(name=f"{op}_{family}_hdim{headdim}_{dtype}", family=family, op=op, headdim=headdim, dtype=dtype,
             features=features, archs=ARCHS[family], smem_bytes=0)
    e.update(changes)
    return e


def build(*families, ops=("fwd", "bwd")):
    """The registry of a build holding every head dim and half dtype of these families' ops (sm90: fwd only)."""
    return tuple(entry(f, op, h, d) for f in families for op in ops if (f, op) != ("sm90", "bwd")
                 for h in (64, 128, 256) for d in ("bf16", "fp16"))


@pytest.fixture
def fake_registry(monkeypatch):
    """Install a registry (a tuple of entries) as the binary's; returns the installer."""
    def install(reg):
        monkeypatch.setattr(_ext, "registry", lambda: reg)
    monkeypatch.setattr(_ext, "loaded", lambda: True)
    monkeypatch.setattr(_ext, "build_info", lambda: {})
    install(())
    return install


@pytest.fixture
def gpu(monkeypatch, fake_registry):
    """Pretend to be a GPU of a given capability whose build holds the kernel families `served` lists."""
    monkeypatch.setattr(dispatch, "_warned", set())
    state = {"cap": (9, 0)}
    monkeypatch.setattr(dispatch, "_capability", lambda index: state["cap"])

    def serve(*families, ops=("fwd", "bwd")):
        fake_registry(build(*families, ops=ops))
    state["serve"] = serve
    return state


def test_auto_prefers_sm90_on_hopper(gpu):
    gpu["serve"]("sm90", "sm80")
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm90"


def test_auto_uses_sm80_when_sm90_cannot(gpu):
    gpu["serve"]("sm80")
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm80"


def test_auto_on_ampere_and_ada(gpu):
    gpu["serve"]("sm90", "sm80")
    for cap in [(8, 0), (8, 6), (8, 9)]:
        gpu["cap"] = cap
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm80"


def test_auto_falls_back_with_one_warning_per_reason(gpu):
    gpu["cap"] = (8, 6)
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="sm80: no sm80 forward kernel for head dim 128 bf16"):
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"  # same reason: silent
    gpu["cap"] = (7, 5)
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="7.5"):
        assert dispatch.choose(CUDA_PROBLEM, "auto") == "reference"


def test_forced_backend_that_cannot_serve_says_why_and_what_would(gpu):
    gpu["cap"] = (8, 6)
    gpu["serve"]("sm80", "sm90")
    with pytest.raises(SinkattnRuntimeError) as info:
        dispatch.choose(CUDA_PROBLEM, "sm90")
    msg = str(info.value)
    assert "needs a cc 9.0 GPU" in msg and "backend='sm80'" in msg and "reference" in msg
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
    gpu["serve"]("sm80-emulated")
    problem = dataclasses.replace(CUDA_PROBLEM, device_type="cpu", device_index=None)
    assert dispatch.choose(problem, "auto") == "reference"
    assert dispatch.choose(problem, "sm80-emulated") == "sm80-emulated"
    with pytest.raises(SinkattnRuntimeError, match="CPU tensors only"):
        dispatch.choose(CUDA_PROBLEM, "sm80-emulated")


def test_backward_of_a_forced_kernel_falls_back_with_warning(gpu):
    gpu["cap"] = (8, 0)
    gpu["serve"]("sm80", ops=("fwd",))
    bwd = dataclasses.replace(CUDA_PROBLEM, kind="bwd")
    assert dispatch.choose(CUDA_PROBLEM, "sm80") == "sm80"
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="backward"):
        assert dispatch.choose_backward(bwd, "sm80") == "reference"
    gpu["serve"]("sm80")
    assert dispatch.choose_backward(bwd, "sm80") == "sm80"


def test_kernel_launch_points_are_called(gpu, monkeypatch):
    """Forward and backward reach kernels.launch_fwd / kernels.launch_bwd with preallocated outputs."""
    gpu["serve"]("sm80-emulated")
    calls = {}

    def fake_forward(backend, q, k, v, sinks, out, lse, *args, **kw):
        calls["fwd"] = (backend, out.shape, out.dtype, lse.shape, lse.dtype, args)
        out.fill_(1.0)
        lse.fill_(2.0)

    def fake_backward(backend, dout, q, k, v, sinks, out, lse, dlse, dq, dk, dv, dsinks, mask, **kw):
        calls["bwd"] = (backend, dlse is None, kw["deterministic"])
        for t in (dq, dk, dv, dsinks):
            t.fill_(3.0)

    monkeypatch.setattr(kernels, "launch_fwd", fake_forward)
    monkeypatch.setattr(kernels, "launch_bwd", fake_backward)
    q = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    s = torch.zeros(4, requires_grad=True)
    out, lse = sinkattn.flash_attn_with_sinks(q, k, k, s, causal=True, window_size=(3, 0), return_lse=True,
                                              deterministic=True, backend="sm80-emulated")
    backend, oshape, odtype, lshape, ldtype, args = calls["fwd"]
    assert (backend, oshape, odtype, lshape, ldtype) == ("sm80-emulated", q.shape, q.dtype, (2, 4, 5), torch.float32)
    assert args == (Mask(pytest.approx(64 ** -0.5), 3, 0, 0, 0.0),)
    assert (out == 1).all() and (lse == 2).all()
    out.float().sum().backward()
    assert calls["bwd"] == ("sm80-emulated", False, True)
    assert (q.grad == 3).all() and (k.grad == 6).all() and (s.grad == 3).all()  # k used as k and v: 3 + 3


# ---- why_not reads the registry: features, shared memory ----------------------------------------------------
KVCACHE_PROBLEM = dataclasses.replace(CUDA_PROBLEM, kind="kvcache", nheads_k=2, mask=Mask(0.125, 127, 0))
BWD_256 = dataclasses.replace(CUDA_PROBLEM, kind="bwd", headdim=256)


def test_kvcache_needs_the_kvcache_feature(gpu, fake_registry):
    gpu["cap"] = (8, 0)
    sm80 = entry("sm80", "fwd")
    fake_registry((sm80,))
    assert dispatch.why_not("sm80", KVCACHE_PROBLEM) is None
    # The registry decides: a forward kernel that does not list kvcache is refused, naming the feature.
    no_cache = entry("sm80", "fwd", features=sm80["features"].replace(",kvcache", ""))
    fake_registry((no_cache,))
    reason = dispatch.why_not("sm80", KVCACHE_PROBLEM)
    assert "decode over a KV cache" in reason and no_cache["features"] in reason and no_cache["name"] in reason


@pytest.mark.parametrize("validated", [False, True])
def test_sm90_cache_is_opt_in(gpu, fake_registry, monkeypatch, validated):
    """The sm90 forward serves cache calls (contiguous, paged at any page size, FP8 caches, at every head dim) when
    forced; "auto" keeps them on sm80 on cc 9.0, before a GPU run validates it
    (SM90_CACHE_VALIDATED) and the report's note says why; once validated (it splits keys like the sm80 kernels),
    "auto" runs it."""
    monkeypatch.setattr(dispatch, "SM90_CACHE_VALIDATED", validated)
    gpu["cap"] = (9, 0)
    fake_registry(build("sm90", "sm80"))
    paged16 = dataclasses.replace(KVCACHE_PROBLEM, paged=True, page_size=16)
    for problem in (KVCACHE_PROBLEM, paged16, dataclasses.replace(paged16, page_size=256)):
        assert dispatch.why_not("sm90", problem) is None
        assert dispatch.choose(problem, "sm90") == "sm90"
        assert dispatch.choose(problem, "auto") == ("sm90" if validated else "sm80")
    note = dispatch.preference_note((9, 0), KVCACHE_PROBLEM).get("sm90", "")
    assert ("has not yet run on a GPU" in note and "backend='sm90'" in note) != validated
    for page in (1, 5, 24):
        odd = dataclasses.replace(paged16, page_size=page)
        assert dispatch.why_not("sm90", odd) is None and dispatch.choose(odd, "sm90") == "sm90"
        assert dispatch.why_not("sm80", odd) is None
        assert dispatch.choose(odd, "auto") == ("sm90" if validated else "sm80")
        assert dispatch.why_not("sm90", dataclasses.replace(odd, headdim=256)) is None
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm90"  # the forward's choice is untouched
    # FP8 caches: the sm90 forward's fwd_fp8 entries (the same kernels, csrc/sm90/fwd_tiles.h fwd_fp8_features) serve
    # them when forced; "auto" routes them as every cache call
    fp8 = dataclasses.replace(paged16, kv_fp8=True)
    fake_registry(build("sm90", "sm80")
                  + tuple(entry("sm80", "fwd_fp8", h, "bf16") for h in (64, 128))
                  + tuple(entry("sm90", "fwd_fp8", h, "bf16", features=FEATURES[("sm90", "fwd")] + ",fp8_kv")
                          for h in (64, 128, 256)))
    assert dispatch.why_not("sm90", fp8) is None and dispatch.choose(fp8, "sm90") == "sm90"
    assert dispatch.choose(fp8, "auto") == ("sm90" if validated else "sm80")
    # head dim 256: the sm90 forward's gather decodes it; the sm80 FP8 tiles stop at 128
    fp8_256 = dataclasses.replace(fp8, headdim=256)
    assert dispatch.why_not("sm90", fp8_256) is None and dispatch.choose(fp8_256, "sm90") == "sm90"


def test_fp8_cache_runs_on_the_fwd_fp8_kernels(gpu, fake_registry, monkeypatch):
    """An FP8-cache decode is served by the family's "fwd_fp8" kernels (csrc/sm80/fp8_kv.h) where the build has them:
    "auto" picks sm80 on cc 8.x and 9.0 (the sm90 kernels read no FP8), a head dim with no FP8 tile or not a multiple
    of 16 is refused with the reason; without fwd_fp8 kernels the forward kernels serve it only if they list fp8_kv."""
    fp8 = dataclasses.replace(KVCACHE_PROBLEM, kv_fp8=True)
    fp8_entries = tuple(entry("sm80", "fwd_fp8", h, "bf16") for h in (64, 128))
    fake_registry(build("sm90", "sm80") + fp8_entries)
    monkeypatch.setattr(_ext, "build_info", lambda: {"fp8_kv_headdims": [64, 128]})  # the binary's FP8 tile table
    for cap in ((8, 0), (8, 6), (9, 0)):
        gpu["cap"] = cap
        assert dispatch.why_not("sm80", fp8) is None
        assert dispatch.choose(fp8, "auto") == "sm80"
    assert "FP8 KV caches" in dispatch.why_not("sm90", fp8)  # the sm90 forward reads caches in q's dtype only
    assert "head dims 64, 128 only" in dispatch.why_not("sm80", dataclasses.replace(fp8, headdim=256))
    assert "multiple of 16" in dispatch.why_not("sm80", dataclasses.replace(fp8, headdim=120))
    assert "bf16 or fp16" in dispatch.why_not("sm80", dataclasses.replace(fp8, dtype=torch.float32))
    # the build without the dtype's FP8 kernel says which to rebuild
    assert "SINKATTN_DTYPES including fp16" in dispatch.why_not("sm80", dataclasses.replace(fp8, dtype=torch.float16))
    # no fwd_fp8 kernels: the forward kernels decide by their features
    fake_registry(build("sm90", "sm80"))
    assert "FP8 KV caches" in dispatch.why_not("sm80", fp8)
    fake_registry((entry("sm80", "fwd", features=FEATURES[("sm80", "fwd")] + ",fp8_kv"),))
    assert dispatch.why_not("sm80", fp8) is None


def test_kvcache_refusal_without_the_head_dim_names_the_feature(gpu, fake_registry):
    """A build without the call's head dim still says the family cannot serve decode (its siblings' features),
    rather than advising a rebuild that would not help."""
    no_cache = FEATURES[("sm90", "fwd")].replace(",kvcache,paged16", "")
    fake_registry((entry("sm90", "fwd", headdim=64, features=no_cache), entry("sm80", "fwd")))
    assert "decode over a KV cache" in dispatch.why_not("sm90", KVCACHE_PROBLEM)
    assert "SINKATTN_HEADDIMS including 128" in dispatch.why_not("sm90", CUDA_PROBLEM)


def test_paged_cache_needs_the_paged_feature(gpu, fake_registry):
    gpu["cap"] = (8, 0)
    paged = dataclasses.replace(KVCACHE_PROBLEM, paged=True)
    fake_registry((entry("sm80", "fwd", features="sinks,causal,window,gqa,kvcache"),))
    assert dispatch.why_not("sm80", KVCACHE_PROBLEM) is None
    reason = dispatch.why_not("sm80", paged)
    assert "a paged KV cache" in reason and "sinks,causal,window,gqa,kvcache" in reason
    with pytest.raises(SinkattnRuntimeError, match="paged KV cache.*What would serve: backend='reference'"):
        dispatch.choose(paged, "sm80")
    fake_registry((entry("sm80", "fwd"),))
    assert dispatch.why_not("sm80", paged) is None


def test_every_needed_feature_is_checked(gpu, fake_registry):
    gpu["cap"] = (8, 0)
    fake_registry((entry("sm80", "fwd", features="kvcache"),))
    problem = dataclasses.replace(CUDA_PROBLEM, mask=Mask(0.125, 7, 0, 4, 30.0), nheads_k=2, varlen=True)
    reason = dispatch.why_not("sm80", problem)
    for words in ("learnable sinks", "sink tokens", "causal masks", "sliding windows", "softcap", "GQA/MQA",
                  "varlen"):
        assert words in reason, (words, reason)
    plain = dataclasses.replace(CUDA_PROBLEM, has_sinks=False, mask=Mask(0.125))
    assert dispatch.why_not("sm80", plain) is None


def test_deterministic_backward_needs_the_deterministic_feature(gpu, fake_registry):
    gpu["cap"] = (8, 0)
    bwd = dataclasses.replace(CUDA_PROBLEM, kind="bwd")
    det = dataclasses.replace(bwd, deterministic=True)
    fake_registry((entry("sm80", "fwd"), entry("sm80", "bwd", features=FEATURES[("sm80", "bwd")].replace(
        ",deterministic", ""))))
    assert dispatch.why_not("sm80", bwd) is None
    assert "a deterministic backward" in dispatch.why_not("sm80", det)
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="deterministic backward"):
        assert dispatch.choose_backward(det, "sm80") == "reference"
    assert dispatch.why_not("sm80", dataclasses.replace(CUDA_PROBLEM, deterministic=True)) is None  # a forward
    fake_registry((entry("sm80", "bwd"),))
    assert dispatch.why_not("sm80", det) is None


def test_shared_memory_of_the_kernel_against_the_device(gpu, fake_registry):
    """The hd256 backward's shared memory (registry smem_bytes) against the device's opt-in limit per block."""
    fake_registry((entry("sm80", "bwd", headdim=256, smem_bytes=144 * 1024),))
    for cc, served in (((8, 0), True), ((8, 7), True), ((9, 0), True), ((10, 0), True), ((8, 6), False),
                       ((8, 9), False), ((12, 0), False)):
        gpu["cap"] = cc
        reason = dispatch.why_not("sm80", BWD_256)
        assert (reason is None) == served, (cc, reason)
    gpu["cap"] = (8, 6)
    assert dispatch.why_not("sm80", BWD_256) == ("the sm80 backward for head dim 256 needs 144 KB of shared memory "
                                                 "per block; cc 8.6 allows 99 KB; the reference backend serves it")
    with pytest.warns(sinkattn.ReferenceFallbackWarning, match="144 KB"):
        assert dispatch.choose(BWD_256, "auto") == "reference"
    # The numbers are the registry's: a kernel that fits in 99 KB runs on cc 8.6, one over 163 KB nowhere on cc 8.0.
    fake_registry((entry("sm80", "bwd", headdim=256, smem_bytes=101376),))
    assert dispatch.why_not("sm80", BWD_256) is None
    fake_registry((entry("sm80", "bwd", headdim=256, smem_bytes=170000),))
    gpu["cap"] = (8, 0)
    assert "needs 166 KB" in dispatch.why_not("sm80", BWD_256) and "allows 163 KB" in dispatch.why_not("sm80", BWD_256)
    # Decode runs on the forward kernels: their shared memory decides.
    decode = dataclasses.replace(KVCACHE_PROBLEM, headdim=256)
    fake_registry((entry("sm80", "fwd", headdim=256, smem_bytes=120 * 1024),))
    gpu["cap"] = (8, 9)
    assert dispatch.why_not("sm80", decode).startswith("the sm80 forward for head dim 256 needs 120 KB")
    gpu["cap"] = (8, 0)
    assert dispatch.why_not("sm80", decode) is None
    # A registry from before smem_bytes existed: no shared-memory refusal (read as 0).
    old = entry("sm80", "bwd", headdim=256)
    del old["smem_bytes"]
    fake_registry((old,))
    gpu["cap"] = (8, 6)
    assert dispatch.why_not("sm80", BWD_256) is None


def test_sm80_smem_cap_declines_like_a_99k_device(gpu, fake_registry):
    """sinkattn.sm80_smem_limit / SINKATTN_SM80_MAX_SMEM on an H200: the sm80 kernels are judged against the cap
    where it is below the device's limit, with a reason that names it; sm90 does not read it; a cap above the
    device's limit changes nothing."""
    fake_registry((entry("sm80", "bwd", headdim=256, smem_bytes=144 * 1024),
                   entry("sm80", "fwd", headdim=256, smem_bytes=96 * 1024),
                   entry("sm90", "fwd", headdim=256, smem_bytes=161 * 1024)))
    gpu["cap"] = (9, 0)
    fwd_256 = dataclasses.replace(CUDA_PROBLEM, headdim=256)
    assert dispatch.why_not("sm80", BWD_256) is None
    with sinkattn.sm80_smem_limit("99K"):
        assert dispatch.why_not("sm80", BWD_256) == (
            "the sm80 backward for head dim 256 needs 144 KB of shared memory per block; the sm80 shared-memory cap "
            "sinkattn.sm80_smem_limit('99K') allows 99 KB (cc 9.0 allows 227 KB); the reference backend serves it")
        with pytest.warns(sinkattn.ReferenceFallbackWarning, match=r"cap sinkattn.sm80_smem_limit\('99K'\)"):
            assert dispatch.choose(BWD_256, "auto") == "reference"
        with pytest.raises(SinkattnRuntimeError, match="allows 99 KB"):
            dispatch.choose(BWD_256, "sm80")
        assert dispatch.why_not("sm80", fwd_256) is None  # the 96 KB tile fits
        assert dispatch.why_not("sm90", fwd_256) is None  # sm90 does not read the sm80 cap
        # The report's pretended devices are judged under it too; a device below the cap keeps its own reason.
        assert "cap sinkattn.sm80_smem_limit('99K') allows 99 KB (cc 8.0 allows 163 KB)" in \
            dispatch.why_not("sm80", BWD_256, capability=(8, 0))
        assert dispatch.why_not("sm80", BWD_256, capability=(8, 6)).endswith("cc 8.6 allows 99 KB; the reference "
                                                                              "backend serves it")
    with sinkattn.sm80_smem_limit(300 * 1024):  # above the device's limit: the device decides
        assert dispatch.why_not("sm80", BWD_256) is None
        assert dispatch.why_not("sm80", BWD_256, capability=(8, 9)) == (
            "the sm80 backward for head dim 256 needs 144 KB of shared memory per block; cc 8.9 allows 99 KB; the "
            "reference backend serves it")
    assert dispatch.why_not("sm80", BWD_256) is None


def test_sm80_launches_get_the_cap(gpu, monkeypatch):
    """Every sm80 launch dispatch makes (forward, backward, KV cache) carries the cap as max_smem; sm90's never."""
    seen = {}
    for name in ("launch_fwd", "launch_bwd", "launch_kvcache"):
        monkeypatch.setattr(kernels, name, lambda backend, *a, _n=name, **kw: seen.setdefault(_n, []).append(
            (backend, kw["max_smem"])))
    gpu["serve"]("sm80", "sm90")
    monkeypatch.setattr(dispatch, "choose", lambda problem, requested: requested)
    monkeypatch.setattr(dispatch, "choose_backward", lambda problem, requested: requested)
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    mask = Mask(0.125, -1, 0, 0, 0.0)
    cache_seqlens = torch.tensor([4], dtype=torch.int32)
    for cap in (None, 99 * 1024):
        with sinkattn.sm80_smem_limit(cap):
            for backend in ("sm80", "sm90"):
                dispatch.run_fwd(q, q, q, None, None, None, 0, 0, mask, False, backend)
            dispatch.run_bwd(q, None, q, q, q, None, q, torch.zeros(1, 2, 4), None, None, 0, 0, mask, False,
                             "sm80")
            dispatch.run_kvcache(q, q.clone(), q.clone(), None, None, None, cache_seqlens, None, None, None, False,
                                 mask, 0, "sm80")
    assert seen == {"launch_fwd": [("sm80", 0), ("sm90", 0), ("sm80", 99 * 1024), ("sm90", 0)],
                    "launch_bwd": [("sm80", 0), ("sm80", 99 * 1024)],
                    "launch_kvcache": [("sm80", 0), ("sm80", 99 * 1024)]}


def test_emulated_kernels_have_no_device_limit(gpu, fake_registry):
    fake_registry((entry("sm80-emulated", "bwd", headdim=256, smem_bytes=10 ** 6),))
    cpu = dataclasses.replace(BWD_256, device_type="cpu", device_index=None)
    assert dispatch.why_not("sm80-emulated", cpu) is None


def test_pretended_capability_uses_the_table(gpu, fake_registry):
    """The report and vLLM's selection pass a capability; its limit is the table's, whatever GPU this is."""
    fake_registry((entry("sm80", "bwd", headdim=256, smem_bytes=144 * 1024),))
    gpu["cap"] = (8, 0)
    assert "cc 8.6 allows 99 KB" in dispatch.why_not("sm80", BWD_256, capability=(8, 6))
    assert dispatch.why_not("sm80", BWD_256, capability=(9, 0)) is None


def test_device_smem_table_and_own_property(monkeypatch):
    table = {(8, 0): 166912, (8, 7): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448,
             (10, 3): 232448, (12, 0): 101376, (7, 5): None}
    _device.smem_per_block_optin.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cc, want in table.items():
        assert _device.smem_per_block_optin(cc, 0) == want, cc
    # A visible device of that capability answers with its own property (torch's shared_memory_per_block_optin).
    _device.smem_per_block_optin.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_device, "capability", lambda index: (8, 6))
    monkeypatch.setattr(_device, "device_info",
                        lambda index: _device.DeviceInfo(index, "fake", (8, 6), 80, smem_per_block_optin=12345))
    assert _device.smem_per_block_optin((8, 6), 0) == 12345
    assert _device.smem_per_block_optin((8, 0), 0) == 166912  # pretended: not this device's capability
    assert _device.smem_per_block_optin((8, 6), 1) == 101376  # no such device
    _device.smem_per_block_optin.cache_clear()


# ---- softmax_scale <= 0: the kernels decline it (their running max is over raw scores, masks are -inf) -------
@pytest.mark.needs_ext
def test_kernels_decline_a_nonpositive_scale():
    for backend in ("sm80", "sm90", "sm80-emulated"):
        reason = dispatch.why_not(backend, dataclasses.replace(CUDA_PROBLEM, mask=Mask(-0.125, -1, 0),
                                                               device_type="cpu" if "emulated" in backend else "cuda"),
                                  capability=None if "emulated" in backend else (9, 0))
        assert reason is not None and "softmax_scale > 0" in reason, (backend, reason)


@pytest.mark.skipif(not any(k["family"] == "sm80-emulated" and k["headdim"] == 64 and k["dtype"] == "bf16"
                            for k in _ext.registry()), reason="no emulated hdim64 bf16 kernel in this build")
@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_nonpositive_scale_runs_on_the_reference_without_nan(scale):
    """The emulated sm80 kernel gave NaN rows for these scales (masked -inf times a scale <= 0); forcing it now
    raises with the reason, and auto takes the reference, which matches the float64 oracle."""
    from oracle import attention_oracle
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g).to(torch.bfloat16) for n in (70, 90, 90))
    sinks = torch.randn(2, generator=g)
    with pytest.raises(SinkattnRuntimeError, match="softmax_scale > 0"):
        sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, softmax_scale=scale, backend="sm80-emulated")
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, softmax_scale=scale)
    ref = attention_oracle(q, k, v, sinks, causal=True, softmax_scale=scale)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert not out.isnan().any()
    assert (out.double() - ref.double()).abs().max().item() < 2e-2
    # a positive scale still runs on the kernel
    out = sinkattn.flash_attn_with_sinks(q, k, v, sinks, causal=True, softmax_scale=0.125, backend="sm80-emulated")
    assert not out.isnan().any()


def _sm90_bwd_build():
    """A 90a build: both families' forwards and backwards, the sm90 backward at head dims 64 and 128 only."""
    return build("sm80", "sm90") + tuple(entry("sm90", "bwd", h, d) for h in (64, 128) for d in ("bf16", "fp16"))


@pytest.mark.parametrize("validated", [False, True])
def test_sm90_backward_auto_waits_for_its_gpu_run(gpu, fake_registry, monkeypatch, validated):
    """The sm90 backward serves its head dims when forced; "auto" keeps the backward on sm80 until
    SM90_BWD_VALIDATED says a GPU run passed it, and the report's note says why."""
    monkeypatch.setattr(dispatch, "SM90_BWD_VALIDATED", validated)
    fake_registry(_sm90_bwd_build())
    bwd = dataclasses.replace(CUDA_PROBLEM, kind="bwd")
    assert dispatch.why_not("sm90", bwd) is None
    assert dispatch.choose_backward(bwd, "sm90") == "sm90"
    assert dispatch.choose(bwd, "auto") == ("sm90" if validated else "sm80")
    note = dispatch.preference_note((9, 0), bwd)
    assert ("sm90" in note) != validated
    if not validated:
        assert "has not yet run on a GPU" in note["sm90"] and "backend='sm90'" in note["sm90"]
    # the forward's choice is untouched
    assert dispatch.choose(CUDA_PROBLEM, "auto") == "sm90"


def test_sm90_backward_has_no_head_dim_256(gpu, fake_registry, monkeypatch):
    """A 90a build asked for head dim 256 holds no sm90 backward for it (the tile table has none): dispatch names
    the sm80 backward, which serves it."""
    monkeypatch.setattr(dispatch, "SM90_BWD_VALIDATED", True)
    fake_registry(_sm90_bwd_build())
    monkeypatch.setattr(_ext, "build_info", lambda: {"requested_headdims": "64,128,256", "requested_dtypes": "bf16,fp16"})
    reason = dispatch.why_not("sm90", BWD_256)
    assert reason is not None and "no tile for head dim 256" in reason and "sm80 backward serves it" in reason
    assert dispatch.choose(BWD_256, "auto") == "sm80"
    with pytest.raises(SinkattnRuntimeError, match="no tile for head dim 256"):
        dispatch.choose(BWD_256, "sm90")


@pytest.mark.skipif(not _ext.loaded(), reason="needs the compiled extension's build_info")
def test_a_gpu_subset_build_says_so(monkeypatch):
    """A build whose GPU units were narrowed (SINKATTN_GPU_HEADDIMS / _DTYPES, CI's compile check) declines a head
    dim and dtype its grid holds by naming the narrowing, not by calling the family missing."""
    info = dict(_ext.build_info())
    monkeypatch.setattr(_ext, "build_info", lambda: {**info, "requested_headdims": "64,128,256",
                                                     "requested_dtypes": "bf16,fp16", "gpu_headdims": "64,256",
                                                     "gpu_dtypes": "bf16"})
    p = Problem(kind="fwd", device_type="cuda", dtype=torch.float16, headdim=128, mask=Mask(0.1, -1, 0),
                has_sinks=True)
    why = dispatch.why_not("sm80", p, (8, 0))
    assert "GPU units were narrowed to head dims 64,256 and dtypes bf16" in why and "SINKATTN_GPU_HEADDIMS" in why
    # The same grid with GPU units for all of it (whatever this build's own narrowing is: CI's build is narrowed).
    monkeypatch.setattr(_ext, "build_info", lambda: {**info, "requested_headdims": "64,128,256",
                                                     "requested_dtypes": "bf16,fp16", "gpu_headdims": "64,128,256",
                                                     "gpu_dtypes": "bf16,fp16"})
    assert "narrowed" not in (dispatch.why_not("sm80", p, (8, 0)) or "")
