"""What the public functions refuse: every malformed argument raises a sinkattn error of the right kind (also the
matching builtin) whose message names the argument (the cases found by probing every argument: flags
given as strings, int32 overflow, caches whose memory is shared, merge_attn_states), and the arguments at the edge
of a check that are accepted (padding in block tables, interleaved K/V views, SINKATTN_VALUE_CHECKS=0).

tests/test_input_edges.py holds the valid inputs at the edges (empty, degenerate, past int32) and the calls that
write nothing but their outputs."""
import pytest
import torch

import sinkattn
from sinkattn import SinkattnError, SinkattnRuntimeError, SinkattnTypeError, SinkattnValueError
from oracle import single_thread  # noqa: F401  (autouse: one torch thread per test)

B, S, H, HK, D = 2, 8, 4, 2, 32


def qkv(dtype=torch.float32, **shapes):
    q = torch.randn(shapes.get("q", (B, S, H, D))).to(dtype)
    k = torch.randn(shapes.get("k", (B, S, HK, D))).to(dtype)
    v = torch.randn(shapes.get("v", (B, S, HK, D))).to(dtype)
    return q, k, v


def attn(*args, **kw):
    return sinkattn.flash_attn_with_sinks(*args, **kw)


A, VL, KV, M = (sinkattn.flash_attn_with_sinks, sinkattn.flash_attn_varlen_with_sinks, sinkattn.flash_attn_with_kvcache,
                sinkattn.merge_attn_states)


def transposed_last(x):
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


q0, k0, v0 = qkv()

