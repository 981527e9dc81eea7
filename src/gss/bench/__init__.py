"""Benchmarks: runnable studies that measure gss on models with known memorization."""
