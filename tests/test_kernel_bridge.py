"""sinkattn/kernels.py's input layouts, on a faked registry (no extension needed): a broadcast (zero-stride) input
reaches a kernel in place only where the kernel's registry entry lists "broadcast_strides"; every other kernel
(the sm90 ones read through TMA descriptors, which take no zero stride) gets a contiguous copy, and inputs that
are not broadcast are never copied for it."""
import torch

from sinkattn import _ext, kernels, layout, registry


def entry(name, family, op, features):
    return dict(name=name, family=family, op=op, headdim=64, dtype="bf16", features=features, archs="sm_80",
                smem_bytes=0)


REGISTRY = (entry("fwd_sm80_hdim64_bf16", "sm80", "fwd", "sinks,causal,broadcast_strides"),
            entry("fwd_sm90_hdim64_bf16", "sm90", "fwd", "sinks,causal"),
            entry("bwd_sm80_hdim64_bf16", "sm80", "bwd", "sinks,broadcast_strides"),
            entry("bwd_sm90_hdim64_bf16", "sm90", "bwd", "sinks"),
            entry("sweep_fwd_sm90_m128n128s4_hdim64_bf16", "sm90-sweep", "fwd", "sinks,causal"),
            entry("sweep_fwd_sm80_m64n64w4_hdim64_bf16", "sm80-sweep", "fwd", "sinks,causal,broadcast_strides"))


def fake_build(monkeypatch):
    monkeypatch.setattr(_ext, "registry", lambda: REGISTRY)
    monkeypatch.setattr(layout, "KERNEL_HEADDIMS", (64, 128, 256))  # the binary's list (empty without one)


def test_broadcast_inputs_are_copied_only_for_kernels_that_cannot_read_them(monkeypatch):
    fake_build(monkeypatch)
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16).expand(1, 16, 4, 64)  # one KV head broadcast over four
    v = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    assert k.stride(2) == 0
    for backend, op, in_place in (("sm80", "fwd", True), ("sm90", "fwd", False), ("sm80", "bwd", True),
                                  ("sm90", "bwd", False),
                                  ("variant:sweep_fwd_sm90_m128n128s4_hdim64_bf16", "fwd", False),
                                  ("variant:sweep_fwd_sm80_m64n64w4_hdim64_bf16", "fwd", True),
                                  ("variant:not_registered", "fwd", False)):
        q2, k2, v2 = kernels._readable(backend, op, q, (q, k, v))
        assert q2 is q and v2 is v, backend  # not broadcast, aligned: never copied
        assert (k2 is k) == in_place, backend
        if not in_place:
            assert k2.is_contiguous() and torch.equal(k2, k)
    # A head dim served by the padded 64 kernel (48 -> 64) finds the same entry.
    assert registry.reads_broadcast_strides(registry.launched_by("sm80", "fwd", 48, torch.bfloat16))
    assert not registry.reads_broadcast_strides(registry.launched_by("sm80", "fwd", 64, torch.float16))  # not built


def test_an_unaligned_input_is_still_copied_where_broadcasts_are_read(monkeypatch):
    fake_build(monkeypatch)
    base = torch.randn(1, 16, 4, 68, dtype=torch.bfloat16)
    q = base[..., :64]  # rows 68 elements (136 bytes) apart: not a multiple of 16
    k = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16).expand(1, 16, 4, 64)
    q2, k2 = kernels._readable("sm80", "fwd", q, (q, k))
    assert q2 is not q and q2.is_contiguous() and torch.equal(q2, q)
    assert k2 is k
