#!/usr/bin/env python3
"""Which branches a kernel's loop takes, without a GPU: the host-emulated kernel's line counts on the problem
(tools/perf_counts.sh: gcov over tools/perf_counts_harness.cpp) carried onto the kernel's SASS blocks through the
cubin's line info (nvdisasm -gi: each instruction's source line and the lines it was inlined at), then the loop's
dominant path for tools/perf_model.py to cost (perf_model.py --rows --path profile).

Why: the model costs what one loop iteration issues, and the SASS alone does not say which of a loop's branches
the interior iterations take (docs/internals.md: the whole loop, or the path with the most MMAs, missed 4d9dcbd's
forward by -58% and +29% at hd64). The emulated kernel runs the same source on the same problem, so its line
counts say how often each statement ran.

A block's weight is the largest count of the kernel-body lines (`body`, the innermost frame in that file) its
instructions come from: ptxas if-converts short conditional code into straight-line blocks (4d9dcbd's softcap
test: its lines ran 0 times, yet its predicated-off instructions sit in the block that holds the MMAs), so a block
runs whenever any of its lines does. Counts are per emulated thread and per execution of the statement; only their
comparison between a branch's successors matters. From the loop's header the path takes, at each branch, a
successor run on at least half the iterations, preferring one that is not the latch (which every iteration reaches
anyway), then, where the counts say it runs, the conditional block over the edge that skips it (its join follows
anyway), else the most executed; where no count speaks for either side, the edge that skips. Before all of that,
a block the emulated kernel never ran is not taken while a successor remains that it may have run (dead_blocks: the
kernel-body lines cannot say which way a branch inside an inlined helper went, e.g. KvLoader's whole-tile copy
against its bounds-checked one, both inlined from one line of the body; the helpers' own lines, counted per
instantiation, can). A loop block holding a never-run statement is weighed without the set-up and sunk lines ptxas
also put there, nor lines that a block run on most iterations holds too (block_weights); a block whose lines all
ran 0 times ranks below one no count speaks for, and where no count says that any side runs, the side nearer the
branch's join is taken.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass  # noqa: E402

BODY = "sm80/fwd_kernel.h"  # the sm80 forward's body: its statements' counts weigh the blocks


def line_chains(cubin: str, fn: str) -> dict[int, list[tuple[str, int]]]:
    """{instruction address: [(file, line), ...] innermost first} of function `fn` (mangled) of a cubin."""
    out = subprocess.run([sass.find_tool("nvdisasm"), "-gi", cubin], capture_output=True, text=True,
                         check=True).stdout
    res, group, fresh, inside = {}, [], True, False
    for ln in out.splitlines():
        if ln.startswith(".text."):
            inside = ln[len(".text."):].rstrip(":") == fn
            continue
        if not inside:
            continue
        if "//##" in ln:  # a group of these precedes the instructions it describes
            if fresh:
                group, fresh = [], False
            group += [(f, int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', ln)]
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", ln)
        if m:
            fresh = True
            res[int(m.group(1), 16)] = list(group)
    return res


def gcov_counts(cov_json: str, needle: str, body: str = BODY) -> collections.Counter:
    """{line of `body`: executions} summed over the instantiations whose mangled name holds `needle` (the tile's
    traits, e.g. 'FwdTraitsILi64ELi128ELi64ELi4E'). `.lambdas`: the first lines of the body's lambdas (call operators
    of those instantiations), whose line gcov records a multi-line lambda's body under (lambda_line)."""
    counts = collections.Counter()
    counts.lambdas = set()
    for f in json.load(open(cov_json))["files"]:
        if f["file"].endswith(body):
            for ln in f["lines"]:
                if needle in ln.get("function_name", ""):
                    counts[ln["line_number"]] += ln["count"]
            counts.lambdas |= {fn["start_line"] for fn in f.get("functions", [])
                               if needle in fn["name"] and "clE" in fn["name"] and "Ul" in fn["name"]}
    return counts


