"""The conftest of flash-attn 2.8.3's own tests/test_flash_attn.py, run against sinkattn.flash_attn_interface.

Loaded as a pytest plugin (`-p flash_attn_adapter`, by tests/flash_attn_upstream.run) rather than placed as a
conftest.py, so that the project's own test run never loads it. It changes four things and nothing else; the
suite's references (attention_ref & co.), tolerances and assertions run as flash-attn ships them:

1. Imports. `flash_attn` is a package whose attention functions are the drop-in's (sinkattn.flash_attn_interface)
   and whose other modules are flash-attn's own files from the sdist (flash_attn/bert_padding.py). Two names
   the suite imports from flash-attn modules that need CUDA are replaced:
   - flash_attn.layers.rotary.apply_rotary_emb (a Triton kernel) -> `apply_rotary_emb` below, the same math in
     PyTorch (fp32, rounded to x's dtype), written here from flash-attn's documented semantics; it computes the
     suite's reference and so does not use sinkattn's own rotary code;
   - flash_attn.flash_attn_interface._get_block_size_n (the CUDA kernel's tile width, read only to decode the
     dropout mask in S_dmask) -> a function that raises: dropout is refused before the suite gets there.
2. The device. The suite writes device="cuda"; a TorchFunctionMode maps every CUDA device argument of a torch
   call to the CPU, where sinkattn runs its PyTorch reference backend.
3. Capability queries. torch.cuda.get_device_capability -> (8, 0) (an A100: every dtype, and the suite's gradient
   checks all on); torch.cuda.get_device_properties(...).total_memory -> this machine's RAM (the suite skips its
   largest cases below 16 GiB); torch.cuda.synchronize -> no-op.
4. The parametrization, sampled (SINKATTN_FA_SAMPLE, default "cover"; "all" runs all ~509,000 cases): for each
   test function a deterministic set of cases in which every value of every parameter occurs at least once
   (sample_cases: seeded by SINKATTN_FA_SEED, default 0; large sequence lengths paired with small head dims;
   each refused value in a case of its own; none of the combinations the suite's body skips itself).
   SINKATTN_FA_MAX_AREA ("N" or "N,test_name=M,..."; unset: no cap) leaves out the sequence-length values whose
   seqlen_q * seqlen_k is above the cap, named in the report and the terminal summary: on a CPU the suite's
   half-precision reference (upcast=False) dominates, about 75 s for one (2048, 2048) case on 2 busy cores.
   SINKATTN_FA_SKIP (comma-separated test functions) skips whole functions with SKIP_REASON's words.

Reporting. A case the drop-in refuses by design is reported as skipped with the refusal as the reason (only
when the case asked for that feature: dropout_p > 0, alibi=True, has_leftpad=True); upstream's own
`pytest.skip()` guards keep theirs. Each case's outcome and reason go to SINKATTN_FA_REPORT (JSON), which
tests/test_flash_attn_upstream.py reads. docs/migration.md lists the reasons.
"""
from __future__ import annotations

import json
import os
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import sinkattn.flash_attn_interface as dropin
from sinkattn.errors import SinkattnError

SUITE_ROOT = Path(os.environ["SINKATTN_FA_SUITE_ROOT"])
CAPABILITY = (8, 0)


# ------------------------------------------------------------------------------------------------ 1. imports

