"""Ratio benchmarks for mdm_lens (run `python -m benchmarks`; see benchmarks/README.md)."""
