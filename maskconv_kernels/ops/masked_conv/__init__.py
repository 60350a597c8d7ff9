"""``masked_conv``: exact masked convolutions, whose kernels never read a masked tap.

* :mod:`.api`: :func:`masked_conv`, the implementations and ``implementation_for``;
* :mod:`.backends`: the implementations table (:data:`IMPLEMENTATIONS`, :data:`PREFERENCE`);
* :mod:`.spec`: the validated problem (:class:`~.spec.ConvSpec`), and :mod:`.layout`,
  lax's dimension orders, input dilation and batch groups around it;
* :mod:`.kernel_problem`: the 2-D problem every kernel backend reads (active taps only);
* :mod:`.maps`: the three linear maps as primitives, differentiable to any order;
* :mod:`.reference`: the float64 oracle and the leaky ``lax.conv(kernel * mask)`` baseline;
* :mod:`.decode`: decode caches, one position at a time;
* one folder per implementation: :mod:`.xla`, :mod:`.pallas_triton`, :mod:`.triton`,
  :mod:`.pallas_mosaic_gpu`, :mod:`.pallas_mosaic_tpu`.
"""
from .api import IMPLEMENTATIONS, PREFERENCE, implementation_for, masked_conv

__all__ = ["masked_conv", "IMPLEMENTATIONS", "PREFERENCE", "implementation_for"]
