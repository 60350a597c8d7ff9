"""Benchmarks of maskconv_kernels against ``lax.conv_general_dilated(x, kernel * mask)``.

``shapes`` holds the real-model shapes (shared with ``tests/test_benchmark_shapes.py``),
``run`` times them, ``chart`` draws the speed-up chart, ``seed`` reproduces the two
experiments of the original gradient-leak report. See ``benchmarks/README.md``.
"""
