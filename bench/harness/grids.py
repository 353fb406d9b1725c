"""The benchmark grids.

Each grid is a list of `Case`s; a case is one attention call shape. Every case is run by sinkattn
(backend "auto", i.e. the kernel a user gets) and by each comparator that can do the same math.

    smoke        a few tiny cases of every kind; runs on the CPU through the reference backend in
                 seconds (CI exercises the harness with it; not a performance claim)
    check        the short GPU grid of `make gpu-check` (a minute or two on an H200)
    replication  FlashAttention-3 paper setup: bf16, head dim 64/128/256, nheads = 2048 / headdim,
                 seqlen 512..16k, batch = 16k / seqlen, causal off/on, forward and backward
    gptoss       64 q heads, 8 kv heads, head dim 64, sinks on/off, window (127, 0) and full causal,
                 seqlen 1k..128k (batch = max(1, 16k / seqlen)), forward and backward
    streaming    StreamingLLM: sink_tokens 4 and 16, window 128 / 1k / 4k (window_size = (w - 1, 0)),
                 Llama-like heads (32 q, 8 kv, head dim 128), seqlen 4k..64k, forward
    decode       gpt-oss heads with sinks, one new token, batch 1..256, seqlen_k 1k..128k, contiguous
                 and paged (page size 256) caches; cases whose K/V exceed DECODE_KV_BYTES are left out;
                 FP8 caches (FP8_DECODE): paged and contiguous e4m3 at batch 1/16/64, seqlen_k
                 16k..128k, and e5m2 at b64/sk64k, each right after the same case over the bf16 cache
    all          replication + gptoss + streaming + decode
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DECODE_KV_BYTES = 16 << 30  # K + V of one decode case, at most (the H200 has 141 GB; the lease is short)


@dataclass(frozen=True)
class Case:
    grid: str
    kind: str               # "attn" or "decode"
    mode: str               # "fwd" or "bwd" (decode: "fwd")
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    sink_tokens: int = 0
    sinks: bool = False
    paged: bool = False
    page_size: int = 256
    deterministic: bool = False  # the backward's deterministic mode (sinkattn's columns; the others: n/a)
    kv_dtype: str = "auto"  # decode: the cache's type, "auto" (dtype) or vLLM's "fp8_e4m3" / "fp8_e5m2"
    skip: tuple = field(default=())  # comparator names not to run on this case (e.g. to bound compile time)

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes per cached K/V element: 1 for an FP8 cache, else the dtype's."""
        return 1 if self.kv_dtype != "auto" else torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def mask_name(self) -> str:
        parts = []
        if self.window_left >= 0:
            parts.append(f"win{self.window_left + 1}")
        elif self.causal or self.window_right == 0:
            parts.append("causal")
        else:
            parts.append("full")
        if self.sink_tokens:
            parts.append(f"st{self.sink_tokens}")
        return "-".join(parts)

    @property
    def variant(self) -> str:
        """What the plot lines of one panel share: everything but the sequence length and batch."""
        s = f"{self.kind}/{self.mode}/hd{self.headdim}/h{self.nheads}kv{self.nheads_k}/{self.mask_name}"
        s += "/sinks" if self.sinks else ""
        # pages of 256, the grids' default, keep the bare name of the rows measured so far; other sizes say theirs
        s += ("/paged" if self.page_size == 256 else f"/paged{self.page_size}") if self.paged else ""
        s += "/det" if self.deterministic else ""
        s += f"/{self.kv_dtype}" if self.kv_dtype != "auto" else ""
        return s

    @property
    def id(self) -> str:
        s = f"{self.grid}/{self.variant}/b{self.batch}/sq{self.seqlen_q}/sk{self.seqlen_k}/{self.dtype}"
        return s

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("skip")
        d.update(id=self.id, variant=self.variant, mask=self.mask_name)
        return d


