"""Context parallelism as its clients run it, against the same model on one device (8 CPU devices).

* A MaxText-style hybrid block (Qwen3-Next's gated short convolution between projections,
  then causal attention) with the sequence in the zigzag layout causal attention balances
  its work with: the short convolution is ``sequence_sharded_causal_conv1d(layout="zigzag")``,
  the attention a stand-in that gathers keys and values and masks by each position's place
  in the sequence (what an all-gather context-parallel attention does).
* A CogVideoX-style causal 3-D encoder block (causal conv, SiLU, a time-strided causal conv,
  a residual through a strided causal 1x1x1) with time split over devices, as its
  ``ContextParallelCausalConv3d`` runs: ``time_sharded_causal_conv``.

Values and gradients within rounding of the single-device pass (two programs; the attention
sums its keys in another order); the conv layers' own exactness is tested beside them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from support.mesh import has_mesh_already, needs_mesh, run_on_forced_cpu_devices
from support.numerics import assert_close, random

import maskconv_kernels as mk
from maskconv_kernels import parallel

F32 = np.dtype(np.float32)
SHARDS = 4


@has_mesh_already
def test_on_8_forced_cpu_devices():
    run_on_forced_cpu_devices(__file__)


def _hybrid_params(dim, inner, width):
    return dict(w_in=random(1, (dim, 2 * inner), F32, scale=0.3), conv=random(2, (width, inner), F32, scale=0.5),
                bias=random(3, (inner,), F32, scale=0.3), w_qkv=random(4, (inner, 3 * inner), F32, scale=0.3),
                w_out=random(5, (inner, dim), F32, scale=0.3))


def _attention(q, k, v, q_pos, k_pos):
    """Causal softmax attention by positions: query at p sees keys at positions <= p."""
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, -jnp.inf)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)


def _hybrid_block(params, x, conv, attention):
    """Projection, gated short causal conv (SiLU), causal attention, output projection, residual."""
    u, z = jnp.split(x @ params["w_in"], 2, axis=-1)
    u = jax.nn.silu(conv(u, params["conv"], params["bias"]))
    q, k, v = jnp.split(u @ params["w_qkv"], 3, axis=-1)
    return x + (attention(q, k, v) * jax.nn.silu(z)) @ params["w_out"]


@needs_mesh
def test_maxtext_style_hybrid_block_in_the_zigzag_layout_equals_one_device():
    batch, length, dim, inner, width = 2, 64, 8, 12, 4
    mesh = jax.make_mesh((SHARDS, 2), ("seq", "data"), axis_types=(AxisType.Auto,) * 2)
    params = _hybrid_params(dim, inner, width)
    x = random(6, (batch, length, dim), F32)
    positions = np.asarray(parallel.to_zigzag(np.arange(length)[None], SHARDS))[0]  # each zigzag slot's position

    def sharded_conv(u, w, b):
        return parallel.sequence_sharded_causal_conv1d(u, w, b, mesh=mesh, axis_name="seq", batch_axis="data",
                                                       layout="zigzag")

    def sharded_attention(q, k, v):
        def local(q, k, v, q_pos):
            gathered = [lax.all_gather(a, "seq", axis=1, tiled=True) for a in (k, v)]
            return _attention(q, *gathered, q_pos, jnp.asarray(positions))

        return jax.shard_map(local, mesh=mesh, in_specs=(P("data", "seq"),) * 3 + (P("seq"),),
                             out_specs=P("data", "seq"))(q, k, v, jnp.asarray(positions))

    def single_attention(q, k, v):
        return _attention(q, k, v, jnp.arange(length), jnp.arange(length))

    sharded = jax.jit(lambda p, x: _hybrid_block(p, x, sharded_conv, sharded_attention))
    single = jax.jit(lambda p, x: _hybrid_block(p, x, mk.causal_conv1d, single_attention))
    xz = jax.device_put(parallel.to_zigzag(x, SHARDS), NamedSharding(mesh, P("data", "seq")))
    y = parallel.from_zigzag(np.asarray(sharded(params, xz)), SHARDS)
    y1 = single(params, x)
    assert_close(y, y1, F32, length * inner, float(np.abs(np.asarray(y1)).max()))
    loss = lambda f: lambda p, x: jnp.sum(f(p, x) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss(sharded)))(params, xz)
    grads1 = jax.jit(jax.grad(loss(single)))(params, x)
    for name in params:
        scale = float(np.abs(np.asarray(grads1[name])).max())
        assert_close(grads[name], grads1[name], F32, batch * length * inner, scale)


def _encoder_block(x, k1, k2, k_skip, conv):
    """A causal 3-D encoder block: conv, SiLU, a time-strided conv, plus a strided 1x1x1 skip."""
    h = jax.nn.silu(conv(x, k1, strides=1))
    return conv(h, k2, strides=(2, 1, 1)) + conv(x, k_skip, strides=(2, 1, 1))


@pytest.mark.slow  # test_time_sharded.py's layers are the fast tier's
@needs_mesh
def test_cogvideox_style_encoder_block_with_time_sharded_convs_equals_one_device():
    x = random(10, (2, 16, 6, 6, 4), F32)
    k1, k2 = random(11, (3, 3, 3, 4, 8), F32, scale=0.2), random(12, (3, 3, 3, 8, 8), F32, scale=0.2)
    k_skip = random(13, (1, 1, 1, 4, 8), F32, scale=0.5)
    mesh = jax.make_mesh((SHARDS, 2), ("time", "data"), axis_types=(AxisType.Auto,) * 2)

    def sharded_conv(x, k, strides):
        return parallel.time_sharded_causal_conv(x, k, mesh=mesh, axis_name="time", batch_axis="data",
                                                 strides=strides, padding="SAME", padding_mode="replicate")

    def single_conv(x, k, strides):
        return mk.causal_conv(x, k, strides=strides, padding="SAME", padding_mode="replicate")

    sharded = jax.jit(lambda *a: _encoder_block(*a, sharded_conv))
    single = jax.jit(lambda *a: _encoder_block(*a, single_conv))
    y, y1 = sharded(x, k1, k2, k_skip), single(x, k1, k2, k_skip)
    assert y.shape == y1.shape == (2, 8, 6, 6, 8)
    assert_close(y, y1, F32, 27 * 8 + 27 * 4, float(np.abs(np.asarray(y1)).max()) + 1.0)
    text = sharded.lower(x, k1, k2, k_skip).compile().as_text()
    assert "collective-permute" in text
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) ** 2), argnums=(0, 1, 2)))(x, k1, k2, k_skip)
    grads1 = jax.jit(jax.grad(lambda *a: jnp.sum(single(*a) ** 2), argnums=(0, 1, 2)))(x, k1, k2, k_skip)
    for g, g1 in zip(grads, grads1):
        assert_close(g, g1, F32, 2 * 16 * 36 * 27 * 8, float(np.abs(np.asarray(g1)).max()))
