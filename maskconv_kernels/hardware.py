"""Hardware constants the kernel heuristics and ahead-of-time lowering share (one place).

The kernels are tuned for NVIDIA Hopper (H100 / H200): the tile heuristics size their
grids against its SM count, and lowering for ``cuda`` on a machine without a GPU
targets its compute capability.
"""
from __future__ import annotations

import contextlib

import jax

__all__ = ["SM_COUNT", "COMPUTE_CAPABILITY", "DEVICE_KIND", "SMEM_BYTES", "TL_DOT_MIN_BLOCK", "gpu_target"]

# Streaming multiprocessors of an H100 SXM / H200.
SM_COUNT = 132
# sm_90: what a cuda lowering targets when no GPU is attached to ask.
COMPUTE_CAPABILITY = 90
# The device an abstract mesh names for a cuda lowering on a host without a GPU (jax >= 0.12).
DEVICE_KIND = "NVIDIA H200"
# Shared memory one block may use on an H100 / H200 (227 KiB).
SMEM_BYTES = 232448
# Triton's tl.dot needs every dimension of a tile to be at least 16.
TL_DOT_MIN_BLOCK = 16


@contextlib.contextmanager
def gpu_target(device_kind: str = DEVICE_KIND, num_cores: int = SM_COUNT):
    """Names the target GPU while lowering for cuda on a host without one.

    jax >= 0.12 asks the Pallas Triton lowering for the GPU's compute capability; on a
    CPU-only host that comes from an abstract device in an abstract mesh. Older jax needs
    nothing, and this is a no-op there. Wrap ``jax.export(..., platforms=(..., "cuda"))``
    or ``jit(f).trace(...).lower(lowering_platforms=("cuda",))`` in it.
    """
    if not hasattr(jax.sharding, "AbstractDevice"):
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        yield
