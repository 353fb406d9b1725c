"""The benchmark harness (bench/): FLOP and byte counts against the oracle's mask, the comparators' math
against the oracle, ratios, the report files, and a smoke run end to end. CPU tests are short; the
GPU-marked ones check CUDA timing, graph capture and the comparators on a GPU day (`make gpu-check`)."""
from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from oracle import attention_oracle, visible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import comparators as C  # noqa: E402
from bench.harness import flops as F  # noqa: E402
from bench.harness import grids, report, run, timing  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from bench.__main__ import select  # noqa: E402
from bench.harness.grids import Case  # noqa: E402

# (seqlen_q, seqlen_k) including seqlen_q > seqlen_k (negative offset), 0 and 1.
SHAPES = [(1, 1), (1, 7), (7, 1), (5, 5), (9, 17), (17, 9), (16, 16), (0, 4), (4, 0), (1, 33), (33, 33)]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (2, 3), (-1, 2), (5, -1), (0, -1), (40, 0)]
SINK_TOKENS = [0, 1, 3, 50]


@pytest.mark.parametrize("sq,sk", SHAPES)
def test_visible_pairs_and_keys_match_oracle_mask(sq, sk):
    for (left, right), n in itertools.product(WINDOWS, SINK_TOKENS):
        m = visible(sq, sk, left, right, n)
        per_row = F.visible_per_row(sq, sk, left, right, n)
        assert per_row.tolist() == m.sum(1).tolist(), (sq, sk, left, right, n)
        assert F.visible_pairs(sq, sk, left, right, n) == int(m.sum()), (sq, sk, left, right, n)
        assert F.visible_keys(sq, sk, left, right, n) == int(m.any(0).sum()), (sq, sk, left, right, n)


def test_flops_closed_forms_and_bytes():
    # Full, causal (square), and gpt-oss window: known closed forms.
    s, b, h, d = 4096, 2, 8, 64
    assert F.attention_flops(b, h, d, s, s) == 4 * b * h * d * s * s
    assert F.attention_flops(b, h, d, s, s, causal=True) == 4 * b * h * d * s * (s + 1) // 2
    w = 128  # window_size (127, 0): row i sees min(i + 1, 128) keys
    pairs = sum(min(i + 1, w) for i in range(s))
    assert F.attention_flops(b, h, d, s, s, causal=True, window_size=(w - 1, 0)) == 4 * b * h * d * pairs
    # sink tokens add the first n keys to rows whose window has moved past them
    n = 4
    pairs_st = sum(min(i + 1, w) + max(0, min(n, i + 1 - w)) for i in range(s))
    assert F.visible_pairs(s, s, w - 1, 0, n) == pairs_st
    assert F.attention_flops(b, h, d, s, s, causal=True, mode="bwd") == int(
        round(2.5 * F.attention_flops(b, h, d, s, s, causal=True)))
    # Decode: K and V once per KV head (GQA does not multiply them) + q + out.
    assert F.decode_bytes(3, 64, 8, 64, 1000, elem_bytes=2) == (2 * 3 * 1000 * 8 * 64 + 2 * 3 * 64 * 64) * 2
    assert F.decode_bytes(1, 64, 8, 64, 1000, elem_bytes=2, window_size=(127, 0)) == (2 * 128 * 8 * 64 + 2 * 64 * 64) * 2
    with pytest.raises(ValueError, match="causal"):
        F.attention_flops(1, 1, 64, 8, 8, causal=True, window_size=(-1, 2))
    with pytest.raises(ValueError, match="window_left"):
        F.visible_pairs(4, 4, -2, 0)
    with pytest.raises(ValueError, match="mode"):
        F.attention_flops(1, 1, 64, 8, 8, mode="sideways")


def test_visible_pairs_is_fast_at_128k():
    import time

    t = time.perf_counter()
    n = F.visible_pairs(131072, 131072, 127, 0, 4)
    assert n == sum(min(i + 1, 128) + min(4, max(0, i - 127)) for i in range(131072))
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("sq,sk", [(9, 17), (17, 9), (16, 16), (1, 33)])
def test_flex_mask_mod_matches_oracle(sq, sk):
    for (left, right), n in itertools.product(WINDOWS, SINK_TOKENS):
        case = Case("t", "attn", "fwd", 1, sq, sk, 1, 1, 64, causal=False, window_left=left, window_right=right,
                    sink_tokens=n)
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        got = C.mask_mod_for(case)(0, 0, i, j).expand(sq, sk)
        assert torch.equal(got, visible(sq, sk, left, right, n)), (sq, sk, left, right, n)


