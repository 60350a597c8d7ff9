"""The ``pallas_triton`` backend: Pallas GPU kernels, lowered through Triton, that never read a masked tap.

* :mod:`.config`: :class:`Config`, the tile sizes and their heuristic
  (``masked_conv(..., implementation="pallas_triton", config=Config(...))``);
* :mod:`.kernels`: the forward, input-gradient and weight-gradient kernels;
* :mod:`.conv`: :func:`unsupported` and the three kernels as the core calls them.

Runs on NVIDIA GPUs, or anywhere with ``interpret=True``. Supports 1-D and 2-D
convolutions with any padding, strides, dilation, window or channel-partial masks and
float32 / bfloat16 / float16; 3-D and ``feature_group_count > 1`` are reported by
:func:`unsupported` (``implementation=None`` then uses ``"xla"``).

jax >= 0.11 deprecates the Pallas Triton lowering; its warning is filtered while the
kernels are lowered, and only then (the backend record's ``lowering_warnings``).
"""
from ...._moved import renamed_attributes
from .config import Config
from .conv import forward, input_grad, unsupported, weight_grad

__all__ = ["Config", "unsupported", "forward", "input_grad", "weight_grad"]

# The config's name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"BlockSizes": "Config"})
