"""A child process that compiles and runs masked_conv's ``xla`` strategies over a grid of small
16-bit problems: ``python compile_grid.py --strategies conv,matmul DTYPE [INDEX ...]``
(``--regressions``: the problems that once aborted a compiler instead of the grid).

Why a child: XLA:CPU's code generator can abort the whole process on a 16-bit fusion
(jaxlib 0.12.1: "LLVM ERROR: Cannot select ... v8bf16", the design notes' CPU compiler
abort), and pytest dies with it. Here an abort ends this process only; the parent test
(``tests/masked_conv/test_compile_grid.py``) reads the last ``case`` line it printed and
fails naming the problem. Run it at XLA's default optimization level: the fast tier's
``-O0`` (tests/conftest.py) hides the abort.

The grid (:func:`problems`): every dimension order lax takes for 1-D and 2-D problems
(each permutation of x's, the kernel's and the output's axes appears once, the others
cycled beside it), a sample of the 3-D ones, with strides, kernel and input dilation,
explicit and named paddings, feature groups, and random masks (window masks, so boxes of
one, two and more taps, and channel-partial ones), 3 to 6 channels. Each problem compiles
the forward and the vector-Jacobian product (both gradients) under each strategy, and
checks them against lax on the same rounded inputs (computed once per problem), within
bounds from ``|x|``, ``|kernel|`` and ``|dy|``. A strategy whose programs are another's
(it fell back to it) is not compiled twice.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import maskconv_kernels as mk
from maskconv_kernels.ops.masked_conv import xla
from maskconv_kernels.ops.masked_conv.spec import make_spec
from support.lax_oracle import dense_mask

SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def _orders(letters: str) -> list[str]:
    return ["".join(p) for p in itertools.permutations(letters)]


def problems(seed: int = 0) -> list[dict]:
    """The grid: one dict of ``masked_conv`` arguments (and shapes) per problem, seeded."""
    rng = np.random.default_rng(seed)
    out = []
    for ndim, count in ((1, 6), (2, 24), (3, 6)):
        s = SPATIAL[ndim]
        lhs, rhs, res = _orders("NC" + s), _orders("OI" + s), _orders("NC" + s)
        picks = rng.permutation(len(lhs))[:count] if count < len(lhs) else range(count)
        for j, i in enumerate(picks):
            out.append(_problem(rng, ndim, (lhs[i], rhs[(5 * j + 1) % len(rhs)], res[(7 * j + 3) % len(res)]), len(out)))
    return out


def _problem(rng, ndim: int, dimension_numbers, index: int) -> dict:
    window = tuple(int(w) for w in rng.integers(1, 4, ndim))
    if np.prod(window) == 1:
        window = (2, *window[1:])
    groups = 2 if index % 5 == 4 else 1
    c_in = groups * int(rng.integers(2, 4)) if groups > 1 else int(rng.integers(3, 7))
    c_out = groups * int(rng.integers(2, 4)) if groups > 1 else int(rng.integers(3, 7))
    strides = tuple(int(v) for v in rng.integers(1, 3, ndim))
    dilation = tuple(int(v) for v in rng.integers(1, 3, ndim))
    lhs_dilation = (2,) * ndim if index % 6 == 5 else (1,) * ndim
    kind = index % 3
    if kind == 0 and lhs_dilation == (1,) * ndim:
        padding = ("SAME", "VALID", "SAME_LOWER")[index % 9 // 3]
    else:
        padding = tuple((int(lo), int(hi)) for lo, hi in rng.integers(0, 3, (ndim, 2)))
    spatial = tuple(int(v) for v in rng.integers(5, 9, ndim))
    batch = int(rng.integers(1, 3))
    kernel_channels_last = (*window, c_in // groups, c_out)
    if index % 4 == 3:  # channel-partial taps
        mask = rng.random(kernel_channels_last) < 0.6
        mask.flat[0] = True
    else:
        mask = rng.random(window) < 0.6
        mask.flat[int(rng.integers(mask.size))] = True
    return dict(
        index=index, seed=index, ndim=ndim, dimension_numbers=dimension_numbers, batch=batch, spatial=spatial, c_in=c_in,
        c_out=c_out, window=window, mask=mask, strides=strides, dilation=dilation, lhs_dilation=lhs_dilation,
        padding=padding, groups=groups,
    )


def case_id(p: dict) -> str:
    pad = p["padding"] if isinstance(p["padding"], str) else "".join(f"{lo}{hi}" for lo, hi in p["padding"])
    tup = lambda v: "".join(map(str, v))  # noqa: E731
    partial = "_partial" if p["mask"].ndim > p["ndim"] else ""
    return (
        f"{p['index']}:{'-'.join(p['dimension_numbers'])}_N{p['batch']}_{tup(p['spatial'])}_c{p['c_in']}-{p['c_out']}"
        f"_w{tup(p['window'])}_s{tup(p['strides'])}_d{tup(p['dilation'])}_l{tup(p['lhs_dilation'])}_p{pad}"
        f"_g{p['groups']}{partial}"
    )


def _shape(letters: str, sizes: dict) -> tuple[int, ...]:
    return tuple(sizes[c] for c in letters)


def _operands(p: dict, dtype):
    """x and the kernel in the problem's layouts, rounded to ``dtype``, and the mask in the kernel's order."""
    lhs, rhs, _ = p["dimension_numbers"]
    s = SPATIAL[p["ndim"]]
    x_sizes = dict(N=p["batch"], C=p["c_in"], **dict(zip(s, p["spatial"])))
    k_sizes = dict(O=p["c_out"], I=p["c_in"] // p["groups"], **dict(zip(s, p["window"])))
    if "values" in p:  # a regression's own operands
        x, k = p["values"]
    else:
        rng = np.random.default_rng(1000 + p["index"])
        x, k = rng.standard_normal(_shape(lhs, x_sizes)), rng.standard_normal(_shape(rhs, k_sizes)) / 3
    x, k = jnp.asarray(x, dtype), jnp.asarray(k, dtype)
    mask = p["mask"]
    if mask.ndim > p["ndim"]:  # channels-last (*window, I, O) to the kernel's order
        mask = mask.transpose([(s + "IO").index(c) for c in rhs])
    else:  # the window in the kernel's order of its spatial axes
        mask = mask.transpose([s.index(c) for c in rhs if c in s])
    return x, k, mask


def _conv_args(p: dict) -> dict:
    return dict(
        window_strides=p["strides"], padding=p["padding"], rhs_dilation=p["dilation"], lhs_dilation=p["lhs_dilation"],
        feature_group_count=p["groups"], dimension_numbers=p["dimension_numbers"],
    )


def spec(p: dict):
    """The problem's :class:`~maskconv_kernels.ops.masked_conv.spec.ConvSpec`, channels-last."""
    x, k, mask = _operands(p, jnp.bfloat16)
    a = _conv_args(p)
    return make_spec(
        x, k, mask, strides=a["window_strides"], padding=a["padding"], dilation=a["rhs_dilation"],
        lhs_dilation=a["lhs_dilation"], feature_group_count=a["feature_group_count"],
        dimension_numbers=a["dimension_numbers"],
    ).channels_last()


