"""The linen and nnx ``Conv`` drop-ins with ``segment_ids``: exactly ``masked_conv`` with them.

Each module's output is compared bit for bit with :func:`maskconv_kernels.masked_conv`
given the same parameters and ids, the batch dims flattened as flax flattens them (none,
one or several), plus the bias. Then what packing promises through a module: a NaN in
one document reaches no other, the gradient across documents is exactly 0.0; and the
padding modes that copy values across the border (``"CIRCULAR"``, ``"REFLECT"``) are
refused with segment ids.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.numerics import random

import maskconv_kernels as mk
from maskconv_kernels.flax import MaskedConv
from maskconv_kernels.flax import nnx as mk_nnx


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    x_shape: tuple[int, ...]  # with the batch dims the module sees
    features: int
    kernel_size: tuple[int, ...]
    mask: np.ndarray | None
    fields: dict = dataclasses.field(default_factory=dict)

    @property
    def ndim(self) -> int:
        return len(self.kernel_size)

    def segment_ids(self) -> np.ndarray:
        """Documents of 1 to 5 positions along the last spatial axis (raster order in 2-D), padding last."""
        shape = self.x_shape[:-1]
        flat = np.zeros(int(np.prod(shape)), np.int32)
        rng = np.random.default_rng(len(self.name))
        rows = flat.reshape(-1, shape[-1])
        for row in rows:
            start, doc = 0, 0
            while start < row.size:
                length = int(rng.integers(1, 6))
                row[start : start + length] = doc
                start, doc = start + length, doc + 1
            row[-1] = -1  # a padding position at the end of each row
        return flat.reshape(shape)


CASES = [
    Case("N3_T17_C4_F4_k4_causal_depthwise", (3, 17, 4), 4, (4,), None, dict(padding="CAUSAL", feature_group_count=4)),
    Case("N2_T16_C3_F5_k3_gap_dil2", (2, 16, 3), 5, (3,), np.array([1, 0, 1], bool),
         dict(padding=((4, 0),), kernel_dilation=2)),
    Case("N2_H6_W7_C2_F3_k3_A_same", (2, 6, 7, 2), 3, (3, 3), mk.pixelcnn_mask((3, 3), "A")),
    Case("nobatch_T12_C2_F3_k3_causal", (12, 2), 3, (3,), None, dict(padding="CAUSAL", use_bias=False)),
    Case("N2x3_T10_C2_F2_k2_causal_batchdims", (2, 3, 10, 2), 2, (2,), None, dict(padding="CAUSAL")),
]


def _params(case: Case, seed: int = 3):
    c_in = case.x_shape[-1]
    kernel = random(seed, (*case.kernel_size, c_in // case.fields.get("feature_group_count", 1), case.features),
                    scale=0.5)
    params = {"kernel": kernel}
    if case.fields.get("use_bias", True):
        params["bias"] = random(seed + 1, (case.features,))
    return params


def _expected(case: Case, x, ids, params):
    """``masked_conv`` on the batch dims flattened as flax does, plus the bias."""
    spatial = case.x_shape[-case.ndim - 1 : -1]
    y = mk.masked_conv(
        x.reshape(-1, *spatial, x.shape[-1]), params["kernel"], case.mask, padding=case.fields.get("padding", "SAME"),
        dilation=case.fields.get("kernel_dilation", 1), feature_group_count=case.fields.get("feature_group_count", 1),
        segment_ids=ids.reshape(-1, *spatial),
    )
    y = y.reshape(*x.shape[:-1], case.features)
    return y + params["bias"] if "bias" in params else y


def _nnx_conv(case: Case, params):
    layer = mk_nnx.Conv(case.x_shape[-1], case.features, case.kernel_size, mask=case.mask, rngs=nnx.Rngs(0),
                        **case.fields)
    layer.kernel[...] = params["kernel"]
    if "bias" in params:
        layer.bias[...] = params["bias"]
    return layer


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_linen_conv_with_segment_ids_is_masked_conv(case):
    x, ids, params = random(1, case.x_shape), jnp.asarray(case.segment_ids()), _params(case)
    layer = MaskedConv(case.features, case.kernel_size, mask=case.mask, **case.fields)
    y = layer.apply({"params": params}, x, ids)
    np.testing.assert_array_equal(y, _expected(case, x, ids, params))
    assert not np.array_equal(y, layer.apply({"params": params}, x))  # the ids change something


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nnx_conv_with_segment_ids_is_masked_conv(case):
    x, ids, params = random(1, case.x_shape), jnp.asarray(case.segment_ids()), _params(case)
    layer = _nnx_conv(case, params)
    np.testing.assert_array_equal(layer(x, ids), _expected(case, x, ids, params))


def test_no_value_or_gradient_crosses_a_document_in_a_module():
    """A Mamba-style depthwise causal conv over packed rows, jitted with its gradient."""
    case = CASES[0]
    x, ids, params = random(4, case.x_shape), jnp.asarray(case.segment_ids()), _params(case)
    layer = MaskedConv(case.features, case.kernel_size, mask=case.mask, **case.fields)
    apply = jax.jit(lambda x: layer.apply({"params": params}, x, ids))
    doc = np.asarray(ids) == 1
    poisoned = jnp.where(doc[..., None], jnp.nan, x)
    np.testing.assert_array_equal(np.asarray(apply(poisoned))[~doc], np.asarray(apply(x))[~doc])
    dx = jax.grad(lambda x: jnp.where(doc[..., None], apply(x), 0.0).sum())(x)
    assert not np.asarray(dx)[~doc].any() and np.asarray(dx)[doc].all()


@pytest.mark.parametrize("padding", ["CIRCULAR", "REFLECT"])
def test_padding_that_copies_across_the_border_is_refused(padding):
    x, ids = jnp.ones((2, 8, 3)), jnp.zeros((2, 8), jnp.int32)
    layer = MaskedConv(4, (3,), padding=padding)
    variables = {"params": _params(Case("", (2, 8, 3), 4, (3,), None))}
    with pytest.raises(ValueError, match=f"segment_ids with padding='{padding}'.*pad with zeros"):
        layer.apply(variables, x, ids)
    with pytest.raises(ValueError, match=f"segment_ids with padding='{padding}'"):
        mk_nnx.Conv(3, 4, 3, padding=padding, rngs=nnx.Rngs(0))(x, ids)


def test_segment_ids_errors_name_the_shape_and_the_argument():
    x = jnp.ones((2, 3, 8, 3))  # two batch dims
    layer = mk_nnx.Conv(3, 4, 3, padding="CAUSAL", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"segment_ids must have the inputs' shape without their channels, "
                                         r"\(\*batch_dims, \*spatial\) = \(2, 3, 8\), got \(6, 8\)"):
        layer(x, jnp.zeros((6, 8), jnp.int32))
    with pytest.raises(TypeError, match="pass out_sharding= by keyword"):
        layer(x, jax.sharding.PartitionSpec())
    with pytest.raises(ValueError, match="segment_ids need an output on the input's grid"):
        mk_nnx.Conv(3, 4, 3, strides=2, padding="CAUSAL", rngs=nnx.Rngs(0))(x, jnp.zeros((2, 3, 8), jnp.int32))


def test_decode_steps_take_no_segment_ids():
    layer = MaskedConv(2, (3,), padding="CAUSAL", decode=True)
    variables = layer.init(jax.random.key(0), jnp.ones((1, 6, 2)))
    with pytest.raises(ValueError, match="segment_ids is for full inputs"):
        layer.apply(variables, jnp.ones((1, 1, 2)), jnp.zeros((1, 1), jnp.int32), mutable=["cache"])
