"""Benchmarks: Decoupled DiLoCo against data-parallel and synchronous DiLoCo on the same model,
data, token budget and seed (`python -m bench --help`, docs/bench.md)."""
