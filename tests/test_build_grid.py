"""The instantiation grid (csrc/generate_kernels.py): env narrowing, gencode flags per family, units.

Pure Python: nothing here compiles. `parse_grid(env)` takes the environment as a mapping, so each test
passes its own and never touches os.environ.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_gen():
    spec = importlib.util.spec_from_file_location("sinkattn_generate_kernels", ROOT / "csrc" / "generate_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


gen = _load_gen()


def _exit_message(env) -> str:
    with pytest.raises(SystemExit) as e:
        gen.parse_grid(env)
    msg = str(e.value.code if e.value.code is not None else "")
    assert msg and not msg.isdigit(), f"parse_grid({env}) exits without a message: {msg!r}"
    return msg


# ---- parse_grid ---------------------------------------------------------------------------------------
def test_defaults():
    g = gen.parse_grid({})
    assert g.archs == ["80", "90a"]
    assert g.headdims == [64, 128, 256]
    assert g.dtypes == ["bf16", "fp16"]
    # the host-emulated kernels are a test facility: `make test` asks for them, a plain install does not
    assert g.emulation is False and g.native == []


@pytest.mark.parametrize("value,want", [
    ("80", ["80"]), ("90a", ["90a"]), ("80;90a", ["80", "90a"]), ("80,86", ["80", "86"]),
    (" 80 ; 89 ", ["80", "89"]), ("80;86;89;90a", ["80", "86", "89", "90a"]),
])
def test_archs_narrowing(value, want):
    assert gen.parse_grid({"SINKATTN_CUDA_ARCHS": value}).archs == want


@pytest.mark.parametrize("value,want", [("128", [128]), ("256,64", [64, 256]), ("64;64", [64]), (" 128 ", [128])])
def test_headdims_narrowing(value, want):
    g = gen.parse_grid({"SINKATTN_HEADDIMS": value})
    assert g.headdims == want and g.archs == ["80", "90a"] and g.dtypes == ["bf16", "fp16"]


@pytest.mark.parametrize("value,want", [("bf16", ["bf16"]), ("fp16", ["fp16"]), ("fp16,bf16", ["bf16", "fp16"])])
def test_dtypes_narrowing(value, want):
    g = gen.parse_grid({"SINKATTN_DTYPES": value})
    assert g.dtypes == want and g.headdims == [64, 128, 256]


def test_gpu_subset_narrows_the_gpu_units_only():
    """SINKATTN_GPU_HEADDIMS / _DTYPES (CI's compile check): the GPU units at the subset, the emulated units at the
    whole grid; a value outside the grid is refused, naming the knob."""
    env = {"SINKATTN_EMULATION": "1", "SINKATTN_CUDA_ARCHS": "80;90a"}
    whole = gen.units(gen.parse_grid(env))
    ci = gen.units(gen.parse_grid({**env, "SINKATTN_GPU_HEADDIMS": "256,64", "SINKATTN_GPU_DTYPES": "bf16"}))
    assert sorted(u.name for u in ci if u.family == "emu") == sorted(u.name for u in whole if u.family == "emu")
    gpu = [u.name for u in ci if u.family != "emu"]
    assert gpu and all("fp16" not in n and "hdim128" not in n for n in gpu), gpu
    assert set(gpu) < {u.name for u in whole if u.family != "emu"}
    assert {"fwd_sm80_hdim256_bf16", "fwd_sm90_hdim64_bf16", "bwd_sm80_hdim64_bf16", "merge_bf16"} <= set(gpu)
    assert "merge_fp16" not in gpu and "fwd_emu_hdim128_fp16" in {u.name for u in ci}
    g = gen.parse_grid({"SINKATTN_HEADDIMS": "64,128"})
    assert g.gpu_headdims_only is None and g.headdims_of("sm80") == [64, 128]
    assert "SINKATTN_GPU_HEADDIMS" in _exit_message({"SINKATTN_HEADDIMS": "64", "SINKATTN_GPU_HEADDIMS": "128"})
    assert "SINKATTN_GPU_DTYPES" in _exit_message({"SINKATTN_DTYPES": "bf16", "SINKATTN_GPU_DTYPES": "fp16"})


def test_emulation_switch():
    assert gen.parse_grid({"SINKATTN_EMULATION": "0"}).emulation is False
    assert gen.parse_grid({"SINKATTN_EMULATION": "1"}).emulation is True


def test_diagnostic_switch_off_by_default_and_units_unchanged():
    """SINKATTN_DIAGNOSTIC is a compile define only (setup.py adds -DSINKATTN_DIAGNOSTIC=1 to the CUDA units): off by
    default, a bad value refused, and the unit list the same either way."""
    assert gen.parse_grid({}).diagnostic is False
    on = gen.parse_grid({"SINKATTN_DIAGNOSTIC": "1"})
    assert on.diagnostic is True
    assert [u.name for u in gen.units(on)] == [u.name for u in gen.units(gen.parse_grid({}))]
    with pytest.raises(SystemExit, match="SINKATTN_DIAGNOSTIC"):
        gen.parse_grid({"SINKATTN_DIAGNOSTIC": "maybe"})


# The sm90 seam (csrc/sm90/pipeline.cuh: the protocol vocabulary; sm90/prims_gpu.cuh: GpuPrims, the hardware): the
# kernel bodies reach TMA, mbarriers, named barriers, wgmma, setmaxnreg, the thread and block indices, atomics and
# inline asm only through their `Prims` parameter, so that a host implementation (emu/sm90_prims.h) can run the same
# bodies, and the diagnostic build bounds every mbarrier wait (GpuPrims::wait). What counts as raw, by kind:
SM90_RAW = {
    "inline asm": r"\basm\b",
    "CUTLASS arch (mbarriers, named barriers, proxy fences, setmaxnreg)":
        r"cutlass::arch::|\bCluster(Transaction)?Barrier\b|\bNamedBarrier::(sync|arrive)|\bwarpgroup_reg_(alloc|dealloc)\b",
    "TMA": r"\bSM90_TMA_\w+|\bmake_tma_copy\b|\bprefetch_tma_descriptor\b|\.with\(",
    "wgmma": r"\bwarpgroup_(arrive|commit_batch|wait|fence_operand)\b|(?<![\w:.])gemm\s*\(",
    "thread and block indices": r"\b(threadIdx|blockIdx|gridDim|blockDim)\b",
    "CUDA intrinsics": r"\b(__syncthreads|__syncwarp|__shfl\w*|__nanosleep|__threadfence\w*|atomic[A-Z]\w*|__trap|clock64)\b",
    "shared-window addresses": r"\bcast_smem_ptr_to_uint\b|\b__cvta_generic_to_shared\b",
}
SM90_SEAM_IMPL = "prims_gpu.cuh"


def _code_lines(text: str):
    """(line number, code) with // and /* */ comments removed (string literals are kept as they are: none of the
    sm90 files outside the seam has one with a comment marker)."""
    import re
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for i, line in enumerate(text.splitlines()):
        yield i + 1, line.split("//", 1)[0]


def _raw_uses(name: str, text: str):
    import re
    return [(f"{name}:{n}", kind) for n, code in _code_lines(text)
            for kind, pat in SM90_RAW.items() if re.search(pat, code)]


def _sm90_files():
    sm90 = pathlib.Path(gen.__file__).parent / "sm90"
    files = sorted(p for p in sm90.iterdir() if p.suffix in (".cuh", ".h"))
    assert {"pipeline.cuh", SM90_SEAM_IMPL, "fwd_kernel.cuh", "bwd_kernel.cuh"} <= {p.name for p in files}
    return files


def test_sm90_hardware_primitives_only_in_the_seam():
    """No sm90 file but prims_gpu.cuh issues a raw primitive; the kernels take them from Prims."""
    raw = [u for p in _sm90_files() if p.name != SM90_SEAM_IMPL for u in _raw_uses(p.name, p.read_text())]
    assert raw == [], f"raw hardware primitives outside sm90/{SM90_SEAM_IMPL} (go through Prims / GpuPrims): {raw}"


def test_sm90_seam_patterns_are_live():
    """The check above can fail: each kind is found in the GPU implementation itself, and a planted raw use of each
    kind (as the kernels wrote them before the seam) is flagged, while the seam's calls are not."""
    impl = next(p for p in _sm90_files() if p.name == SM90_SEAM_IMPL).read_text()
    found = {kind for _, kind in _raw_uses(SM90_SEAM_IMPL, impl)}
    assert found == set(SM90_RAW), set(SM90_RAW) - found
    planted = {
        "inline asm": 'asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));',
        "CUTLASS arch (mbarriers, named barriers, proxy fences, setmaxnreg)":
            "EmptyBarrier::arrive(&ss.k_empty[st]); cutlass::arch::fence_view_async_shared();",
        "TMA": "copy(tma.k.with(ss.k_full[st]), tKgK(_, n), tKsK(_, st));",
        "wgmma": "warpgroup_wait<0>();",
        "thread and block indices": "if (threadIdx.x < 128) {",
        "CUDA intrinsics": "while (atomicAdd(sem, 0) != turn) __nanosleep(32);",
        "shared-window addresses": "uint32_t const a = cast_smem_ptr_to_uint(ss.ds);",
    }
    assert set(planted) == set(SM90_RAW)
    for kind, line in planted.items():
        assert kind in {k for _, k in _raw_uses("planted", line)}, kind
    seam_calls = ("Prims::template wgmma<true>(mma_s, a, b, acc); Prims::template wgmma_wait<1>();"
                  " Prims::fence_operand(acc); wait_full<Prims>(ss.k_full, kv, BarrierId::kKFull);"
                  " Prims::tma_load(tma.k, ss.k_full[st], src, dst);"
                  " Prims::named_sync(256, id_of(NamedBarrier::kBwdDs)); // a comment: asm threadIdx.x gemm(")
    assert _raw_uses("seam", seam_calls) == []


