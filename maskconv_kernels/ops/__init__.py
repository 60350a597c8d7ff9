"""The ops, one package each, in one shape: ``api`` (the public function, its
implementations table and default order), its problem and checks, its float64
reference, and one module or folder per implementation, named as its ``implementation=``
string, with its frozen ``Config``.

* :mod:`.masked_conv`: exact masked convolutions (``xla``, ``pallas_triton``, ``triton``,
  ``pallas_mosaic_gpu``);
* :mod:`.causal_conv1d`: the short causal convolutions of sequence models (``xla``,
  ``pallas_triton``);
* :mod:`.causal_conv`: causal convolutions over time for video and audio tokenizers,
  streamed chunk by chunk (``masked_conv``'s implementations).
"""