BATCHED = [
    # (id, call, exception type, words the message must contain)
    ("int-dtype", lambda: attn(q0.int(), k0.int(), v0.int()), SinkattnTypeError, ["q", "int32", "bfloat16"]),
    ("float8-dtype", lambda: attn(*(t.to(torch.float8_e4m3fn) for t in (q0, k0, v0))), SinkattnTypeError, ["q"]),
    ("mismatched-k-dtype", lambda: attn(q0, k0.half(), v0), SinkattnTypeError, ["k", "float16", "float32"]),
    ("mismatched-v-dtype", lambda: attn(q0, k0, v0.double()), SinkattnTypeError, ["v"]),
    ("q-rank", lambda: attn(q0[0], k0, v0), SinkattnValueError, ["q", "4-D", "(batch, seqlen_q, nheads, headdim)"]),
    ("k-rank", lambda: attn(q0, k0[..., None], v0), SinkattnValueError, ["k", "4-D"]),
    ("k-batch", lambda: attn(q0, k0[:1], v0[:1]), SinkattnValueError, ["k", "batch"]),
    ("v-seqlen", lambda: attn(q0, k0, v0[:, :3]), SinkattnValueError, ["v", "seqlen"]),
    ("k-headdim", lambda: attn(q0, torch.randn(B, S, HK, 16), v0), SinkattnValueError, ["k", "head dim"]),
    ("v-heads", lambda: attn(q0, k0, torch.randn(B, S, 1, D)), SinkattnValueError, ["v", "heads"]),
    ("gqa-ratio", lambda: attn(*qkv(k=(B, S, 3, D), v=(B, S, 3, D))), SinkattnValueError, ["nheads", "k", "multiple"]),
    ("headdim-too-big", lambda: attn(*qkv(q=(B, S, H, 264), k=(B, S, HK, 264), v=(B, S, HK, 264))),
     SinkattnValueError, ["q", "head dim", "264", "256"]),
    ("headdim-odd", lambda: attn(*qkv(q=(B, S, H, 36), k=(B, S, HK, 36), v=(B, S, HK, 36))),
     SinkattnValueError, ["q", "head dim", "36", "multiple of 8"]),
    # (the default scale 1/sqrt(0) must not come first as a ZeroDivisionError)
    ("headdim-zero", lambda: attn(*qkv(q=(B, S, H, 0), k=(B, S, HK, 0), v=(B, S, HK, 0))),
     SinkattnValueError, ["q", "head dim", "0", "multiple of 8"]),
    ("sinks-shape", lambda: attn(q0, k0, v0, torch.zeros(HK)), SinkattnValueError, ["sinks", "(2,)", "(4,)"]),
    ("sinks-2d", lambda: attn(q0, k0, v0, torch.zeros(1, H)), SinkattnValueError, ["sinks"]),
    ("sinks-dtype", lambda: attn(q0, k0, v0, torch.zeros(H, dtype=torch.int64)), SinkattnTypeError, ["sinks", "int64"]),
    ("sinks-device", lambda: attn(q0, k0, v0, torch.zeros(H, device="meta")), SinkattnValueError, ["sinks", "meta", "cpu"]),
    ("sinks-not-tensor", lambda: attn(q0, k0, v0, [0.0] * H), SinkattnTypeError, ["sinks", "list"]),
    ("sinks-and-s_aux", lambda: attn(q0, k0, v0, torch.zeros(H), s_aux=torch.zeros(H)), SinkattnValueError,
     ["sinks", "s_aux"]),
    ("window-left", lambda: attn(q0, k0, v0, window_size=(-2, 0)), SinkattnValueError, ["window_size[0]", "-2", ">= -1"]),
    ("window-right", lambda: attn(q0, k0, v0, window_size=(4, -5)), SinkattnValueError, ["window_size[1]", "-5"]),
    ("window-float", lambda: attn(q0, k0, v0, window_size=(4.5, 0)), SinkattnTypeError, ["window_size[0]", "int"]),
    ("window-not-pair", lambda: attn(q0, k0, v0, window_size=3), SinkattnValueError, ["window_size", "pair"]),
    ("causal-right", lambda: attn(q0, k0, v0, causal=True, window_size=(4, 2)), SinkattnValueError,
     ["causal", "window_size[1]"]),
    ("sink-tokens", lambda: attn(q0, k0, v0, sink_tokens=-1), SinkattnValueError, ["sink_tokens", "-1", ">= 0"]),
    ("softcap", lambda: attn(q0, k0, v0, softcap=-1.0), SinkattnValueError, ["softcap", "-1"]),
    ("softmax-scale-nan", lambda: attn(q0, k0, v0, softmax_scale=float("nan")), SinkattnValueError, ["softmax_scale"]),
    ("k-device", lambda: attn(q0, k0.to("meta"), v0), SinkattnValueError, ["k", "meta", "same device"]),
    ("v-device", lambda: attn(q0, k0, v0.to("meta")), SinkattnValueError, ["v", "meta"]),
    ("q-last-dim", lambda: attn(transposed_last(q0), k0, v0), SinkattnValueError, ["q", "contiguous last dimension"]),
    ("k-last-dim", lambda: attn(q0, transposed_last(k0), v0), SinkattnValueError, ["k", "stride"]),
    ("backend-unknown", lambda: attn(q0, k0, v0, backend="triton"), SinkattnValueError, ["backend", "triton", "reference"]),
    ("backend-forced-gpu-on-cpu", lambda: attn(q0, k0, v0, backend="sm90"), SinkattnRuntimeError,
     ["backend='sm90'", "CUDA", "reference"]),
]


def varlen(cq=None, ck=None, mq=S, mk=S, q=None, k=None, v=None, **kw):
    q = torch.randn(2 * S, H, D) if q is None else q
    k = torch.randn(2 * S, HK, D) if k is None else k
    v = torch.randn(2 * S, HK, D) if v is None else v
    cq = torch.tensor([0, S, 2 * S], dtype=torch.int32) if cq is None else cq
    ck = torch.tensor([0, S, 2 * S], dtype=torch.int32) if ck is None else ck
    return sinkattn.flash_attn_varlen_with_sinks(q, k, v, cq, ck, mq, mk, **kw)


def i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


