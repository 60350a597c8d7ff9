"""The target hardware: what the tile heuristics size their grids and blocks against, and
what ahead-of-time lowering targets on a host without the accelerator.

GPU: the kernels are tuned for NVIDIA Hopper (H100 / H200). :func:`sm_count` reads the
attached GPU, as jax's own Pallas ops do; the constants are the fallback for a host
without one. TPU: :func:`tpu_info` is jax's own table (``pltpu.TpuInfo``: generation,
VMEM, MXU columns and count, peak bfloat16 rate, HBM bandwidth) for the attached chip, or
for the TPU v5e this project measures on (:data:`TPU_CHIP`) without one.
"""
from __future__ import annotations

import contextlib
import functools

import jax

__all__ = [
    "SM_COUNT", "COMPUTE_CAPABILITY", "DEVICE_KIND", "SMEM_BYTES", "TL_DOT_MIN_BLOCK", "sm_count", "gpu_target",
    "jax_version", "attached_compute_capability", "TPU_CHIP", "tpu_info",
]

# Streaming multiprocessors of an H100 SXM / H200: the count when no GPU is attached to ask.
SM_COUNT = 132
# sm_90: what a cuda lowering targets when no GPU is attached to ask.
COMPUTE_CAPABILITY = 90
# The device an abstract mesh names for a cuda lowering on a host without a GPU (jax >= 0.12).
DEVICE_KIND = "NVIDIA H200"
# Shared memory one block may use on an H100 / H200 (227 KiB).
SMEM_BYTES = 232448
# Triton's tl.dot needs every dimension of a tile to be at least 16.
TL_DOT_MIN_BLOCK = 16


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """The attached GPU's streaming multiprocessors; :data:`SM_COUNT` without one."""
    try:
        count = getattr(jax.devices("gpu")[0], "core_count", None)
    except RuntimeError:  # no GPU backend in this process
        return SM_COUNT
    return int(count) if count else SM_COUNT


def jax_version() -> tuple[int, int]:
    """jax's ``(major, minor)``: what a backend compares with the release its kernels need."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def attached_compute_capability() -> tuple[int, int] | None:
    """The attached GPU's compute capability, ``(9, 0)`` on Hopper; ``None`` without one
    (lowering ahead of time targets :data:`COMPUTE_CAPABILITY`, sm_90)."""
    try:
        major, minor = str(jax.devices("gpu")[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # no GPU backend here
        return None


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


# The TPU a lowering for tpu targets on a host without one: the chip this project measures on.
TPU_CHIP = "v5e"


@functools.lru_cache(maxsize=None)
def tpu_info():
    """The attached TPU's ``pltpu.TpuInfo`` (per TensorCore), or :data:`TPU_CHIP`'s without one."""
    from jax.experimental.pallas import tpu as pltpu  # Pallas' TPU module, on first use only

    try:
        attached = bool(jax.devices("tpu"))
    except RuntimeError:  # no TPU backend in this process
        attached = False
    if attached:
        return pltpu.get_tpu_info()
    return pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(TPU_CHIP), 1)