def test_sm90_kernel_bodies_take_the_seam_as_a_parameter():
    """The bodies name GpuPrims only where the __global__ wrapper picks it (fwd_cta / bwd_cta), so a host
    implementation can take its place; every mbarrier wait is one of the seam's (the diagnostic build bounds
    GpuPrims::wait), at least the 14 the two kernels have."""
    import re
    bodies = [p for p in _sm90_files() if p.name != SM90_SEAM_IMPL and not p.name.endswith("_launch.cuh")
              and not p.name.endswith("_traits.h")]
    named = [f"{p.name}:{n}" for p in bodies for n, code in _code_lines(p.read_text())
             if "GpuPrims" in code and not re.search(r"\b(fwd|bwd)_cta<Kt, GpuPrims", code)]
    assert named == [], f"kernel code naming GpuPrims instead of its Prims parameter: {named}"
    kernels = [p.read_text() for p in bodies if p.name.endswith("_kernel.cuh")]
    waits = sum(len(re.findall(r"\bwait_(full|empty)<Prims>\(|\bPrims::wait\(", k)) for k in kernels)
    assert waits >= 14, waits


@pytest.mark.parametrize("env,names", [
    ({"SINKATTN_CUDA_ARCHS": "90"}, ["SINKATTN_CUDA_ARCHS", "'90'", "90a"]),
    ({"SINKATTN_CUDA_ARCHS": "80;sm_86"}, ["SINKATTN_CUDA_ARCHS", "sm_86", "80, 86, 89, 90a"]),
    ({"SINKATTN_CUDA_ARCHS": "75"}, ["SINKATTN_CUDA_ARCHS", "75"]),
    ({"SINKATTN_HEADDIMS": "96"}, ["SINKATTN_HEADDIMS", "96", "64", "128", "256"]),
    ({"SINKATTN_HEADDIMS": "64,512"}, ["SINKATTN_HEADDIMS", "512"]),
    ({"SINKATTN_DTYPES": "fp32"}, ["SINKATTN_DTYPES", "fp32", "bf16, fp16"]),
    ({"SINKATTN_DTYPES": "bfloat16"}, ["SINKATTN_DTYPES", "bfloat16"]),
])
def test_bad_values_are_rejected_clearly(env, names):
    msg = _exit_message(env)
    for n in names:
        assert n in msg, f"message for {env} should mention {n!r}: {msg}"


