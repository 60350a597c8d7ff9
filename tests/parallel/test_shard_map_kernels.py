"""Every kernel implementation traced and run inside ``jax.shard_map`` with ``check_vma=True``.

Inside ``shard_map`` values carry the manual axes they vary over. A kernel is a per-device
custom call: its operands are traced plain (``maskconv_kernels._core.primitives``), the
results vary as the operands do, and a replicated kernel's cotangent gets its ``psum``.
One device is enough: the manual axis exists whatever its size. Results must equal the
call outside ``shard_map`` bit for bit (same program per device).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.implementations import BACKENDS
from support.numerics import random
from support.short_conv import implementation_params
from support.tiers import tiered

import maskconv_kernels as mk
from maskconv_kernels.parallel import sequence_sharded_causal_conv1d, spatially_sharded_masked_conv


def _mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _kernel_backends():
    """xla and every kernel backend; the interpreters that run as host callbacks (slow), and the
    TPU kernels (named only; interpreted, their fast tier is test_pallas_mosaic_tpu.py), in the slow tier."""
    names = sorted(name for name, b in BACKENDS.items() if b.implementation != "xla" or name == "xla")
    slow = {"triton", "pallas_mosaic_gpu", "pallas_mosaic_tpu"}
    return tiered(names, lambda n: BACKENDS[n].implementation not in slow)


@pytest.mark.parametrize("name", _kernel_backends())
def test_masked_conv_inside_shard_map(name):
    backend = BACKENDS[name]
    x, k = random(0, (2, 6, 6, 4), backend.dtype), random(1, (3, 3, 4, 4), backend.dtype, scale=0.3)
    mask = mk.pixelcnn_mask((3, 3), "B")
    conv = lambda x, k: backend(x, k, mask).astype(jnp.float32)  # noqa: E731
    sharded = jax.shard_map(conv, mesh=_mesh(), in_specs=(P("x"), P()), out_specs=P("x"), check_vma=True)
    loss = lambda f: lambda x, k: jnp.sum(f(x, k) ** 2)  # noqa: E731
    _same(jax.jit(sharded)(x, k), jax.jit(conv)(x, k))
    _same(jax.jit(jax.grad(loss(sharded), (0, 1)))(x, k), jax.jit(jax.grad(loss(conv), (0, 1)))(x, k))


@pytest.mark.parametrize("implementation", implementation_params())
def test_causal_conv1d_inside_shard_map(implementation):
    x, w, b = random(2, (2, 9, 16)), random(3, (4, 16), scale=0.5), random(4, (16,))
    ids = jnp.asarray([[0] * 4 + [1] * 5, [2] * 9])

    def conv(x, w, b, ids):
        return mk.causal_conv1d(x, w, b, segment_ids=ids, activation="silu", implementation=implementation,
                                interpret=implementation != "xla")

    sharded = jax.shard_map(conv, mesh=_mesh(), in_specs=(P("x"), P(), P(), P("x")), out_specs=P("x"), check_vma=True)
    loss = lambda f: lambda x, w, b: jnp.sum(f(x, w, b, ids) ** 2)  # noqa: E731
    _same(jax.jit(sharded)(x, w, b, ids), jax.jit(conv)(x, w, b, ids))
    _same(jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(x, w, b), jax.jit(jax.grad(loss(conv), (0, 1, 2)))(x, w, b))


def test_the_parallel_functions_take_the_kernel_implementations():
    """Context parallelism and spatial sharding run their shards through the Pallas kernels."""
    mesh = _mesh()
    x, w = random(5, (2, 8, 16)), random(6, (4, 16), scale=0.5)
    ours = sequence_sharded_causal_conv1d(x, w, mesh=mesh, axis_name="x", implementation="pallas_triton",
                                          interpret=True)
    _same(ours, mk.causal_conv1d(x, w, implementation="pallas_triton", interpret=True))
    xi, k = random(7, (1, 6, 6, 3)), random(8, (3, 3, 3, 4), scale=0.3)
    mask = mk.pixelcnn_mask((3, 3), "A")
    ours = spatially_sharded_masked_conv(xi, k, mask, mesh=mesh, axis_name="x", implementation="pallas_triton",
                                         interpret=True)
    _same(ours, mk.masked_conv(xi, k, mask, implementation="pallas_triton", interpret=True))
