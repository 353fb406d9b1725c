"""sinkattn's benchmarks (docs/DESIGN.md section 7), one folder per role:

    harness/   the benchmark harness: `python -m bench --help` (this package's __main__.py is its command line)
    gpu/       GPU validation: check.sh (`make gpu-check`), sanitize.py (compute-sanitizer)
    sweep/     the tuning sweep: `python -m bench.sweep`, gpu_sweep.sh (`make gpu-sweep`)
    studies/   one-question measurements (CPU decode, per-call overhead, the 32k memory bound, reference vs eager)

RESULTS.md keeps every published figure with its commit.
"""
