"""The ``pallas_mosaic_gpu`` backend: Pallas kernels lowered through Mosaic GPU, for NVIDIA Hopper.

* :mod:`.config`: :class:`Config`, the tile sizes and their heuristic
  (``masked_conv(..., implementation="pallas_mosaic_gpu", config=Config(...))``);
* :mod:`.grid`: the padded pixel grid that makes every active tap one TMA box;
* :mod:`.kernels`: the tap GEMM (forward, input gradient) and the tap weight gradient,
  ``plgpu.kernel`` bodies with TMA pipelines and ``wgmma``;
* :mod:`.conv`: :func:`unsupported` and the three kernels as the core calls them.

Runs on sm_90 GPUs, or anywhere in Mosaic GPU's interpreter (``interpret=True``; jax >=
0.11). Supports 1-D and 2-D, stride-1 convolutions with any padding, dilation and window
mask, bfloat16 and float16 inputs (float32 accumulation, any float output); the rest is
reported by :func:`unsupported` and ``implementation=None`` uses the next backend.

Importing this package imports no Mosaic GPU module: :mod:`.kernels` is imported when the
kernels run, so choosing a backend costs nothing where they do not run (and jax 0.10's
Mosaic GPU package, which needs absl-py, is never imported).
"""
from ...._moved import renamed_attributes
from .config import Config
from .conv import forward, input_grad, unsupported, weight_grad

__all__ = ["Config", "unsupported", "forward", "input_grad", "weight_grad"]

# The config's name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"Tiles": "Config"})
