"""One lock per download folder of the test cache (~/.cache/sinkattn): the pytest-xdist workers of one run (and two
runs at once) that find a download missing fetch and unpack it one after the other, the later ones finding the
first one's result instead of unpacking over it."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def cache_lock(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        yield
