"""Build of sinkattn and its extension sinkattn._C.

The kernels (.cu, no torch headers) and the host-emulated kernels (.cpp, no torch headers) are
compiled by a ninja file of our own, so each kernel family gets exactly its own gencode flags and
ccache can serve rebuilds; api.cpp, cpu_front.cpp and host_probes.cpp (the only files that see torch) are
compiled by torch's BuildExtension and linked with those objects into sinkattn._C.

Environment:
    SINKATTN_CUDA_ARCHS   default "80;90a"; "native": the archs of the GPUs torch sees at build time
    SINKATTN_HEADDIMS     default "64,128,256"
    SINKATTN_DTYPES       default "bf16,fp16"
    SINKATTN_GPU_HEADDIMS / SINKATTN_GPU_DTYPES  the GPU units' subset of the grid (default: all of it; CI narrows it)
    SINKATTN_EMULATION    "1" also builds the host-emulated kernels the CPU tests run (default "0"; make test: "1")
    SINKATTN_DIAGNOSTIC   "1" builds the diagnostic GPU build (bounded sm90 barrier waits; generate_kernels.py)
    SINKATTN_SKIP_CUDA    "1" builds a pure-Python package (reference backend only)
    SINKATTN_CUTLASS_DIR  a CUTLASS include dir (holding cute/ and cutlass/)
    SINKATTN_PTXAS_VERBOSE "1" prints ptxas resource usage per kernel
    SINKATTN_SWEEP        "1" (or name substrings) also builds the tuning grid's variants (csrc/sweep_grid.py)
    SINKATTN_PREBUILT_KERNELS a folder of kernel objects built elsewhere for the same grid: only the torch-facing
                          files compile (a GPU round's machine; Makefile gpu-prebuilt)
    SINKATTN_ALLOW_CUDA_MISMATCH "1" builds although nvcc's CUDA major differs from torch's
    MAX_JOBS              parallel compile jobs
"""
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
sys.path.insert(0, CSRC)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_progress  # noqa: E402
import generate_kernels as gen  # noqa: E402

FETCH_HINT = "make cutlass   (or: python third_party/fetch_cutlass.py)"


def package_version():
    """sinkattn/_version.py's __version__, read as text (importing the package would import torch)."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sinkattn", "_version.py")).read()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if not found:
        fail("sinkattn/_version.py holds no line __version__ = \"x.y.z\"")
    return found.group(1)


def fail(msg):
    sys.stderr.write(f"\nsinkattn build error: {msg}\n\n")
    raise SystemExit(1)


def find_cuda_home():
    """The toolkit root, robust to an nvcc on PATH that is a wrapper script (as /usr/local/bin/nvcc here)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        try:  # a wrapper script: look for the real nvcc path inside it
            text = open(real, errors="ignore").read(4096)
            for m in re.finditer(r"(/[\w./+-]+)/bin/nvcc", text):
                candidates.append(m.group(1))
        except OSError:
            pass
    candidates += ["/usr/local/cuda"] + sorted(
        (os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")), reverse=True)
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")) and os.path.isfile(
                os.path.join(c, "include", "cuda_runtime.h")):
            return os.path.abspath(c)
    return None


def nvcc_version(cuda_home):
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        fail(f"could not read the version of {cuda_home}/bin/nvcc (output: {out.strip()[:200]!r})")
    return int(m.group(1)), int(m.group(2))


def find_cutlass():
    candidates = [os.environ.get("SINKATTN_CUTLASS_DIR"), os.path.join(ROOT, "third_party", "cutlass", "include")]
    try:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.append(os.path.join(loc, "source", "include"))
    except (ImportError, ValueError):
        pass
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "cute", "tensor.hpp")) and os.path.isfile(
                os.path.join(c, "cutlass", "version.h")):
            return os.path.abspath(c)
    return None


def cutlass_version(include_dir):
    text = open(os.path.join(include_dir, "cutlass", "version.h")).read()
    parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) if p else "?" for p in parts)


def expected_cost(unit):
    kind = build_progress.unit_kind(os.path.basename(unit[0]))
    return build_progress.UNIT_COST_S.get(kind, build_progress.DEFAULT_COST_S)


def native_gpus():
    """SINKATTN_CUDA_ARCHS=native: (name, compute capability) of each GPU torch sees now."""
    import torch
    if not torch.cuda.is_available():
        fail("SINKATTN_CUDA_ARCHS=native, but torch sees no CUDA GPU on this machine (torch "
             f"{torch.__version__}, CUDA {torch.version.cuda}); name the archs instead, e.g. 80;90a (the default), "
             "or 80;86;89;90a for every Ampere, Ada and Hopper GPU")
    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


