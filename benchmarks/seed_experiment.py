"""The original report's two experiments, verbatim, for lax.conv and masked_conv, eager and jitted.

    python -m benchmarks.seed_experiment [--json PATH]

The report (JAX's issue tracker, jax 0.3.14 on a GTX 1080 Ti) masked the last row of a
3x3 kernel over a 5x5 image with 128 channels, ``SAME`` padding and dimension numbers
``('NHWC', 'HWOI', 'NHWC')``:

1. the gradient of ``out[:, 2, 2, :].sum()`` at the input pixels of row 3, which the
   centre reaches only through the masked row: ~1e-7 on the GPU run op by op, 0 when
   jitted;
2. rows 0-2 zeros and rows 3-4 ones, jitted: row 2 of the output reads ones only
   through the masked row, yet was ~1.2e-7 on the GPU.

The same code here (``PRNGKey(42)``, the same splits, scale and mask) runs both, eager
and under ``jax.jit``, with ``lax.conv_general_dilated(x, kernel * mask)`` and with
:func:`maskconv_kernels.masked_conv` (the mask as its static 3x3 taps,
``implementation=None``: what the platform picks). It prints the per-pixel mean
``|gradient|`` and ``|output|`` maps, as the report did, and the two figures that matter:
the largest ``|gradient|`` on row 3 and the largest ``|output|`` on row 2 (exact: 0).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax import random

import maskconv_kernels as mk

DIMENSION_NUMBERS = ("NHWC", "HWOI", "NHWC")


def seed_inputs(feat_dim: int = 128):
    """The report's input, kernel and (broadcast) mask, drawn as it drew them."""
    rng = random.PRNGKey(42)
    rng, inp_rng, kernel_rng = random.split(rng, 3)
    inp = random.normal(inp_rng, (1, 5, 5, feat_dim))
    kernel = 1 / jnp.sqrt(9 * feat_dim) * random.normal(kernel_rng, (3, 3, feat_dim, feat_dim))
    mask = jnp.concatenate([jnp.ones((2, 3, feat_dim, feat_dim)), jnp.zeros((1, 3, feat_dim, feat_dim))], axis=0)
    return inp, kernel, mask


def convs(mask):
    """``{name: conv(input, kernel)}``: the report's ``apply_masked_conv`` and masked_conv."""
    taps = np.asarray(mask[:, :, 0, 0], bool)

    def lax_conv(input_tensor, kernel_tensor):
        kernel_tensor *= mask
        return lax.conv_general_dilated(input_tensor, kernel_tensor, (1, 1), "SAME",
                                        dimension_numbers=DIMENSION_NUMBERS)

    def masked(input_tensor, kernel_tensor):
        return mk.masked_conv(input_tensor, kernel_tensor, taps, padding="SAME", dimension_numbers=DIMENSION_NUMBERS)

    return {"lax.conv(kernel*mask)": lax_conv, "masked_conv": masked}


def experiments(feat_dim: int = 128) -> dict:
    """Per convolution and mode (eager, jit): the two maps and the two figures."""
    inp, kernel, mask = seed_inputs(feat_dim)
    ones_below = jnp.concatenate([jnp.zeros((1, 3, 5, feat_dim)), jnp.ones((1, 2, 5, feat_dim))], axis=1)
    found = {}
    for name, conv in convs(mask).items():
        grad_fn = jax.grad(lambda input_tensor, conv=conv: conv(input_tensor, kernel)[:, 2, 2, :].sum())
        for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
            grads = np.asarray(wrap(grad_fn)(inp), np.float64)
            out = np.asarray(wrap(lambda x, conv=conv: conv(x, kernel))(ones_below), np.float64)
            found[f"{name}, {mode}"] = {
                "grad_row3_max_abs": float(np.abs(grads[:, 3]).max()),
                "out_row2_max_abs": float(np.abs(out[:, 2]).max()),
                "grad_map": np.abs(grads).mean(axis=-1)[0].tolist(),
                "out_map": np.abs(out).mean(axis=-1)[0].tolist(),
            }
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures and maps here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    found = experiments()
    np.set_printoptions(precision=8, linewidth=120)
    for label, r in found.items():
        print(f"\n{label}: mean |grad| per pixel (row 3 reached only through the masked row)")
        print(np.array(r["grad_map"]))
        print(f"{label}: mean |out| per pixel, zeros over ones (row 2 reads ones only through the masked row)")
        print(np.array(r["out_map"]))
    print("\n| convolution, mode | max |grad| on row 3 | max |out| on row 2 |\n|---|---:|---:|")
    for label, r in found.items():
        print(f"| {label} | {r['grad_row3_max_abs']:.3g} | {r['out_row2_max_abs']:.3g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
                       "experiments": found}, f, indent=1)
    exact = all(r["grad_row3_max_abs"] == 0 == r["out_row2_max_abs"] for k, r in found.items() if "masked_conv" in k)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
