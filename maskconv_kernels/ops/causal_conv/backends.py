"""``causal_conv``'s implementations table: ``masked_conv``'s own records, in ``masked_conv``'s order.

A causal convolution is a ``masked_conv`` with every tap active and time padded on the
low side only (:mod:`.checks`), so its implementations are exactly ``masked_conv``'s:
``"xla"`` (every problem, every platform) and each kernel backend that takes the problem
(``"pallas_triton"``: 1-D and 2-D, ungrouped, any stride; ``"triton"``: 1-D and 2-D,
ungrouped; ``"pallas_mosaic_gpu"``: 1-D and 2-D, stride 1, bfloat16 and float16, jax >=
0.11; ``"pallas_mosaic_tpu"``: 1-D and 2-D, stride 1, float32 and bfloat16). Nothing per implementation is written here: the records are shared, a backend
added to ``masked_conv`` enters this table with it, and an implementation is asked
about the problem's :class:`~maskconv_kernels.ops.masked_conv.spec.ConvSpec`. Only the
table's name differs, so every error speaks of ``causal_conv``.

``implementation=None`` is ``masked_conv``'s: per platform, when lowered (3-D video on
a GPU falls through the kernel backends to ``"xla"``).
"""
from __future__ import annotations

from ..._core.registry import Registry
from ..masked_conv import backends as _masked

__all__ = ["REGISTRY", "IMPLEMENTATIONS", "PREFERENCE"]

REGISTRY = Registry(
    "causal_conv",
    tuple(_masked.REGISTRY),
    _masked.PREFERENCE,
    # masked_conv's own needs (segment ids and mixed dtypes: the xla backend only).
    _masked.BACKENDS["xla"].requirements,
)
IMPLEMENTATIONS = REGISTRY.names
PREFERENCE = REGISTRY.preference