def write_ninja(build_dir, units, cuda_home, cutlass_inc, grid, cxx_flags_extra):
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    ccache = shutil.which("ccache")
    pre = f"{ccache} " if ccache else ""
    cccl = os.path.join(cuda_home, "include", "cccl")
    includes = f"-I{CSRC} -I{cutlass_inc} -I{os.path.join(cuda_home, 'include')}"
    if os.path.isdir(cccl):
        includes += f" -I{cccl}"
    ptxas_v = " -Xptxas -v" if os.environ.get("SINKATTN_PTXAS_VERBOSE") == "1" else ""
    nvcc_common = (f"-std=c++20 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -Xcompiler -fPIC "
                   f"-lineinfo -Xptxas=--warn-on-spills{ptxas_v} {includes}")
    # CuTe's register fragments are reinterpreted across types; g++ at -O2 miscompiles that under strict
    # aliasing (seen here: the host-emulated GEMM was wrong at -O2 and right with -fno-strict-aliasing).
    cxx_common = f"-std=c++20 -O2 -fno-strict-aliasing -fPIC -DNDEBUG -pthread {includes} {cxx_flags_extra}"
    lines = ["ninja_required_version = 1.3", ""]
    objects = []
    families = sorted({f for _, f in units})
    for fam in families:
        if fam == "emu":
            lines += [f"rule cc_{fam}",
                      f"  command = touch $out.start && {pre}c++ {cxx_common} -DSINKATTN_COMPILED_ARCHS='\"host\"' "
                      "-MMD -MF $out.d -c $in -o $out",
                      "  description = $unit", "  depfile = $out.d", "  deps = gcc", ""]
        else:
            # The diagnostic define reaches the sm90 units only (the only code it changes), so their sm80 neighbours
            # keep their command lines: a diagnostic build of the same grid recompiles only the sm90 units (ccache
            # serves the rest), and make gpu-prebuilt packs both builds for one GPU round.
            diag = grid.diagnostic and fam.startswith("sm90")
            flags = " ".join(gen.gencode_flags(fam, grid.archs)) + (" -DSINKATTN_DIAGNOSTIC=1" if diag else "")
            archs = gen.arch_list_string(fam, grid.archs)
            lines += [f"rule cc_{fam}",
                      f"  command = touch $out.start && {pre}{nvcc} {nvcc_common} {flags} "
                      f"-DSINKATTN_COMPILED_ARCHS='\"{archs}\"' -MD -MF $out.d -c $in -o $out",
                      "  description = $unit", "  depfile = $out.d", "  deps = gcc", ""]
    # The object list keeps the grid's order (the link line); the ninja file lists the heaviest units first,
    # so with ninja's in-order scheduling the long ones start early and the short ones fill the gaps.
    for src, fam in units:
        objects.append(os.path.join(build_dir, os.path.basename(src) + ".o"))
    for src, fam in sorted(units, key=lambda u: -expected_cost(u)):
        unit = os.path.basename(src)
        lines += [f"build {os.path.join(build_dir, unit + '.o')}: cc_{fam} {src}", f"  unit = {unit}"]
    with open(os.path.join(build_dir, "build.ninja"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return objects


def cuda_extension():
    if os.environ.get("SINKATTN_SKIP_CUDA") == "1":
        print("sinkattn build: SINKATTN_SKIP_CUDA=1, building the pure-Python package (reference backend only)")
        return [], {}
    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("sinkattn build: no CUDA toolkit found (no nvcc); building the pure-Python package. "
              "Set CUDA_HOME to the toolkit root to build the kernels.")
        return [], {}
    os.environ["CUDA_HOME"] = cuda_home  # torch.utils.cpp_extension reads it at import
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    grid = gen.parse_grid(native=native_gpus)
    major, minor = nvcc_version(cuda_home)
    if "90a" in grid.archs and (major, minor) < (12, 3):
        fail(f"nvcc {major}.{minor} at {cuda_home} is older than 12.3, which the sm_90a kernels need. "
             "Use CUDA >= 12.3, or build without Hopper kernels: SINKATTN_CUDA_ARCHS=80")
    torch_cuda = torch.version.cuda
    if torch_cuda is None:
        fail(f"torch {torch.__version__} is a CPU-only build, but nvcc was found at {cuda_home}. Install a CUDA "
             "build of torch, or build the pure-Python package: SINKATTN_SKIP_CUDA=1")
    if int(torch_cuda.split(".")[0]) != major and os.environ.get("SINKATTN_ALLOW_CUDA_MISMATCH") != "1":
        fail(f"nvcc is CUDA {major}.{minor} ({cuda_home}) but torch {torch.__version__} was built with CUDA "
             f"{torch_cuda}; the extension would not load. Point CUDA_HOME at a CUDA {torch_cuda.split('.')[0]}.x "
             f"toolkit or install a torch built for CUDA {major}.")
    # Kernel objects hold no torch and no Python, so a machine whose time is scarce (the borrowed GPU) can
    # link objects compiled elsewhere for the same grid and compile only the torch-facing files against its own
    # torch. They include no CUTLASS header, so the headers (27 MB) need not travel with the objects:
    # the CUTLASS version they were built with comes from cutlass_version.txt beside them.
    prebuilt = os.environ.get("SINKATTN_PREBUILT_KERNELS")
    cutlass_inc = find_cutlass()
    version_file = os.path.join(prebuilt or "", "cutlass_version.txt")
    if cutlass_inc is None and not (prebuilt and os.path.isfile(version_file)):
        fail(f"CUTLASS/CuTe headers not found (looked in SINKATTN_CUTLASS_DIR, third_party/cutlass/include and an "
             f"installed cutlass_library). Fetch them with: {FETCH_HINT}")
    cutlass_ver = cutlass_version(cutlass_inc) if cutlass_inc else open(version_file).read().strip()

    units = gen.generate(os.path.join(CSRC, "instantiations"), grid)
    units += [(os.path.join(CSRC, "build_info_cuda.cu"), "common")]
    units += [(os.path.join(CSRC, "build_info.cpp"), "emu")]
    build_dir = os.path.join(ROOT, "build", "kernels")
    os.makedirs(build_dir, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    objects = write_ninja(build_dir, units, cuda_home, cutlass_inc or "", grid, f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
    if cutlass_inc:
        with open(os.path.join(build_dir, "cutlass_version.txt"), "w") as f:
            f.write(cutlass_ver + "\n")
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
    if prebuilt:
        objects = [os.path.join(prebuilt, os.path.basename(o)) for o in objects]
        missing = [o for o in objects if not os.path.isfile(o)]
        if missing:
            fail(f"SINKATTN_PREBUILT_KERNELS={prebuilt} lacks {len(missing)} of the grid's kernel objects, e.g. "
                 f"{os.path.basename(missing[0])}; build them with the same SINKATTN_* grid, or unset it")

    class Build(BuildExtension):
        def build_extensions(self):
            print(f"sinkattn build: {len(objects)} kernel objects, archs {grid.archs}, head dims {grid.headdims}, "
                  f"dtypes {grid.dtypes}, emulation {'on' if grid.emulation else 'off'}, {jobs} jobs")
            if prebuilt:
                print(f"sinkattn build: linking the prebuilt kernel objects in {prebuilt}")
            else:
                build_progress.run_ninja(build_dir, int(jobs))
            print("sinkattn build: compiling api.cpp against torch's headers and linking sinkattn._C "
                  "(about a minute on 2 cores)", flush=True)
            super().build_extensions()

    defines = [f"-DSINKATTN_CUTLASS_VERSION=\"{cutlass_ver}\"",
               f"-DSINKATTN_TORCH_VERSION_AT_BUILD=\"{torch.__version__}\"",
               f"-DSINKATTN_REQUESTED_ARCHS=\"{';'.join(grid.archs)}\"",
               f"-DSINKATTN_NATIVE_GPUS=\"{gen.native_string(grid)}\"",
               f"-DSINKATTN_REQUESTED_HEADDIMS=\"{','.join(map(str, grid.headdims))}\"",
               f"-DSINKATTN_REQUESTED_DTYPES=\"{','.join(grid.dtypes)}\"",
               f"-DSINKATTN_GPU_HEADDIMS=\"{','.join(map(str, grid.headdims_of('sm80')))}\"",
               f"-DSINKATTN_GPU_DTYPES=\"{','.join(grid.dtypes_of('sm80'))}\"",
               f"-DSINKATTN_EMULATION_BUILT={int(grid.emulation)}",
               f"-DSINKATTN_DIAGNOSTIC_BUILT={int(grid.diagnostic)}"]
    ext = CUDAExtension(
        name="sinkattn._C",
        sources=["csrc/api.cpp", "csrc/cpu_front.cpp", "csrc/host_probes.cpp"],
        include_dirs=[CSRC],
        extra_objects=objects,
        extra_compile_args={"cxx": ["-std=c++20", "-O2"] + defines},
    )
    return [ext], {"build_ext": Build}


ext_modules, cmdclass = cuda_extension()

setup(
    name="sinkattn",
    version=package_version(),
    description="Fused attention with attention sinks (learnable sink logits and StreamingLLM sink tokens)",
    packages=find_packages(include=["sinkattn", "sinkattn.*"]),
    python_requires=">=3.10",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["sinkattn-report=sinkattn.report:main"],
        # vLLM loads general plugins at start-up; ours registers sinkattn's backend as vLLM's CUSTOM attention
        # backend, used only with --attention-backend CUSTOM (sinkattn/compat.py).
        "vllm.general_plugins": ["sinkattn = sinkattn.compat:vllm_plugin"],
    },
)
