"""python -m bench.sweep: the tuning sweep (runner.py says what it does; `make gpu-sweep` runs it through
gpu_sweep.sh)."""
import sys

from bench.sweep.runner import cli

sys.exit(cli())
