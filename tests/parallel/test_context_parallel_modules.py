"""The modules under context parallelism by configuration: ``context_parallel=ContextParallel(...)``.

Linen's and nnx's ``ShortConv`` and ``CausalConv`` and Equinox's ``CausalConv`` with the
sequence (time) split over 4 of 8 forced CPU devices, contiguous and zigzagged, against the
same module without the attribute on one device, same parameters. ``ShortConv``'s outputs
are equal bit for bit (``sequence_sharded_causal_conv1d``'s promise, its tests say why);
``CausalConv``'s within rounding (``time_sharded_causal_conv``'s: XLA's convolutions block
by shape); gradients within rounding. Decode steps run as without the split.
"""
from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from support.mesh import has_mesh_already, needs_mesh, run_on_forced_cpu_devices
from support.numerics import assert_close, random
from support.tiers import tiered

from maskconv_kernels import equinox as mk_eqx, parallel
from maskconv_kernels.flax import linen as mk_linen, nnx as mk_nnx
from maskconv_kernels.parallel import ContextParallel

F32 = np.dtype(np.float32)
SHARDS = 4
LAYOUTS = ["contiguous", "zigzag"]


def one_fast(layout: str | None) -> list:
    """Both layouts, only ``layout`` in the fast tier (``None``: neither; the fast tier
    keeps linen's ShortConv and nnx's CausalConv, each zigzagged)."""
    return tiered(LAYOUTS, lambda l: l == layout)


@has_mesh_already
def test_on_8_forced_cpu_devices():
    run_on_forced_cpu_devices(__file__)


def _mesh():
    return jax.make_mesh((SHARDS, 2), ("seq", "data"), axis_types=(AxisType.Auto,) * 2)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def _laid_out(a, layout):
    """A global array in the layout (time axis 1)."""
    return parallel.to_zigzag(a, SHARDS) if layout == "zigzag" else jnp.asarray(a)


def _in_order(a, layout):
    return parallel.from_zigzag(a, SHARDS) if layout == "zigzag" else a


def _documents(batch, length):
    """Segment ids with documents straddling every border, some padding, and their positions."""
    ids = np.zeros((batch, length), np.int32)
    ids[0, 5:] = 1
    ids[0, 27:] = 2
    ids[1, :3] = -1
    ids[1, 3:40] = 3
    ids[1, 40:] = 4
    positions = np.zeros_like(ids)
    for b in range(batch):
        for t in range(length):
            positions[b, t] = -1 if ids[b, t] < 0 else (0 if t == 0 or ids[b, t] != ids[b, t - 1] else positions[b, t - 1] + 1)
    return ids, positions


@needs_mesh
@pytest.mark.parametrize("layout", one_fast("zigzag"))
def test_linen_short_conv_equals_one_device(layout):
    mesh = _mesh()
    cp = ContextParallel(mesh, "seq", layout, batch_axis="data")
    x = random(0, (2, 64, 6), F32)
    ids, positions = _documents(2, 64)
    one = mk_linen.ShortConv(kernel_size=4, activation="silu")
    split = mk_linen.ShortConv(kernel_size=4, activation="silu", context_parallel=cp)
    variables = one.init(jax.random.key(0), x)
    assert jax.tree.structure(split.init(jax.random.key(0), _laid_out(x, layout))) == jax.tree.structure(variables)
    for kw, kw_split in [
        ({}, {}),
        ({"segment_ids": ids}, {"segment_ids": _laid_out(ids, layout)}),
        ({"positions": positions}, {"positions": _laid_out(positions, layout)}),
    ]:
        y1 = one.apply(variables, x, **kw)
        y = jax.jit(lambda v, x, kw: split.apply(v, x, **kw))(variables, _laid_out(x, layout), kw_split)
        np.testing.assert_array_equal(_bits(_in_order(y, layout)), _bits(y1), err_msg=str(sorted(kw)))

    # A random cotangent: the parameter gradients are sums of random-signed terms.
    dy = random(9, x.shape, F32)

    def loss(module, x, dy, v):
        return jnp.sum(module.apply(v, x) * dy)

    g1 = jax.grad(lambda v: loss(one, x, dy, v))(variables)["params"]
    g = jax.jit(jax.grad(lambda v: loss(split, _laid_out(x, layout), _laid_out(dy, layout), v)))(variables)["params"]
    terms, dy_max = x.shape[0] * x.shape[1], 1.1 * float(jnp.abs(dy).max())  # SiLU's slope is at most 1.1
    assert_close(g["weight"], g1["weight"], F32, terms, float(jnp.abs(x).max()) * dy_max)
    assert_close(g["bias"], g1["bias"], F32, terms, dy_max)


