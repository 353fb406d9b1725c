"""The README is a front page that works as written.

- README.md has at most 180 lines.
- Its quick start (the python block under "## Quick start") runs as written on CPU tensors, and what it computes
  matches the float64 oracle; so does the runnable block of docs/usage.md.
- Every relative link in README.md and docs/*.md, and every repository path written in backticks there
  (`tests/test_x.py`), names a file that exists.
- Code comments cite the design contract by its path in the repository, docs/DESIGN.md.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from oracle import attention_oracle, attention_oracle_varlen, single_thread  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 180


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def section(text: str, heading: str) -> str:
    """The text under a '## ' heading that starts with `heading`, up to the next '## ' heading."""
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def run_block(code: str, name: str) -> dict:
    ns: dict = {"__name__": "__main__"}
    exec(compile(code, name, "exec"), ns)  # noqa: S102  (the documentation's own example, run as written)
    return ns


def close(got, want, name, atol=2e-5, rtol=1e-4):
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES} (move detail to docs/)"


def test_readme_quick_start_runs_and_matches_the_oracle():
    blocks = python_blocks(section(README.read_text(), "Quick start"))
    assert len(blocks) == 1, f"the quick start should hold one python block, found {len(blocks)}"
    ns = run_block(blocks[0], "README.md quick start")
    q, k, v, sinks = ns["q"], ns["k"], ns["v"], ns["sinks"]
    assert q.device.type == "cpu"

    # The gpt-oss layer: out, lse and the gradients of out.sum() for q and the sinks.
    q64, s64 = q.detach().double().requires_grad_(), sinks.detach().double().requires_grad_()
    want_out, want_lse = attention_oracle(q64, k.double(), v.double(), s64, causal=True, window_size=(127, 0))
    close(ns["out"], want_out, "out")
    close(ns["lse"], want_lse, "lse")
    want_out.sum().backward()
    close(sinks.grad, s64.grad, "dsinks", atol=1e-4)
    close(q.grad, q64.grad, "dq", atol=1e-4)

    # StreamingLLM: 4 sink tokens and a 64-token window.
    want_stream, _ = attention_oracle(q.double(), k.double(), v.double(), causal=True, window_size=(63, 0),
                                      sink_tokens=4)
    close(ns["out_stream"], want_stream, "out_stream")

    # The decode step appended token 256 and attended to all 257 cached tokens.
    k_cache, v_cache, q1, k1, v1 = (ns[n] for n in ("k_cache", "v_cache", "q1", "k1", "v1"))
    assert torch.equal(k_cache[:, 256], k1[:, 0]) and torch.equal(v_cache[:, 256], v1[:, 0])
    assert torch.equal(k_cache[:, :256], k) and not k_cache[:, 257:].any()
    want_step, _ = attention_oracle(q1.double(), k_cache[:, :257].double(), v_cache[:, :257].double(),
                                    sinks.detach().double(), causal=True)
    close(ns["out_step"], want_step, "out_step")


def test_usage_doc_block_runs_and_matches_the_oracle():
    blocks = python_blocks((ROOT / "docs" / "usage.md").read_text())
    assert len(blocks) == 1, f"docs/usage.md should hold one runnable python block, found {len(blocks)}"
    ns = run_block(blocks[0], "docs/usage.md")
    sinks = ns["sinks"].double()

    cu = ns["cu_seqlens"]
    want, want_lse = attention_oracle_varlen(ns["qp"].double(), ns["kp"].double(), ns["vp"].double(), cu, cu, sinks,
                                             causal=True)
    close(ns["out_varlen"], want, "out_varlen")
    close(ns["lse_varlen"], want_lse, "lse_varlen")

    # The paged decode: gather each sequence's pages after the append, then attend over lens + 1 tokens.
    k_pages, v_pages, table, lens = ns["k_pages"], ns["v_pages"], ns["block_table"], ns["lens"]
    page = k_pages.shape[1]
    for b in range(table.shape[0]):
        n = int(lens[b]) + 1
        kb = torch.cat([k_pages[int(p)] for p in table[b]])[:n]
        vb = torch.cat([v_pages[int(p)] for p in table[b]])[:n]
        assert torch.equal(kb[n - 1], ns["k1"][b, 0]), f"sequence {b}: new k not at position {n - 1}"
        w, _ = attention_oracle(ns["q1"][b:b + 1].double(), kb[None].double(), vb[None].double(), sinks,
                                causal=True, window_size=(127, 0))
        close(ns["out_paged"][b:b + 1], w, f"out_paged[{b}]")
    assert page == 16

    q, k, v = (ns[n].double() for n in ("q", "k", "v"))
    want_whole, _ = attention_oracle(q, k, v, sinks)
    close(ns["out_merged"], want_whole, "out_merged")
    close(ns["out_whole"], want_whole, "out_whole")


# ---- links and paths -----------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in backticks: starts at a top-level folder or file of the tree, ends in a file extension.
TOP = ("csrc/", "sinkattn/", "tests/", "bench/", "examples/", "tools/", "third_party/", "docs/", ".ci/")
CODE_PATH = re.compile(r"`((?:%s)[A-Za-z0-9_./-]*\.[A-Za-z0-9]+)`" % "|".join(re.escape(t) for t in TOP))


def doc_files():
    return [README] + DOCS


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto, an anchor in the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if ROOT not in path.parents or not path.is_file():
            bad.append(target)
    assert not bad, f"{doc.relative_to(ROOT)} links to files that do not exist in the repository: {bad}"


def missing_paths(text: str) -> list[str]:
    """Backticked paths of this tree's folders that name no file. A path whose folder this tree does not have
    is another project's (flash-attn's `csrc/flash_attn/...`) and is left alone."""
    return sorted({p for p in CODE_PATH.findall(text) if (ROOT / p).parent.is_dir() and not (ROOT / p).is_file()})


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_named_in_docs_exist(doc):
    missing = missing_paths(doc.read_text())
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_link_checks_catch_a_missing_file():
    """The two checks above would fail on a dangling link and a stale path (so they can fail)."""
    text = "see [gone](docs/nothing-here.md), `tests/test_nothing_here.py` and flash-attn's `csrc/flash_attn/x.cpp`"
    targets = LINK.findall(text)
    assert targets == ["docs/nothing-here.md"] and not (ROOT / targets[0]).is_file()
    assert missing_paths(text) == ["tests/test_nothing_here.py"]
    assert missing_paths("`tests/oracle.py`") == []


def test_code_cites_the_design_contract_in_the_repository():
    """Comments say docs/DESIGN.md (the contract lives in the repository), never a path outside it."""
    assert (ROOT / "docs" / "DESIGN.md").is_file()
    stale = re.compile(r"(?<!docs/)DESIGN\.md")
    bad = []
    for folder in ("csrc", "sinkattn", "tests", "bench", "tools", "examples"):
        for f in sorted((ROOT / folder).rglob("*")):
            if f.suffix not in (".py", ".h", ".cuh", ".cu", ".cpp", ".sh", ".md") or "instantiations" in f.parts:
                continue
            if f == Path(__file__).resolve():
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if stale.search(line):
                    bad.append(f"{f.relative_to(ROOT)}:{n}")
    assert not bad, "cite the design contract as docs/DESIGN.md: " + ", ".join(bad)
