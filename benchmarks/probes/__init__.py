"""Probes: one-off measurements kept as they ran, beside their outputs in ``benchmarks/results``.

Each docstring says what it measured, when, and where its output is; ``benchmarks/NOTES.md``
says what was concluded. A probe that has not run yet says so.
"""