@pytest.mark.slow  # test_context_parallel.py's HLO check is the fast tier's
@needs_mesh
def test_linen_short_conv_compiles_to_collective_permutes_without_all_gather():
    mesh = _mesh()
    layer = mk_linen.ShortConv(kernel_size=4, context_parallel=ContextParallel(mesh, "seq", "zigzag", "data"))
    x = jax.device_put(random(1, (2, 64, 6), F32), NamedSharding(mesh, P("data", "seq")))
    variables = layer.init(jax.random.key(0), x)
    text = jax.jit(layer.apply).lower(variables, x).compile().as_text()
    assert "collective-permute" in text and "all-gather" not in text


@needs_mesh
def test_linen_short_conv_decodes_after_a_split_prefill_as_without_one():
    mesh = _mesh()
    x = random(2, (2, 32, 6), F32)
    kw = dict(kernel_size=3, decode=True)
    one, split = mk_linen.ShortConv(**kw), mk_linen.ShortConv(**kw, context_parallel=ContextParallel(mesh, "seq"))
    variables = one.init(jax.random.key(0), x)
    variables_split = split.init(jax.random.key(0), x)
    np.testing.assert_array_equal(variables_split["params"]["weight"], variables["params"]["weight"])
    token = random(3, (2, 1, 6), F32)
    y1, _ = one.apply(variables, token, mutable=["cache"])
    y, _ = split.apply(variables_split, token, mutable=["cache"])
    np.testing.assert_array_equal(_bits(y), _bits(y1))


@needs_mesh
@pytest.mark.parametrize("layout", one_fast(None))
def test_nnx_short_conv_equals_one_device(layout):
    mesh = _mesh()
    x = random(4, (2, 64, 6), F32)
    ids, _ = _documents(2, 64)
    one = mk_nnx.ShortConv(6, 4, rngs=nnx.Rngs(0))
    split = mk_nnx.ShortConv(6, 4, rngs=nnx.Rngs(0), context_parallel=ContextParallel(mesh, "seq", layout, "data"))
    y1 = one(x, ids)
    y = nnx.jit(lambda m, x, ids: m(x, ids))(split, _laid_out(x, layout), _laid_out(ids, layout))
    np.testing.assert_array_equal(_bits(_in_order(y, layout)), _bits(y1))


def _video(seed):
    return random(seed, (2, 16, 5, 4, 3), F32)  # (N, T, H, W, C): 4 frames a shard, 2 a zigzag chunk


