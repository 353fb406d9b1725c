"""The compile-time capability report (sinkattn.capabilities, python -m sinkattn.report, sinkattn-report).

No GPU is needed: devices are faked with DeviceInfo, and for the serving-path logic the binary's registry
is replaced by registries of builds that could exist (what the generator would compile for a given
SINKATTN_CUDA_ARCHS), so each (device, build) pair is checked against an expectation written here
independently of sinkattn/registry.py and sinkattn/dispatch.py.
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import sinkattn
from sinkattn import _ext, capability, dispatch, registry
from sinkattn._device import DeviceInfo
from sinkattn.report import render

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXT = pytest.mark.skipif(not _ext.loaded(), reason=f"no compiled extension: {_ext.IMPORT_ERROR}")


def _load_gen():
    spec = importlib.util.spec_from_file_location("sinkattn_generate_kernels_r", ROOT / "csrc" / "generate_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gen = _load_gen()

FAKE_DEVICES = [
    DeviceInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912),
    DeviceInfo(1, "NVIDIA GeForce RTX 3090", (8, 6), 82, 101376),
    DeviceInfo(2, "NVIDIA L4", (8, 9), 58, 101376),
    DeviceInfo(3, "NVIDIA H200", (9, 0), 132, 232448),
    DeviceInfo(4, "Tesla T4", (7, 5), 40, 65536),
    DeviceInfo(5, "NVIDIA GeForce RTX 5090", (12, 0), 170, 101376),
]
FWD_FEATURES = ("learnable_sinks", "sink_tokens")
ALL_FEATURES = ("learnable_sinks", "sink_tokens", "backward", "decode", "fp8_decode", "vllm_paged_step")


# ---- an independent model of what should serve ---------------------------------------------------------
def sass_runs(arch: str, cc: tuple[int, int]) -> bool:
    """SASS for `arch` loads on cc: same major and minor <= cc's, except arch-specific ('a') targets,
    which need exactly their cc."""
    m = re.fullmatch(r"sm_(\d+)(\d)(a?)", arch)
    if not m:
        return False
    major, minor, specific = int(m.group(1)), int(m.group(2)), m.group(3)
    return (major, minor) == cc if specific else (major == cc[0] and minor <= cc[1])


def runs_on(arch: str, cc: tuple[int, int]) -> bool:
    """SASS as above, or embedded PTX (compute_XY), which the driver JIT-compiles for any cc >= X.Y."""
    m = re.fullmatch(r"compute_(\d+)(\d)", arch)
    if m:
        return (int(m.group(1)), int(m.group(2))) <= cc
    return sass_runs(arch, cc)


def native(registry, cc) -> bool:
    """Whether the sm80 forward kernels of this registry have SASS for cc (no JIT)."""
    return any(k["family"] == "sm80" and k["op"] == "fwd" and any(sass_runs(a, cc) for a in k["archs"].split(","))
               for k in registry)


def expected_backend(feature: str, cc: tuple[int, int], registry) -> str:
    # Decode runs on the sm80 forward kernel on every device (on cc 9.0 the sm90 forward over caches comes second:
    # until dispatch.SM90_CACHE_VALIDATED; it reads no FP8 cache at head dim 256); the backward on the bwd
    # kernels (sm90 devices use the sm80 backward until the sm90 one has passed a GPU run: dispatch.SM90_BWD_VALIDATED).
    # The learnable-sinks problem is gpt-oss's window (127, 0), which "auto" gives to sm80 first on cc 9.0
    # (dispatch.SM90_MIN_WINDOW).
    # An FP8 cache's decode runs on the family's fwd_fp8 kernels (csrc/sm80/fp8_kv.h), or, in a build without any,
    # on forward kernels that list fp8_kv.
    op = "bwd" if feature == "backward" else "fwd"
    decode = feature in ("decode", "fp8_decode", "vllm_paged_step")
    order = ["sm90", "sm80"] if cc == (9, 0) else (["sm80"] if cc[0] >= 8 else [])
    if cc == (9, 0) and decode:
        order = ["sm80", "sm90"]
    if cc == (9, 0) and (feature == "learnable_sinks" or (feature == "backward" and not dispatch.SM90_BWD_VALIDATED)):
        order = ["sm80", "sm90"]
    for b in order:
        fam_op = op
        if feature == "fp8_decode":
            fam_op = "fwd_fp8" if any(k["family"] == b and k["op"] == "fwd_fp8" for k in registry) else "fwd"
        for k in registry:
            if (k["family"], k["op"], k["headdim"], k["dtype"]) == (b, fam_op, 64, "bf16") and any(
                    runs_on(a, cc) for a in k["archs"].split(",")) and (
                    feature != "fp8_decode" or "fp8_kv" in k["features"].split(",")):
                return b
    return "reference"


# The features each family's forward kernels list in the registry (csrc: SINKATTN_FWD_FEATURES, and the sm90 tiles'
# fwd_features at head dim 64, which gathers pages of any size).
FWD_FEATURES_OF = {"sm80": "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged,paged16,split_kv,"
                           "broadcast_strides",
                   "sm90": "sinks,sink_tokens,causal,window,softcap,gqa,varlen,kvcache,paged16,split_kv,paged"}


def fake_registry(archs: list[str], sm90: bool = False) -> tuple[dict, ...]:
    """The registry a build of the full head-dim/dtype grid for `archs` would hold once the forward kernels
    exist (the sm80 family per generate_kernels, and optionally an sm90 family)."""
    out = [dict(name=f"merge_{d}", family="common", op="merge", headdim=0, dtype=d, features="sinks",
                archs=gen.arch_list_string("common", archs)) for d in ("bf16", "fp16", "fp32")]
    fams = ["sm80"] + (["sm90"] if sm90 else [])
    for fam in fams:
        a = gen.arch_list_string(fam, archs)
        if not a:
            continue
        for h in (64, 128, 256):
            for d in ("bf16", "fp16"):
                out.append(dict(name=f"fwd_{fam}_hdim{h}_{d}", family=fam, op="fwd", headdim=h, dtype=d,
                                features=FWD_FEATURES_OF[fam], archs=a))
    return tuple(out)


@pytest.fixture
def fake_build(monkeypatch):
    def install(registry):
        monkeypatch.setattr(_ext, "registry", lambda: registry)
        if not _ext.loaded():
            # The paths below need a "loaded" extension to reach the registry logic. On a build without one (the
            # pure-Python build) the rest of the binary's surface is faked too: a build consistent with this torch
            # (no version mismatch to report) and no CUDA runtime.
            monkeypatch.setattr(_ext, "loaded", lambda: True)
            archs = sorted({a.split("_")[1] for k in registry for a in k["archs"].split(",") if "_" in a})
            monkeypatch.setattr(_ext, "build_info", lambda: {
                "nvcc_version": f"{torch.version.cuda or '13.0'}.0", "cutlass_version": "0.0.0",
                "torch_version_at_build": torch.__version__, "requested_archs": ";".join(archs)})
            monkeypatch.setattr(capability, "_runtime", lambda: {"cuda_runtime": None, "cuda_driver": None})
    return install


# ---- the report's structure, in process ------------------------------------------------------------------
def _check_structure(cap: dict):
    for key in ("sinkattn_version", "python", "torch_version", "torch_cuda", "extension", "build", "runtime",
                "kernels", "devices", "mismatches"):
        assert key in cap, f"report lacks {key!r}"
    assert cap["sinkattn_version"] == sinkattn.__version__
    assert cap["torch_version"] == torch.__version__ and cap["torch_cuda"] == torch.version.cuda
    assert set(cap["runtime"]) >= {"cuda_runtime", "cuda_driver"}
    assert isinstance(cap["kernels"], list) and isinstance(cap["devices"], list) and isinstance(cap["mismatches"], list)
    for m in cap["mismatches"]:
        assert m["problem"] and m["fix"]
    for d in cap["devices"]:
        assert set(d) >= {"index", "name", "capability", "paths"}
        assert set(d["paths"]) == set(ALL_FEATURES)
        for p in d["paths"].values():
            assert p["backend"] in ("sm90", "sm80", "reference") and isinstance(p["declined"], dict)


@EXT
def test_report_holds_build_and_kernels():
    cap = sinkattn.capabilities(devices=[])
    _check_structure(cap)
    assert cap["extension"] == {"loaded": True, "error": None}
    b = cap["build"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", b["nvcc_version"]), b
    assert re.fullmatch(r"\d+\.\d+\.\d+", b["cutlass_version"]) and b["cutlass_version"] == b["cutlass_version_header"]
    assert b["torch_version_at_build"] and b["requested_archs"]
    assert cap["kernels"] == [dict(k) for k in _ext._C.registry()]
    rt = _ext._C.runtime_info()
    assert cap["runtime"]["cuda_runtime"] == (f"{rt['cuda_runtime_version'] // 1000}."
                                              f"{rt['cuda_runtime_version'] % 1000 // 10}"
                                              if rt["cuda_runtime_version"] else None)
    text = render(cap)
    assert f"nvcc {b['nvcc_version']}" in text and f"CUTLASS {b['cutlass_version']}" in text
    assert b["requested_archs"] in text
    for k in cap["kernels"]:
        assert k["family"] in text and k["archs"] in text and k["dtype"] in text


def test_version_format():
    assert capability._fmt_version(13000) == "13.0"
    assert capability._fmt_version(12040) == "12.4"
    assert capability._fmt_version(12090) == "12.9"
    assert capability._fmt_version(0) is None


def test_report_without_gpu_says_reference_serves():
    cap = sinkattn.capabilities(devices=[])
    assert cap["devices"] == []
    text = render(cap)
    assert "GPUs: none visible" in text and "reference backend" in text


def test_report_json_subprocess():
    r = subprocess.run([sys.executable, "-m", "sinkattn.report", "--json"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cap = json.loads(r.stdout)
    _check_structure(cap)
    assert cap["extension"]["loaded"] == _ext.loaded()
    assert cap["kernels"] == [dict(k) for k in _ext.registry()]
    assert cap["build"] == (_ext.build_info() if _ext.loaded() else None)
    # text mode: the same facts for people
    r2 = subprocess.run([sys.executable, "-m", "sinkattn.report"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.startswith(f"sinkattn {sinkattn.__version__}") and "Compiled kernels:" in r2.stdout
    for k in cap["kernels"]:
        assert k["archs"] in r2.stdout


def test_console_script_installed():
    if not list(importlib.metadata.distributions(name="sinkattn")):
        pytest.skip("sinkattn is not pip-installed here (the suite runs on a source tree): no console script to check")
    eps = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "sinkattn-report"]
    assert eps and eps[0].value == "sinkattn.report:main", eps
    exe = shutil.which("sinkattn-report") or str(pathlib.Path(sys.executable).parent / "sinkattn-report")
    assert os.path.exists(exe), "console script sinkattn-report not found on PATH nor beside python"
    r = subprocess.run([exe, "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sinkattn_version"] == sinkattn.__version__


# ---- the registry is what the generator says this build compiled -------------------------------------------
def _requested_grid_candidates(build: dict):
    """Grids consistent with build_info: archs from the binary; head dims/dtypes/emulation from build_info when
    it records them, else every narrowing the env vars allow."""
    archs = [a for a in re.split(r"[;,]", build["requested_archs"]) if a]
    hs = [build["requested_headdims"]] if "requested_headdims" in build else [
        list(c) for n in range(1, 4) for c in itertools.combinations(gen.ALL_HEADDIMS, n)]
    ds = [build["requested_dtypes"]] if "requested_dtypes" in build else [
        list(c) for n in range(1, 3) for c in itertools.combinations(gen.ALL_DTYPES, n)]
    emus = [build["emulation"]] if "emulation" in build else [True, False]
    for h, d, e in itertools.product(hs, ds, emus):
        env = {"SINKATTN_CUDA_ARCHS": ";".join(archs),
               "SINKATTN_HEADDIMS": ",".join(map(str, h)) if not isinstance(h, str) else h,
               "SINKATTN_DTYPES": ",".join(d) if not isinstance(d, str) else d,
               "SINKATTN_EMULATION": "1" if e else "0"}
        for key, var in (("gpu_headdims", "SINKATTN_GPU_HEADDIMS"), ("gpu_dtypes", "SINKATTN_GPU_DTYPES")):
            if build.get(key):
                env[var] = build[key]
        yield env, gen.parse_grid(env)


@EXT
def test_registry_matches_generator():
    reg = _ext.registry()
    build = _ext.build_info()
    names = [k["name"] for k in reg]
    assert len(names) == len(set(names)), f"a kernel is registered twice: {names}"
    matches = [env for env, grid in _requested_grid_candidates(build)
               if sorted(n for u in gen.units(grid) for n in u.registered) == sorted(names)]
    assert matches, (f"no grid with requested_archs={build['requested_archs']!r} makes generate_kernels.units() "
                     f"equal to the registry {sorted(names)}")
    env = matches[0]
    grid = gen.parse_grid(env)
    fam_of = {n: u.family for u in gen.units(grid) for n in [u.name, *u.twins]}
    for k in reg:
        fam = fam_of[k["name"]]
        want = "host" if fam == "emu" else gen.arch_list_string(fam, grid.archs)
        assert k["archs"] == want, f"{k['name']}: registered archs {k['archs']!r}, the build rule gives {want!r}"
        assert k["op"] in ("merge", "fwd", "bwd", "fwd_fp8") and k["dtype"] in ("bf16", "fp16", "fp32")
    # __CUDA_ARCH_LIST__ of the common family's translation unit (90a reads 900)
    want_list = ",".join(str(int(re.sub(r"\D", "", r)) * 10) for _, r in gen.family_targets("common", grid.archs))
    assert build["cuda_arch_list"] == want_list
    # the generated sources on disk are the same set (generate() removes stale units), parts of a kernel included
    inst = ROOT / "csrc" / "instantiations"
    if inst.is_dir():
        on_disk = sorted(p.stem for p in inst.iterdir() if p.suffix in (".cu", ".cpp"))
        want_units = sorted(u.name for u in gen.translation_units(grid))
        assert on_disk == want_units, f"csrc/instantiations holds {on_disk}, the build's grid {want_units}"


@EXT
def test_build_info_records_whole_grid():
    b = _ext.build_info()
    assert {"requested_headdims", "requested_dtypes"} <= set(b)


# ---- serving paths on fake devices ---------------------------------------------------------------------------
BUILDS = {
    "current": None,
    "80;90a": (["80", "90a"], False),
    "80;90a+sm90": (["80", "90a"], True),
    "80": (["80"], False),
    "86": (["86"], False),
    "90a": (["90a"], False),
    "80;86;89;90a+sm90": (["80", "86", "89", "90a"], True),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_serving_paths_fake_devices(build, fake_build):
    if BUILDS[build] is None:
        if not _ext.loaded():
            pytest.skip("no compiled extension")
        registry = _ext.registry()
    else:
        registry = fake_registry(*BUILDS[build])
        fake_build(registry)
    cap = sinkattn.capabilities(devices=FAKE_DEVICES)
    _check_structure(cap)
    assert [d["capability"] for d in cap["devices"]] == ["8.0", "8.6", "8.9", "9.0", "7.5", "12.0"]
    text = render(cap)
    for dev, row in zip(FAKE_DEVICES, cap["devices"]):
        assert row["name"] == dev.name and row["sm_count"] == dev.sm_count
        assert f"GPU {dev.index}: {dev.name} (cc {dev.capability[0]}.{dev.capability[1]}" in text
        for feature in ALL_FEATURES:
            path = row["paths"][feature]
            want = expected_backend(feature, dev.capability, registry)
            assert path["backend"] == want, (f"build {build}, cc {dev.capability}, {feature}: serves "
                                             f"{path['backend']}, expected {want}; declined: {path['declined']}")
            problem = capability._problem(feature, dev.index)
            tried = list(dispatch.preferred_backends(dev.capability))
            if dev.capability[0] < 8:
                assert tried == [] and "cc >= 8.0" in path["declined"]["kernels"] and "7.5" in path["declined"]["kernels"]
                continue
            # every better backend tried and declined, with the reason why_not gives (a backend "auto" ranks lower
            # for this problem, dispatch.preference_note, is listed first; when none serves, in the order tried)
            stop = tried.index(want) if want in tried else len(tried)
            if want == "reference":
                tried = list(dispatch.preferred_backends(dev.capability, problem))
            assert list(path["declined"]) == tried[:stop]
            for b, reason in path["declined"].items():
                assert reason == (dispatch.why_not(b, problem, capability=dev.capability)
                                  or dispatch.preference_note(dev.capability, problem).get(b))
                assert reason and reason in text
                if feature == "backward":
                    assert "backward" in reason
                elif feature == "decode":
                    assert "decode" in reason
                elif b == "sm90" and dev.capability != (9, 0):
                    assert "9.0" in reason
            if want != "reference":
                assert dispatch.why_not(want, problem, capability=dev.capability) is None
        # a GPU whose sink features run on the reference backend, or only through PTX JIT, is flagged
        ref = row["paths"]["learnable_sinks"]["backend"] == "reference"
        jit = row["paths"]["learnable_sinks"]["backend"] == "sm80" and not native(registry, dev.capability)
        flagged = [m for m in cap["mismatches"] if m["problem"].startswith(f"GPU {dev.index} ")]
        assert bool(flagged) == (ref or jit), (build, dev, flagged)


def _without_ptx(registry):
    return tuple(dict(k, archs=",".join(a for a in k["archs"].split(",") if not a.startswith("compute_")))
                 for k in registry)


def test_paths_reasons_name_the_device_arch(fake_build):
    fake_build(_without_ptx(fake_registry(["90a"])))  # sm80 family compiled as sm_90 only, no PTX
    cap = sinkattn.capabilities(devices=[FAKE_DEVICES[1]])
    reason = cap["devices"][0]["paths"]["learnable_sinks"]["declined"]["sm80"]
    assert "sm_90" in reason and "8.6" in reason and "SINKATTN_CUDA_ARCHS=80" in reason
    fake_build(_without_ptx(fake_registry(["80"])))
    cap = sinkattn.capabilities(devices=[FAKE_DEVICES[3]])
    p = cap["devices"][0]["paths"]["learnable_sinks"]
    assert p["backend"] == "reference"
    assert "cc 9.0" in p["declined"]["sm80"] and "SINKATTN_CUDA_ARCHS=90a" in p["declined"]["sm80"]
    assert "sm90" in p["declined"]


def test_sass_runs_on_table():
    table = [("sm_80", (8, 0), True), ("sm_80", (8, 6), True), ("sm_80", (8, 9), True), ("sm_86", (8, 0), False),
             ("sm_86", (8, 9), True), ("sm_80", (9, 0), False), ("sm_90", (9, 0), True), ("sm_90a", (9, 0), True),
             ("sm_90", (12, 0), False), ("sm_90a", (10, 0), False), ("sm_80", (12, 0), False),
             ("sm_100a", (10, 0), True), ("sm_120", (12, 0), True), ("sm_80", (7, 5), False),
             ("compute_80", (8, 0), False), ("host", (8, 0), False)]
    for arch, cc, want in table:
        assert registry.sass_runs_on(arch, cc) is want, (arch, cc)
        assert sass_runs(arch, cc) is want, (arch, cc)
    for arch, cc, want in [("compute_80", (8, 0), True), ("compute_80", (12, 0), True), ("compute_86", (8, 0), False),
                           ("compute_80", (7, 5), False), ("sm_80", (9, 0), False)]:
        assert registry.how_it_runs(arch, cc) is not None if want else registry.how_it_runs(arch, cc) is None
        assert runs_on(arch, cc) is want


def test_preferred_backends():
    assert dispatch.preferred_backends((9, 0)) == ("sm90", "sm80")
    # Short forward windows go to sm80 first on cc 9.0 (measured faster there); everything else to sm90 first.
    short = capability._problem("learnable_sinks", 0)
    assert short.mask.window_left == 127 and dispatch.preferred_backends((9, 0), short) == ("sm80", "sm90")
    assert "sm80" in dispatch.preference_note((9, 0), short)["sm90"]
    p = capability._problem("sink_tokens", 0)
    assert dispatch.preferred_backends((9, 0), p) == ("sm90", "sm80") and not dispatch.preference_note((9, 0), p)
    # The sm90 forward over KV caches ranks below the sm80 kernels (not run on a GPU yet: SM90_CACHE_VALIDATED).
    decode = capability._problem("decode", 0)
    assert dispatch.preferred_backends((9, 0), decode) == ("sm80", "sm90")
    assert "backend='sm90'" in dispatch.preference_note((9, 0), decode)["sm90"]
    # The sm90 backward waits for its first GPU run (dispatch.SM90_BWD_VALIDATED) below the sm80 one.
    bwd = capability._problem("backward", 0)
    if dispatch.SM90_BWD_VALIDATED:
        assert dispatch.preferred_backends((9, 0), bwd) == ("sm90", "sm80") and not dispatch.preference_note((9, 0), bwd)
    else:
        assert dispatch.preferred_backends((9, 0), bwd) == ("sm80", "sm90")
        assert "not yet run on a GPU" in dispatch.preference_note((9, 0), bwd)["sm90"]
    assert dispatch.preferred_backends((8, 0), short) == ("sm80",) and not dispatch.preference_note((8, 0), short)
    for cc in ((8, 0), (8, 6), (8, 9)):
        assert dispatch.preferred_backends(cc) == ("sm80",)
    assert dispatch.preferred_backends((7, 5)) == ()
    assert dispatch.preferred_backends(None) == ()


# ---- advice in the report must be actionable -------------------------------------------------------------------
def _advised_archs(reason: str):
    m = re.search(r"SINKATTN_CUDA_ARCHS=(\w+)", reason)
    return m.group(1) if m else None


@pytest.mark.parametrize("cc,build", [((8, 0), ["90a"]), ((8, 6), ["90a"]), ((8, 9), ["90a"]), ((8, 0), ["86"]),
                                      ((9, 0), ["80"]), ((12, 0), ["80", "90a"]), ((10, 0), ["80", "90a"])])
def test_rebuild_arch_advice_is_actionable(cc, build, fake_build):
    # Every sm80 build embeds compute_80 PTX, so such a GPU is served through JIT; the report flags it with
    # the rebuild that gives native code, and that rebuild must be one the build accepts and that helps.
    fake_build(fake_registry(build))
    dev = DeviceInfo(0, "GPU", cc)
    cap = sinkattn.capabilities(devices=[dev])
    path = cap["devices"][0]["paths"]["learnable_sinks"]
    assert path["backend"] == "sm80" and "PTX" in path["kernel"], path
    flagged = [m for m in cap["mismatches"] if m["problem"].startswith("GPU 0 ")]
    assert flagged, cap["mismatches"]
    advised = _advised_archs(flagged[0]["fix"])
    assert advised, f"no SINKATTN_CUDA_ARCHS advice in {flagged[0]!r}"
    try:
        grid = gen.parse_grid({"SINKATTN_CUDA_ARCHS": advised})
    except SystemExit as e:
        pytest.fail(f"cc {cc}: the report advises SINKATTN_CUDA_ARCHS={advised}, which the build rejects: {e.code}")
    assert native(fake_registry(grid.archs), cc), f"rebuilding with {advised} gives no native code for cc {cc}"


@EXT
def test_rebuild_grid_advice_is_actionable():
    build = _ext.build_info()
    for dev in FAKE_DEVICES:
        row = sinkattn.capabilities(devices=[dev])["devices"][0]
        for feature in FWD_FEATURES:
            for b, reason in row["paths"][feature]["declined"].items():
                m = re.search(r"SINKATTN_HEADDIMS including (\d+) and SINKATTN_DTYPES including (\w+)", reason)
                if not m:
                    continue
                grid = gen.parse_grid({"SINKATTN_CUDA_ARCHS": build["requested_archs"], "SINKATTN_HEADDIMS": m.group(1),
                                       "SINKATTN_DTYPES": m.group(2)})
                family = registry.BACKEND_FAMILY[b]
                tag = f'"{family}", "fwd", {m.group(1)}, "{m.group(2)}"'
                assert any(tag in u.text for u in gen.units(grid)), (
                    f"cc {dev.capability} {feature}: advice {reason!r} cannot help: a build with it generates no "
                    f"{family} fwd hdim{m.group(1)} {m.group(2)} kernel")


# ---- mismatches ------------------------------------------------------------------------------------------------
@EXT
def test_mismatch_flags(monkeypatch):
    b = _ext.build_info()
    nvcc_major = int(b["nvcc_version"].split(".")[0])
    # consistent: none of the version mismatches
    monkeypatch.setattr(torch.version, "cuda", f"{nvcc_major}.0")
    monkeypatch.setattr(torch, "__version__", b["torch_version_at_build"])
    monkeypatch.setattr(capability, "_runtime", lambda: {"cuda_runtime": f"{nvcc_major}.0", "cuda_driver": f"{nvcc_major}.2"})
    cap = sinkattn.capabilities(devices=[FAKE_DEVICES[3]])
    assert not [m for m in cap["mismatches"] if "nvcc" in m["problem"] or "torch" in m["problem"]], cap["mismatches"]
    # torch built for another CUDA major
    monkeypatch.setattr(torch.version, "cuda", f"{nvcc_major - 1}.8")
    cap = sinkattn.capabilities(devices=[])
    m = [m for m in cap["mismatches"] if "nvcc" in m["problem"] and "torch uses CUDA" in m["problem"]]
    assert m and f"CUDA {nvcc_major - 1}.x" in m[0]["fix"]
    monkeypatch.setattr(torch.version, "cuda", f"{nvcc_major}.0")
    # torch upgraded since the build
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    cap = sinkattn.capabilities(devices=[])
    m = [m for m in cap["mismatches"] if "9.9.9" in m["problem"]]
    assert m and "rebuild" in m[0]["fix"]
    monkeypatch.setattr(torch, "__version__", b["torch_version_at_build"])
    # a driver older than the toolkit, with a GPU present
    monkeypatch.setattr(capability, "_runtime", lambda: {"cuda_runtime": f"{nvcc_major}.0", "cuda_driver": f"{nvcc_major - 1}.4"})
    cap = sinkattn.capabilities(devices=[FAKE_DEVICES[0]])
    m = [m for m in cap["mismatches"] if "driver" in m["problem"]]
    assert m and "driver" in m[0]["fix"] and f"{nvcc_major}.x" in m[0]["fix"]
    text = render(cap)
    assert "Problems found:" in text and m[0]["problem"] in text and m[0]["fix"] in text
    # ... but no driver complaint without a GPU
    cap = sinkattn.capabilities(devices=[])
    assert not [m for m in cap["mismatches"] if "driver" in m["problem"]]


# ---- a CPU-only build: the extension is missing ---------------------------------------------------------------
# Prepended to the scripts below that model one layout: this machine's own sinkattn installs (an editable one,
# whose finder would also serve sinkattn.* names) are hidden, so the package imported is the only one.
HIDE_INSTALLS = r"""
import importlib.metadata, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
_distributions = importlib.metadata.distributions
importlib.metadata.distributions = lambda **kw: iter(()) if kw.get("name") == "sinkattn" else _distributions(**kw)
"""

MISSING_EXT_SCRIPT = HIDE_INSTALLS + r"""
import json, sys
sys.modules["sinkattn._C"] = None          # what a pure-Python build (SINKATTN_SKIP_CUDA=1) looks like
import torch
import sinkattn
from sinkattn import _ext, capability
from sinkattn._device import DeviceInfo
from sinkattn.report import render, main
assert not _ext.loaded() and _ext._C is None
try:
    _ext.require()
    raise SystemExit("require() did not raise")