def test_add_sink_is_exact():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = torch.randn(2, 13, 4, 16), torch.randn(2, 13, 2, 16), torch.randn(2, 13, 2, 16)
    sinks = torch.randn(4) * 3
    sinks[1] = float("-inf")
    out0, lse0 = attention_oracle(q, k, v, None, causal=True, window_size=(4, 0))
    ref, _ = attention_oracle(q, k, v, sinks, causal=True, window_size=(4, 0))
    got = C.add_sink(out0.transpose(1, 2), lse0, sinks.double()).transpose(1, 2)
    assert (got - ref).abs().max() < 1e-12


def _cpu_case(**kw):
    base = dict(grid="t", kind="attn", mode="fwd", batch=2, seqlen_q=48, seqlen_k=48, nheads=4, nheads_k=2,
                headdim=32, dtype="fp32")
    base.update(kw)
    return Case(**base)


def _oracle_for(case, x):
    return attention_oracle(x.q, x.k, x.v, x.sinks, causal=case.causal, window_size=case.window_size,
                            sink_tokens=case.sink_tokens)[0]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True, window_right=0, sinks=True),
    dict(kind="decode", seqlen_q=1, seqlen_k=40, causal=True, window_right=0, sinks=True),
])
def test_sdpa_comparator_matches_oracle_on_cpu(kw):
    case = _cpu_case(**kw)
    x = C.make_inputs(case, torch.device("cpu"))
    p = C.prep_sdpa(case, x, torch.device("cpu"))
    assert p.sink_handling == ("exact (lse correction)" if case.sinks else "none needed")
    err = run.rel_err(p.output(), _oracle_for(case, x))
    assert err < 1e-5, err


def test_sdpa_declines_what_it_cannot_do():
    cpu = torch.device("cpu")
    for kw, why in [(dict(causal=True, window_left=7, window_right=0), "sliding window"),
                    (dict(causal=True, window_right=0, seqlen_q=16), "seqlen_q != seqlen_k"),
                    (dict(kind="decode", seqlen_q=1, seqlen_k=40, paged=True, page_size=16), "paged")]:
        case = _cpu_case(**kw)
        with pytest.raises(C.Unsupported, match=why):
            C.prep_sdpa(case, C.make_inputs(case, cpu), cpu)
    # backward with sinks: SDPA's lse has no gradient, so it runs without the sink and says so
    case = _cpu_case(mode="bwd", causal=True, window_right=0, sinks=True)
    p = C.prep_sdpa(case, C.make_inputs(case, cpu), cpu)
    assert p.sink_handling == "no sink"


@pytest.mark.parametrize("kw", [
    dict(causal=True, window_left=7, window_right=0, sink_tokens=3, sinks=True),
    dict(seqlen_q=20, causal=True, window_left=5, window_right=0, sinks=True),
    dict(kind="decode", seqlen_q=1, seqlen_k=40, causal=True, window_right=0, sinks=True),
])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_comparator_matches_oracle_on_cpu(kw):
    case = _cpu_case(**kw)
    x = C.make_inputs(case, torch.device("cpu"))
    p = C.prep_flex(case, x, torch.device("cpu"))
    err = run.rel_err(p.output(), _oracle_for(case, x))
    assert err < 1e-5, err


def test_sinkattn_comparator_and_paged_inputs_match_oracle_on_cpu():
    cpu = torch.device("cpu")
    for kw in (dict(causal=True, window_left=7, window_right=0, sink_tokens=2, sinks=True),
               dict(kind="decode", seqlen_q=1, seqlen_k=40, causal=True, window_right=0, sinks=True, paged=True,
                    page_size=16)):
        case = _cpu_case(**kw)
        x = C.make_inputs(case, cpu)
        p = C.prep_sinkattn(case, x, cpu)
        assert p.backend == "reference"
        assert run.rel_err(p.output(), _oracle_for(case, x)) < 1e-5


def test_ratios_and_ceiling_fractions():
    rows = [dict(id="a", comparator="sinkattn", status="ok", median_ms=2.0),
            dict(id="a", comparator="flex", status="ok", median_ms=3.0),
            dict(id="a", comparator="sdpa-flash", status="n/a", median_ms=None),
            dict(id="b", comparator="sinkattn", status="error", median_ms=None),
            dict(id="b", comparator="flex", status="ok", median_ms=1.0)]
    run.add_ratios(rows)
    assert rows[0]["sinkattn_speedup"] == 1.0
    assert rows[1]["sinkattn_speedup"] == 1.5
    assert "sinkattn_speedup" not in rows[2]
    assert "sinkattn_speedup" not in rows[4]  # no sinkattn time for case b: no ratio, never a guess


