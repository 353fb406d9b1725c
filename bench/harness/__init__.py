"""The benchmark harness of `python -m bench` (bench/__main__.py): grids.py (the cases), comparators.py (what runs
them; prepared.py their shared types, peer_vllm.py vLLM's Triton kernel), run.py, timing.py, flops.py, report.py,
env.py and ceilings.py."""