except sinkattn.SinkattnRuntimeError as e:
    require_msg = str(e)
cap = sinkattn.capabilities(devices=[DeviceInfo(0, "NVIDIA A100", (8, 0)), DeviceInfo(1, "NVIDIA H200", (9, 0))])
q = torch.randn(1, 5, 2, 16)
out = sinkattn.flash_attn_with_sinks(q, q, q, torch.zeros(2))
m_out, m_lse = sinkattn.merge_attn_states(q, torch.zeros(1, 2, 5), q, torch.zeros(1, 2, 5))
print(json.dumps({"import_error": _ext.IMPORT_ERROR, "require": require_msg, "cap": cap, "text": render(cap),
                  "out_shape": list(out.shape), "merge_ok": bool(torch.allclose(m_out, q))}))
"""


def test_missing_extension_subprocess():
    r = subprocess.run([sys.executable, "-c", MISSING_EXT_SCRIPT], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    err = res["import_error"]
    assert err and "sinkattn._C" in err
    assert err in res["require"] and "reference" in res["require"]
    cap = res["cap"]
    _check_structure(cap)
    assert cap["extension"] == {"loaded": False, "error": err}
    assert cap["build"] is None and cap["kernels"] == []
    assert cap["runtime"] == {"cuda_runtime": None, "cuda_driver": None}
    for d in cap["devices"]:
        for feature, path in d["paths"].items():
            assert path["backend"] == "reference", (d["capability"], feature)
            assert path["declined"] and all(err in r for r in path["declined"].values())
    assert any(err in m["problem"] and "reference" in m["problem"] for m in cap["mismatches"])
    text = res["text"]
    assert "no compiled extension" in text and err in text and "reference backend" in text
    assert "(none)" in text
    assert res["out_shape"] == [1, 5, 2, 16] and res["merge_ok"]
    # the module entry point too
    script = "import sys; sys.modules['sinkattn._C'] = None\nfrom sinkattn.report import main\nsys.exit(main(['--json']))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    cap = json.loads(r.stdout)
    assert cap["extension"]["loaded"] is False and "sinkattn._C" in cap["extension"]["error"]


# ---- a build for the GPUs present, and what a wider one would add ----------------------------------------
def test_wider_build_lists_what_each_missing_arch_adds():
    assert capability.wider_build(None) == {}
    full = {"requested_archs": ";".join(capability.ARCH_ADDS)}
    assert capability.wider_build(full) == {}
    hopper_only = capability.wider_build({"requested_archs": "90a"})
    assert set(hopper_only) == {"80", "86", "89", "100", "120"}
    assert "cc 8.0" in hopper_only["80"] and "A100" in hopper_only["80"]
    assert "sm90" in capability.wider_build({"requested_archs": "80"})["90a"]


def test_report_names_a_native_build_and_the_wider_one(monkeypatch):
    cap = sinkattn.capabilities(devices=[])
    cap["extension"] = {"loaded": True, "error": None}
    cap["build"] = {"nvcc_version": "13.0.88", "cutlass_version": "4.2.0", "torch_version_at_build": "2.14.1",
                    "requested_archs": "90a", "native_gpus": "NVIDIA H200 (cc 9.0: 90a)"}
    cap["wider_build"] = capability.wider_build(cap["build"])
    text = render(cap)
    assert "built for the GPUs present (SINKATTN_CUDA_ARCHS=native): NVIDIA H200 (cc 9.0: 90a)" in text
    assert "a wider build (SINKATTN_CUDA_ARCHS) would add:" in text and "    80: native sm_80 code" in text
    cap["build"]["native_gpus"] = ""
    assert "SINKATTN_CUDA_ARCHS=native" not in render(cap)


@EXT
def test_this_build_reports_its_wider_build():
    cap = sinkattn.capabilities(devices=[])
    have = set(cap["build"]["requested_archs"].split(";"))
    assert set(cap["wider_build"]) == set(capability.ARCH_ADDS) - have


# ---- the emulated kernels are named only where the build holds them --------------------------------------------
def test_report_names_the_emulated_backends_only_in_builds_that_hold_them():
    cap = sinkattn.capabilities(devices=[])
    emulated = any(k["family"] == "sm80-emulated" for k in _ext.registry())
    assert ("sm80-emulated" in render(cap)) == emulated, (emulated, render(cap))
    kernel = dict(name="fwd_emu_hdim64_bf16", family="sm80-emulated", op="fwd", headdim=64, dtype="bf16",
                  features="sinks", archs="host")
    merge = dict(name="merge_bf16", family="common", op="merge", headdim=0, dtype="bf16", features="sinks",
                 archs="sm_80,compute_80")
    assert "backend='sm80-emulated'" in render(dict(cap, kernels=[merge, kernel]))
    assert "sm90-emulated" not in render(dict(cap, kernels=[merge, kernel]))
    kernel90 = dict(kernel, name="fwd_emu90_hdim64_bf16", family="sm90-emulated")
    both = render(dict(cap, kernels=[merge, kernel, kernel90]))
    assert "backend='sm80-emulated' / backend='sm90-emulated' run the sm80 / sm90 kernels" in both, both
    text = render(dict(cap, kernels=[merge]))
    assert "sm80-emulated" not in text and "sm90-emulated" not in text
    assert "GPUs: none visible. CPU tensors are served by the reference backend." in text


# ---- a source tree that shadows an installed build -------------------------------------------------------------
def _package_copy(dest: pathlib.Path, with_ext: bool) -> pathlib.Path:
    """A copy of the sinkattn package at dest/sinkattn; with_ext adds a file named as this Python's compiled
    sinkattn._C (never imported by these tests: the copy with it is the one hidden)."""
    shutil.copytree(pathlib.Path(sinkattn.__file__).parent, dest / "sinkattn",  # the package under test
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    if with_ext:
        (dest / "sinkattn" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    return dest / "sinkattn"


def _clone(tmp_path: pathlib.Path) -> pathlib.Path:
    """A clone after a non-editable `pip install .`: setup.py and csrc/ beside a sinkattn/ without _C."""
    clone = tmp_path / "clone"
    (clone / "csrc").mkdir(parents=True)
    (clone / "setup.py").write_text("# the clone's setup.py\n")
    _package_copy(clone, with_ext=False)
    return clone


SHADOW_SCRIPT = HIDE_INSTALLS + r"""
import json
import sinkattn
from sinkattn import _ext
from sinkattn.report import render
try:
    _ext.require()
    raise SystemExit("require() did not raise")