@pytest.mark.parametrize("value", ["64,abc", "128.0", "hdim128"])
def test_non_numeric_headdims_rejected_clearly(value):
    msg = _exit_message({"SINKATTN_HEADDIMS": value})
    assert "SINKATTN_HEADDIMS" in msg


@pytest.mark.parametrize("var", ["SINKATTN_CUDA_ARCHS", "SINKATTN_HEADDIMS", "SINKATTN_DTYPES"])
@pytest.mark.parametrize("value", ["", ";", " , "])
def test_empty_values_not_silently_empty(var, value):
    try:
        g = gen.parse_grid({var: value})
    except SystemExit as e:
        assert var in str(e.code)
        return
    assert g.archs and g.headdims and g.dtypes, f"{var}={value!r} gave {g}"


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_emulation_bad_value_not_silently_on(value):
    try:
        g = gen.parse_grid({"SINKATTN_EMULATION": value})
    except SystemExit as e:
        assert "SINKATTN_EMULATION" in str(e.code)
        return
    assert g.emulation is False


def test_repeated_archs_deduplicated():
    g = gen.parse_grid({"SINKATTN_CUDA_ARCHS": "80;80"})
    assert g.archs == ["80"]
    assert gen.gencode_flags("sm80", g.archs) == ["-gencode=arch=compute_80,code=sm_80",
                                                  "-gencode=arch=compute_80,code=compute_80"]


# ---- family targets and gencode flags ---------------------------------------------------------------------
def test_sm80_family_default_archs():
    # sm_80 SASS for cc 8.x and, from the same compute_80 source, sm_90 SASS: the portable path on Hopper.
    assert gen.family_targets("sm80", ["80", "90a"]) == [("compute_80", "sm_80"), ("compute_80", "sm_90")]
    assert gen.gencode_flags("sm80", ["80", "90a"]) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=sm_90",
        "-gencode=arch=compute_80,code=compute_80"]  # the PTX: the portable path on newer GPUs (JIT)
    assert gen.arch_list_string("sm80", ["80", "90a"]) == "sm_80,sm_90,compute_80"