VARLEN = [
    ("cu-int64", lambda: varlen(cq=torch.tensor([0, S, 2 * S])), SinkattnTypeError, ["cu_seqlens_q", "int64", "int32"]),
    ("cu-k-float", lambda: varlen(ck=torch.tensor([0.0, 8, 16])), SinkattnTypeError, ["cu_seqlens_k", "int32"]),
    ("cu-not-monotonic", lambda: varlen(ck=i32(0, 12, 10)), SinkattnValueError, ["cu_seqlens_k", "non-decreasing"]),
    ("cu-lengths-differ", lambda: varlen(cq=i32(0, 8, 12, 16)), SinkattnValueError,
     ["cu_seqlens_q", "cu_seqlens_k", "length"]),
    ("cu-2d", lambda: varlen(cq=i32(0, 8, 16)[None]), SinkattnValueError, ["cu_seqlens_q", "1-D"]),
    ("cu-empty", lambda: varlen(cq=i32(), ck=i32()), SinkattnValueError, ["cu_seqlens_q", "length 0"]),
    ("cu-start", lambda: varlen(cq=i32(1, 8, 16)), SinkattnValueError, ["cu_seqlens_q[0]", "0"]),
    ("cu-past-end", lambda: varlen(ck=i32(0, 8, 17)), SinkattnValueError, ["cu_seqlens_k[-1]", "17", "16"]),
    ("max-seqlen-small", lambda: varlen(mq=4), SinkattnValueError, ["max_seqlen_q", "8"]),
    ("max-seqlen-negative", lambda: varlen(mk=-1), SinkattnValueError, ["max_seqlen_k"]),
    ("varlen-q-rank", lambda: varlen(q=torch.randn(1, 2 * S, H, D)), SinkattnValueError, ["q", "3-D", "total_q"]),
    ("cu-device", lambda: varlen(cq=i32(0, 8, 16).to("meta")), SinkattnValueError, ["cu_seqlens_q", "meta"]),
]


def kvc(q=None, kc=None, vc=None, **kw):
    q = torch.randn(B, 1, H, D) if q is None else q
    kc = torch.randn(B, 16, HK, D) if kc is None else kc
    vc = torch.randn(B, 16, HK, D) if vc is None else vc
    kw.setdefault("cache_seqlens", i32(3, 5))
    return sinkattn.flash_attn_with_kvcache(q, kc, vc, **kw)


def paged(block_table, **kw):
    return kvc(kc=torch.randn(6, 4, HK, D), vc=torch.randn(6, 4, HK, D), block_table=block_table, **kw)


K1 = torch.randn(B, 1, HK, D)
COS = torch.randn(32, 8)

KVCACHE = [
    ("cache-seqlens-beyond-capacity", lambda: kvc(cache_seqlens=i32(3, 16), k=K1, v=K1), SinkattnValueError,
     ["cache_seqlens[1]", "16", "capacity"]),
    ("cache-seqlens-past-capacity", lambda: kvc(cache_seqlens=i32(3, 17)), SinkattnValueError, ["cache_seqlens[1]"]),
    ("cache-seqlens-negative", lambda: kvc(cache_seqlens=i32(-1, 2)), SinkattnValueError, ["cache_seqlens[0]", ">= 0"]),
    ("cache-seqlens-int64", lambda: kvc(cache_seqlens=torch.tensor([3, 5])), SinkattnTypeError, ["cache_seqlens", "int32"]),
    ("cache-seqlens-shape", lambda: kvc(cache_seqlens=i32(3)), SinkattnValueError, ["cache_seqlens", "(2,)"]),
    ("block-table-out-of-range", lambda: paged(i32(0, 1, 2, 3, 4, 9).view(2, 3), cache_seqlens=i32(3, 12)),
     SinkattnValueError,
     ["block_table[1, 2]", "9", "[0, 6)"]),
    ("block-table-negative", lambda: paged(i32(0, -1, 2, 3, 4, 5).view(2, 3), cache_seqlens=i32(6, 5)),
     SinkattnValueError,
     ["block_table[0, 1]", "-1"]),
    ("block-table-int64", lambda: paged(torch.arange(6).view(2, 3)), SinkattnTypeError, ["block_table", "int32"]),
    ("block-table-rows", lambda: paged(i32(0, 1, 2)[None]), SinkattnValueError, ["block_table", "batch"]),
    ("paged-capacity", lambda: paged(i32(0, 1, 2, 3, 4, 5).view(2, 3), cache_seqlens=i32(3, 12), k=K1, v=K1),
     SinkattnValueError, ["cache_seqlens[1]", "capacity of 12"]),
    ("k-without-v", lambda: kvc(k=K1), SinkattnValueError, ["k", "v", "together"]),
    ("new-k-shape", lambda: kvc(k=torch.randn(B, 1, H, D), v=torch.randn(B, 1, H, D)), SinkattnValueError,
     ["k", "shape"]),
    ("new-k-dtype", lambda: kvc(k=K1.half(), v=K1.half()), SinkattnTypeError, ["k", "float16"]),
    ("cache-dtype", lambda: kvc(kc=torch.randn(B, 16, HK, D).half()), SinkattnTypeError, ["k_cache", "float16"]),
    ("cache-batch", lambda: kvc(kc=torch.randn(3, 16, HK, D), vc=torch.randn(3, 16, HK, D)), SinkattnValueError,
     ["k_cache", "batch"]),
    ("v-cache-shape", lambda: kvc(vc=torch.randn(B, 8, HK, D)), SinkattnValueError, ["v_cache", "k_cache"]),
    ("rotary-cos-only", lambda: kvc(rotary_cos=COS), SinkattnValueError, ["rotary_cos", "rotary_sin"]),
    ("rotary-too-wide", lambda: kvc(rotary_cos=torch.randn(32, 20), rotary_sin=torch.randn(32, 20)),
     SinkattnValueError, ["rotary_cos", "20"]),
    ("rotary-too-short", lambda: kvc(rotary_cos=COS[:4], rotary_sin=COS[:4], k=K1, v=K1), SinkattnValueError,
     ["rotary_cos", "4 positions"]),
    ("kv-none-with-full-cache", lambda: kvc(cache_seqlens=None, k=K1, v=K1), SinkattnValueError, ["cache_seqlens"]),
    ("num-splits", lambda: kvc(num_splits=-1), SinkattnValueError, ["num_splits"]),
    ("cache-last-dim", lambda: kvc(kc=transposed_last(torch.randn(B, 16, HK, D))), SinkattnValueError,
     ["k_cache", "contiguous"]),
    ("cache-seqlens-device", lambda: kvc(cache_seqlens=i32(3, 5).to("meta")), SinkattnValueError,
     ["cache_seqlens", "meta"]),
]


