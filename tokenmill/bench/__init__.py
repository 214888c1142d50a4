"""Benchmarks: ShareGPT dataset, offline throughput vs HF transformers."""
