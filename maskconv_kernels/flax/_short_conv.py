"""What the linen and nnx ``ShortConv`` modules share: PyTorch's initialisers, the state's shape,
the arithmetic, the full pass and the decode step, and the converters from depthwise ``Conv`` s.

Mamba's, Mamba-2's and gated DeltaNet's short convolutions are ``torch.nn.Conv1d(D, D,
kernel_size=W, groups=D)`` (flash-linear-attention's ``ShortConvolution`` subclasses
it) left at PyTorch's default initialisation: ``kaiming_uniform_(a=sqrt(5))`` for the
weight and ``uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the bias, with ``fan_in =
(D / groups) * W = W`` for a depthwise convolution. Both bounds are then ``1/sqrt(W)``
(the gain ``sqrt(2 / (1 + a^2)) = sqrt(1/3)`` times ``sqrt(3 / fan_in)``). A PyTorch
weight ``(D, 1, W)`` loads as ``weight = w[:, 0, :].T``, ``(W, D)``.

Flax models write the same convolution as ``nn.Conv(features=D, kernel_size=(W,),
feature_group_count=D, padding="CAUSAL")`` (or ``((W - 1) * dilation, 0)``; MaxText's
gated DeltaNet, with ``use_bias=False``), whose kernel is ``(W, 1, D)``:
:func:`from_conv_params` converts its parameters, :func:`conv_fields` the layer's fields,
with :data:`ARITHMETICS` saying how its weight meets the input: a Flax convolution casts
its parameters to its ``dtype`` before it convolves (``promote_dtype``), so a converter
that kept a float32 weight against bfloat16 inputs would compute something else.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding

from maskconv_kernels._core.args import as_segment_ids
from maskconv_kernels.flax._conv import kernel_size_tuple
from maskconv_kernels.ops.causal_conv1d import PAD_SLOT_ID, causal_conv1d, causal_conv1d_update

__all__ = [
    "ARITHMETICS", "torch_conv1d_uniform", "weight_init", "bias_init_for", "state_shape", "check_padding",
    "check_arithmetic", "operands", "full_pass", "decode_step", "refuse_state_arguments", "refuse_full_pass_states",
    "from_conv_params", "conv_fields",
]

# How the weight and bias meet the input (the modules' ``arithmetic``):
# "wide": the parameters stay in param_dtype (Mamba's float32 weights with bfloat16
#   activations): products in the wider dtype, float32 accumulation, bias and activation
#   in float32, one rounding;
# "promote": x, weight and bias first cast to one computation dtype (dtype, else their
#   promoted one), as Flax's promote_dtype casts them; then as "wide": what the library's
#   CausalConv computes;
# "nn_conv": what nn.Conv / nnx.Conv(dtype=...) and then the activation compute: the
#   promoted products rounded to the computation dtype, the bias added in that dtype (a
#   second rounding), the activation in float32 on that and rounded again (MaxText's
#   silu(conv(x).astype(float32)).astype(dtype)).
ARITHMETICS = ("wide", "promote", "nn_conv")


def torch_conv1d_uniform(width: int):
    """``uniform(-1/sqrt(width), 1/sqrt(width))``: PyTorch's depthwise ``Conv1d`` weight and bias initialiser."""
    bound = 1.0 / math.sqrt(width)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def weight_init(key, shape, dtype=jnp.float32):
    """PyTorch's ``Conv1d`` default for a depthwise weight ``(W, D)``: ``uniform(±1/sqrt(W))``."""
    return torch_conv1d_uniform(shape[0])(key, shape, dtype)


def bias_init_for(width: int, bias_init):
    """``bias_init``, or PyTorch's default (``uniform(±1/sqrt(width))``) when it is ``None``."""
    return torch_conv1d_uniform(width) if bias_init is None else bias_init


def state_shape(input_shape, width: int, dilation: int, features: int) -> tuple[int, int, int]:
    """``(N, (W - 1) * dilation, D)``: the decode state for full-size inputs of ``input_shape`` ``(N, L, D)``."""
    if len(input_shape) != 3 or input_shape[-1] != features:
        raise ValueError(
            f"ShortConv decodes inputs (N, L, D) with D = {features}: give the full-size input shape (N, L, "
            f"{features}) to allocate the state, got {tuple(input_shape)}"
        )
    return (input_shape[0], (width - 1) * dilation, features)


