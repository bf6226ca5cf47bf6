"""Test models and inputs: random tiny Kimi-K3 GGUFs, random quant blocks, hostile files, cgroup helpers.
Tests, benchmarks and commands use these; no library module imports them."""