def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash_attn.layers.rotary.apply_rotary_emb's math: x (batch, seqlen, nheads, headdim); cos/sin (seqlen_ro,
    rotary_dim / 2); token i of sequence b at position seqlen_offsets[b] + i (an int offset for all); the first
    rotary_dim dims rotated, as pairs (x[2j], x[2j+1]) when interleaved, else as halves (x[j], x[j + rd/2])."""
    if cu_seqlens is not None or inplace:
        raise NotImplementedError("the adapter's rotary serves the batched, out-of-place form the suite uses")
    batch, seqlen = x.shape[0], x.shape[1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).to(torch.long).reshape(-1, 1)
    pos = offsets + torch.arange(seqlen, device=x.device)  # (batch or 1, seqlen)
    pos = pos.expand(batch, seqlen)
    c = cos[pos].float().unsqueeze(2)  # (batch, seqlen, 1, rd/2)
    s = sin[pos].float().unsqueeze(2)
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    raise NotImplementedError("flash-attn's CUDA tile width decodes its dropout mask; sinkattn has no dropout")


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


_NAMES = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
          "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")
_functions = {n: getattr(dropin, n) for n in _NAMES}
_package = _module("flash_attn", __path__=[str(SUITE_ROOT / "flash_attn")], __version__="2.8.3", **_functions)
_module("flash_attn.flash_attn_interface", _get_block_size_n=_get_block_size_n, **_functions)
_layers = _module("flash_attn.layers", __path__=[])
_layers.rotary = _module("flash_attn.layers.rotary", apply_rotary_emb=apply_rotary_emb)
_package.layers = _layers


# ------------------------------------------------------------------------------------ 2-3. device, capability

def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Every CUDA device argument of a torch call becomes the CPU (device=..., a positional device in .to(...))."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _properties(device=None):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(total_memory=ram, name="cpu (sinkattn adapter)", major=CAPABILITY[0],
                                 minor=CAPABILITY[1])


torch.cuda.get_device_capability = lambda device=None: CAPABILITY
torch.cuda.get_device_properties = _properties
torch.cuda.synchronize = lambda device=None: None


@pytest.fixture(autouse=True)
def _on_cpu():
    with CudaToCpu():
        yield


# ----------------------------------------------------------------------------------------------- 4. sampling
# The suite's full parametrization is about 509,000 cases (pytest alone takes minutes to collect them), so the
# sample is drawn from each test function's parametrize marks before pytest expands them: the marks are
# replaced by one parametrize over the chosen cases.

# Values the drop-in refuses by design: each gets one case of its own (the rest of the sample never carries
# them, so no other value is covered only by a refused case).
REFUSED_VALUES = {"dropout_p": lambda v: v > 0, "alibi": lambda v: v is True, "has_leftpad": lambda v: v is True}
# Combinations the suite's own body skips (`pytest.skip()` at the top of test_flash_attn_kvcache): the sample
# avoids them, so that every value it covers runs.
UPSTREAM_SKIPS = (
    lambda c: c.get("new_kv") is False and (c.get("rotary_fraction") or 0) > 0,
    lambda c: c.get("has_batch_idx") is True and c.get("paged_kv_block_size", None) is not None,
    lambda c: c.get("has_leftpad") is True and c.get("paged_kv_block_size", None) is not None,
    lambda c: "seqlen_q,seqlen_k" in c and c.get("new_kv") is True and c["seqlen_q,seqlen_k"][0] > c["seqlen_q,seqlen_k"][1],
    lambda c: (c.get("softcap") or 0) > 0 and (c.get("dropout_p") or 0) > 0,
)


def _cost(value) -> int:
    c = 1
    for v in (value if isinstance(value, tuple) else (value,)):
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            c *= v
    return c


def _area(value) -> int:
    """seqlen_q * seqlen_k of a sequence-length value ((seqlen_q, seqlen_k), or seqlen for both)."""
    return value[0] * value[1] if isinstance(value, tuple) else value * value


def _caps() -> dict:
    """SINKATTN_FA_MAX_AREA: "N" (every function) or "N,test_name=M,..." (M for test_name); unset: no cap."""
    spec = os.environ.get("SINKATTN_FA_MAX_AREA")
    if not spec:
        return {}
    caps = {}
    for part in spec.split(","):
        name, _, value = part.rpartition("=")
        caps[name or "*"] = int(value)
    return caps


def _too_long(test: str, name: str, value) -> bool:
    caps = _caps()
    cap = caps.get(test, caps.get("*"))
    return cap is not None and "seqlen" in name and _area(value) > cap


# Sequence-length values above SINKATTN_FA_MAX_AREA (seqlen_q * seqlen_k), which no sampled case carries:
# {"test_name argnames": [values]}, in the report and the terminal summary.
LEFT_OUT = {}
# Each sampled function's full grid, {"test_name": {"argnames": [repr(value)]}}, for the report.
GRID = {}


def _skipped(case) -> bool:
    return any(rule(case) for rule in UPSTREAM_SKIPS)


def sample_cases(params, seed: int, test: str = ""):
    """params: [(argnames, values)] -> cases [{argnames: value}] in which every value of every parameter occurs,
    refused values each in a case of their own, none of upstream's own skips; cost-balanced (a parameter's large
    values go with another's small ones) and seeded."""
    rng = random.Random(seed)
    refused = {n: [v for v in vals if n in REFUSED_VALUES and REFUSED_VALUES[n](v)] for n, vals in params}
    accepted = {n: [v for v in vals if v not in refused[n] and not _too_long(test, n, v)] for n, vals in params}
    sized = [n for n, vals in params if len({_cost(v) for v in vals}) > 1]
    pref = {}
    for n, _ in params:
        vals = list(accepted[n])
        rng.shuffle(vals)
        if n in sized:  # alternate directions: the first sized parameter starts large, the next small, ...
            vals.sort(key=_cost, reverse=sized.index(n) % 2 == 0)
        pref[n] = vals
    cheapest = {n: sorted(accepted[n], key=_cost)[0] if n in sized else None for n, _ in params}
    todo = {n: list(pref[n]) for n, _ in params}
    cases = []

    def build(forced):
        case = dict(forced)
        for n, _ in params:
            if n in case:
                continue
            fallback = [cheapest[n]] if cheapest[n] is not None else rng.sample(accepted[n], len(accepted[n]))
            for v in todo[n] + [v for v in fallback if v not in todo[n]] + accepted[n]:
                if not _skipped({**case, n: v}):
                    case[n] = v
                    break
            else:
                raise ValueError(f"no value of {n} avoids upstream's skips in {case}")
        return case

    while any(todo.values()):
        case = build({})
        for n, v in case.items():
            if v in todo[n]:
                todo[n].remove(v)
        cases.append(case)
    for n, vals in refused.items():
        for v in vals:
            cases.append(build({n: v}))
    return cases


