"""The project's own GPU tools, on top of the installed benchmarks (``python -m maskconv_kernels.bench``).

``gpu_check.sh`` is the one-command check of a lent GPU; ``tune`` sweeps the kernels' tiles
per kernel; ``predict_mgpu`` predicts the Mosaic GPU kernels' times; ``mgpu_cubin`` and
``short_conv_sm90`` compile kernels for sm_90a without a GPU. See ``benchmarks/README.md``.
"""
