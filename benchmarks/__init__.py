"""The benchmarks: entry points (`python -m benchmarks.bench_serving ...`), the load, metrics and report
library they share, and their committed results in `results/`."""
