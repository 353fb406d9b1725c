"""bench/gpu/predict_check.py (the gpu-check step that prints the SASS model's prediction beside each measured row)
and tools/perf_predict.py's launch arithmetic, on the CPU: a fake bench result file, a fake model, no cuobjdump."""
import csv
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import perf_predict as pp  # noqa: E402

spec = importlib.util.spec_from_file_location("predict_check", os.path.join(REPO, "bench", "gpu", "predict_check.py"))
pc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pc)

FIELDS = ["id", "variant", "kind", "mode", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim", "dtype",
          "causal", "window_left", "window_right", "sink_tokens", "comparator", "backend", "status", "tflops", "gbps"]


def _row(comparator, backend, tflops="", gbps="", status="ok", kind="attn", variant="attn/fwd/hd64/h32kv32/full"):
    return dict(id=f"check/{variant}/b2/sq8192/sk8192/bf16", variant=variant, kind=kind, mode="fwd", batch=2,
                seqlen_q=8192 if kind == "attn" else 1, seqlen_k=8192, nheads=32, nheads_k=32, headdim=64,
                dtype="bf16", causal="False", window_left=-1, window_right=-1, sink_tokens=0, comparator=comparator,
                backend=backend, status=status, tflops=tflops, gbps=gbps)


@pytest.fixture
def bench_out(tmp_path):
    rows = [_row("sinkattn", "sm90", tflops="400"),             # the sm90 kernel, as "auto" picked it
            _row("sinkattn-sm80", "sm80", tflops="150"),        # the sm80 kernel on the same case
            _row("sdpa-flash", "", tflops="300"),               # a peer: not ours, no prediction
            _row("sinkattn-sm80", "sm80", status="error"),      # failed: nothing measured
            _row("sinkattn", "sm80", gbps="2500", kind="decode", variant="decode/fwd/hd64/h64kv8/causal/sinks")]
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return tmp_path


def test_rows_of_our_columns_only(bench_out):
    rows = pc.measured_rows(str(bench_out / "results.csv"))
    # sinkattn (sm90), sinkattn-sm80, the decode row; not the peer, not the failed row
    assert [(r["comparator"], r["family"], r["measured"], r["unit"]) for r in rows] == [
        ("sinkattn", "sm90", 400.0, "TFLOP/s"), ("sinkattn-sm80", "sm80", 150.0, "TFLOP/s"),
        ("sinkattn", "sm80", 2500.0, "GB/s")]
    assert rows[1]["case"]["headdim"] == "64" and rows[1]["case"]["causal"] is False


def test_table_puts_prediction_beside_measurement(bench_out):
    rows = pc.measured_rows(str(bench_out / "results.csv"))

    def fake(case, family):  # a model that predicts the sm80 forward and has no sm90 kernel in this build
        if family == "sm90":
            return {"error": "sm90 forward hd64: not in this build"}
        return {"value": 100.0 if case["kind"] == "attn" else 2000.0, "note": "fake"}

    lines = pc.table(rows, fake)
    sm80 = lines[1]
    assert (sm80["predicted"], sm80["measured"], sm80["ratio"]) == (100.0, 150.0, 1.5)
    assert lines[2]["ratio"] == pytest.approx(1.25)
    assert lines[0]["predicted"] is None and "not in this build" in lines[0]["why"]
    text = pc.render(lines, "abc1234", "H200")
    assert "| sinkattn-sm80 | sm80 | 100 | 150 | TFLOP/s | 1.50 | fake |" in text
    assert "| sinkattn | sm90 | - | 400 | TFLOP/s | - | sm90 forward hd64: not in this build |" in text
    assert "abc1234" in text.splitlines()[0]


def test_a_failing_row_does_not_stop_the_table(bench_out):
    rows = pc.measured_rows(str(bench_out / "results.csv"))
    lines = pc.table(rows, lambda case, fam: 1 / 0)
    assert len(lines) == 3 and all(ln["predicted"] is None and "ZeroDivisionError" in ln["why"] for ln in lines)


def test_never_fails_the_round(tmp_path, bench_out, capsys):
    # no results file
    assert pc.main(["--out", str(tmp_path / "missing")]) == 0
    assert "no " in capsys.readouterr().out
    # results, but the extension named is not a file cuobjdump can read (or cuobjdump is missing): still 0
    assert pc.main(["--out", str(bench_out), "--so", str(tmp_path / "nope.so"), "--device", "h200"]) == 0
    assert "predict-check: not run" in capsys.readouterr().out
    # bad arguments: 0 as well
    assert pc.main(["--device", "v100"]) == 0