def smoke() -> list[Case]:
    """Tiny shapes of every kind (a few seconds on a CPU through the reference backend)."""
    g = "smoke"
    cases = []
    for mode in ("fwd", "bwd"):
        for causal in (False, True):
            for s in ((64, 128) if (mode, causal) == ("fwd", True) else (128,)):
                cases.append(Case(g, "attn", mode, 1, s, s, 4, 4, 64, "bf16", causal=causal,
                                  window_right=0 if causal else -1))
    # gpt-oss-like: GQA, learnable sinks, sliding window and full causal
    for mode in ("fwd", "bwd"):
        cases.append(Case(g, "attn", mode, 1, 128, 128, 8, 2, 64, "bf16", causal=True, window_left=31,
                          window_right=0, sinks=True))
    cases.append(Case(g, "attn", "fwd", 1, 128, 128, 8, 2, 64, "bf16", causal=True, window_right=0, sinks=True))
    # StreamingLLM: sink tokens + window
    cases.append(Case(g, "attn", "fwd", 1, 128, 128, 4, 2, 64, "bf16", causal=True, window_left=31, window_right=0,
                      sink_tokens=4))
    # decode, contiguous and paged
    for paged in (False, True):
        cases.append(Case(g, "decode", "fwd", 2, 1, 256, 8, 2, 64, "bf16", causal=True, window_right=0, sinks=True,
                          paged=paged, page_size=64))
    return cases


def replication() -> list[Case]:
    cases = []
    for mode in ("fwd", "bwd"):
        for hd in (64, 128, 256):
            for causal in (False, True):
                for s in (512, 1024, 2048, 4096, 8192, 16384):
                    h = 2048 // hd
                    cases.append(Case("replication", "attn", mode, 16384 // s, s, s, h, h, hd, "bf16", causal=causal,
                                      window_right=0 if causal else -1))
    return cases


