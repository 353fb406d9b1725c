"""tools/perf_counts.sh and its harness, as `make gpu-prebuilt` runs them for the SASS model's profile rule: a decode
step over a paged cache under gcov, checked by the harness against a float softmax, its counts recorded with the
problem and the per-block limit they were made for. No GPU; one gcov build of the hd64 emulation (about a minute)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
import perf_counts  # noqa: E402

CUTLASS = os.path.join(REPO, "third_party", "cutlass", "include")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("gcov") and os.path.isdir(CUTLASS)
                         and os.path.isdir(os.path.join(CUDA_HOME, "include"))),
                    reason="needs g++, gcov, the CUTLASS headers (make cutlass) and CUDA_HOME's headers")
def test_a_paged_decode_step_is_counted_and_checked(tmp_path):
    out = tmp_path / "perf_counts_decode_p16"
    env = dict(os.environ, CUDA_HOME=CUDA_HOME, PERF_COUNTS_DECODE="16", PERF_COUNTS_S="1024", OUT=str(out))
    r = subprocess.run(["bash", os.path.join(REPO, "tools", "perf_counts.sh"), "64"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr  # the harness exits 2 when the step's output is not the softmax's
    assert (out / "problem").read_text().strip() == "decode 16"
    assert (out / "smem_kb").read_text().strip() == "227"
    cov = str(out / "cov_hd64.json")
    json.load(open(cov))
    # the decode tile ran: its kernel body's lines counted, and the loader took the row-by-row copies of small pages
    counts = perf_counts.gcov_counts(cov, "fwd_tiles9Hd64Keys4E", "sm80/fwd_kernel.h")
    assert counts and max(counts.values()) > 0
    rows = perf_counts.gcov_instances(cov, "fwd_tiles9Hd64Keys4E")
    assert any(rel == "sm80/row_loader.h" and max(cs) > 0 for (rel, _), cs in rows.items())