def test_tile_tables_read_from_the_headers():
    # csrc/sm80/fwd_tiles.h: Hd64Rows{64, 128, 64, 4} (stages default 2), Hd64Keys4{64, 16, 128, 4, 3, 4}
    t = pp.sm80_fwd_tiles()
    assert t["Hd64Rows"] == dict(head_dim=64, block_m=128, block_n=64, warps=4, stages=2, key_groups=1, q_regs=0, s_ahead=0,
                                 branch_free_loads=0, ctas_per_sm=0)
    assert t["Hd64Keys4"]["stages"] == 3 and t["Hd64Keys4"]["key_groups"] == 4
    assert pp.sm80_bwd_tiles()["Hd64"] == dict(head_dim=64, block_m=64, block_n=64, warps_m=4, warps_n=1, stages=2)
    assert pp.sm90_fwd_tiles()[64] == dict(head_dim=64, block_n=128, stages=3, block_m=128)
    # FwdTile::smem_bytes: Q once (it carries the tile's O out too), then the stages' K and V (hd256: 161 KB)
    assert pp.sm90_fwd_smem(pp.sm90_fwd_tiles()[256]) == (128 + 2 * 2 * 48) * 256 * 2 + 1024
    assert pp.sm90_bwd_smem(pp.sm90_bwd_tiles()[128]) == 165888 and pp.sm90_bwd_tiles()[64]["block_m"] == 128
    # the decode tile choice follows choose_fwd_tile: gpt-oss decode (8 rows) -> 4 key groups, 24 rows -> 2
    assert pp.sm80_decode_tile(t, 64, 8, 166912) == "Hd64Keys4"
    assert pp.sm80_decode_tile(t, 64, 24, 166912) == "Hd64Keys2"
    # Hd64Keys2 takes (32 + 2 * 3 * 128) * 64 * 2 = 100 KB: over cc 8.6's 99 KB, its Small sibling there
    assert pp.sm80_decode_tile(t, 64, 24, 99 * 1024) == "Hd64Keys2Small"
    # hd256 has no two-group tile: 17-64 rows take a 64-row tile (sm80 Hd256Few, sm86 Hd256RowsSmall, sm90 staggered)
    assert [pp.sm80_decode_tile(t, 256, 24, kb * 1024) for kb in (163, 99, 227)] == \
        ["Hd256Few", "Hd256RowsSmall", "Hd256Staggered"]
    assert pp.sm80_decode_tile(t, 256, 8, 163 * 1024) == "Hd256Keys4"
    assert pp.sm80_decode_tile(t, 256, 8, 99 * 1024) == "Hd256RowsSmall"
    # the hd128 prefill tile: branch-free interior loads above sm8x's 163 KB per block (sm90); below, the loader's
    # branches: 128 rows of 4 warps over 32-key blocks where two CTAs fit (sm80), 128 rows of 8 where one does (sm86 /
    # sm89)
    assert pp.sm80_prefill_tile(t, 128, 227 * 1024) == "Hd128RowsSm90" and t["Hd128RowsSm90"]["branch_free_loads"] == 1
    assert pp.sm80_prefill_tile(t, 128, 163 * 1024) == "Hd128RowsTwoCtas"
    assert (t["Hd128RowsTwoCtas"]["block_n"], t["Hd128RowsTwoCtas"]["stages"]) == (32, 3)
    assert pp.sm80_prefill_tile(t, 128, 99 * 1024) == "Hd128Rows"
    # the hd64 prefill tile: three stages asking for two CTAs per SM where two fit an SM (sm80, sm90), else Hd64Rows
    assert pp.sm80_prefill_tile(t, 64, 163 * 1024) == pp.sm80_prefill_tile(t, 64, 227 * 1024) == "Hd64RowsTwoCtas"
    assert t["Hd64RowsTwoCtas"]["ctas_per_sm"] == 2 and pp.sm80_prefill_tile(t, 64, 99 * 1024) == "Hd64Rows"


