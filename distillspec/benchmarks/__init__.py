"""Benchmark scripts: each prints JSON ratios measured in one process (GUIDE.md section 4)."""