def decode_dir(counts_dir: str, page: int) -> str:
    """The folder of a decode step's line counts over a cache of `page`-row pages (0: contiguous), beside the
    prefill's counts_dir: what `PERF_COUNTS_DECODE=<page> OUT=<counts_dir>_decode_p<page> perf_counts.sh` writes and
    `make gpu-prebuilt` packs."""
    return f"{counts_dir.rstrip('/')}_decode_p{page}"


def lambda_line(n: int, counts) -> int | None:
    """The counted line that speaks for body line n when gcov has no count of n's own: the first line of the lambda
    n lies in (`auto load_kv = [&](int t) {` for its body on the next line: gcov records the body's executions under
    the lambda's first line), found as the nearest counted line above n when that is a lambda's first line."""
    for m in range(n - 1, 0, -1):
        if m in counts:
            return m if m in getattr(counts, "lambdas", ()) else None
    return None


def block_weights(insns, chains, counts, body: str = BODY, loop=None):
    """(blocks, successors, weight per block: the largest count of its body lines, None without any). A line that a
    predecessor block holds too says nothing of this block: a statement's condition and its branch can share a line
    (`if (pages) return ... pages[j / page_size] ...`: the count is the test's, not the division's). Given the loop
    (sass.hot_loop's), a loop block holding a statement that never ran (a line counted 0) is weighed without two
    kinds of line, both of which ptxas puts into blocks that never run: a set-up line (instructions outside the loop
    too, run on fewer than half the iterations: ptxas rematerializes a tile's set-up inside the conditional blocks that
    need it, e.g. KvLoader's base in its never-run branch, the mask's bounds in the never-run mask block); and a line
    held by a block that runs whenever a predecessor does (that predecessor's post-dominators within the iteration:
    ptxas sinks part of a statement every iteration runs, e.g. the stage index, into a never-run branch as well as into
    the join after it), or by a loop block that runs on most iterations by a line of its own and has no never-run
    statement (the same sunk line, when the block that also holds it is not on every path: the MMA block behind the
    warp-active test). Only there: a block of one statement run on most iterations (`if (t + 1 < t_end)
    load_v_at(...)`) shares its line with the join too (ptxas puts the statement's convergence there), and that
    count is all there is to say that it runs."""
    blocks, succ, _ = sass.cfg(insns)
    lines_of = []
    for a, e in blocks:
        ls = set()
        for i in range(a, e + 1):
            # the innermost frame of the body that gcov counted: a lambda's line may have no count of its own
            # (gcov records it under the lambda's name only where it kept one), its call site in the body has
            counted = (n if n in counts else lambda_line(n, counts) for f, n in chains.get(insns[i].addr, [])
                       if f.endswith(body))
            line = next((n for n in counted if n is not None), None)
            if line is not None:
                ls.add(line)
        lines_of.append(ls)
    preds = collections.defaultdict(set)
    for b, ss in enumerate(succ):
        for t in ss:
            preds[t].add(b)
    owns = [ls - set().union(*(lines_of[q] for q in preds[b] if q != b)) if preds[b] else ls
            for b, ls in enumerate(lines_of)]
    if loop is not None:
        inside = set(loop[1])
        outside = set().union(*(lines_of[b] for b in range(len(blocks)) if b not in inside))
        iterations = max((counts[n] for n in lines_of[loop[2]]), default=0)  # the header's lines, the latch's too
        setup = {n for n in outside if 0 < counts[n] < 0.5 * iterations}
        pdom = post_dominators(succ, inside, loop[2])
        never = {b for b in inside if any(counts[n] == 0 for n in owns[b])}
        for b in never:  # a statement of it never ran: do the others speak for it?
            joins = set().union(*(lines_of[x] for q in preds[b] if q in inside for x in pdom[q] if x != b))
            # a block that runs on most iterations by a line of its own (no never-run statement in it) explains
            # the count of any line it shares with b
            joins |= set().union(*(lines_of[x] for x in inside - never - {b}
                                   if any(counts[n] >= 0.5 * iterations for n in lines_of[x] - lines_of[b])))
            owns[b] = owns[b] - setup - joins
    return blocks, succ, [max(counts[n] for n in own) if own else None for own in owns]


