"""The tuning sweep of `make gpu-sweep`: runner.py (`python -m bench.sweep`) and gpu_sweep.sh, which relaunches it."""