def check_padding(padding, width: int, dilation: int) -> None:
    """``padding`` is causal: ``"CAUSAL"`` or ``((W - 1) * dilation, 0)``, as a Flax conv spells it.

    A ``ShortConv`` is causal by construction; the field exists so that a port can keep
    the ``padding="CAUSAL"`` its ``nn.Conv`` had, and anything else is refused, not ignored.
    """
    causal = ((width - 1) * dilation, 0)
    if isinstance(padding, str):
        ok = padding.upper() == "CAUSAL"
    else:
        try:
            ok = [tuple(p) for p in canonicalize_padding(padding, 1)] == [causal]
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"ShortConv is causal: padding must be 'CAUSAL' (output t sees inputs up to t, as nn.Conv's) or "
            f"(({causal[0]}, 0),) = ((kernel_size - 1) * dilation, 0), got {padding!r}; a convolution that reads "
            "later positions is maskconv_kernels.flax.MaskedConv(..., feature_group_count=D, padding=...)"
        )


def check_arithmetic(arithmetic) -> None:
    """``arithmetic`` is one of :data:`ARITHMETICS`."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(
            f"arithmetic must be one of {ARITHMETICS}: 'wide' (weight and bias kept in param_dtype, Mamba's), "
            f"'promote' (cast to the computation dtype first, as CausalConv) or 'nn_conv' (nn.Conv's roundings), "
            f"got {arithmetic!r}"
        )


def operands(module, x, weight, bias):
    """``(x, weight, bias)`` in the dtypes the module's ``arithmetic`` convolves them in.

    ``"wide"``: ``x`` cast to ``dtype`` (if set), the parameters left in ``param_dtype``.
    Otherwise all three cast to ``dtype``, or (``dtype=None``) to their promoted dtype,
    as Flax's ``promote_dtype`` does.
    """
    if module.arithmetic == "wide":
        return (x if module.dtype is None else jnp.asarray(x, module.dtype)), weight, bias
    given = [a for a in (x, weight, bias) if a is not None]
    dtype = module.dtype if module.dtype is not None else jnp.result_type(*given)
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, weight, bias))


def _padding_mask(y, segment_ids, positions, padding_id, state_indices=None):
    """Where ``y (B, T, D)`` (or ``(B, D)``) is padding: the op's zero outputs, by the same rules."""
    real = jnp.ones(y.shape[:-1], bool)
    if segment_ids is not None:
        ids = as_segment_ids(segment_ids, y.shape[:-1], "x's shape without D")
        real = (ids >= 0) if padding_id is None else (ids >= 0) & (ids != padding_id)
    elif positions is not None:
        real = jnp.reshape(jnp.asarray(positions), y.shape[:-1]) >= 0
    if state_indices is not None:
        rows = jnp.asarray(state_indices) != PAD_SLOT_ID
        real = real & rows.reshape((-1,) + (1,) * (real.ndim - 1))
    return ~real


def _convolve(module, fn, x, weight, bias, padding, **kw):
    """``fn`` (:func:`causal_conv1d`, its context-parallel form or :func:`causal_conv1d_update`) on the
    operands of :func:`operands`, with the module's activation, in its arithmetic.

    ``"nn_conv"``: the op convolves alone (no bias, no activation: rounded once, as
    ``nn.Conv`` rounds its convolution), then the bias is added in the output's dtype and
    the activation applied in float32 and rounded; padding outputs are zeros again
    (``padding``: :func:`_padding_mask`'s arguments). The other arithmetics are the op's.
    """
    if module.arithmetic != "nn_conv" or (bias is None and module.activation is None):
        return fn(x, weight, bias, activation=module.activation, **kw)
    out = fn(x, weight, None, activation=None, **kw)
    y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    if module.activation is not None:
        y = jax.nn.silu(y.astype(jnp.promote_types(y.dtype, jnp.float32))).astype(x.dtype)
    if bias is not None:
        y = jnp.where(_padding_mask(y, *padding)[..., None], jnp.zeros((), y.dtype), y)
    return y if rest is None else (y, *rest)


