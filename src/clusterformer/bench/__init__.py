"""Benchmarks: time and memory of attention layers, plots."""

from .attention import BenchConfig, run_attention_benchmark

__all__ = ["BenchConfig", "run_attention_benchmark"]
