"""bench/gpu/sanitize.py on the CPU: its cases run (dry run) and its verdicts never call a sanitizer run that did not
happen a pass. The sanitizer itself is replaced by small fake scripts that behave like the real one does when it
passes, finds errors, is refused by the runtime (as on gVisor: "Device not supported") or runs out of time."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu", "sanitize.py")
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
import sanitize  # noqa: E402

HELP = "--tool --kernel-name --padding --leak-check --racecheck-report --print-limit"


def _fake(tmp_path, body: str) -> str:
    """A fake compute-sanitizer: `--help` lists options; otherwise $TOOL is the --tool value and $PROBE is 1 for
    the one-allocation probe (a `python -c` command)."""
    p = tmp_path / "compute-sanitizer"
    p.write_text(f"""#!/bin/bash
if [ "$1" = "--help" ]; then echo "{HELP}"; exit 0; fi
TOOL=$2; PROBE=0; case "$*" in *" -c "*) PROBE=1;; esac
{body}
""")
    p.chmod(0o755)
    return str(p)


def _run(tmp_path, body, budget=60, tools="memcheck,racecheck,synccheck,initcheck"):
    fake = _fake(tmp_path, body)
    log = tmp_path / "log.txt"
    p = subprocess.run([sys.executable, SCRIPT, "run", "--sanitizer", fake, "--budget", str(budget), "--log", str(log),
                        "--tools", tools], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, log.read_text() if log.exists() else ""


PASS = 'echo "SANITIZE-CASES-DONE 13/13"; echo "========= ERROR SUMMARY: 0 errors"; exit 0'


def test_all_pass(tmp_path):
    rc, out, log = _run(tmp_path, PASS)
    assert rc == 0, out
    assert out.count(": PASS (0 errors") == 4
    assert "--padding 64" in log and "--kernel-name kns=sinkattn" in log and "--racecheck-report all" in log


def test_errors_fail(tmp_path):
    body = ('if [ "$TOOL" = racecheck ] && [ $PROBE = 0 ]; then echo "SANITIZE-CASES-DONE 13/13"; '
            'echo "========= ERROR SUMMARY: 3 errors"; exit 1; fi\n' + PASS)
    rc, out, _ = _run(tmp_path, body)
    assert rc == 1
    assert "racecheck: FAIL (3 errors)" in out and out.count(": PASS") == 3


def test_refused_by_the_runtime_is_not_run(tmp_path):
    body = 'echo "========= Error: Device not supported"; echo "CUDA error 999"; exit 1'
    rc, out, _ = _run(tmp_path, body)
    assert rc == 3
    assert out.count("NOT RUN") == 4 and "PASS" not in out and "Device not supported" in out


def test_out_of_time_is_not_run(tmp_path):
    body = 'if [ $PROBE = 1 ]; then ' + PASS + '; fi; sleep 30'
    rc, out, _ = _run(tmp_path, body, budget=10, tools="memcheck")
    assert rc == 3
    assert "memcheck: NOT RUN" in out and "PASS" not in out


def test_missing_sanitizer_is_not_run(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "run", "--sanitizer", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 3 and p.stdout.count("NOT RUN (compute-sanitizer not found") == 4


@pytest.mark.parametrize("output,rc,want", [
    ("SANITIZE-CASES-DONE 3/3\n== ERROR SUMMARY: 0 errors", 0, "PASS"),
    ("SANITIZE-CASES-DONE 2/3\n== ERROR SUMMARY: 0 errors", 1, "FAIL"),   # a case failed under the sanitizer
    ("== ERROR SUMMARY: 0 errors", 1, "FAIL"),                            # the driver died before the end
    ("SANITIZE-CASES-DONE 3/3\n== ERROR SUMMARY: 7 errors", 1, "FAIL"),
    ("SANITIZE-CASES-DONE 3/3", 0, "NOT RUN"),                            # no summary: not a sanitized run
    ("Device not supported\n== ERROR SUMMARY: 0 errors", 1, "NOT RUN"),
    ("SANITIZE-CASES-DONE 3/3\n== ERROR SUMMARY: 0 errors", None, "NOT RUN"),  # timed out
])
def test_verdict(output, rc, want):
    assert sanitize.verdict(output, rc)[0] == want


def test_cases_dry_run_on_cpu():
    """Every case runs on the CPU (emulated sm80 kernels where built, else the reference) and agrees."""
    p = subprocess.run([sys.executable, SCRIPT, "cases", "--dry-run", "--cases", "sm80-fwd,sm80-decode-paged,merge"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SANITIZE-CASES-DONE 3/3" in p.stdout


def test_every_family_has_a_case():
    import subprocess as sp
    names = sp.run([sys.executable, SCRIPT, "cases", "--list"], capture_output=True, text=True).stdout.split()
    for needed in ("sm80-fwd", "sm80-decode", "sm80-decode-split-combine", "sm80-decode-paged", "sm80-bwd",
                   "sm80-bwd-deterministic", "sm90-fwd", "merge"):
        assert needed in names