def test_block_counts():
    # 256 x 256, blocks of 128 rows x 64 keys: full 4 + 4; causal: rows 0-127 see keys 0-127 (2 blocks), 128-255 all
    assert pp.key_blocks_per_row_block(256, 256, 128, 64, -1, -1, 0) == [4, 4]
    assert pp.key_blocks_per_row_block(256, 256, 128, 64, -1, 0, 0) == [2, 4]
    # window (127, 0): rows 128-255 see keys 1-255 -> blocks 0-3; 4 sink tokens add nothing already seen
    assert pp.key_blocks_per_row_block(512, 512, 128, 64, 127, 0, 0) == [2, 4, 4, 4]
    # rows 384-511 see keys 257-511: blocks 4-7; sink tokens add block 0
    assert pp.key_blocks_per_row_block(512, 512, 128, 64, 127, 0, 4)[-1] == 5
    # the backward: key block j is seen by query blocks from the diagonal on (causal, 64 x 64)
    assert pp.query_blocks_per_key_block(256, 256, 64, 64, -1, 0, 0) == [4, 3, 2, 1]
    # the blocks the mask cuts: none without a mask; causal 128 x 64: the two on the diagonal of each row block;
    # 48-key blocks: rows 128-255 see keys 0-255, blocks 2-5 (keys 96-287) cross the diagonal of row 128
    assert pp.masked_blocks_per_row_block(256, 256, 128, 64, -1, -1, 0) == [0, 0]
    assert pp.masked_blocks_per_row_block(256, 256, 128, 64, -1, 0, 0) == [2, 2]
    assert pp.masked_blocks_per_row_block(256, 256, 128, 48, -1, 0, 0) == [3, 4]
    # a window of 127 cuts every block of 64 it touches (both edges fall inside the row block); sink tokens' block too
    assert pp.masked_blocks_per_row_block(512, 512, 128, 64, 127, 0, 0) == [2, 4, 4, 4]
    assert pp.masked_blocks_per_row_block(512, 512, 128, 64, 127, 0, 4)[-1] == 5


def test_the_persistent_schedule_deals_tiles_in_its_order():
    """The sm90 forward's CTAs take tiles c, c + grid, ... of the tile order (common/tile_order.h), unsorted: the
    model deals them so. 2 x sms tiles, the first sms of 3 iterations, the rest of 1: 3 + 1 on every SM; every other
    tile heavy: both of an even SM's tiles are (3 + 3), where sorting them first would have balanced them."""
    import perf_model as pm
    dev = pm.DEVICES["h200"]
    k = pm.Kernel("k", 128, 384, 1024, pm.loop_cost([], [], dev), 0, 8)
    k._sim[(2, dev.name, dev.hmma, 2, pm.PHASES, pm.ITERS)] = 1000.0  # one iteration: 1000 cycles
    n = dev.sms
    even = pm.kernel_time_s(k, dev, 2 * n, [3] * n + [1] * n, persistent=True)["time"]
    paired = pm.kernel_time_s(k, dev, 2 * n, [3, 1] * n, persistent=True)["time"]
    assert even == pytest.approx(4 * 1000 / (dev.ghz * 1e9))
    assert paired == pytest.approx(6 * 1000 / (dev.ghz * 1e9)) if n % 2 == 0 else paired > even


def test_counts_dir_prefers_the_packed_counts(tmp_path, monkeypatch):
    """predict_check's second table (the profile rule) reads the line counts gpu-prebuilt packs, else build/'s."""
    monkeypatch.setattr(pc, "REPO", str(tmp_path))
    assert pc.counts_dir() is None
    (tmp_path / "build" / "perf_counts").mkdir(parents=True)
    (tmp_path / "build" / "perf_counts" / "cov_hd64.json").write_text("{}")
    assert pc.counts_dir() == str(tmp_path / "build" / "perf_counts")
    (tmp_path / ".prebuilt" / "perf_counts").mkdir(parents=True)
    (tmp_path / ".prebuilt" / "perf_counts" / "cov_hd128.json").write_text("{}")
    assert pc.counts_dir() == str(tmp_path / ".prebuilt" / "perf_counts")


