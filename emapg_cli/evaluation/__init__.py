"""Benchmark evaluation: sampling, grading, metrics (avg@n, pass@k, maj@n, strict), resumable runs."""
