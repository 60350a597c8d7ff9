"""The causality audit on the digits gated PixelCNN: three networks, one parameter tree.

    python examples/pixelcnn/audit.py [--json PATH]

* ``GatedPixelCNN()``, built from ``maskconv_kernels.flax.MaskedConv``: passes (every
  gradient from the future exactly 0.0, NaN in the future leaves every output
  bit-identical);
* ``GatedPixelCNN(leaky=True)``, the same network from ``flax.linen.Conv(mask=...)``:
  its gradients are exact on CPU, but NaN isolation fails (``0 * NaN = NaN`` under a
  masked tap; on GPUs cuDNN's Winograd/FFT algorithms can also leak gradients);
* the same network without the vertical-to-horizontal shift (the vertical stack's first
  layer keeps the centre row): fails on every platform, gradient leak > 0, with the first
  offending pixels named.

The parameters are the initial ones (seed 0): causality is a property of the wiring, so
training is not needed to audit it. Needs flax and this package.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import maskconv_kernels as mk  # noqa: E402
from model import GatedPixelCNN, vertical_mask  # noqa: E402


class UnshiftedGatedPixelCNN(GatedPixelCNN):
    """The classic bug: the vertical stack's first layer sees the centre row (type "B"),
    so the horizontal stack, which adds it, sees the pixels right of the centre and the
    centre itself. Same parameter tree as :class:`GatedPixelCNN`."""

    def masked(self, features: int, mask: np.ndarray, c_in: int, name: str, first: bool = False):
        if name == "v0":
            mask = vertical_mask(mask.shape[0], first=False)
        return super().masked(features, mask, c_in, name, first=first)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the three reports here, as JSON")
    args = parser.parse_args(argv)

    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 8, 8, 1)), jnp.float32)
    variables = GatedPixelCNN().init(jax.random.PRNGKey(0), x)
    models = {
        "MaskedConv": GatedPixelCNN(),
        "nn.Conv(mask=...)": GatedPixelCNN(leaky=True),
        "no vertical shift": UnshiftedGatedPixelCNN(),
    }
    reports = {}
    for name, model in models.items():
        reports[name] = mk.audit_causal(mk.as_function(model, variables), x)
        print(f"== {name}\n{reports[name]}\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