def _reference(x, k, ct, dense, args):
    """:func:`_lax_maps`, compiled at LLVM's -O0 (a third of the time): only ours need XLA's default."""
    lowered = jax.jit(_lax_maps, static_argnames="args").lower(x, k, ct, dense, args)
    return lowered.compile({"xla_backend_optimization_level": 0})(x, k, ct, dense)


def _lax_maps(x, k, ct, dense, args):
    """lax in float32 on the same rounded values: ``y``, ``dx``, ``dk``, then the same maps of
    the magnitudes (the bounds)."""
    args = dict(args)
    ref = lambda x, k: lax.conv_general_dilated(x, k, precision=lax.Precision.HIGHEST, **args)  # noqa: E731
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    km = jnp.where(dense, f32(k), 0.0)
    y, vjp = jax.vjp(ref, f32(x), km)
    dx, dk = vjp(f32(ct))
    y_abs, vjp_abs = jax.vjp(ref, jnp.abs(f32(x)), jnp.abs(km))
    dx_abs, dk_abs = vjp_abs(jnp.abs(f32(ct)))
    # lax's gradient of the masked entries of k * mask is not ours (exactly 0.0)
    return y, dx, jnp.where(dense, dk, 0.0), y_abs, dx_abs, dk_abs


def check(p: dict, strategies, dtype, seen: set) -> None:
    """Under each strategy, compiles and runs the forward and the VJP of both operands and
    checks them against lax within bounds; prints ``case <strategy>/<problem>`` before and
    ``ok`` after each. Programs another strategy already compiled (the same text: a
    strategy that falls back to another where it does not apply) are not compiled again;
    ``seen`` holds their texts."""
    x, k, mask = _operands(p, dtype)
    args = _conv_args(p)
    y_shape = None
    want = None
    for strategy in strategies:
        print(f"case {strategy}/{case_id(p)}", flush=True)
        config = xla.Config(strategy)
        f = lambda x, k, config=config: mk.masked_conv(x, k, mask, implementation="xla", config=config, **args)  # noqa: E731
        y_shape = y_shape or jax.eval_shape(f, x, k).shape
        ct = jnp.asarray(np.random.default_rng(p["seed"]).standard_normal(y_shape), dtype)
        forward = jax.jit(f).lower(x, k)
        backward = jax.jit(lambda x, k, ct, f=f: jax.vjp(f, x, k)[1](ct)).lower(x, k, ct)
        texts = (forward.as_text(), backward.as_text())
        if texts in seen:
            print("ok", flush=True)
            continue
        seen.add(texts)
        y = forward.compile()(x, k)
        dx, dk = backward.compile()(x, k, ct)
        if want is None:
            dn = lax.conv_dimension_numbers(x.shape, k.shape, args["dimension_numbers"])
            dense = jnp.asarray(dense_mask(mask, k.shape, dn))
            want = dense, _reference(x, k, ct, dense, tuple(args.items()))
        _assert_within_bounds((y, dx, dk), *want, dtype)
        print("ok", flush=True)