@needs_mesh
@pytest.mark.parametrize("layout", one_fast(None))
def test_linen_causal_conv_equals_one_device(layout):
    mesh = _mesh()
    x = _video(5)
    kw = dict(features=4, kernel_size=(3, 3, 3), strides=(2, 1, 1), padding_mode="replicate")
    one = mk_linen.CausalConv(**kw)
    split = mk_linen.CausalConv(**kw, context_parallel=ContextParallel(mesh, "seq", layout, "data"))
    variables = one.init(jax.random.key(0), x)
    y1 = one.apply(variables, x)
    y = jax.jit(split.apply)(variables, _laid_out(x, layout))
    taps = 27 * 3
    bound = taps * float(jnp.abs(x).max() * jnp.abs(variables["params"]["kernel"]).max())
    assert y.shape == y1.shape
    assert_close(_in_order(y, layout), y1, F32, taps, bound)

    dy = random(10, y1.shape, F32)

    def loss(module, x, dy, v):
        return jnp.sum(module.apply(v, x) * dy)

    g1 = jax.grad(lambda v: loss(one, x, dy, v))(variables)["params"]["kernel"]
    g = jax.jit(jax.grad(lambda v: loss(split, _laid_out(x, layout), _laid_out(dy, layout), v)))(variables)
    assert_close(g["params"]["kernel"], g1, F32, y1.size // 4, float(jnp.abs(x).max() * jnp.abs(dy).max()))


@needs_mesh
@pytest.mark.parametrize("layout", one_fast("zigzag"))
def test_nnx_causal_conv_with_segment_ids_equals_one_device(layout):
    mesh = _mesh()
    x = _video(6)
    clips = np.array([0] * 5 + [1] * 6 + [2] * 5, np.int32)  # clips straddling the borders
    ids = np.broadcast_to(clips[None, :, None, None], (2, 16, 5, 4))
    one = mk_nnx.CausalConv(3, 4, (2, 3, 3), rngs=nnx.Rngs(0))
    split = mk_nnx.CausalConv(3, 4, (2, 3, 3), rngs=nnx.Rngs(0), context_parallel=ContextParallel(mesh, "seq", layout))
    y1 = one(x, ids)
    y = nnx.jit(lambda m, x, ids: m(x, ids))(split, _laid_out(x, layout), _laid_out(ids, layout))
    taps = 18 * 3
    assert_close(_in_order(y, layout), y1, F32, taps, taps * float(jnp.abs(x).max() * jnp.abs(one.kernel[...]).max()))


@needs_mesh
@pytest.mark.parametrize("layout", one_fast(None))
def test_equinox_causal_conv_under_vmap_equals_one_device(layout):
    mesh = _mesh()
    key = jax.random.key(0)
    one = mk_eqx.CausalConv(1, 3, 4, 3, stride=2, key=key)  # audio: (C, T)
    split = mk_eqx.CausalConv(1, 3, 4, 3, stride=2, key=key, context_parallel=ContextParallel(mesh, "seq", layout))
    x = random(7, (2, 3, 32), F32)  # a batch of (C, T)
    y1 = jax.vmap(one)(x)
    zigzag = layout == "zigzag"
    y = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(split, parallel.to_zigzag(x, SHARDS, axis=2) if zigzag else x)
    y = parallel.from_zigzag(y, SHARDS, axis=2) if zigzag else y
    assert_close(y, y1, F32, 9, 9 * float(jnp.abs(x).max() * jnp.abs(one.weight).max()))


def test_context_parallel_names_a_bad_axis_or_layout():
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"axis_name='time' is not an axis of the mesh, whose axes are \('seq',\)"):
        ContextParallel(mesh, "time")
    with pytest.raises(ValueError, match=r"batch_axis='data' is not an axis"):
        ContextParallel(mesh, "seq", batch_axis="data")
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous', 'zigzag'\), got 'ring'"):
        ContextParallel(mesh, "seq", "ring")
    with pytest.raises(ValueError, match="cannot split the batch: batch_axis must be None"):
        mk_eqx.CausalConv(1, 3, 4, 3, key=jax.random.key(0), context_parallel=ContextParallel(mesh, "seq", batch_axis="seq"))


def test_a_module_with_context_parallel_is_hashable_and_keeps_its_parameters():
    """Linen modules are dataclasses compared and hashed by their fields; the config is one frozen field."""
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,))
    a, b = ContextParallel(mesh, "seq"), ContextParallel(mesh, "seq")
    assert a == b and hash(a) == hash(b) and a.shards == 1
    x = random(8, (1, 8, 4), F32)
    variables = mk_linen.ShortConv(kernel_size=3, context_parallel=a).init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"bias": (4,), "weight": (3, 4)}}
    assert isinstance(mk_linen.ShortConv(kernel_size=3, context_parallel=a), nn.Module)