def test_failures_are_rows_and_a_lost_cuda_context_stops_the_grid(monkeypatch):
    cpu = torch.device("cpu")

    def broken(case, x, device):
        raise RuntimeError("something odd")

    def nan_out(case, x, device):
        return C.Prepared(lambda: None, "none needed", "fake", output=lambda: torch.full((2,), float("nan")))

    def fault(case, x, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(C.COMPARATORS, "broken", broken)
    monkeypatch.setitem(C.COMPARATORS, "fault", fault)
    cases = [_cpu_case(seqlen_q=8, seqlen_k=8), _cpu_case(seqlen_q=16, seqlen_k=16)]
    kw = dict(ceilings={}, timing_kw={"budget_ms": 1, "min_reps": 1, "max_reps": 1}, progress=False)
    rows = run.run_grid(cases, ["sinkattn", "broken"], cpu, **kw)
    assert [r["status"] for r in rows] == ["ok", "error"] * 2 and "something odd" in rows[1]["reason"]
    rows = run.run_grid(cases, ["sinkattn", "fault", "broken"], cpu, **kw)
    assert [r["status"] for r in rows] == ["ok", "error", "not run"] + ["not run"] * 3
    assert all("context lost" in r["reason"] for r in rows[2:])
    monkeypatch.setitem(C.COMPARATORS, "sinkattn", nan_out)
    rows = run.run_grid(cases[:1], ["sinkattn"], cpu, **kw)
    assert rows[0]["status"] == "error" and "non-finite" in rows[0]["reason"]


def test_timing_statistics():
    t = timing.summarize([5.0, 1.0, 3.0, 2.0, 4.0], 1, "perf_counter", False)
    assert (t.median_ms, t.min_ms, t.reps) == (3.0, 1.0, 5)
    assert math.isclose(t.p10_ms, 1.4) and math.isclose(t.p90_ms, 4.6)
    calls = []
    t = timing.bench_cpu(lambda: calls.append(1), warmup=2, budget_ms=1.0, min_reps=4, max_reps=6)
    assert 4 <= t.reps <= 6 and len(calls) == t.reps + 2 and t.median_ms >= 0
    calls.clear()
    t = timing.bench_cpu(lambda: calls.append(1), warmup=0, budget_ms=1.0, min_reps=3, max_reps=3)
    assert t.reps == 3 and len(calls) == 3


def test_grids_are_well_formed():
    all_cases = grids.get("all") + grids.get("smoke") + grids.get("check")
    ids = [c.id for c in all_cases]
    assert len(ids) == len(set(ids))
    for c in all_cases:
        assert c.nheads % c.nheads_k == 0 and c.mode in ("fwd", "bwd") and c.kind in ("attn", "decode")
    rep = grids.get("replication")
    assert {c.headdim for c in rep} == {64, 128, 256}
    assert all(c.nheads * c.headdim == 2048 and c.batch * c.seqlen_q == 16384 for c in rep)
    assert len(rep) == 3 * 6 * 2 * 2
    oss = grids.get("gptoss")
    assert {(c.window_left, c.window_right) for c in oss} == {(127, 0), (-1, 0)}
    assert max(c.seqlen_q for c in oss) == 131072 and {c.sinks for c in oss} == {True, False}
    st = grids.get("streaming")
    assert {c.sink_tokens for c in st} == {4, 16} and {c.window_left + 1 for c in st} == {128, 1024, 4096}
    dec = grids.get("decode")
    assert {c.paged for c in dec} == {True, False}
    # the check grid times vLLM's page size too, under a name of its own
    check_paged = {c.page_size: c.variant for c in grids.get("check") if c.kind == "decode" and c.paged}
    assert check_paged == {256: "decode/fwd/hd64/h64kv8/causal/sinks/paged",
                           16: "decode/fwd/hd64/h64kv8/causal/sinks/paged16"}
    assert all(2 * c.batch * c.seqlen_k * c.nheads_k * c.headdim * 2 <= grids.DECODE_KV_BYTES for c in dec)
    with pytest.raises(ValueError, match="unknown grid"):
        grids.get("nope")


def test_filter_selects_by_substrings():
    cases = grids.get("smoke")
    assert all("decode" in c.id for c in select(cases, "decode"))
    assert all("paged" in c.id and "decode" in c.id for c in select(cases, "decode,paged"))
    assert all("decode" not in c.id for c in select(cases, "~decode"))
    assert select(cases, None) == cases


def test_smoke_grid_writes_csv_markdown_and_plot(tmp_path, capsys):
    """The whole smoke grid as `make bench` runs it on a CPU, with one timed run per pair to stay short."""
    out = tmp_path / "res"
    rc = bench_main(["--grid", "smoke", "--out", str(out), "--no-progress", "--budget-ms", "1", "--min-reps", "1",
                     "--max-reps", "1"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    cases = grids.get("smoke")
    assert len(rows) == len(C.COMPARATORS) * len(cases)
    assert {r["id"] for r in rows} == {c.id for c in cases}
    by = {(r["id"], r["comparator"]): r for r in rows}
    for r in rows:
        assert r["status"] in ("ok", "n/a"), (r["id"], r["comparator"], r["reason"])
        assert r["status"] == "ok" or r["reason"], (r["id"], r["comparator"])
        if r["comparator"] == "sinkattn":
            assert r["status"] == "ok" and r["backend"] == "reference" and float(r["sinkattn_speedup"]) == 1.0
        if r["status"] == "ok":
            assert float(r["median_ms"]) > 0 and float(r["tflops"]) > 0 and float(r["gbps"]) > 0
            assert float(r["frac_matmul_ceiling"]) > 0 and float(r["frac_copy_ceiling"]) > 0
            assert r["method"] == "perf_counter"
        if r["status"] == "ok" and r["comparator"] != "sinkattn":
            t0 = float(by[(r["id"], "sinkattn")]["median_ms"])
            assert math.isclose(float(r["sinkattn_speedup"]), float(r["median_ms"]) / t0, rel_tol=1e-4)
            if r["sink_handling"] != "no sink":
                assert float(r["rel_err_vs_sinkattn"]) < 2e-2, (r["id"], r["comparator"])  # bf16, same math
    # every kind ran through at least one comparator besides sinkattn, where one can do the math
    for kind in ("attn", "decode"):
        assert any(r["status"] == "ok" and r["comparator"] == "sdpa-flash" and r["kind"] == kind for r in rows)
    assert any(r["status"] == "ok" and r["comparator"] == "flex" and r["sink_tokens"] != "0" for r in rows)
    # windows are n/a for SDPA, with the reason
    win = [r for r in rows if r["comparator"] == "sdpa-flash" and "win" in r["id"]]
    assert win and all(r["status"] == "n/a" and "window" in r["reason"] for r in win)
    md = (out / "results.md").read_text()
    assert "not a performance claim" in md and "## smoke" in md and "## Details" in md
    assert json.loads((out / "env.json").read_text())["grid"] == "smoke"
    assert "bench: wrote" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "plots.png").stat().st_size > 1000


def test_cli_lists_cases():
    r = subprocess.run([sys.executable, "-m", "bench", "--grid", "gptoss", "--filter", "win128,sinks,~bwd", "--list"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = r.stdout.split()
    assert len(ids) == 8 and all("win128" in i and "sinks" in i and "/fwd/" in i for i in ids)


def test_report_roundtrip_and_markdown_marks_no_sink(tmp_path):
    rows = [dict(grid="g", id="g/x", variant="attn/bwd/x", kind="attn", batch=1, seqlen_q=8, seqlen_k=8,
                 comparator="sinkattn", status="ok", median_ms=1.0, tflops=2.0, sinkattn_speedup=1.0,
                 backend="sm90", sink_handling="exact (native)"),
            dict(grid="g", id="g/x", variant="attn/bwd/x", kind="attn", batch=1, seqlen_q=8, seqlen_k=8,
                 comparator="sdpa-flash", status="ok", median_ms=2.0, tflops=1.0, sinkattn_speedup=2.0,
                 backend="flash", sink_handling="no sink")]
    report.write_csv(rows, str(tmp_path / "r.csv"))
    back = report.read_csv(str(tmp_path / "r.csv"))
    assert [r["comparator"] for r in back] == ["sinkattn", "sdpa-flash"]
    md = report.markdown(rows, {"device": {"type": "cuda", "name": "X"}, "ceilings": {}})
    assert "1 (2.00x) [no sink]" in md and "not a performance claim" not in md


def test_unknown_comparator_and_empty_filter_are_errors(capsys):
    assert bench_main(["--grid", "smoke", "--comparators", "sinkattn,nope"]) == 2
    assert bench_main(["--grid", "smoke", "--filter", "no-such-case"]) == 2


def test_gpu_check_script_parses():
    r = subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "gpu", "check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------- GPU day

@pytest.mark.gpu
def test_cuda_timing_flush_and_graph():
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    t = timing.bench_cuda(lambda: a @ a, budget_ms=50, min_reps=5)
    assert t.method == "cuda-events" and t.l2_flush and t.reps >= 5 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    t = timing.bench_cuda(lambda: a @ a, budget_ms=50, min_reps=5, use_graph=True)
    assert t.method == "cuda-events+graph"
    st = timing.gpu_state(dev.index or 0)
    assert st.get("clocks.sm") not in (None, "")


@pytest.mark.gpu
def test_comparators_on_gpu_agree_with_sinkattn(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    noflex = ("flex",)  # FlexAttention compiles per shape and mask (tens of seconds): one case only
    cases = [Case("t", "attn", "fwd", 1, 1024, 1024, 8, 2, 64, "bf16", causal=True, window_right=0, sinks=True,
                  skip=noflex),
             Case("t", "attn", "fwd", 1, 1024, 1024, 8, 2, 64, "bf16", causal=True, window_left=127, window_right=0,
                  sink_tokens=4, sinks=True),
             Case("t", "attn", "bwd", 1, 1024, 1024, 8, 8, 128, "bf16", causal=True, window_right=0, skip=noflex),
             Case("t", "decode", "fwd", 4, 1, 2048, 8, 2, 64, "bf16", causal=True, window_right=0, sinks=True,
                  skip=noflex),
             Case("t", "decode", "fwd", 4, 1, 2048, 8, 2, 64, "bf16", causal=True, window_right=0, sinks=True,
                  paged=True, page_size=256)]
    rows = run.run_grid(cases, list(C.COMPARATORS), dev, ceilings={"matmul_TFLOPs": 1.0, "copy_GBps": 1.0},
                        timing_kw={"budget_ms": 20, "min_reps": 3, "max_reps": 10}, progress=False,
                        verbose_errors=True)
    errors = [(r["id"], r["comparator"], r.get("reason")) for r in rows if r["status"] == "error"]
    assert not errors, errors
    for r in rows:
        if r["status"] == "ok" and r.get("rel_err_vs_sinkattn") is not None:
            assert r["rel_err_vs_sinkattn"] < 2e-2, (r["id"], r["comparator"], r["rel_err_vs_sinkattn"])
        if r["status"] == "ok":
            assert r["method"].startswith("cuda-events") and r["l2_flush"]
    ok = {(r["id"], r["comparator"]) for r in rows if r["status"] == "ok"}
    assert (cases[0].id, "sdpa-flash") in ok and (cases[1].id, "flex") in ok and (cases[3].id, "sdpa-flash") in ok
    graphs = [r for r in rows if r["status"] == "ok" and r["kind"] == "decode" and r["comparator"] == "sdpa-flash"]
    assert all(r["method"] == "cuda-events+graph" for r in graphs)
    report.write_all(rows, {"device": {"type": "cuda"}, "ceilings": {}}, str(tmp_path))
    assert (tmp_path / "results.md").exists()


def test_gpu_round_runs_the_diagnostic_build_first():
    """make gpu-prebuilt packs the diagnostic build beside the normal one and gpu-check runs the never-run sm90
    kernels' tests on it before its other test steps (docs/DESIGN.md section 8). A GPU-less check of the wiring:
    the pack step, the diagnostic run ahead of the sm90 steps, and the define reaching the sm90 units only."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    recipe = make[make.index("\ngpu-prebuilt:"):make.index("\n# The tuning sweep of a GPU round")]
    assert "SINKATTN_DIAGNOSTIC=1 $(MAKE) --no-print-directory install" in recipe
    assert recipe.index("SINKATTN_DIAGNOSTIC=1 $(MAKE)") < recipe.index("cp $(KERNEL_OBJECTS) .prebuilt/diagnostic/") \
        < recipe.index("tar -C")
    assert "reinstalling the normal build" in recipe
    with open(os.path.join(ROOT, "bench", "gpu", "check.sh")) as f:
        check = f.read()
    diag = check.index("step diagnostic-sm90")
    assert diag < check.index("step sm90-tests") < check.index("step sm90-bwd-tests") < check.index("step tests ")
    assert 'SINKATTN_PREBUILT_KERNELS/diagnostic' in check and "SINKATTN_DIAGNOSTIC=1" in check
    assert check.index('"$SKIP_SM90_STEPS" = "0"') > diag
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup = f.read()
    assert 'diag = grid.diagnostic and fam.startswith("sm90")' in setup
