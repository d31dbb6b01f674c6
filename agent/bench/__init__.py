"""Native host<->device offload microbenchmark: the CUDA source and its build.

`offload_bench.cu` is shipped as package data and compiled on first use by `build.build()`;
its JSON output schema and exit statuses are documented in docs/offload-bench.md.
"""
