"""The memory bound: the reference backend runs batch 1, 8 heads, head dim 128, seqlen 32k causal within
4 GiB of extra memory. Minutes of CPU, so it is skipped unless asked for: `pytest -m slow`."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_32k_causal_within_4gib(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (minutes of CPU): run with -m slow")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "studies", "memory_32k.py"), "--threads", "1"],
                       capture_output=True, text=True, timeout=3600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