except sinkattn.SinkattnRuntimeError as e:
    require_msg = str(e)
cap = sinkattn.capabilities(devices=[])
print(json.dumps({"file": sinkattn.__file__, "require": require_msg, "cap": cap, "text": render(cap)}))
"""


def _run_in(cwd: pathlib.Path, pythonpath: list[pathlib.Path]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    r = subprocess.run([sys.executable, "-c", SHADOW_SCRIPT], capture_output=True, text=True, timeout=180, cwd=cwd,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_report_detects_a_source_tree_shadowing_the_installed_build(tmp_path):
    clone = _clone(tmp_path)
    installed = _package_copy(tmp_path / "site-packages", with_ext=True).resolve()
    res = _run_in(clone, [installed.parent])  # python run in the clone: its sinkattn/ comes first on sys.path
    assert pathlib.Path(res["file"]).resolve() == (clone / "sinkattn" / "__init__.py").resolve()
    cap, text = res["cap"], res["text"]
    err = cap["extension"]["error"]
    assert cap["extension"]["loaded"] is False and "pure-Python build" not in err and "pure-Python build" not in text
    assert "source tree" in err and str(installed) in err and "shadows" in err
    assert cap["package"]["source_tree"] is True
    assert {"path": str(installed), "has_extension": True} in cap["package"]["shadows"]
    [m] = cap["mismatches"]
    assert str(installed) in m["problem"] and "reference backend" in m["problem"]
    assert "cd elsewhere" in m["fix"] and "pip install --no-build-isolation -e ." in m["fix"]
    assert m["problem"] in text and m["fix"] in text
    # a kernel request says the same, not "build it"
    assert err in res["require"] and "Build it with" not in res["require"]


def test_report_without_an_installed_build_is_a_pure_python_build(tmp_path):
    clone = _clone(tmp_path)
    other = _package_copy(tmp_path / "elsewhere", with_ext=False).resolve()  # another copy, no extension either
    res = _run_in(clone, [other.parent])
    cap = res["cap"]
    assert "pure-Python build" in cap["extension"]["error"] and "shadows" not in cap["extension"]["error"]
    assert {"path": str(other), "has_extension": False} in cap["package"]["shadows"]
    assert "Build it with" in res["require"]
    assert not [m for m in cap["mismatches"] if "hides" in m["problem"]]


def test_shadowed_finds_editable_and_installed_distributions(tmp_path):
    clone = _clone(tmp_path)
    # an editable install of another clone: its dist-info points at that clone through direct_url.json
    other_clone = tmp_path / "other-clone"
    other = _package_copy(other_clone, with_ext=True).resolve()
    site = tmp_path / "site"
    info = site / "sinkattn-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sinkattn\nVersion: 0.1.0\n")
    (info / "direct_url.json").write_text(json.dumps({"url": other_clone.resolve().as_uri(),
                                                      "dir_info": {"editable": True}}))
    found = _ext.shadowed(str(clone / "sinkattn"), search_path=[str(clone), str(site)])
    assert found == [{"path": str(other), "has_extension": True}]
    note = _ext.shadowing(str(clone / "sinkattn"), found)
    assert note["installed"] == str(other) and note["source_tree"] and "-e ." in note["fix"]
    # the imported package itself is never reported, and a folder without a package is not one
    assert _ext.shadowed(str(clone / "sinkattn"), search_path=[str(clone), str(tmp_path)]) == []
    assert _ext.shadowing(str(clone / "sinkattn"), []) is None


FOREIGN_EXT_SCRIPT = r"""
import importlib.abc, importlib.machinery, json, sys
called = []