def post_dominators(succ, inside: set[int], header: int) -> dict[int, set[int]]:
    """{block of the loop: the loop's blocks every path from it to the end of the iteration passes through, itself
    included}. The iteration ends at an edge back to the header or out of the loop."""
    end = -1
    nxt = {b: [t if t in inside and t != header else end for t in succ[b]] or [end] for b in inside}
    pd = {b: set(inside) for b in inside}
    pd[end] = set()
    changed = True
    while changed:
        changed = False
        for b in inside:
            new = {b} | set.intersection(*(pd[t] for t in nxt[b]))
            if new != pd[b]:
                pd[b], changed = new, True
    del pd[end]
    return pd


def gcov_instances(cov_json: str, needle: str) -> dict[tuple[str, int], list[int]]:
    """{(path under csrc/, line): [count of each instantiation holding `needle` that has the line]} over every
    source file of the tree (the kernel's helpers too: gcov counts each template instantiation apart)."""
    out = collections.defaultdict(list)
    for f in json.load(open(cov_json))["files"]:
        if "/csrc/" not in f["file"]:
            continue
        rel = f["file"].split("/csrc/")[-1]
        for ln in f["lines"]:
            if needle in ln.get("function_name", ""):
                out[(rel, ln["line_number"])].append(ln["count"])
    return out


def dead_blocks(insns, blocks, chains, inst, loop=None, body: str = BODY, loop_count: int | None = None) -> set[int]:
    """The blocks the emulated kernel never ran. An instruction's verdict comes from its inlining chain, innermost
    frame first: the first frame in the tree whose line every matching instantiation ran (alive) or none did (dead);
    a line some ran and some did not (a helper called from two places, e.g. the row loader for Q once per tile and
    for a tail key block) passes the question to its caller's line. A block is dead when some instruction of it is
    and none is alive (ptxas puts if-converted code that never runs beside code that does). Given the loop, an
    instruction of it whose body line also has instructions before or after the loop says nothing for its block:
    ptxas rematerializes a tile's set-up inside the loop's conditional blocks where it is needed (the mask's bounds
    inside the mask block), and a line run once per tile is no evidence that the block runs. Given loop_count (the
    loop header's count), that holds only for a body line that ran fewer times: a loop statement ptxas hoisted part of
    out of the loop (a loader's block offset) still speaks for its block. The body line is an instruction's outermost
    frame of the body: a lambda of the body (a loader called before the loop and in it) has its own line outside the
    loop as well, its call site in the loop does not."""
    body_line = lambda i: next((n for f, n in reversed(chains.get(insns[i].addr, [])) if f.endswith(body)), None)  # noqa: E731
    inside = set(loop[0]) if loop else set()
    outside_lines = {body_line(i) for i in range(len(insns)) if i not in inside} if loop else set()

    def verdict(i):
        for f, n in chains.get(insns[i].addr, []):
            if "/csrc/" not in f:
                continue
            cs = inst.get((f.split("/csrc/")[-1], n))
            if not cs:
                continue
            if all(c == 0 for c in cs):
                return False
            if all(c > 0 for c in cs):
                n_body = body_line(i)
                setup = n_body is not None and n_body in outside_lines and (
                    loop_count is None or max(inst.get((body, n_body), [0])) < loop_count)
                return None if i in inside and setup else True
        return None
    dead = set()
    for b, (a, e) in enumerate(blocks):
        vs = {verdict(i) for i in range(a, e + 1)}
        if False in vs and True not in vs:
            dead.add(b)
    return dead


