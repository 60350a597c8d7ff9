"""The Triton backend: ``triton.jit`` kernels launched through ``jax_triton.triton_call``.

From jax 0.11 the Pallas Triton lowering is deprecated and names official Triton with
jax-triton as the way to keep using Triton; this backend is that path. Same structure
and contract as the Pallas backend: implicit GEMMs whose tap loop runs over active taps
only, float32 accumulation, a deterministic weight gradient; differentiation, batching
and dispatch are the shared core's (:mod:`..maps`).

Modules: :mod:`.conv` (what it supports and its three kernels), :mod:`.kernels` (the
``triton.jit`` kernels), :mod:`.config` (the backend's :class:`Config` of per-kernel
:class:`Launch` parameters, the heuristic, the autotune list), :mod:`.ops` (jax-triton
launches, autotune), :mod:`.interpret` (Triton's interpreter in a worker process).
Importing this package imports neither ``triton`` nor ``jax_triton``: they are needed
(``pip install maskconv-kernels[triton]``) only to run or compile the kernels.
Selected explicitly with ``implementation="triton"``; with ``interpret=True`` the same
kernels run in Triton's interpreter on any host (:mod:`.interpret`), which is how CI
checks them without a GPU.
"""
from ...._moved import renamed_attributes
from .config import Config, Launch
from .conv import forward, input_grad, unsupported, weight_grad

__all__ = ["Config", "Launch", "unsupported", "forward", "input_grad", "weight_grad"]

# The config's name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"Configs": "Config"})
