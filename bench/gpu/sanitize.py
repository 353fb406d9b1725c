"""compute-sanitizer over a small case of every kernel family and mode.

Two commands:

    python bench/gpu/sanitize.py cases [--cases a,b] [--dry-run]
        Runs the cases in this process, each checked against the reference backend, and prints one line per
        case and a last line "SANITIZE-CASES-DONE <passed>/<total>". This is what runs under the sanitizer.
        --dry-run runs them on the CPU (sm80 cases on the emulated kernels where the build has them, the others
        on the reference backend), to check the cases and this script without a GPU.

    python bench/gpu/sanitize.py run [--tools memcheck,racecheck,synccheck,initcheck] [--budget 120] [--log FILE]
                                 [--sanitizer PATH] [--dry-run]
        Finds compute-sanitizer, checks that this machine's runtime lets it run (a one-allocation probe: some
        container runtimes refuse the device), then runs `cases` once under each tool, time-boxed. Each tool gets a
        verdict: PASS (the cases ran to the end and the sanitizer counted 0 errors), FAIL (errors, or a case failed),
        or NOT RUN (no sanitizer, refused by the runtime, out of time, no error summary): never PASS unless it ran.
        Full output goes to --log (appended); the verdict lines go to stdout; the exit status is 1 when a tool
        FAILED, 3 when none failed but some did NOT RUN, 0 when all passed. --dry-run prints the commands only.

check.sh (here) calls `run` after the GPU tests. The cases are tiny (a few CTAs): sanitizers slow kernels down
10-1000x, racecheck most.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Share of the budget per tool (racecheck instruments every shared-memory access: it is the slow one).
WEIGHTS = {"memcheck": 1.0, "racecheck": 2.0, "synccheck": 1.0, "initcheck": 1.0}
DONE = "SANITIZE-CASES-DONE"
# bench/gpu/ -> the repo, for `import sinkattn`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---------------------------------------------------------------------------------------------- the cases
def _cases():
    """name -> (family, run(device, backend) -> max abs error vs the reference backend)."""
    import torch

    import sinkattn

    g = torch.Generator().manual_seed(0)

    def r(dev, *shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    def err(a, b):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0

    def fwd(dev, backend, varlen=False, d=64, dtype=torch.bfloat16, **kw):
        if varlen:
            lq, lk = [17, 0, 70], [40, 5, 90]
            cu_q = torch.tensor([0, 17, 17, 87], dtype=torch.int32, device=dev)
            cu_k = torch.tensor([0, 40, 45, 135], dtype=torch.int32, device=dev)
            q, k, v = r(dev, 87, 4, d, dtype=dtype), r(dev, 135, 2, d, dtype=dtype), r(dev, 135, 2, d, dtype=dtype)
            s = torch.randn(4, generator=g).to(dev)
            call = lambda b: sinkattn.flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, max(lq), max(lk), s,  # noqa: E731
                                                                   return_lse=True, backend=b, **kw)
        else:
            q, k, v = r(dev, 2, 70, 4, d, dtype=dtype), r(dev, 2, 100, 2, d, dtype=dtype), r(dev, 2, 100, 2, d, dtype=dtype)
            s = torch.randn(4, generator=g).to(dev)
            call = lambda b: sinkattn.flash_attn_with_sinks(q, k, v, s, return_lse=True, backend=b, **kw)  # noqa: E731
        (o, l), (ro, rl) = call(backend), call("reference")
        return max(err(o, ro), err(l, rl))

    def bwd(dev, backend, varlen=False, deterministic=False):
        q, k, v = r(dev, 1, 70, 4, 64), r(dev, 1, 90, 2, 64), r(dev, 1, 90, 2, 64)
        s = torch.randn(4, generator=g).to(dev)
        do = r(dev, 1, 70, 4, 64)
        kw = dict(causal=True, window_size=(40, 0), sink_tokens=2, deterministic=deterministic)
        res = []
        for b in (backend, "reference"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, s)]
            if varlen:
                cu_q = torch.tensor([0, 30, 70], dtype=torch.int32, device=dev)
                cu_k = torch.tensor([0, 50, 90], dtype=torch.int32, device=dev)
                o = sinkattn.flash_attn_varlen_with_sinks(leaves[0][0], leaves[1][0], leaves[2][0], cu_q, cu_k, 40, 50,
                                                          leaves[3], backend=b, **kw)[None]
            else:
                o = sinkattn.flash_attn_with_sinks(*leaves, backend=b, **kw)
            res.append(torch.autograd.grad(o, leaves, do))
        return max(err(a, b_) for a, b_ in zip(*res))

    def decode(dev, backend, paged=False, num_splits=1):
        b, hk, d, cap, page = 3, 2, 64, 128, 16
        lens = torch.tensor([0, 37, 120], dtype=torch.int32, device=dev)
        q, kn, vn = r(dev, b, 1, 8, d), r(dev, b, 1, hk, d), r(dev, b, 1, hk, d)
        s = torch.randn(8, generator=g).to(dev)
        if paged:
            kc, vc = r(dev, b * cap // page + 2, page, hk, d), r(dev, b * cap // page + 2, page, hk, d)
            bt = torch.randperm(b * cap // page, generator=g).view(b, cap // page).to(torch.int32).to(dev)
        else:
            kc, vc, bt = r(dev, b, cap, hk, d), r(dev, b, cap, hk, d), None
        outs = []
        for be in (backend, "reference"):
            k2, v2 = kc.clone(), vc.clone()
            outs.append(sinkattn.flash_attn_with_kvcache(q, k2, v2, s, k=kn, v=vn, cache_seqlens=lens, block_table=bt,
                                                         causal=True, window_size=(60, 0), sink_tokens=4,
                                                         num_splits=num_splits, return_lse=True, backend=be))
        return max(err(outs[0][0], outs[1][0]), err(outs[0][1], outs[1][1]))

    def merge(dev, backend):
        oa, ob = r(dev, 2, 5, 4, 64), r(dev, 2, 5, 4, 64)
        la, lb = torch.randn(2, 4, 5, generator=g).to(dev), torch.randn(2, 4, 5, generator=g).to(dev)
        la[0, 0, 0] = float("-inf")
        s = torch.randn(4, generator=g).to(dev)
        o, lse = sinkattn.merge_attn_states(oa, la, ob, lb, s)
        # The reference: lse = logsumexp(lse_a, lse_b, sink) per row; out = the weighted parts.
        top = torch.logsumexp(torch.stack([la, lb, s.view(1, 4, 1).expand_as(la)]), 0)
        want = (torch.exp(la - top).transpose(1, 2)[..., None] * oa.float()
                + torch.exp(lb - top).transpose(1, 2)[..., None] * ob.float())
        return max(err(o, want), err(lse, top))

    win = dict(causal=True, window_size=(30, 0), sink_tokens=3)
    return {
        "sm80-fwd": ("sm80", lambda dev, be: fwd(dev, be, **win)),
        "sm80-fwd-hd128-fp16-softcap": ("sm80", lambda dev, be: fwd(dev, be, d=128, dtype=torch.float16, softcap=10.0)),
        "sm80-fwd-hd256": ("sm80", lambda dev, be: fwd(dev, be, d=256, causal=True)),
        "sm80-fwd-varlen": ("sm80", lambda dev, be: fwd(dev, be, varlen=True, **win)),
        "sm80-decode": ("sm80", lambda dev, be: decode(dev, be)),
        "sm80-decode-split-combine": ("sm80", lambda dev, be: decode(dev, be, num_splits=3)),
        "sm80-decode-paged": ("sm80", lambda dev, be: decode(dev, be, paged=True, num_splits=2)),
        "sm80-bwd": ("sm80", lambda dev, be: bwd(dev, be)),
        "sm80-bwd-deterministic": ("sm80", lambda dev, be: bwd(dev, be, deterministic=True)),
        "sm80-bwd-varlen": ("sm80", lambda dev, be: bwd(dev, be, varlen=True)),
        "sm90-fwd": ("sm90", lambda dev, be: fwd(dev, be, **win)),
        "sm90-fwd-varlen": ("sm90", lambda dev, be: fwd(dev, be, varlen=True, **win)),
        # The sm90 backward (never run on a GPU before its first gpu-check): racecheck and synccheck matter most.
        "sm90-bwd": ("sm90", lambda dev, be: bwd(dev, be)),
        "sm90-bwd-deterministic": ("sm90", lambda dev, be: bwd(dev, be, deterministic=True)),
        "sm90-bwd-varlen": ("sm90", lambda dev, be: bwd(dev, be, varlen=True)),
        "merge": ("merge", lambda dev, be: merge(dev, be)),
    }


def _backend(family: str, dry_run: bool) -> tuple[str, str] | None:
    """(device, backend) for a family, or None when this machine cannot run it (said so in the output)."""
    import torch

    from sinkattn import _ext

    if not dry_run:
        if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
            return None
        return "cuda", {"sm80": "sm80", "sm90": "sm90", "merge": "auto"}[family]
    emu = any(k["family"] == "sm80-emulated" for k in _ext.registry())
    return "cpu", {"sm80": "sm80-emulated" if emu else "reference", "sm90": "reference", "merge": "auto"}[family]


def run_cases(names: list[str] | None, dry_run: bool) -> int:
    cases = _cases()
    unknown = sorted(set(names or []) - set(cases))
    if unknown:
        print(f"sanitize: unknown cases {unknown}; known: {', '.join(cases)}")
        return 2
    failed = passed = 0
    total = 0
    for name, (family, fn) in cases.items():
        if names and name not in names:
            continue
        total += 1
        where = _backend(family, dry_run)
        if where is None:
            print(f"case {name}: SKIPPED (family {family} needs a cc 9.0 GPU)")
            passed += 1  # skipped cases are listed; the family's absence is not an error of this run
            continue
        t0 = time.time()
        try:
            e = fn(*where)
            ok = e <= 0.05
            print(f"case {name}: {'ok' if ok else 'MISMATCH'} on {where[1]} (max |err| vs reference {e:.3g}, "
                  f"{time.time() - t0:.1f}s)", flush=True)
        except Exception as exc:  # every case runs, whatever one does
            ok = False
            print(f"case {name}: ERROR on {where[1]}: {type(exc).__name__}: {exc}", flush=True)
        passed += ok
        failed += not ok
    print(f"{DONE} {passed}/{total}", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- the runner
def find_sanitizer(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if os.path.exists(explicit) or shutil.which(explicit) else None
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for c in (shutil.which("compute-sanitizer"), f"{cuda}/bin/compute-sanitizer",
              f"{cuda}/compute-sanitizer/compute-sanitizer", "/usr/local/cuda/bin/compute-sanitizer"):
        if c and os.path.exists(c):
            return c
    return None


def tool_args(tool: str, help_text: str) -> list[str]:
    """The options for one tool, keeping only those this sanitizer version lists in its --help."""
    args = ["--tool", tool, "--print-limit", "50"]
    if "--kernel-name" in help_text:
        args += ["--kernel-name", "kns=sinkattn"]  # our kernels only: torch's own are not under test
    elif "--filter" in help_text:
        args += ["--filter", "kns=sinkattn"]
    if tool == "memcheck":
        if "--padding" in help_text:
            args += ["--padding", "64"]  # bytes after each allocation: catches reads just past a tensor's end
        if "--leak-check" in help_text:
            args += ["--leak-check", "no"]  # torch keeps allocations alive by design
    if tool == "racecheck" and "--racecheck-report" in help_text:
        args += ["--racecheck-report", "all"]
    return args


SUMMARY_RE = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
REFUSED_RE = re.compile(r"Device not supported|not supported on this|unable to initialize|Sanitizer cannot|"
                        r"CUDA_ERROR_UNKNOWN|error 999", re.I)


def verdict(output: str, rc: int | None) -> tuple[str, str]:
    """(PASS | FAIL | NOT RUN, why) from one sanitized run's output and exit status (None: timed out)."""
    if rc is None:
        return "NOT RUN", "out of time (the sanitizer was stopped before it finished)"
    m = SUMMARY_RE.findall(output)
    done = re.search(rf"{DONE} (\d+)/(\d+)", output)
    if REFUSED_RE.search(output) and not done:
        line = next((ln for ln in output.splitlines() if REFUSED_RE.search(ln)), "")
        return "NOT RUN", f"the runtime refused the sanitizer: {line.strip()[:200]}"
    if not m:
        return "NOT RUN", f"no error summary in the sanitizer's output (exit {rc})"
    errors = int(m[-1])
    if errors:
        return "FAIL", f"{errors} errors"
    if not done:
        return "FAIL", f"0 sanitizer errors, but the cases did not run to the end (exit {rc})"
    if done.group(1) != done.group(2):
        return "FAIL", f"0 sanitizer errors, but cases failed ({done.group(1)}/{done.group(2)} passed)"
    return "PASS", f"0 errors, {done.group(2)} cases"


