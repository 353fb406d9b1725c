"""sinkattn's benchmark harness (docs/DESIGN.md section 7, issue 9). Run it with `python -m bench --help`."""