def dominant_path(loop, blocks, succ, weights, dead=frozenset()) -> list[int]:
    """The instruction indices of one interior iteration of `loop` (sass.hot_loop's (indices, blocks, header))."""
    _, body, h = loop
    inside, path, b, seen = set(body), [], h, set()
    full = weights[h] or 0
    # a block whose lines all ran 0 times ranks below one no count speaks for
    wt = lambda t: weights[t] if weights[t] else -2.0 if weights[t] == 0 else -1.0  # noqa: E731
    pdom = post_dominators(succ, inside, h)

    def reach(t):  # the loop's blocks reachable from t without passing the header
        out, todo = set(), [t]
        while todo:
            x = todo.pop()
            if x in out or x == h or x not in inside:
                continue
            out.add(x)
            todo += succ[x]
        return out

    def to_join(t, join):  # the fewest instructions from t to join within the iteration
        best, todo = {t: 0}, [t]
        while todo:
            x = todo.pop()
            if x == join or x not in inside or x == h:
                continue
            for y in succ[x]:
                c = best[x] + blocks[x][1] - blocks[x][0] + 1
                if c < best.get(y, 1 << 30):
                    best[y] = c
                    todo.append(y)
        return best.get(join, 1 << 30)
    while True:
        seen.add(b)
        path.extend(range(blocks[b][0], blocks[b][1] + 1))
        nxt = [t for t in succ[b] if t in inside]
        options = [t for t in nxt if t not in seen]
        options = [t for t in options if t not in dead] or options
        if not options:
            return path
        # run on most iterations first; then not the latch; then, where the counts say it runs, the branch into a
        # conditional block over the edge that skips it (the skipped-to block follows anyway); then the most executed;
        # where no count speaks for either side, the edge that skips (no evidence that the block runs); last, where no
        # count says that any side runs, the side nearer the branch's join (its nearest post-dominator): a bare test
        # on the way to the join rather than a helper's branches
        known = lambda t: bool(weights[t])  # noqa: E731
        join = max(pdom[b] - {b}, key=lambda x: len(pdom[x]), default=None)  # the nearest has the most of its own
        unknown = join is not None and not any(known(o) for o in options)
        best = max(options, key=lambda t: (wt(t) >= 0.5 * full, h not in succ[t],
                                           known(t) and any(o in reach(t) for o in options if o != t), wt(t),
                                           not known(t) and any(t in reach(o) for o in options if o != t),
                                           -to_join(t, join) if unknown else 0))
        if h in nxt and wt(best) < 0.5 * full:
            return path
        b = best


def cubin_of(obj: str, arch: str, workdir: str) -> str:
    """The `arch` cubin inside an object (.o) or .so, extracted into workdir (nvdisasm reads cubins only)."""
    if obj.endswith(".cubin"):
        return obj
    os.makedirs(workdir, exist_ok=True)
    subprocess.run([sass.find_tool("cuobjdump"), "-xelf", "all", os.path.abspath(obj)], cwd=workdir,
                   capture_output=True, check=True)
    found = [f for f in os.listdir(workdir) if f.endswith(f".{arch}.cubin")]
    if not found:
        raise FileNotFoundError(f"no {arch} cubin in {obj}")
    return os.path.join(workdir, sorted(found)[0])


def profile_path(cubin: str, fn: str, insns, loop, cov_json: str, needle: str, body: str = BODY) -> list[int]:
    """The loop's interior path by the emulated kernel's line counts (the module's docstring)."""
    return profile(cubin, fn, insns, loop, cov_json, needle, body)[0]


def profile(cubin: str, fn: str, insns, loop, cov_json: str, needle: str, body: str = BODY) -> tuple[list[int], int]:
    """(the loop's interior path, the instructions outside the loop in blocks the emulated kernel ran): what a CTA
    issues once besides its iterations. Counting every instruction outside the loop charged each CTA with every
    epilogue and set-up variant compiled in (split-KV partials, the key-group merge, FP8 scales): 5374 instructions
    in HEAD's hd64 forward, 2.3x FA2's, which the causal rows (half the iterations per CTA) felt most."""
    chains = line_chains(cubin, fn)
    counts = gcov_counts(cov_json, needle, body)
    blocks, succ, weights = block_weights(insns, chains, counts, body, loop)
    dead = dead_blocks(insns, blocks, chains, gcov_instances(cov_json, needle), loop, body, weights[loop[2]])
    inside = set(loop[1])
    outside = sum(e - a + 1 for b, (a, e) in enumerate(blocks) if b not in inside and b not in dead)
    return dominant_path(loop, blocks, succ, weights, dead), outside