# SINKATTN_FA_SKIP: comma-separated test functions skipped whole, with this reason (CI skips the race-condition
# test: 251 repeats of a batch-60 forward and backward, written to catch GPU kernels' races, take about 20 s a
# repeat on the CPU reference backend, so over an hour a case).
SKIP_REASON = {
    "test_flash_attn_race_condition": "CPU run: a GPU race-condition test (251 repeats of a batch-60 forward and "
                                      "backward, about 20 s a repeat on the CPU reference backend); run it on a GPU",
}


def pytest_collection_modifyitems(config, items):
    skip = {n for n in os.environ.get("SINKATTN_FA_SKIP", "").split(",") if n}
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in skip:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON.get(name, "skipped by SINKATTN_FA_SKIP")))


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    mode = os.environ.get("SINKATTN_FA_SAMPLE", "cover")
    if mode == "all" or not name.startswith("test_") or not callable(obj):
        return None
    if mode != "cover":
        raise pytest.UsageError(f"SINKATTN_FA_SAMPLE={mode!r}; accepted: cover, all")
    marks = getattr(obj, "pytestmark", [])
    grid = [m for m in marks if m.name == "parametrize"]
    if not grid:
        return None
    params = [(m.args[0] if isinstance(m.args[0], str) else ",".join(m.args[0]), list(m.args[1])) for m in grid]
    GRID[name] = {n: [repr(v) for v in vals] for n, vals in params}
    for n, vals in params:
        out = [v for v in vals if _too_long(name, n, v)]
        if out:
            LEFT_OUT[f"{name} {n}"] = out
    cases = sample_cases(params, int(os.environ.get("SINKATTN_FA_SEED", "0")), name)
    names = [n for n, _ in params]
    argnames = [a.strip() for n in names for a in n.split(",")]
    rows = [tuple(x for n in names for x in (c[n] if "," in n else (c[n],))) for c in cases]
    obj.pytestmark = [m for m in marks if m.name != "parametrize"] + [pytest.mark.parametrize(argnames, rows).mark]
    return None


# ---------------------------------------------------------------------------------------------- 5. reporting

# A refusal by design: (the case's parameter and value that asks for it, words the drop-in's error holds).
REFUSED = (
    ("dropout_p", lambda v: v > 0, "dropout_p="),
    ("alibi", lambda v: v is True, "alibi_slopes is not supported"),
    ("has_leftpad", lambda v: v is True, "cache_leftpad is not supported"),
)
_report = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and call.excinfo is not None and \
            isinstance(call.excinfo.value, SinkattnError) and hasattr(item, "callspec"):
        msg = str(call.excinfo.value)
        params = item.callspec.params
        for name, asks, words in REFUSED:
            if name in params and asks(params[name]) and words in msg:
                rep.outcome = "skipped"
                rep.longrepr = (str(item.path), item.location[1] or 0,
                                f"Skipped: refused by design ({name}={params[name]!r}): {msg.splitlines()[0]}")
                break
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        reason = ""
        if rep.skipped and isinstance(rep.longrepr, tuple):
            reason = rep.longrepr[2]
        elif rep.failed:
            reason = str(rep.longrepr)[-2000:]
        params = getattr(item, "callspec", None)
        _report.append({"nodeid": item.nodeid, "outcome": rep.outcome, "reason": reason,
                        "params": {k: repr(v) for k, v in params.params.items()} if params else {}})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SINKATTN_FA_REPORT")
    if path:
        left_out = {k: [repr(v) for v in vals] for k, vals in LEFT_OUT.items()}
        Path(path).write_text(json.dumps({"cases": _report, "left_out": left_out, "grid": GRID}, indent=1))


def pytest_terminal_summary(terminalreporter):
    if LEFT_OUT:
        terminalreporter.write_line(f"sequence lengths above SINKATTN_FA_MAX_AREA={os.environ.get('SINKATTN_FA_MAX_AREA')} "
                                    f"(seqlen_q * seqlen_k), not sampled:")
        for k, vals in LEFT_OUT.items():
            terminalreporter.write_line(f"  {k}: {vals}")