def test_the_profile_rule_predicts_the_sm80_prefill_forward_and_backward_only():
    """With line counts, every case but the sm80 prefill forward and backward and the bf16/fp16 decode says it has no
    profile prediction (no silent whole-loop figure in the profile table)."""
    import perf_model as pm

    class NoKernels:  # find() would be the next step of a case the rule costs
        dev = pm.DEVICES["h200"]

        def find(self, *needles):
            raise AssertionError("looked up a kernel for a case the profile rule does not cost")

    for c, fam in ((pp.case("decode", "fwd", 64, 1, 8192, 64, 8, 64, True, kv_dtype="fp8_e4m3"), "sm80"),
                   (pp.case("attn", "fwd", 2, 8192, 8192, 32, 32, 64), "sm90")):
        assert "profile rule" in pp.predict_case(NoKernels(), c, fam, counts_dir="/nowhere")["error"]


def test_line_counts_cost_only_the_device_they_were_made_for(tmp_path):
    """tools/perf_counts.sh records the shared memory per block its tiles were chosen for; perf_predict refuses counts
    made for another limit (an A100 on an H200's counts: its hd128 tile's lines barely ran, and a figure came out),
    naming the command that makes the right ones."""
    import perf_model as pm
    a100, h200 = pm.DEVICES["a100"], pm.DEVICES["h200"]
    assert "smem_kb, problem" in pp.counts_mismatch(str(tmp_path), h200)
    (tmp_path / "smem_kb").write_text("227\n")
    (tmp_path / "problem").write_text("prefill\n")
    assert pp.counts_mismatch(str(tmp_path), h200) is None
    err = pp.counts_mismatch(str(tmp_path), h200, "decode 16")  # a prefill's counts for a decode row
    assert "prefill problem" in err and "PERF_COUNTS_DECODE=16" in err
    err = pp.counts_mismatch(str(tmp_path), a100)
    assert "227 KB" in err and "PERF_COUNTS_SMEM_KB=163" in err
    (tmp_path / "smem_kb").write_text("163\n")
    assert pp.counts_mismatch(str(tmp_path), a100) is None and pp.counts_mismatch(str(tmp_path), h200)


def test_a_decode_row_reads_the_counts_of_its_own_kind_of_cache(tmp_path):
    """The decode rows' line counts sit beside the prefill's, one folder per kind of cache (gpu-prebuilt packs
    perf_counts_decode_p0, _p256, _p16), and a folder made for another page size is refused."""
    import perf_model as pm
    base = str(tmp_path / "perf_counts")
    contiguous = pp.case("decode", "fwd", 64, 1, 8192, 64, 8, 64, True, -1, 0, sinks=True)
    paged16 = pp.case("decode", "fwd", 64, 1, 8192, 64, 8, 64, True, -1, 0, sinks=True, paged=True, page_size=16)
    assert pp.decode_counts(base, contiguous) == base + "_decode_p0"
    assert pp.decode_counts(base + "/", paged16) == base + "_decode_p16"
    # a results.csv row: strings
    row = {k: str(v) for k, v in paged16.items()}
    assert pp.decode_counts(base, row) == base + "_decode_p16"
    d = tmp_path / "perf_counts_decode_p16"
    d.mkdir()
    (d / "smem_kb").write_text("227\n")
    (d / "problem").write_text("decode 256\n")
    err = pp.counts_mismatch(str(d), pm.DEVICES["h200"], "decode 16")
    assert "decode 256 problem" in err and "PERF_COUNTS_DECODE=16" in err
    (d / "problem").write_text("decode 16\n")
    assert pp.counts_mismatch(str(d), pm.DEVICES["h200"], "decode 16") is None


def test_a_measured_paged_row_is_costed_on_its_own_page_size(tmp_path):
    """A paged decode row of results.csv keeps its page size: the check grid's page-16 row reads a page-16 step's
    counts, its page-256 row a page-256 step's (before, both were costed as a contiguous cache)."""
    rows = []
    for ps, name in ((16, "paged16"), (256, "paged")):
        r = _row("sinkattn", "sm80", gbps="3000", kind="decode", variant=f"decode/fwd/hd64/h64kv8/causal/sinks/{name}")
        rows.append({**r, "paged": "True", "page_size": ps})
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["paged", "page_size"])
        w.writeheader()
        w.writerows(rows)
    base = str(tmp_path / "perf_counts")
    got = [pp.decode_counts(base, r["case"]) for r in pc.measured_rows(str(tmp_path / "results.csv"))]
    assert got == [base + "_decode_p16", base + "_decode_p256"]