class Loader(importlib.abc.Loader):
    def create_module(self, spec):
        called.append(spec.origin)
        raise ImportError("the other copy's _C was loaded")

    def exec_module(self, module):
        pass

class Finder(importlib.abc.MetaPathFinder):  # what setuptools' editable finder does for another clone
    def find_spec(self, name, path, target=None):
        if name == "sinkattn._C":
            return importlib.machinery.ModuleSpec(name, Loader(), origin="/elsewhere/sinkattn/_C.so")

sys.meta_path.insert(0, Finder())
import sinkattn
from sinkattn import _ext
print(json.dumps({"file": sinkattn.__file__, "called": called, "loaded": _ext.loaded(), "error": _ext.IMPORT_ERROR}))
"""


def test_a_compiled_extension_of_another_copy_is_not_loaded(tmp_path):
    """With an editable install present, a pure-Python copy earlier on sys.path loaded the clone's sinkattn._C
    (built from other sources) through setuptools' editable finder."""
    clone = _clone(tmp_path)
    r = subprocess.run([sys.executable, "-c", FOREIGN_EXT_SCRIPT], capture_output=True, text=True, timeout=180,
                       cwd=clone)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert pathlib.Path(res["file"]).resolve().parent == (clone / "sinkattn").resolve()
    assert res["called"] == [] and res["loaded"] is False
    assert "/elsewhere/sinkattn/_C.so" in res["error"] or "shadows the build installed" in res["error"], res