LSE = torch.zeros(B, H, S)

# Found by probing every argument of every public function.
PROBED = [
    ("return-lse-str", lambda: A(q0, k0, v0, return_lse="yes"), SinkattnTypeError, ["return_lse", "bool", "'yes'"]),
    ("deterministic-str", lambda: A(q0, k0, v0, deterministic="no"), SinkattnTypeError, ["deterministic", "bool"]),
    ("varlen-deterministic-int", lambda: VL(q0[0], k0[0], v0[0], i32(0, 8), i32(0, 8), 8, 8, deterministic=1),
     SinkattnTypeError, ["deterministic"]),
    ("kvcache-return-lse-none", lambda: KV(q0[:, :1], k0, v0, cache_seqlens=3, return_lse=None), SinkattnTypeError,
     ["return_lse"]),
    ("varlen-max-seqlen-past-int32", lambda: VL(q0[0], k0[0], v0[0], i32(0, 8), i32(0, 8), 2**40, 8),
     SinkattnValueError, ["max_seqlen_q", "2147483647"]),
    ("varlen-cu-negative", lambda: VL(q0[0], k0[0], v0[0], i32(0, -2), i32(0, 8), 8, 8), SinkattnValueError,
     ["cu_seqlens_q", "non-decreasing"]),
    ("kvcache-broadcast-cache-append", lambda: KV(q0[:, :1], k0[:1].expand(B, -1, -1, -1), v0, k=k0[:, :1],
                                                 v=v0[:, :1], cache_seqlens=i32(1, 2)),
     SinkattnValueError, ["k_cache", "sharing memory"]),
    ("kvcache-same-cache-twice", lambda: KV(q0[:, :1], k0, k0, k=k0[:, :1], v=v0[:, :1], cache_seqlens=i32(1, 2)),
     SinkattnValueError, ["k_cache", "v_cache", "same memory"]),
    ("kvcache-cache-seqlens-list", lambda: KV(q0[:, :1], k0, v0, cache_seqlens=[1, 2]), SinkattnTypeError,
     ["cache_seqlens"]),
    ("kvcache-block-table-1d", lambda: KV(q0[:, :1], torch.randn(4, 4, HK, D), torch.randn(4, 4, HK, D),
                                         cache_seqlens=i32(1, 1), block_table=i32(0, 1)),
     SinkattnValueError, ["block_table", "2-D"]),
    ("kvcache-pages-past-table", lambda: KV(q0[:, :1], torch.randn(4, 4, HK, D), torch.randn(4, 4, HK, D),
                                           k=k0[:, :1], v=v0[:, :1], cache_seqlens=i32(4, 1),
                                           block_table=i32(0, 1).view(2, 1)),
     SinkattnValueError, ["cache_seqlens[0]", "capacity of 4"]),
]

