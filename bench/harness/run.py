"""Running a grid: every case by every comparator, one row per (case, comparator)."""
from __future__ import annotations

import gc
import math
import time
import traceback
import warnings

import torch

from . import comparators as C
from . import flops as F
from . import timing
from .grids import Case

ROW_FIELDS = [
    "grid", "id", "variant", "kind", "mode", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim",
    "dtype", "causal", "window_left", "window_right", "sink_tokens", "sinks", "paged", "page_size", "mask",
    "comparator", "backend", "sink_handling", "status", "reason", "note",
    "median_ms", "p10_ms", "p90_ms", "min_ms", "reps", "warmup", "method", "l2_flush",
    "flops", "bytes", "tflops", "gbps", "frac_matmul_ceiling", "frac_copy_ceiling", "sinkattn_speedup",
    "rel_err_vs_sinkattn", "sm_clock_mhz",
]


def case_counts(case: Case) -> tuple[int, int]:
    """(FLOPs, fewest bytes) of one call of the case."""
    eb = torch.empty((), dtype=case.torch_dtype).element_size()
    if case.kind == "decode":
        fl = F.attention_flops(case.batch, case.nheads, case.headdim, case.seqlen_q, case.seqlen_k,
                               causal=case.causal, window_size=case.window_size, sink_tokens=case.sink_tokens)
        kw = dict(seqlen_q=case.seqlen_q, causal=case.causal, window_size=case.window_size,
                  sink_tokens=case.sink_tokens)
        # K/V at the cache's element size (1 byte for an FP8 cache), q and out at the query dtype's.
        kv = F.decode_bytes(case.batch, case.nheads, case.nheads_k, case.headdim, case.seqlen_k,
                            elem_bytes=case.kv_elem_bytes, **kw)
        qo_elems = 2 * case.batch * case.seqlen_q * case.nheads * case.headdim
        return fl, kv + qo_elems * (eb - case.kv_elem_bytes)
    fl = F.attention_flops(case.batch, case.nheads, case.headdim, case.seqlen_q, case.seqlen_k, causal=case.causal,
                           window_size=case.window_size, sink_tokens=case.sink_tokens, mode=case.mode)
    by = F.attention_bytes(case.batch, case.nheads, case.nheads_k, case.headdim, case.seqlen_q, case.seqlen_k,
                           elem_bytes=eb, causal=case.causal, window_size=case.window_size,
                           sink_tokens=case.sink_tokens, mode=case.mode)
    return fl, by


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp32 (NaN anywhere gives inf)."""
    g, r = got.float(), ref.float()
    if g.shape != r.shape:
        return float("nan")
    if not torch.isfinite(g).all():
        return float("inf")
    den = r.norm().item()
    return (g - r).norm().item() / den if den > 0 else (g - r).norm().item()


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _free(device):
    """Give back the memory of the last comparator (GPU only: gc.collect costs ~0.5 s with dynamo loaded)."""
    if device.type == "cuda":
        gc.collect()  # autograd graphs kept by backward closures hold cycles
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


_FATAL = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
          "illegal instruction", "an illegal address")


class CudaContextLost(RuntimeError):
    """A kernel fault poisons the CUDA context; nothing after it in this process can be trusted."""


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_case(case: Case, names: list[str], device: torch.device, *, ceilings: dict, timing_kw: dict,
             use_graph: bool = False, flusher=None, verbose_errors: bool = False) -> list[dict]:
    fl, by = case_counts(case)
    base = case.as_dict()
    base.update(flops=fl, bytes=by)
    rows = []
    try:
        x = C.make_inputs(case, device)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: every comparator of the case is reported so
        _free(device)
        status = "oom" if _is_oom(e) else "error"
        return [dict(base, comparator=n, status=status, reason=f"inputs: {_first_line(e)}") for n in names]
    primary_out = None
    for name in names:
        row = dict(base, comparator=name)
        rows.append(row)
        if name in case.skip:
            row.update(status="skipped", reason="left out of this grid (compile time)")
            continue
        prep = None
        try:
            prep = C.COMPARATORS[name](case, x, device)
            row.update(backend=prep.backend, sink_handling=prep.sink_handling, note=prep.note)
            out = prep.output() if prep.output is not None else None
            if name == C.PRIMARY:
                primary_out = out.detach() if out is not None else None
                if primary_out is not None and not bool(torch.isfinite(primary_out).all()):
                    raise RuntimeError("non-finite values (NaN/inf) in sinkattn's output; not timed")
            elif out is not None and primary_out is not None and prep.sink_handling != "no sink":
                row["rel_err_vs_sinkattn"] = rel_err(out, primary_out)
            del out
            kw = dict(timing_kw)
            if device.type == "cuda":
                kw.update(use_graph=use_graph and prep.graphable, flusher=flusher)
            elif prep.output is not None:
                kw.setdefault("warmup", 0)  # output() above was the warm-up call
            t = timing.bench(prep.fn, device, **kw)
            row.update(t.as_dict(), status="ok")
            sec = t.median_ms * 1e-3
            row["tflops"] = fl / sec / 1e12
            row["gbps"] = by / sec / 1e9
            if ceilings.get("matmul_TFLOPs"):
                row["frac_matmul_ceiling"] = row["tflops"] / ceilings["matmul_TFLOPs"]
            if ceilings.get("copy_GBps"):
                row["frac_copy_ceiling"] = row["gbps"] / ceilings["copy_GBps"]
        except C.Unsupported as e:
            row.update(status="n/a", reason=str(e))
        except NotImplementedError as e:
            row.update(status="n/a", reason=_first_line(e))
        except Exception as e:  # noqa: BLE001 - one failing comparator must not stop the grid
            row.update(status="oom" if _is_oom(e) else "error", reason=_first_line(e))
            if verbose_errors:
                traceback.print_exc()
            if any(f in str(e) for f in _FATAL):
                lost = CudaContextLost(f"{case.id} / {name}: {_first_line(e)}")
                rest = names[names.index(name) + 1:]
                lost.rows = rows + [dict(base, comparator=n, status="not run", reason=f"CUDA context lost ({lost})")
                                    for n in rest]
                raise lost from e
        finally:
            del prep
            _free(device)
    if device.type == "cuda":
        clk = timing.sm_clock_mhz(device.index or 0)
        for r in rows:
            r["sm_clock_mhz"] = clk
    del x, primary_out
    _free(device)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """sinkattn_speedup = comparator time / sinkattn time for the same case (> 1: sinkattn is faster)."""
    primary = {r["id"]: r["median_ms"] for r in rows
               if r["comparator"] == C.PRIMARY and r.get("status") == "ok"}
    for r in rows:
        t0 = primary.get(r["id"])
        t = r.get("median_ms")
        if r.get("status") == "ok" and t0 and t and not math.isnan(t):
            r["sinkattn_speedup"] = t / t0
    return rows


class _Progress:
    """tqdm when installed, else a plain one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="case", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, desc: str):
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(desc[-60:], refresh=False)
            self.bar.update(1)
            return
        import sys

        width = 30
        done = int(width * self.n / max(1, self.total))
        el = time.time() - self.t0
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {el:5.0f}s {desc[-50:]:<50}")
        if self.n == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_grid(cases: list[Case], names: list[str], device: torch.device, *, ceilings: dict, timing_kw: dict,
             graph: str = "auto", time_limit_s: float | None = None, progress: bool = True,
             verbose_errors: bool = False) -> list[dict]:
    """graph: "on" times CUDA-graph replays where the callable can be captured, "off" never, "auto" for
    decode cases only (many small launches, where the launch gaps would otherwise dominate)."""
    if graph not in ("auto", "on", "off"):
        raise ValueError(f"bench: graph must be 'auto', 'on' or 'off'; got {graph!r}")
    rows = []
    flusher = timing.L2Flusher(device) if device.type == "cuda" and timing_kw.get("flush_l2", True) else None
    bar = _Progress(len(cases), progress)
    t0 = time.time()
    with warnings.catch_warnings():
        # sinkattn's one-time reference-fallback warning (the rows say which backend ran and why) and
        # FlexAttention's eager-mode warning on the CPU; filtered here so timed calls carry no filter.
        warnings.simplefilter("ignore")
        _run_cases(cases, names, device, rows, bar, t0, ceilings, timing_kw, graph, time_limit_s, flusher,
                   verbose_errors)
    bar.close()
    return add_ratios(rows)


def _run_cases(cases, names, device, rows, bar, t0, ceilings, timing_kw, graph, time_limit_s, flusher,
               verbose_errors):
    for case in cases:
        if time_limit_s is not None and time.time() - t0 > time_limit_s:
            rows += [dict(case.as_dict(), comparator=n, status="not run", reason="time limit of the run reached")
                     for n in names]
            bar.update(case.id + " (time limit)")
            continue
        use_graph = graph == "on" or (graph == "auto" and case.kind == "decode")
        try:
            rows += run_case(case, names, device, ceilings=ceilings, timing_kw=timing_kw, use_graph=use_graph,
                             flusher=flusher, verbose_errors=verbose_errors)
        except CudaContextLost as e:
            rows += e.rows
            lost = str(e)
            for later in cases[cases.index(case) + 1:]:
                rows += [dict(later.as_dict(), comparator=n, status="not run",
                              reason=f"CUDA context lost earlier ({lost})") for n in names]
                bar.update(later.id + " (not run)")
            bar.update(case.id)
            return
        bar.update(case.id)