def test_sm90_family_only_with_90a():
    assert gen.family_targets("sm90", ["80", "90a"]) == [("compute_90a", "sm_90a")]
    assert gen.gencode_flags("sm90", ["90a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    for archs in (["80"], ["86"], ["80", "86", "89"]):
        assert gen.family_targets("sm90", archs) == []
        assert gen.gencode_flags("sm90", archs) == []
    # never plain sm_90 / compute_90 for the wgmma family
    for f in gen.gencode_flags("sm90", ["80", "86", "89", "90a"]):
        assert "sm_90a" in f and "compute_90a" in f


def test_sm80_family_per_arch():
    assert gen.family_targets("sm80", ["86"]) == [("compute_86", "sm_86")]
    assert gen.family_targets("sm80", ["80", "86", "89"]) == [
        ("compute_80", "sm_80"), ("compute_86", "sm_86"), ("compute_89", "sm_89")]
    assert gen.family_targets("sm80", ["90a"]) == [("compute_80", "sm_90")]
    # no family is built as sm_90a except the sm90 one, and no sm80 code is ever compute_90a
    for arch_set in (["80", "90a"], ["90a"], ["80", "86", "89", "90a"]):
        for v, r in gen.family_targets("sm80", arch_set):
            assert v.startswith("compute_8") and not r.endswith("a")


def test_common_family_every_arch():
    # the merge kernel ("common") is compiled for every requested arch as itself
    assert gen.family_targets("common", ["80", "90a"]) == [("compute_80", "sm_80"), ("compute_90a", "sm_90a")]
    assert gen.arch_list_string("common", ["80", "86", "90a"]) == "sm_80,sm_86,sm_90a,compute_80"


# ---- units ----------------------------------------------------------------------------------------------
def _names(grid, sweep=True):
    return sorted(u.name for u in gen.units(grid) if sweep or not u.name.startswith("sweep_"))


@pytest.fixture
def with_fwd(monkeypatch):
    """Pretend csrc/sm80/fwd_launch.cuh exists so the forward units are generated (nothing is compiled)."""
    real = os.path.exists

    def exists(p):
        return True if str(p).endswith(os.path.join("sm80", "fwd_launch.cuh")) else real(p)

    monkeypatch.setattr(os.path, "exists", exists)


def test_units_merge_only_narrowed():
    have_fwd = (ROOT / "csrc" / "sm80" / "fwd_launch.cuh").exists()
    g = gen.Grid(archs=["80"], headdims=[128], dtypes=["bf16"], emulation=False)
    names = _names(g)
    assert "merge_bf16" in names and "merge_fp32" in names and "merge_fp16" not in names
    assert ("fwd_sm80_hdim128_bf16" in names) == have_fwd
    assert not any("emu" in n for n in names)
    for u in gen.units(g):
        assert u.family in ("common", "sm80", "sm90", "emu")
        assert "do not edit" in u.text and u.name in u.text


def test_units_full_grid_with_fwd(with_fwd):
    g = gen.parse_grid({"SINKATTN_EMULATION": "1"})
    names = _names(g)
    want = {f"merge_{d}" for d in ("bf16", "fp16", "fp32")}
    want |= {f"fwd_sm80_hdim{h}_{d}" for h in (64, 128, 256) for d in ("bf16", "fp16")}
    want |= {f"fwd_emu_hdim{h}_{d}" for h in (64, 128, 256) for d in ("bf16", "fp16")}
    want |= {f"bwd_{f}_hdim{h}_{d}" for f in ("sm80", "emu") for h in (64, 128, 256) for d in ("bf16", "fp16")}
    want |= {f"fwd_sm90_hdim{h}_{d}" for h in (64, 128, 256) for d in ("bf16", "fp16")}
    # the sm90 backward has no head-dim-256 tile (sm90/bwd_tiles.h): the sm80 backward serves it
    want |= {f"bwd_sm90_hdim{h}_{d}" for h in (64, 128) for d in ("bf16", "fp16")}
    # the tile tables' other parts, each in a unit of its own (built in parallel with the launcher's)
    want |= {f"fwd_{f}_hdim{h}_{d}{p}" for f in ("sm80", "emu") for h in (64, 128, 256) for d in ("bf16", "fp16")
             for p in ("_keys", "_softcap")}
    want |= {f"bwd_sm80_hdim128_{d}_small" for d in ("bf16", "fp16")}
    want |= {f"bwd_sm80_hdim{h}_{d}_softcap" for h in (64, 128, 256) for d in ("bf16", "fp16")}
    # the emulation build's one tuning variant (the CPU tests run bench/sweep/runner.py's variant path through it)
    want |= {"sweep_fwd_emu_hdim128_bf16_m128n64w4"}
    # the FP8-cache decode units (sm80/fwd_tiles.h FwdFp8TilesOf: head dims 64 and 128), GPU and emulated
    want |= {f"fwd_fp8_{f}_hdim{h}_{d}" for f in ("sm80", "emu") for h in (64, 128) for d in ("bf16", "fp16")}
    # the sm90 kernels under host emulation: the table's forward and backward tiles, and every sm90 tuning
    # variant's twin at the first dtype (the never-run variants are checked on the CPU)
    want |= {f"fwd_emu90_hdim{h}_{d}" for h in (64, 128, 256) for d in ("bf16", "fp16")}
    want |= {f"bwd_emu90_hdim{h}_{d}" for h in (64, 128) for d in ("bf16", "fp16")}
    want |= {gen.variant_name("emu90", v, "bf16") for v in gen.SWEEP_SM90}
    assert set(names) == want and len(names) == len(want)
    assert {u.name for u in gen.units(g) if not u.registers} == {n for n in want
                                                                  if n.endswith(("_keys", "_small", "_softcap"))}
    fam = {u.name: u.family for u in gen.units(g)}
    assert fam["fwd_sm80_hdim64_bf16"] == "sm80" and fam["fwd_emu_hdim64_bf16"] == "emu" and fam["merge_fp32"] == "common"
    assert fam["fwd_sm90_hdim128_bf16"] == "sm90" and fam["bwd_sm90_hdim64_fp16"] == "sm90"
    bwd90 = next(u for u in gen.units(g) if u.name == "bwd_sm90_hdim128_bf16")
    assert "run_bwd_sm90<128, cutlass::bfloat16_t>" in bwd90.text and '"sm90", "bwd", 128, "bf16"' in bwd90.text
    assert "sm90::bwd_min_smem<128>()" in bwd90.text


def test_emulated_units_compile_packed_per_header_and_head_dim():
    """The build compiles the emulated kernels of one emulation header at one head dim (both dtypes, every part,
    every twin) as one translation unit; the GPU units one kernel (or part) each, as units() lists them."""
    g = gen.parse_grid({"SINKATTN_EMULATION": "1", "SINKATTN_CUDA_ARCHS": "80;90a"})
    logical, built = gen.units(g), gen.translation_units(g)
    assert [u.name for u in built if u.family != "emu"] == [u.name for u in logical if u.family != "emu"]
    packs = {u.name: u for u in built if u.family == "emu"}
    assert sorted(packs) == sorted([f"emu80_{op}_hdim{h}" for op in ("fwd", "bwd") for h in (64, 128, 256)]
                                   + [f"emu90_fwd_hdim{h}" for h in (64, 128, 256)]
                                   + [f"emu90_bwd_hdim{h}" for h in (64, 128)])
    # every emulated kernel is registered in exactly one pack, and each pack holds its header's kernels only
    for u in (u for u in logical if u.family == "emu"):
        holders = [p for p in packs.values() if f"// {u.name}\n" in p.text]
        assert [p.name for p in holders] == [f"{gen.PACK_NAME[u.header]}_hdim{u.headdim}"], u.name
        for name in u.registered:  # the sm90 forward's units register its FP8-cache twin too
            assert f"SINKATTN_REGISTER_KERNEL({name}," in holders[0].text
    for p in packs.values():
        assert p.text.count("#include") == 1 and "extern template" not in p.text and "do not edit" in p.text
    hd128 = packs["emu80_fwd_hdim128"].text
    assert all(n in hd128 for n in ("fwd_emu_hdim128_bf16_keys", "fwd_fp8_emu_hdim128_fp16",
                                    "sweep_fwd_emu_hdim128_bf16_m128n64w4"))
    with pytest.raises(SystemExit, match="PACK_NAME"):
        gen._pack([gen.Unit("x", "emu", "", header="emu/other.h", headdim=64)])


def test_sm90_units_only_with_90a():
    for archs in (["80"], ["86", "89"], ["100", "120"]):
        names = _names(gen.Grid(archs=archs, headdims=[128], dtypes=["bf16"], emulation=False))
        assert not any("sm90" in n for n in names)
    names = _names(gen.Grid(archs=["90a"], headdims=[128], dtypes=["bf16"], emulation=False))
    assert "fwd_sm90_hdim128_bf16" in names and "fwd_sm80_hdim128_bf16" in names and "bwd_sm90_hdim128_bf16" in names
    names = _names(gen.Grid(archs=["90a"], headdims=[256], dtypes=["bf16"], emulation=False))
    assert "fwd_sm90_hdim256_bf16" in names and not any(n.startswith("bwd_sm90") for n in names)


def test_units_narrowed_with_fwd(with_fwd):
    g = gen.parse_grid({"SINKATTN_CUDA_ARCHS": "86", "SINKATTN_HEADDIMS": "128", "SINKATTN_DTYPES": "fp16",
                        "SINKATTN_EMULATION": "0"})
    assert _names(g) == ["bwd_sm80_hdim128_fp16", "bwd_sm80_hdim128_fp16_small", "bwd_sm80_hdim128_fp16_softcap",
                         "fwd_fp8_sm80_hdim128_fp16",
                         "fwd_sm80_hdim128_fp16", "fwd_sm80_hdim128_fp16_keys", "fwd_sm80_hdim128_fp16_softcap",
                         "merge_fp16", "merge_fp32"]
    g = gen.parse_grid({"SINKATTN_CUDA_ARCHS": "90a", "SINKATTN_HEADDIMS": "64", "SINKATTN_DTYPES": "bf16",
                        "SINKATTN_EMULATION": "1"})
    # 90a builds the sm90 forward and backward, and still the sm80 family (as sm_90) and the emulated kernels
    assert _names(g, sweep=False) == ["bwd_emu90_hdim64_bf16", "bwd_emu_hdim64_bf16", "bwd_sm80_hdim64_bf16",
                                      "bwd_sm80_hdim64_bf16_softcap", "bwd_sm90_hdim64_bf16", "fwd_emu90_hdim64_bf16",
                                      "fwd_emu_hdim64_bf16", "fwd_emu_hdim64_bf16_keys", "fwd_emu_hdim64_bf16_softcap",
                                      "fwd_fp8_emu_hdim64_bf16", "fwd_fp8_sm80_hdim64_bf16", "fwd_sm80_hdim64_bf16",
                                      "fwd_sm80_hdim64_bf16_keys", "fwd_sm80_hdim64_bf16_softcap",
                                      "fwd_sm90_hdim64_bf16", "merge_bf16", "merge_fp32"]
    bwd = next(u for u in gen.units(g) if u.name == "bwd_sm80_hdim64_bf16")
    assert "run_bwd_sm80<64, cutlass::bfloat16_t>" in bwd.text and '"sm80", "bwd", 64, "bf16"' in bwd.text
    fwd = next(u for u in gen.units(g) if u.name == "fwd_sm80_hdim64_bf16")
    assert "run_fwd_sm80<64, cutlass::bfloat16_t>" in fwd.text and '"sm80", "fwd", 64, "bf16"' in fwd.text


def test_generate_writes_units_and_removes_stale(tmp_path):
    g = gen.Grid(archs=["80"], headdims=[64], dtypes=["bf16", "fp16"], emulation=False)
    stale = tmp_path / "merge_old.cu"
    stale.write_text("// stale")
    keep_other = tmp_path / "notes.txt"
    keep_other.write_text("x")
    written = gen.generate(str(tmp_path), g)
    by_name = {pathlib.Path(p).stem: fam for p, fam in written}
    assert set(by_name) == {u.name for u in gen.units(g)}
    assert not stale.exists() and keep_other.exists()
    for u in gen.units(g):
        ext = ".cpp" if u.family == "emu" else ".cu"
        assert (tmp_path / (u.name + ext)).read_text() == u.text
    # unchanged units are not rewritten (ninja/ccache keep their work)
    p = tmp_path / "merge_bf16.cu"
    os.utime(p, (1, 1))
    gen.generate(str(tmp_path), g)
    assert p.stat().st_mtime == 1


# ---- SINKATTN_CUDA_ARCHS=native ------------------------------------------------------------------------------
@pytest.mark.parametrize("cc,arch", [((8, 0), "80"), ((8, 6), "86"), ((8, 7), "80"), ((8, 9), "89"), ((9, 0), "90a"),
                                     ((10, 0), "100"), ((10, 3), "100"), ((12, 0), "120"), ((7, 5), None),
                                     ((11, 0), None)])
def test_arch_of_capability(cc, arch):
    assert gen.arch_of_capability(*cc) == arch


def test_native_takes_the_visible_gpus():
    gpus = [("NVIDIA H200", (9, 0)), ("NVIDIA GeForce RTX 4090", (8, 9)), ("NVIDIA H200", (9, 0))]
    g = gen.parse_grid({"SINKATTN_CUDA_ARCHS": "native"}, native=lambda: gpus)
    assert g.archs == ["89", "90a"]  # sorted as KNOWN_ARCHS, each once
    assert [a for _, _, a in g.native] == ["90a", "89", "90a"]
    assert gen.native_string(g) == ("NVIDIA H200 (cc 9.0: 90a), NVIDIA GeForce RTX 4090 (cc 8.9: 89), "
                                    "NVIDIA H200 (cc 9.0: 90a)")
    # a named arch beside native is kept
    g = gen.parse_grid({"SINKATTN_CUDA_ARCHS": "80;native"}, native=lambda: gpus[:1])
    assert g.archs == ["80", "90a"]
    assert gen.native_string(gen.parse_grid({})) == ""


@pytest.mark.parametrize("gpus,words", [
    ([], ["native", "no GPU", "80;90a"]),
    ([("Tesla T4", (7, 5))], ["Tesla T4", "7.5", "SINKATTN_CUDA_ARCHS=80"]),
])
def test_native_without_a_usable_gpu_says_what_to_do(gpus, words):
    with pytest.raises(SystemExit) as e:
        gen.parse_grid({"SINKATTN_CUDA_ARCHS": "native"}, native=lambda: gpus)
    for w in words:
        assert w in str(e.value.code), (w, e.value.code)
    with pytest.raises(SystemExit) as e:  # no detector (e.g. the generator run by hand)
        gen.parse_grid({"SINKATTN_CUDA_ARCHS": "native"})
    assert "native" in str(e.value.code)


def test_parts_are_declared_extern_where_launched_and_defined_once():
    """A part's tiles are instantiated in its own unit only: the launcher's unit declares them extern, so the
    split really moves the compile work (and a part the launcher's unit forgot would link, just not split)."""
    g = gen.parse_grid({"SINKATTN_HEADDIMS": "128", "SINKATTN_DTYPES": "bf16"})
    by = {u.name: u.text for u in gen.units(g)}
    for launcher, part, fn in [("fwd_sm80_hdim128_bf16", "_keys", "launch_fwd_part<128, cutlass::bfloat16_t, "
                                "sm80::FwdUnit::kKeyGroups>"),
                               ("fwd_sm80_hdim128_bf16", "_softcap", "launch_fwd_part<128, cutlass::bfloat16_t, "
                                "sm80::FwdUnit::kSoftcap>"),
                               ("bwd_sm80_hdim128_bf16", "_small", "launch_bwd_part<128, cutlass::bfloat16_t, "
                                "sm80::BwdUnit::kSmallSmem>"),
                               ("bwd_sm80_hdim128_bf16", "_softcap", "launch_bwd_part<128, cutlass::bfloat16_t, "
                                "sm80::BwdUnit::kSoftcap>")]:
        assert f"extern template void sm80::{fn}" in by[launcher]
        assert f"\ntemplate void sm80::{fn}" in by[launcher + part]
        assert "SINKATTN_REGISTER_KERNEL" in by[launcher] and "SINKATTN_REGISTER_KERNEL" not in by[launcher + part]


# ---- the tuning grid (SINKATTN_SWEEP; make gpu-sweep) ----------------------------------------------------------
def _sweep(env) -> list:
    return [u for u in gen.units(gen.parse_grid(env)) if u.name.startswith("sweep_")]


def test_sweep_off_by_default_every_user_build():
    assert _sweep({}) == [] and _sweep({"SINKATTN_SWEEP": "0"}) == [] and _sweep({"SINKATTN_SWEEP": ""}) == []
    # an emulation (test) build holds the sm80 smoke variant at its head dim and the emulated twin of every sm90
    # variant at the build's head dims, in the first dtype; none of them for a GPU
    emu = [u.name for u in _sweep({"SINKATTN_EMULATION": "1"})]
    assert emu == ["sweep_fwd_emu_hdim128_bf16_m128n64w4"] + [gen.variant_name("emu90", v, "bf16")
                                                               for v in gen.SWEEP_SM90]
    hd64 = [u.name for u in _sweep({"SINKATTN_EMULATION": "1", "SINKATTN_HEADDIMS": "64", "SINKATTN_DTYPES": "fp16"})]
    assert hd64 == [gen.variant_name("emu90", v, "fp16") for v in gen.SWEEP_SM90 if v.head_dim == 64]
    assert all(u.family == "emu" for u in _sweep({"SINKATTN_EMULATION": "1"}))


def test_sweep_grid_whole_and_narrowed():
    env = {"SINKATTN_SWEEP": "1", "SINKATTN_DTYPES": "bf16"}
    names = [u.name for u in _sweep(env)]
    assert len(names) == len(set(names)) == len(gen.SWEEP_SM90) + len(gen.SWEEP_SM80)
    assert all(gen.variant_name(f, v, "bf16") in names for f, t in (("sm90", gen.SWEEP_SM90), ("sm80", gen.SWEEP_SM80))
               for v in t)
    # narrowed by head dims, by arch (no 90a: no sm90 variants), and by name substrings
    assert {u.name.split("_")[3] for u in _sweep({**env, "SINKATTN_HEADDIMS": "64"})} == {"hdim64"}
    assert not any("sm90" in u.name for u in _sweep({**env, "SINKATTN_CUDA_ARCHS": "80"}))
    only = [u.name for u in _sweep({**env, "SINKATTN_SWEEP": "sm90_hdim128,_q2"})]
    assert only and all("sm90_hdim128" in n or "_q2" in n for n in only)
    assert any("hdim64" in n for n in only)  # _q2 at hd64
    # with emulation on, every variant's emulated twin too (the sm90 ones are in every emulation build)
    emu = [u.name for u in _sweep({**env, "SINKATTN_EMULATION": "1"}) if u.family == "emu"]
    assert len(emu) == len(set(emu)) == len(gen.SWEEP_SM80) + len(gen.SWEEP_SM90)


def test_sweep_units_register_by_name_in_their_own_family():
    units = {u.name: u for u in _sweep({"SINKATTN_SWEEP": "1", "SINKATTN_DTYPES": "fp16", "SINKATTN_EMULATION": "1"})}
    sm90 = units["sweep_fwd_sm90_hdim128_fp16_m128n128s2_q2"]
    assert sm90.family == "sm90" and sm90.registers
    assert '"sm90-sweep", "fwd", 128, "fp16"' in sm90.text and "sm90::launch_fwd<" in sm90.text
    assert ".q_buffers = 2" in sm90.text and "cutlass::half_t" in sm90.text
    dyn = units["sweep_fwd_sm90_hdim128_fp16_m128n128s2_dyn"]
    # features from the variant's own tile (csrc/sm90/fwd_tiles.h fwd_features: "tile_counter" for a dynamic walk,
    # which api.cpp then allocates; tests/test_tile_pieces.py checks the registered strings)
    assert '.dynamic_tiles = true' in dyn.text
    assert "sm90::fwd_features(SweepTile_sweep_fwd_sm90_hdim128_fp16_m128n128s2_dyn::tile)" in dyn.text
    assert "sm90::fwd_features(SweepTile_sweep_fwd_sm90_hdim128_fp16_m128n128s2_q2::tile)" in sm90.text
    sm80 = units["sweep_fwd_sm80_hdim64_fp16_m128n128w4"]
    assert sm80.family == "sm80" and '"sm80-sweep"' in sm80.text and "sm80::launch_fwd_variant<" in sm80.text
    emu = units["sweep_fwd_emu_hdim64_fp16_m128n128w4"]
    assert emu.family == "emu" and '"sm80-emulated-sweep"' in emu.text and "EmuLaunch const&" in emu.text


def test_sweep_variants_fit_the_machine():
    """What the kernels' static_asserts will say, said here before a compile: shared memory and registers."""
    for v in gen.SWEEP_SM90:
        assert v.smem_bytes() <= 227 * 1024, v
        assert v.block_m % 64 == 0 and 1 <= v.block_m // 64 <= 3 and v.q_buffers in (1, 2), v
        assert 128 * (v.producer_regs + v.block_m // 64 * v.consumer_regs) <= 64512, v
        assert v.block_n % 16 == 0 and v.block_n <= 256 and v.head_dim % 64 == 0, v
    for v in gen.SWEEP_SM80 + [gen.SWEEP_EMU_SMOKE]:
        assert v.smem_bytes() <= 163 * 1024 and v.block_m % (16 * v.warps) == 0, v
    # the defaults of an sm90 GPU are not repeated as variants (the sweep times the default kernels beside them)
    assert gen.Sm90Variant(128, 128, 2) not in gen.SWEEP_SM90 and gen.Sm90Variant(64, 128, 3) not in gen.SWEEP_SM90
    assert gen.Sm80Variant(128, 128, 64, 8, q_regs=1, s_ahead=1, branch_free_loads=1) not in gen.SWEEP_SM80
    assert gen.Sm80Variant(64, 128, 64, 4, 3, ctas_per_sm=2) not in gen.SWEEP_SM80
    # ... but the sm8x-only tiles are, on purpose: the sm8x hd128 tile as the control of sm90's (which loads its
    # interior blocks branch-free), cc 8.0's hd128 tile so that a GPU round on an sm90 times it at all
    assert gen.Sm80Variant(128, 128, 64, 8, q_regs=1, s_ahead=1) in gen.SWEEP_SM80
    assert gen.Sm80Variant(128, 128, 32, 4, 3, ctas_per_sm=2) in gen.SWEEP_SM80