MERGE = [
    ("merge-lse-int", lambda: M(q0, LSE.int(), q0, LSE), SinkattnTypeError, ["lse_a", "int32"]),
    ("merge-out-3d", lambda: M(q0[0], LSE[0], q0[0], LSE[0]), SinkattnValueError, ["out_a", "out_b"]),
    ("merge-lse-shape", lambda: M(q0, LSE[:, :, :3], q0, LSE), SinkattnValueError, ["lse_a", "(2, 4, 8)"]),
    ("merge-device", lambda: M(q0, LSE.to("meta"), q0, LSE), SinkattnValueError, ["one device", "meta"]),
    ("merge-out-dtype", lambda: M(q0, LSE, q0.half(), LSE), SinkattnTypeError, ["out_a", "float16"]),
    ("merge-sinks-shape", lambda: M(q0, LSE, q0, LSE, torch.zeros(3)), SinkattnValueError, ["sinks", "(4,)"]),
    ("merge-sinks-int", lambda: M(q0, LSE, q0, LSE, torch.zeros(H, dtype=torch.int64)), SinkattnTypeError,
     ["sinks", "int64"]),
    ("merge-not-tensor", lambda: M(q0, None, q0, LSE), SinkattnTypeError, ["lse_a", "NoneType"]),
]

ALL = BATCHED + VARLEN + KVCACHE + PROBED + MERGE


def test_case_ids_are_unique():
    ids = [c[0] for c in ALL]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


@pytest.mark.parametrize("call,exc,words", [pytest.param(*c[1:], id=c[0]) for c in ALL])
def test_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, SinkattnError)
    builtin = {SinkattnValueError: ValueError, SinkattnTypeError: TypeError, SinkattnRuntimeError: RuntimeError}[exc]
    assert isinstance(info.value, builtin)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in message: {msg}"


def test_unused_block_table_entries_may_be_padding():
    """Only the pages a sequence uses are checked: -1 padding past them is fine (as in vLLM)."""
    out = paged(i32(0, -1, -1, 3, 4, -1).view(2, 3), cache_seqlens=i32(4, 8))
    assert out.shape == (B, 1, H, D) and not out.isnan().any()


def test_interleaved_kv_views_may_share_an_allocation():
    """kv[:, :, 0] and kv[:, :, 1] (one allocation, disjoint elements) are separate caches: appending works."""
    kv = torch.randn(B, S, 2, HK, D)
    kn, vn = torch.randn(B, 1, HK, D), torch.randn(B, 1, HK, D)
    out = KV(q0[:, :1], kv[:, :, 0], kv[:, :, 1], k=kn, v=vn, cache_seqlens=i32(2, 5))
    assert torch.equal(kv[0, 2, 0], kn[0, 0]) and torch.equal(kv[1, 5, 1], vn[1, 0]) and out.isfinite().all()


def test_value_checks_opt_out(monkeypatch):
    """SINKATTN_VALUE_CHECKS=0 skips the checks that read index tensors (each read synchronises a CUDA device):
    the validators are then not called at all; by default they are."""
    from sinkattn import _checks

    calls = []
    monkeypatch.setattr(_checks, "check_cu_seqlens_values", lambda *a: calls.append("cu"))
    monkeypatch.setattr(_checks, "check_kvcache_values", lambda *a: calls.append("cache"))
    varlen()
    kvc()
    assert calls == ["cu", "cache"]
    monkeypatch.setenv("SINKATTN_VALUE_CHECKS", "0")
    varlen()
    kvc()
    assert calls == ["cu", "cache"]
