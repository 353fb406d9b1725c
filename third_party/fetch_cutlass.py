"""Fetch the CUTLASS/CuTe headers of the pinned nvidia-cutlass wheel into third_party/cutlass/ (git-ignored).

Only headers are taken (and CUTLASS's examples, for reading): the wheel's declared Python dependencies are
not needed for a header-only use, so it is downloaded with --no-deps and unpacked here. Idempotent.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VERSION = "4.2.0.0"
HERE = os.path.dirname(os.path.abspath(__file__))
DEST = os.path.join(HERE, "cutlass")
STAMP = os.path.join(DEST, "VERSION")


def main():
    if os.path.exists(STAMP) and open(STAMP).read().strip() == VERSION:
        print(f"CUTLASS {VERSION} headers already in {DEST}/include")
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, f"nvidia-cutlass=={VERSION}"]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)
        wheel = glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]
        if os.path.exists(DEST):
            shutil.rmtree(DEST)
        prefix = "cutlass_library/source/"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(prefix + "include/") or name.startswith(prefix + "examples/"):
                    rel = name[len(prefix):]
                    target = os.path.join(DEST, rel)
                    if name.endswith("/"):
                        continue
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with z.open(name) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
    with open(STAMP, "w") as f:
        f.write(VERSION + "\n")
    print(f"CUTLASS {VERSION} headers in {DEST}/include")


if __name__ == "__main__":
    main()