def full_pass(module, x, weight, bias, segment_ids=None, positions=None, *, initial_state=None,
              return_final_state: bool = False):
    """A ``ShortConv``'s full pass ``(N, L, D)``: :func:`causal_conv1d` with the module's
    ``activation``, ``dilation``, ``padding_id``, ``arithmetic`` and ``implementation``, over
    its ``context_parallel`` split where it has one
    (:meth:`~maskconv_kernels.parallel.ContextParallel.causal_conv1d`).

    ``initial_state`` ``(N, (W - 1) * dilation, D)`` (in the computation dtype) and
    ``return_final_state`` as :func:`causal_conv1d` takes them: then ``(y, final_state)``.
    """
    x, weight, bias = operands(module, x, weight, bias)
    padding_id = module.padding_id if segment_ids is not None else None  # a field, for the calls that pack
    kw = dict(segment_ids=segment_ids, positions=positions, dilation=module.dilation,
              implementation=module.implementation, initial_state=initial_state, return_final_state=return_final_state)
    if padding_id is not None:
        kw["padding_id"] = padding_id
    fn = causal_conv1d if module.context_parallel is None else module.context_parallel.causal_conv1d
    return _convolve(module, fn, x, weight, bias, (segment_ids, positions, padding_id), **kw)


def decode_step(
    module, x, state, weight, bias, segment_ids=None, positions=None, *, state_indices=None, has_initial_state=None,
) -> tuple[jax.Array, jax.Array]:
    """A ``ShortConv``'s decode step: ``(y, new state)`` from :func:`causal_conv1d_update` with
    the module's ``activation``, ``dilation``, ``arithmetic`` and ``implementation``.

    ``x``: ``(N, T, D)`` (or ``(B, T, D)`` with ``state_indices``); ``state``: ``(N,
    (W - 1) * dilation, D)``; ``y`` is shaped like ``x``. ``segment_ids`` are refused: a
    step continues each row's sequence (``positions`` start documents inside a chunk).
    """
    if segment_ids is not None:
        raise ValueError("segment_ids is for full sequences: a decode step continues one sequence per row")
    x, weight, bias = operands(module, x, weight, bias)

    def update(x, weight, bias, **kw):
        return causal_conv1d_update(x, state, weight, bias, **kw)

    return _convolve(
        module, update, x, weight, bias, (None, positions, None, state_indices), dilation=module.dilation,
        state_indices=state_indices, has_initial_state=has_initial_state, implementation=module.implementation,
        positions=positions,
    )


def refuse_state_arguments(state_indices, has_initial_state, allocation: str) -> None:
    """Raises ``ValueError`` for decode-only arguments in a full pass; ``allocation`` names how the module allocates its state."""
    if state_indices is not None or has_initial_state is not None:
        raise ValueError(
            f"state_indices and has_initial_state are for decode steps (decode=True, after {allocation}); a full "
            "forward pass starts every row from zeros, or from initial_state"
        )


def refuse_full_pass_states(initial_state, return_final_state: bool, cache: str) -> None:
    """Raises ``ValueError`` for a full pass's state arguments in decode mode, where ``cache`` holds the state."""
    if initial_state is not None or return_final_state:
        raise ValueError(
            f"initial_state and return_final_state are for the full pass (decode=False); when decoding the state "
            f"is {cache}: start it from an existing state there instead"
        )


