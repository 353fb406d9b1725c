"""GPU validation: check.sh (`make gpu-check`) and sanitize.py (compute-sanitizer over every kernel family)."""