def _assert_within_bounds(got, dense, want, dtype) -> None:
    """``got`` (y, dx, dk) against lax's maps ``want[:3]`` within ``eps * want[3:]`` (the
    same maps of the magnitudes); masked kernel entries exactly 0.0."""
    eps = float(jnp.finfo(dtype).eps)
    for name, value, reference, bound in zip(("y", "dx", "dk"), got, want[:3], want[3:]):
        value, reference, bound = (np.asarray(a, np.float32) for a in (value, reference, bound))
        excess = np.abs(value - reference) - (eps * bound + 1e-6)
        if value.shape != reference.shape or (excess > 0).any():
            raise AssertionError(f"{name}: shape {value.shape} vs {reference.shape}, worst excess {excess.max()}")
    if (np.asarray(got[2], np.float32)[~np.asarray(dense)] != 0.0).any():
        raise AssertionError("dk: a masked entry is not exactly 0.0")


# Problems that once aborted a compiler, kept beside the grid. Issue 47 (jaxlib 0.12.1): a
# two-tap box of a channels-first kernel's slice fused with its layout transpose.
def _issue_47() -> dict:
    rng = np.random.default_rng(0)  # the issue's snippet, value for value
    values = rng.standard_normal((2, 6, 7, 4)), rng.standard_normal((5, 2, 3, 4))
    mask = rng.random((2, 3)) < 0.6  # (H, W)
    mask[0, 0] = True
    return dict(
        index="issue47", seed=47, values=values, ndim=2, dimension_numbers=("NWHC", "OHWI", "CHWN"), batch=2, spatial=(7, 6), c_in=4,
        c_out=5, window=(2, 3), mask=mask, strides=(1, 2), dilation=(2, 1), lhs_dilation=(1, 1), padding="VALID",
        groups=1,
    )


REGRESSIONS = (_issue_47,)


def main(argv: list[str]) -> int:
    """``[--regressions] --strategies S,... DTYPE [INDEX ...]``: every problem of the grid
    (or of those indices), or the regressions, under each strategy; ``done`` at the end."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--regressions", action="store_true")
    parser.add_argument("--strategies", required=True)
    parser.add_argument("dtype")
    parser.add_argument("indices", nargs="*")
    args = parser.parse_args(argv)
    found = [make() for make in REGRESSIONS] if args.regressions else problems()
    seen: set = set()
    for p in found:
        if not args.indices or str(p["index"]) in args.indices:
            check(p, args.strategies.split(","), jnp.dtype(args.dtype), seen)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
