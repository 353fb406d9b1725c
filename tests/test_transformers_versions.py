"""Which transformers releases SinkCache supports (sinkattn/integrations/transformers_streaming.py's docstring).

SinkCache needs transformers >= 5.24: before 5.24 a model ignores `cache=` (docs/streaming.md's call) and builds its own
growing cache, so SinkCache refuses older releases instead of running as a silent no-op. The release `make deps`
pins (5.24.0, the installed one) is tested throughout tests/test_streaming_transformers.py and
tests/test_transformers_integration.py; here: the version gate in-process, and on a real 5.23.0 in a subprocess
(opt-in: SINKATTN_FETCH_TRANSFORMERS=1 installs it once, --no-deps, into build/transformers-5.23.0, about 12 MB).
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
import sinkattn.integrations.transformers as sat  # noqa: E402
from sinkattn.errors import SinkattnRuntimeError  # noqa: E402
from sinkattn.integrations import transformers_streaming as ts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OLD = "5.23.0"  # the newest release before the `cache=` rename
FETCH_ENV = "SINKATTN_FETCH_TRANSFORMERS"


def _inv_freq():
    import torch
    return 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))


@pytest.mark.parametrize("version,ok", [("5.23.0", False), ("5.13.0", False), ("5.0.0", False), ("4.57.6", False),
                                        ("5.24.0", True), ("5.24.0.dev0", True), ("5.25.1", True), ("6.0.0rc1", True)])
def test_sink_cache_refuses_releases_before_5_24(monkeypatch, version, ok):
    # the module object the gate reads (another test file may have re-imported transformers since collection)
    monkeypatch.setattr(ts.transformers, "__version__", version)
    if ok:
        sat.SinkCache(8, 2, num_layers=1, inv_freq=_inv_freq())
        return
    with pytest.raises(SinkattnRuntimeError, match=r'pip install "transformers>=5\.24"') as e:
        sat.SinkCache(8, 2, num_layers=1, inv_freq=_inv_freq())
    assert version in str(e.value) and "cache=" in str(e.value)


def test_pinned_release_is_supported():
    assert ts._release(transformers.__version__) >= ts.MIN_TRANSFORMERS, (
        f"transformers {transformers.__version__} is installed; `make deps` pins 5.24.0, the lowest SinkCache supports")


def _old_transformers() -> Path:
    """build/transformers-5.23.0 (transformers only; its dependencies are the installed ones, which 5.23 accepts)."""
    target = ROOT / "build" / f"transformers-{OLD}"
    if (target / "transformers" / "__init__.py").exists():
        return target
    if os.environ.get(FETCH_ENV) != "1":
        pytest.skip(f"transformers {OLD} is not in {target}; {FETCH_ENV}=1 installs it there once (--no-deps, about "
                    f"12 MB) to check that SinkCache refuses a release whose models ignore cache=")
    print(f"sinkattn tests: installing transformers {OLD} (--no-deps, once) into {target} ({FETCH_ENV}=1)",
          file=sys.stderr, flush=True)
    partial = target.with_name(target.name + ".partial")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--timeout", "20", "--retries", "1", "--target", str(partial), f"transformers=={OLD}"],
                       capture_output=True, text=True)
    if r.returncode != 0 or not (partial / "transformers" / "__init__.py").exists():
        pytest.skip(f"could not install transformers {OLD} (registry unreachable?): {(r.stderr or r.stdout)[-300:]}")
    partial.rename(target)
    return target


SCRIPT = textwrap.dedent("""
    import warnings, torch
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    assert transformers.__version__ == %r, transformers.__file__
    import sinkattn.integrations.transformers as sat
    from sinkattn.errors import SinkattnRuntimeError
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 64, (1, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = DynamicCache(config=cfg)
        out = model(ids, cache=mine, use_cache=True)
    # the reason for the gate: on this release cache= is ignored and the model builds a cache of its own
    assert mine.get_seq_length() == 0 and out.past_key_values is not mine, "cache= works on this release"
    try:
        sat.SinkCache.from_model(model, capacity=8, sink_tokens=2)
    except SinkattnRuntimeError as e:
        print("REFUSED", e)
    else:
        print("ACCEPTED")
""")


def test_sink_cache_refuses_transformers_5_23_where_cache_is_ignored(one_thread):
    old = _old_transformers()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(old), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT % OLD], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and 'pip install "transformers>=5.24"' in r.stdout, r.stdout
