"""The benchmarks: ``python -m maskconv_kernels.bench``, on the machine you run it on.

Two questions, answered by measurement: is it exact, and is it faster than what JAX
users write today? Each mode times this library against that baseline in one process,
samples interleaved, and writes its rows (each with the machine, versions, commit and
time) to a folder you name (``--out``; by default a new folder under the current one):

* ``conv`` (the default): ``masked_conv`` against ``lax.conv_general_dilated(x, kernel *
  mask)`` at layers of PixelCNN, PixelCNN++, gated PixelCNN and WaveNet (:mod:`.conv`,
  shapes in :mod:`.shapes`), exactness measured on the timed executables;
* ``sequence``: ``causal_conv1d`` against ``lax.conv``'s depthwise convolution and a
  shift-and-add at Mamba-2 and gated-DeltaNet shapes (:mod:`.sequence`);
* ``causal_conv``: ``causal_conv`` against ``jnp.pad`` + ``lax.conv`` (``VALID`` on time),
  and ``causal_conv_stream`` against a concatenating cache, at video VAE and audio codec
  layers (:mod:`.causal_conv`, shapes in :mod:`.shapes`), with each executable's memory;
* ``roofline``: each linear map of the ``xla`` backend against a GEMM of the same FLOPs
  (:mod:`.roofline`);
* ``decode``: generation with decode caches against naive generation, on the repository's
  example models (:mod:`.decode`);
* ``render``: the tables (and chart) of an earlier run's ``.jsonl``.

Timing is in :mod:`.timing`, metadata in :mod:`.machine`, leak figures in
:mod:`maskconv_kernels.leaks`. Charts need matplotlib and the progress bar tqdm (the
``bench`` extra); without them the benchmarks run and say what they skipped.
"""
