"""Mask geometry in Python: which keys a query row sees (docs/DESIGN.md section 1), the twin of csrc/common/mask.h.

`Mask` is one call's scale, softcap and visibility: built once per call by the checks (`_checks.normalize_mask`),
carried as one value through ops, dispatch, the Problem (backend choice), the reference backend and the kernel
bridge (`kernels`, which hands `kernel_args()` to the compiled module as one tuple). Only the torch.library op
schemas (ops.py) hold it as loose scalars, because a schema takes scalars; they convert in one place each way.

Bottom-right alignment: with off = seqlen_k - seqlen_q, query row i sits at key position i + off; key j is visible
if j <= i + off + right (right >= 0) and (j >= i + off - left or j < sink_tokens) (left >= 0). The functions here
answer that question for ranges of rows and keys, on the host: the reference backend's tiling (`key_ranges`,
`fully_visible`, `visible`) and the chunk-pair cutting of the distributed and transformers paths
(`visible_rectangle`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SinkattnRuntimeError, SinkattnValueError

_INF = float("inf")


@dataclass(frozen=True)
class Mask:
    """Scale, softcap and visibility of one call; `off` is set per sequence (bottom-right alignment). The defaults
    are plain attention with scale 1."""
    scale: float = 1.0
    window_left: int = -1     # -1 = unbounded
    window_right: int = -1    # -1 = unbounded; causal is window_right == 0
    sink_tokens: int = 0
    softcap: float = 0.0

    def kernel_args(self) -> tuple[float, int, int, int, float]:
        """(scale, window_left, window_right, sink_tokens, softcap): the order of the op schemas' scalars and of
        the compiled module's mask tuple (csrc/api.cpp MaskArgs)."""
        return (self.scale, self.window_left, self.window_right, self.sink_tokens, self.softcap)

    # The questions the layers above ask of a mask (feature tests, backend preferences, the reference's plans), so
    # that they name no window field.
    @property
    def causal(self) -> bool:
        """The right edge is the diagonal (causal=True, or window_size[1] == 0)."""
        return self.window_right == 0

    @property
    def windowed(self) -> bool:
        """A bounded left edge or a right edge past the diagonal: the kernels' "window" feature."""
        return self.window_left >= 0 or self.window_right > 0

    @property
    def left_unbounded(self) -> bool:
        return self.window_left < 0

    def left_window_under(self, keys: int) -> bool:
        """A bounded left edge that keeps fewer than `keys` keys behind the diagonal."""
        return 0 <= self.window_left < keys

    @property
    def visibility(self) -> tuple[int, int, int]:
        """(window_left, window_right, sink_tokens): what decides which keys a row sees (a cache key for plans)."""
        return (self.window_left, self.window_right, self.sink_tokens)


def window_with_causal(left: int, right: int, causal: bool, *, strict: bool, who: str = "sinkattn") -> tuple[int, int]:
    """The window a call means: causal=True is right = 0. strict (sinkattn's own API): a positive right edge with
    causal is a contradiction and raises; not strict (flash-attn's front end, which the drop-in follows): causal
    overrides whatever right edge was given."""
    if not causal:
        return left, right
    if strict and right > 0:
        raise SinkattnValueError(
            f"{who}: causal=True with window_size[1] (right) = {right}; causal means right = 0; "
            f"accepted: right in (-1, 0) with causal, or causal=False with window_size=({left}, {right})")
    return left, 0


def key_ranges(i0: int, i1: int, seqlen_k: int, off: int, m: Mask) -> list[tuple[int, int]]:
    """Half-open key ranges holding every key visible to some query row in [i0, i1).

    At most two ranges: the sink tokens [0, n) and the window, merged when they touch. Each range
    starts and ends on a key that some row of the chunk sees, so nothing wholly masked is visited.
    """
    wl, wr, n = m.window_left, m.window_right, m.sink_tokens
    hi = seqlen_k if wr < 0 else min(seqlen_k, i1 - 1 + off + wr + 1)
    if hi <= 0 or i1 <= i0:
        return []
    if wl < 0:
        return [(0, hi)]
    lo = max(0, i0 + off - wl)
    ns = min(n, hi)  # sink tokens never reach past the right edge
    if ns >= lo:
        return [(0, hi)]
    ranges = [(0, ns)] if ns > 0 else []
    if lo < hi:
        ranges.append((lo, hi))
    return ranges


def fully_visible(i0: int, i1: int, t0: int, t1: int, off: int, m: Mask) -> bool:
    """Whether every row of [i0, i1) sees every key of [t0, t1)."""
    right_ok = m.window_right < 0 or t1 - 1 <= i0 + off + m.window_right
    left_ok = m.window_left < 0 or t0 >= i1 - 1 + off - m.window_left or t1 <= m.sink_tokens
    return right_ok and left_ok


def visible(i0: int, i1: int, t0: int, t1: int, off: int, m: Mask, device, keys=None) -> torch.Tensor:
    """(rows, keys) visibility of rows [i0, i1) and keys [t0, t1) (or the key positions `keys`)."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = (torch.arange(t0, t1, device=device) if keys is None else keys)[None, :]
    ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=device)
    if m.window_right >= 0:
        ok &= j <= i + off + m.window_right
    if m.window_left >= 0:
        ok &= (j >= i + off - m.window_left) | (j < m.sink_tokens)
    return ok


def visible_rectangle(sq: int, sk: int, d: int, left: int, right: int):
    """Rows [r0, r1) and columns [c0, c1) of a chunk pair that can see anything, and the window
    (left', right') that expresses its mask bottom-right aligned, or None if nothing is visible.

    Global visibility of key j (column) to query i (row) in this pair: with d = i_start - j_start,
    j - i <= d + right (if right >= 0) and j - i >= d - left (if left >= 0)."""
    hi = d + right if right >= 0 else _INF   # j - i <= hi
    lo = d - left if left >= 0 else -_INF    # j - i >= lo
    r0 = 0 if hi == _INF else max(0, -hi)
    r1 = sq if lo == -_INF else min(sq, sk - lo)
    if r0 >= r1:
        return None
    c0 = 0 if lo == -_INF else max(0, r0 + lo)
    c1 = sk if hi == _INF else min(sk, r1 + hi)
    if c0 >= c1:
        return None
    off = (c1 - c0) - (r1 - r0)
    new_right = -1 if hi == _INF else int(hi - c0 + r0 - off)
    new_left = -1 if lo == -_INF else int(off - (lo - c0 + r0))
    if (hi != _INF and new_right < 0) or (lo != -_INF and new_left < 0):  # cannot happen (see tests)
        raise SinkattnRuntimeError(f"sinkattn: internal error cutting the chunk pair "
                                   f"(sq={sq}, sk={sk}, d={d}, window=({left}, {right}))")
    return int(r0), int(r1), int(c0), int(c1), new_left, new_right
