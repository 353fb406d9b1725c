"""One-question measurements beside the harness, each a script of its own that prints its table (bench/RESULTS.md
keeps the figures): cpu_decode.py, cpu_overhead.py, memory_32k.py, reference_vs_eager.py."""