# ---- the commands around the report: make help / make report / make build-all, setup.py's messages ---------------
def _fake_python(tmp_path: pathlib.Path, import_ok: bool) -> tuple[pathlib.Path, pathlib.Path]:
    """A stand-in for $(PYTHON) that logs each call and runs nothing; `import sinkattn` succeeds or fails."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "fake-python"
    exe.write_text("#!/bin/sh\n"
                   f"printf '%s\\n' \"$*\" >> {log}\n"
                   f"case \"$*\" in *'import sinkattn'*) exit {0 if import_ok else 1};; esac\n"
                   "exit 0\n")
    exe.chmod(0o755)
    return exe, log


def _make(*args, **env) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    quiet = [] if "-w" in args else ["--no-print-directory"]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")} | env
    return subprocess.run(["make", *quiet, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def _phony_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    return [t for t in phony if t != "FORCE"]


def test_bare_make_is_help_and_installs_nothing(tmp_path):
    exe, log = _fake_python(tmp_path, import_ok=True)
    dry = _make("-n", f"PYTHON={exe}")
    assert dry.returncode == 0, dry.stderr
    assert "pip" not in dry.stdout and "install" not in dry.stdout.replace("installs", ""), dry.stdout
    r = _make(f"PYTHON={exe}")
    assert r.returncode == 0, r.stderr
    assert not log.exists(), log.read_text()  # $(PYTHON) never ran
    listed = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.startswith("  ")}
    assert list(listed)[0] == "help"
    for target in _phony_targets():  # every target, one line each, with what it does
        assert target in listed and len(listed[target].split()) > 2, (target, r.stdout)
    assert _make("help").stdout == _make().stdout


def test_make_report_builds_only_when_sinkattn_does_not_import(tmp_path):
    exe, log = _fake_python(tmp_path, import_ok=True)
    r = _make("report", f"PYTHON={exe}")
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls == ["-c import sinkattn", "-m sinkattn.report"], calls
    # a dry run (make still runs the line holding $(MAKE), so the import check is real): a sub-make for the build
    # starts only when sinkattn does not import
    r = _make("-n", "-w", "report", f"PYTHON={exe}")
    assert r.returncode == 0 and "make[1]" not in r.stdout, r.stdout
    second = tmp_path / "second"
    second.mkdir()
    exe, log = _fake_python(second, import_ok=False)
    r = _make("-n", "-w", "report", f"PYTHON={exe}")
    assert "make[1]: Entering directory" in r.stdout and r.stdout.count(f"{exe} -m sinkattn.report") == 1, r.stdout


def test_make_build_all_uses_the_repositorys_sass_report_and_fails_first_without_it(tmp_path):
    # The SASS report is the repository's own: build-all defaults to it and names it when a given path
    # is wrong, before building anything.
    assert (ROOT / "tools" / "sass_report.py").is_file()
    r = _make("-n", "build-all")
    assert r.returncode == 0 and "tools/sass_report.py sinkattn/_C" in r.stdout, r.stdout
    exe, log = _fake_python(tmp_path, import_ok=True)
    r = _make("build-all", f"PYTHON={exe}", SASS_REPORT=str(tmp_path / "absent.py"))
    assert r.returncode != 0
    assert str(tmp_path / "absent.py") in r.stderr and "tools/sass_report.py" in r.stderr, r.stderr
    assert "shared/tools" not in r.stderr  # nothing outside the repository
    assert not log.exists(), log.read_text()  # nothing built or installed before failing


def test_setup_messages_have_no_unformatted_placeholders():
    """setup.py's CUDA-mismatch message printed a literal {major} (an f missing on one part of the string)."""
    import ast
    tree = ast.parse((ROOT / "setup.py").read_text())
    in_fstring = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arg) for a in [n]}
    bad = [(node.lineno, node.value) for node in ast.walk(tree)
           if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring
           and any(m in names for m in re.findall(r"(?<!\{)\{(\w+)[^}]*\}(?!\})", node.value))]
    assert not bad, f"plain strings in setup.py with a {{name}} that an f-string would fill: {bad}"
