"""tools/run_grid.py: the grid `make run` builds (native archs with a GPU, the first-look grid without one, the
caller's SINKATTN_* always winning), and that the first-look grid holds every kernel family at every default arch."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "csrc"))

import generate_kernels as gen  # noqa: E402
import run_grid  # noqa: E402


def test_no_gpu_builds_the_first_look_grid():
    chosen, why = run_grid.choose(env={}, gpu=False)
    assert chosen == {"SINKATTN_HEADDIMS": "64", "SINKATTN_DTYPES": "bf16"}
    assert "no GPU" in why and "make install" in why


def test_gpu_builds_native_archs():
    chosen, why = run_grid.choose(env={}, gpu=True)
    assert chosen == {"SINKATTN_CUDA_ARCHS": "native"}
    assert "native" in why


@pytest.mark.parametrize("gpu", [False, True])
def test_the_callers_grid_wins(gpu):
    env = {"SINKATTN_CUDA_ARCHS": "80", "SINKATTN_HEADDIMS": "128", "SINKATTN_DTYPES": "fp16"}
    assert run_grid.choose(env=env, gpu=gpu)[0] == {}
    # one variable given: only the others are chosen
    chosen, _ = run_grid.choose(env={"SINKATTN_HEADDIMS": "128"}, gpu=False)
    assert chosen == {"SINKATTN_DTYPES": "bf16"}


def test_an_installed_build_keeps_its_grid(tmp_path):
    assert run_grid.installed_grid(str(tmp_path)) is None
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / ".grid").write_text("80;90a|64,128,256|bf16,fp16|\n")
    assert run_grid.installed_grid(str(tmp_path)) is None  # a grid without an install is no install
    (tmp_path / "build" / ".installed").write_text("")
    installed = run_grid.installed_grid(str(tmp_path))
    assert installed == {"SINKATTN_CUDA_ARCHS": "80;90a", "SINKATTN_HEADDIMS": "64,128,256",
                         "SINKATTN_DTYPES": "bf16,fp16"}
    # no GPU, but a full install exists (make test ran first): make run keeps it, never narrows it
    chosen, why = run_grid.choose(env={}, gpu=False, installed=installed)
    assert chosen == installed and "already installed" in why
    # the default grid recorded as empty values: nothing to set, so make sees the same grid string
    (tmp_path / "build" / ".grid").write_text("|||\n")
    assert run_grid.choose(env={}, gpu=False, installed=run_grid.installed_grid(str(tmp_path)))[0] == {}


def test_first_look_grid_holds_every_family_and_arch():
    grid = gen.parse_grid(env=dict(run_grid.FIRST_LOOK))
    assert grid.archs == ["80", "90a"] and grid.headdims == [64] and grid.dtypes == ["bf16"]
    names = sorted(u.name for u in gen.units(grid))
    for kind in ("fwd_sm80_hdim64_bf16", "bwd_sm80_hdim64_bf16", "fwd_sm90_hdim64_bf16", "bwd_sm90_hdim64_bf16",
                 "merge_bf16"):
        assert kind in names, names
    assert len(names) <= 10, names  # the first look stays a few minutes on 2 cores


def test_script_prints_make_arguments(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SINKATTN_")}
    env["PATH"] = "/nonexistent"  # no nvidia-smi: the no-GPU answer
    tools = tmp_path / "tools"
    tools.mkdir()  # a checkout with no build yet
    script = tools / "run_grid.py"
    script.write_text(open(os.path.join(ROOT, "tools", "run_grid.py")).read())
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert sorted(out.stdout.split()) == ["SINKATTN_DTYPES=bf16", "SINKATTN_HEADDIMS=64"]
    assert "no GPU is visible" in out.stderr