def gptoss() -> list[Case]:
    cases = []
    for mode in ("fwd", "bwd"):
        for window in ((127, 0), (-1, 0)):
            for sinks in (True, False):
                for s in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
                    cases.append(Case("gptoss", "attn", mode, max(1, 16384 // s), s, s, 64, 8, 64, "bf16",
                                      causal=True, window_left=window[0], window_right=0, sinks=sinks))
    return cases


def streaming() -> list[Case]:
    cases = []
    for n in (4, 16):
        for w in (128, 1024, 4096):
            for s in (4096, 16384, 65536):
                cases.append(Case("streaming", "attn", "fwd", max(1, 16384 // s), s, s, 32, 8, 128, "bf16",
                                  causal=True, window_left=w - 1, window_right=0, sink_tokens=n))
    return cases


# FP8 caches: which decode cases also run over each FP8 cache ((batch, seqlen_k) pairs).
FP8_DECODE = {"fp8_e4m3": [(b, sk) for b in (1, 16, 64) for sk in (16384, 65536, 131072)],
              "fp8_e5m2": [(64, 65536)]}


def decode() -> list[Case]:
    cases = []
    for paged in (False, True):
        for b in (1, 4, 16, 64, 256):
            for sk in (1024, 4096, 16384, 65536, 131072):
                kv_bytes = 2 * b * sk * 8 * 64 * 2
                if kv_bytes > DECODE_KV_BYTES:
                    continue
                case = Case("decode", "decode", "fwd", b, 1, sk, 64, 8, 64, "bf16", causal=True,
                            window_right=0, sinks=True, paged=paged, page_size=256)
                cases.append(case)
                cases += [dataclasses.replace(case, kv_dtype=kv) for kv, at in FP8_DECODE.items() if (b, sk) in at]
    return cases


def check() -> list[Case]:
    """The short GPU grid of `make gpu-check`, most telling cases first (the run is time-boxed).
    FlexAttention compiles per shape and mask (tens of seconds each), so it runs on three cases only."""
    g, noflex = "check", ("flex",)
    cases = []
    for window in ((127, 0), (-1, 0)):
        cases.append(Case(g, "attn", "fwd", 2, 8192, 8192, 64, 8, 64, "bf16", causal=True, window_left=window[0],
                          window_right=0, sinks=True, skip=() if window[0] >= 0 else noflex))
    cases.append(Case(g, "attn", "fwd", 1, 16384, 16384, 32, 8, 128, "bf16", causal=True, window_left=1023,
                      window_right=0, sink_tokens=4))
    for paged in (False, True):
        for b, sk in ((1, 8192), (64, 8192), (64, 32768)):
            cases.append(Case(g, "decode", "fwd", b, 1, sk, 64, 8, 64, "bf16", causal=True, window_right=0,
                              sinks=True, paged=paged, page_size=256, skip=noflex))
    # vLLM's page size (its FlashAttention backends' 16): each 128-key block of the sm80 decode tile spans 8 pages
    for sk in (8192, 32768):
        cases.append(Case(g, "decode", "fwd", 64, 1, sk, 64, 8, 64, "bf16", causal=True, window_right=0, sinks=True,
                          paged=True, page_size=16, skip=noflex))
    for mode in ("fwd", "bwd"):
        for causal in (False, True):
            for s in (2048, 8192):
                flex_here = mode == "fwd" and causal and s == 8192
                cases.append(Case(g, "attn", mode, 16384 // s, s, s, 16, 16, 128, "bf16", causal=causal,
                                  window_right=0 if causal else -1, skip=() if flex_here else noflex))
    cases.append(Case(g, "attn", "bwd", 2, 8192, 8192, 64, 8, 64, "bf16", causal=True, window_left=127,
                      window_right=0, sinks=True, skip=noflex))
    # The issues' targets: what learnable sinks cost in the forward and backward (beside the same shapes
    # above without them), Llama-70B decode heads over 1M cached tokens, and a windowed decode whose time
    # must not grow with seqlen_k.
    for mode in ("fwd", "bwd"):
        cases.append(Case(g, "attn", mode, 2, 8192, 8192, 16, 16, 128, "bf16", sinks=True, skip=noflex))
    cases.append(Case(g, "decode", "fwd", 64, 1, 16384, 64, 8, 128, "bf16", causal=True, window_right=0,
                      sinks=True, skip=noflex))
    # Speculative decoding, 3 queries x 8 heads per KV head: the sm80 tile of two key groups (24 rows).
    cases.append(Case(g, "decode", "fwd", 64, 3, 32768, 64, 8, 64, "bf16", causal=True, window_right=0,
                      sinks=True, skip=noflex))
    for sk in (8192, 131072):
        cases.append(Case(g, "decode", "fwd", 16, 1, sk, 64, 8, 64, "bf16", causal=True, window_left=127,
                          window_right=0, sinks=True, skip=noflex))
    # The sm90 issue's other head dims (16k tokens, nheads = 2048 / headdim), and what sinks cost there.
    for hd in (64, 256):
        for causal, sinks in ((False, False), (True, False), (False, True)):
            cases.append(Case(g, "attn", "fwd", 2, 8192, 8192, 2048 // hd, 2048 // hd, hd, "bf16", causal=causal,
                              window_right=0 if causal else -1, sinks=sinks, skip=noflex))
    # The sm90 backward issue's head dim 64 (16k tokens, 32 heads), beside hd128's rows above, head dim 256 (the
    # sm80 backward's 0.9x target at every head dim; 8 heads), and what the deterministic mode costs (beside hd128's
    # full row).
    for hd in (64, 256):
        for causal in (False, True):
            cases.append(Case(g, "attn", "bwd", 2, 8192, 8192, 2048 // hd, 2048 // hd, hd, "bf16", causal=causal,
                              window_right=0 if causal else -1, skip=noflex))
    cases.append(Case(g, "attn", "bwd", 2, 8192, 8192, 16, 16, 128, "bf16", deterministic=True,
                      skip=("reference", "sdpa-flash", "flex", "vllm-triton")))  # sinkattn's columns only
    return cases


GRIDS = {"smoke": smoke, "check": check, "replication": replication, "gptoss": gptoss, "streaming": streaming,
         "decode": decode}


def get(name: str) -> list[Case]:
    if name == "all":
        return replication() + gptoss() + streaming() + decode()
    if name not in GRIDS:
        raise ValueError(f"bench: unknown grid {name!r}; choose from {', '.join(list(GRIDS) + ['all'])}")
    return GRIDS[name]()