def _run(cmd, timeout, env, log):
    log.write(f"\n== $ {' '.join(cmd)}   (time box {timeout:.0f}s)\n")
    log.flush()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), env=env)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
    log.write(out)
    log.flush()
    return out, rc


def run_tools(tools, budget: float, log_path: str | None, sanitizer: str | None, dry_run: bool,
              cases: str | None = None) -> int:
    log = open(log_path, "a") if log_path else sys.stdout
    deadline = time.time() + budget
    say = lambda s: print(f"sanitize: {s}", flush=True)  # noqa: E731
    exe = find_sanitizer(sanitizer)
    if exe is None:
        for t in tools:
            say(f"{t}: NOT RUN (compute-sanitizer not found: not on PATH, nor under $CUDA_HOME)")
        return 3
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")  # one cudaMalloc per tensor
    driver = [sys.executable, os.path.abspath(__file__), "cases"] + (["--cases", cases] if cases else [])
    if dry_run:
        for t in tools:
            say(f"{t}: would run: {exe} {' '.join(tool_args(t, '--kernel-name --padding --leak-check'))} "
                f"{' '.join(driver)}")
        return 0
    help_out, _ = _run([exe, "--help"], 30, env, log)
    probe, rc = _run([exe, "--tool", "memcheck", sys.executable, "-c",
                      f"import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print('{DONE} 1/1')"],
                     min(60.0, deadline - time.time()), env, log)
    status, why = verdict(probe, rc)
    if status != "PASS":
        for t in tools:
            say(f"{t}: NOT RUN (the probe under memcheck did not pass: {why})")
        return 3
    results = {}
    for i, t in enumerate(tools):
        left = deadline - time.time()
        share = left * WEIGHTS[t] / sum(WEIGHTS[x] for x in tools[i:])
        if share < 5:
            results[t] = ("NOT RUN", "no time left in the budget")
        else:
            out, rc = _run([exe, *tool_args(t, help_out), *driver], share, env, log)
            results[t] = verdict(out, rc)
        say(f"{t}: {results[t][0]} ({results[t][1]})")
    if any(s == "FAIL" for s, _ in results.values()):
        return 1
    return 3 if any(s != "PASS" for s, _ in results.values()) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    c.add_argument("--dry-run", action="store_true", help="run the cases on the CPU")
    c.add_argument("--list", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--tools", default=",".join(TOOLS))
    r.add_argument("--budget", type=float, default=120.0, help="seconds for all tools together")
    r.add_argument("--log", default=None)
    r.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: search)")
    r.add_argument("--cases", default=None)
    r.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    if a.cmd == "cases":
        if a.list:
            print("\n".join(_cases()))
            return 0
        return run_cases(a.cases.split(",") if a.cases else None, a.dry_run)
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        print(f"sanitize: unknown tools {bad}; known: {', '.join(TOOLS)}")
        return 2
    return run_tools(tools, a.budget, a.log, a.sanitizer, a.dry_run, a.cases)


if __name__ == "__main__":
    sys.exit(main())