def from_conv_params(params: Mapping) -> dict:
    """A depthwise ``nn.Conv``'s parameters as ``ShortConv``'s: ``kernel (W, 1, D)`` -> ``weight (W, D)``.

    ``params``: ``{"kernel": (W, 1, D), "bias": (D,)}`` (``bias`` optional), or variables
    holding them under ``"params"``, as ``nn.Conv(features=D, kernel_size=(W,),
    feature_group_count=D).init`` returns them; the result has the same nesting. The
    kernel's values are kept (``kernel[:, 0, :]``), so a ``ShortConv`` with these
    parameters computes the causal convolution that conv computes with ``padding="CAUSAL"``
    or ``((W - 1) * dilation, 0)``: up to rounding with the default arithmetic, bit for bit
    with the module :meth:`ShortConv.from_conv(conv) <maskconv_kernels.flax.linen.ShortConv.from_conv>`
    builds (the conv's ``dtype`` and roundings). Checkpoints of a model that used the
    ``nn.Conv`` load through it::

        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> from maskconv_kernels.flax import ShortConv, from_conv_params
        >>> x = jnp.ones((2, 16, 8))
        >>> conv = nn.Conv(8, (4,), feature_group_count=8, padding="CAUSAL")
        >>> conv_variables = conv.init(jax.random.key(0), x)
        >>> variables = from_conv_params(conv_variables)
        >>> jax.tree_util.tree_map(jnp.shape, variables)
        {'params': {'bias': (8,), 'weight': (4, 8)}}
        >>> bool(jnp.allclose(ShortConv(4).apply(variables, x), conv.apply(conv_variables, x)))
        True
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"from_conv_params takes nn.Conv's parameters, a mapping with 'kernel', got {type(params).__name__}")
    if "params" in params and "kernel" not in params:
        return {**params, "params": from_conv_params(params["params"])}
    if "kernel" not in params or set(params) - {"kernel", "bias"}:
        raise ValueError(
            f"from_conv_params takes a depthwise nn.Conv's parameters {{'kernel', 'bias'}} (or variables holding them "
            f"under 'params'), got keys {sorted(params)}"
        )
    kernel = params["kernel"]
    shape = tuple(jnp.shape(kernel))
    if len(shape) != 3 or shape[1] != 1:
        raise ValueError(
            f"from_conv_params: kernel must be a depthwise 1-D convolution's (W, 1, D) (nn.Conv with "
            f"kernel_size=(W,) and feature_group_count = features = D), got shape {shape}"
        )
    converted = {"weight": kernel[:, 0, :]}
    if "bias" in params:
        if tuple(jnp.shape(params["bias"])) != (shape[2],):
            raise ValueError(f"from_conv_params: bias must be (D,) = ({shape[2]},), got {tuple(jnp.shape(params['bias']))}")
        converted["bias"] = params["bias"]
    return converted


def conv_fields(conv, *, causal_conv: bool) -> dict:
    """The ``ShortConv`` fields that compute what the depthwise 1-D ``conv`` computes, its arithmetic included.

    ``conv``: a Flax ``nn.Conv`` / ``nnx.Conv`` (or this library's ``MaskedConv`` without a
    mask) with ``feature_group_count = in_features = out_features`` and a causal padding,
    or (``causal_conv=True``) this library's linen or nnx ``CausalConv`` of one axis, time.
    Returns ``kernel_size``, ``dilation``, ``use_bias``, ``dtype``, ``param_dtype`` and
    ``arithmetic``: ``"nn_conv"`` for a Flax conv (its parameters cast to its ``dtype``, its
    convolution rounded before its bias is added), ``"promote"`` for a ``CausalConv`` (cast,
    then bias and rounding once, as :func:`~maskconv_kernels.causal_conv`).

    Raises:
      ValueError: every way ``conv`` differs from a ``ShortConv``, in one message.
    """
    name = type(conv).__name__
    window = kernel_size_tuple(conv.kernel_size)
    dilations = kernel_size_tuple(conv.kernel_dilation or 1)  # an int or one per dim, as kernel_size
    d_in, d_out = getattr(conv, "in_features", None), getattr(conv, "out_features", None)
    d_out = d_out if d_out is not None else conv.features  # linen's modules know C_in from their parameters only
    problems = []
    if len(window) != 1 or conv.feature_group_count != d_out or (d_in is not None and d_in != d_out):
        problems.append(
            "a depthwise 1-D convolution (kernel_size (W,), feature_group_count = in_features = out_features), "
            f"got kernel_size {window} with feature_group_count={conv.feature_group_count} and "
            f"{'' if d_in is None else f'in_features={d_in}, '}out_features={d_out}"
        )
    elif causal_conv:
        if conv.padding_mode != "zeros":
            problems.append(
                f"padding_mode='zeros' (a ShortConv reads zeros before position 0), got {conv.padding_mode!r}: keep "
                "the CausalConv for a layer that repeats its first frame"
            )
    else:
        causal = [((window[0] - 1) * dilations[0], 0)]
        padding = canonicalize_padding(conv.padding, 1)
        if not (padding == "CAUSAL" or (not isinstance(padding, str) and [tuple(p) for p in padding] == causal)):
            problems.append(f"a causal padding, 'CAUSAL' or (({causal[0][0]}, 0),), got {conv.padding!r}")
    plain = [conv.strides] + ([] if causal_conv else [getattr(conv, "input_dilation", 1)])
    if any(v not in (None, 1, (1,), [1]) for v in plain) or getattr(conv, "mask", None) is not None:
        problems.append("stride 1, no input dilation and no mask" if not causal_conv else "stride 1")
    if problems:
        raise ValueError(f"ShortConv.from_conv needs {'; and '.join(problems)} (got a {name})")
    return dict(kernel_size=window[0], dilation=dilations[0], use_bias=bool(conv.use_bias), dtype=conv.dtype,
                param_dtype=conv.param_dtype, arithmetic="promote" if causal_conv else "nn_conv")