def test_fa2_figure_only_for_what_fa2_runs(tmp_path, monkeypatch):
    """--fa2 puts FA2's predicted figure beside dense attention rows only (the rows FA2's cubins are costed on: no
    window, sink tokens or GQA), and asks for the hd256 backward by FA2's own instance (Is_even_MN off above hd128)."""
    import perf_rows as R
    dev = pp.pm.DEVICES["h200"]
    for c in (pp.case("attn", "fwd", 2, 8192, 8192, 64, 8, 64, True, 127, 0),
              pp.case("attn", "bwd", 2, 8192, 8192, 32, 8, 64),
              pp.case("decode", "fwd", 64, 1, 8192, 64, 8, 64, True)):
        assert pp.fa2_figure(str(tmp_path), dev, c) is None, c["variant"]
    asked = []
    monkeypatch.setattr(R, "find", lambda files, dev, *needles: asked.append(needles))
    for hd in (128, 256):
        assert pp.fa2_figure(str(tmp_path), dev, pp.case("attn", "bwd", 2, 8192, 8192, 8, 8, hd, True)) is None
    assert asked[0] == ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", R.FA2_BWD[128],
                        "ELb0ELb1ELb0ELb0ELb1ELb1ELb0EEEv")
    assert asked[1] == ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", R.FA2_BWD[256],
                        "ELb0ELb1ELb0ELb0ELb0ELb1ELb0EEEv")
    # an A100's block (163 KB) runs FA2's hd256 backward without double buffering
    pp.fa2_figure(str(tmp_path), pp.pm.DEVICES["a100"], pp.case("attn", "bwd", 2, 8192, 8192, 8, 8, 256))
    assert asked[2][1] == R.FA2_BWD_A100[256] != R.FA2_BWD[256] and R.FA2_BWD_A100[256].endswith("ELb1E")


@pytest.mark.needs_ext
def test_the_tool_picks_the_tiles_the_kernels_pick():
    """perf_predict's copy of choose_fwd_tile (it reads no extension) against the C++ rule, on every head dim, row
    count and per-block limit the predictions and the tile tests use."""
    from sinkattn import _ext
    C = _ext.require()
    t = pp.sm80_fwd_tiles()
    fields = ("head_dim", "block_m", "block_n", "warps", "stages", "key_groups", "branch_free_loads", "ctas_per_sm")
    for kb in (99, 163, 227):
        for hd in (64, 128, 256):
            for rows in (1, 8, 16, 24, 32, 48, 64, 100, 4096):
                name = pp.sm80_decode_tile(t, hd, rows, kb * 1024) if rows <= 64 else pp.sm80_prefill_tile(t, hd, kb * 1024)
                want = C.fwd_tile(hd, rows, False, kb * 1024)
                assert {f: t[name][f] for f in fields} == {f: want[f] for f in fields}, (hd, rows, kb, name)


def test_a_third_table_averages_the_ctas_phases_and_restores_the_default(tmp_path, bench_out, monkeypatch, capsys):
    """With line counts, run() prints the profile rows twice: as the model's default (in phase) and with
    perf_model.PHASES = 32 (or PERF_PHASES where set), which it sets back afterwards; the in-phase tables stay in
    phase whatever PERF_PHASES says."""
    import perf_model as pm
    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    monkeypatch.setattr(pm, "PHASES", 0)
    monkeypatch.setattr(pp, "Kernels", lambda path, dev: None)
    monkeypatch.setattr(pc, "counts_dir", lambda: str(tmp_path))
    monkeypatch.setattr(pp, "predict_case", lambda ks, case, fam, counts_dir=None: {
        "value": 100.0 + (pm.PHASES if counts_dir else 50), "note": "fake"})
    pc.run(str(bench_out), str(so), "a100")
    out = capsys.readouterr().out
    first, profile, phased = out.split("prediction vs measurement")[1:]
    assert "| 150 |" in first and "| 100 |" in profile and "| 132 |" in phased and "PERF_PHASES=32" in profile
    assert pm.PHASES == 0
    monkeypatch.setattr(pm, "PHASES", 6)  # PERF_PHASES=6 in the environment
    pc.run(str(bench_out), str(so), "a100")
    first, profile, phased = capsys.readouterr().out.split("prediction vs measurement")[1:]
    assert "| 150 |" in first and "| 100 |" in profile and "| 106 |" in phased and "PERF_PHASES=6" in profile
    assert pm.PHASES == 6
