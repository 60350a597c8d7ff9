"""The leak report: ``python -m maskconv_kernels``.

Runs, on the local default device, the experiments of the original report (JAX issue
"Gradient leakage through masked convolutions") and a NaN-isolation test, for the usual
``lax.conv_general_dilated(x, kernel * mask)`` and for :func:`masked_conv` side by side,
then a small timing table. Every figure is measured in this process. Each stage is
announced on stderr as it starts, with its time when it ends; the report goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np

from .audit import audit_causal
from .masks import pixelcnn_mask
from .ops.masked_conv import implementation_for, masked_conv
from .ops.masked_conv.reference import leaky_masked_conv
from .ops.masked_conv.spec import make_spec

LAST_ROW_MASKED = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]], bool)


def _convs(implementation):
    return {
        "lax.conv(kernel*mask)": leaky_masked_conv,
        "masked_conv": lambda x, k, m, **kw: masked_conv(x, k, m, implementation=implementation, **kw),
    }


def gradient_leak(conv, channels: int = 128) -> float:
    """Seed experiment 1: max |d out[2, 2] / d x| over rows 3-4, reachable only through masked taps."""
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 5, 5, channels))
    k = jax.random.normal(jax.random.PRNGKey(2), (3, 3, channels, channels)) / np.sqrt(9 * channels)
    g = jax.jit(jax.grad(lambda x: conv(x, k, LAST_ROW_MASKED)[:, 2, 2, :].sum()))(x)
    return float(jnp.abs(g[:, 3:]).max())


def zeros_over_ones(conv, channels: int = 128) -> float:
    """Seed experiment 2: rows 0-2 zeros, rows 3-4 ones; max |out| on row 2 (exactly 0 if exact)."""
    x = jnp.concatenate([jnp.zeros((1, 3, 5, channels)), jnp.ones((1, 2, 5, channels))], axis=1)
    k = jax.random.normal(jax.random.PRNGKey(2), (3, 3, channels, channels)) / np.sqrt(9 * channels)
    return float(jnp.abs(jax.jit(lambda x: conv(x, k, LAST_ROW_MASKED))(x)[:, 2]).max())


def nan_isolation(conv, channels: int = 16) -> int:
    """inf on rows 3-4: number of non-finite outputs on rows 0-2 (which reach them only through masked taps)."""
    x = jax.random.normal(jax.random.PRNGKey(3), (1, 5, 5, channels)).at[:, 3:].set(jnp.inf)
    k = jax.random.normal(jax.random.PRNGKey(4), (3, 3, channels, channels)) / np.sqrt(9 * channels)
    y = jax.jit(lambda x: conv(x, k, LAST_ROW_MASKED))(x)
    return int((~jnp.isfinite(y[:, :3])).sum())


def _stack(conv, layers: int = 6, size: int = 9, channels: int = 32):
    """A PixelCNN stack (7x7 type A, then 3x3 type B, tanh) and its input: the model the audit checks."""
    masks = [pixelcnn_mask((7, 7), "A")] + [pixelcnn_mask((3, 3), "B")] * (layers - 1)
    keys = jax.random.split(jax.random.PRNGKey(5), layers)
    kernels = [
        jax.random.normal(key, (*m.shape, 3 if i == 0 else channels, channels)) / np.sqrt(m.sum() * channels)
        for i, (key, m) in enumerate(zip(keys, masks))
    ]

    @jax.jit
    def pixelcnn_stack(x):
        for m, k in zip(masks, kernels):
            x = jnp.tanh(conv(x, k, m))
        return x

    return pixelcnn_stack, jax.random.normal(jax.random.PRNGKey(6), (1, size, size, 3))


def stack_gradient_leak(conv) -> float:
    """Model level, by the causality audit: the largest |d out_p / d x_q| over every output
    pixel p of the stack and every input q at or after p in raster order."""
    net, x = _stack(conv)
    return float(audit_causal(net, x, checks=("gradient",)).check("gradient").value.max())


def stack_nan_leak(conv) -> int:
    """Model level, by the causality audit: output pixels of the stack that change when every
    input at or after them (in raster order) is NaN."""
    net, x = _stack(conv)
    return int(audit_causal(net, x, checks=("nan",)).check("nan").failing.sum())


TIMING_SHAPES = (
    # name, window, mask type, channels
    ("PixelCNN 7x7 type A", (7, 7), "A", 64),
    ("PixelCNN 5x5 type B", (5, 5), "B", 64),
    ("PixelCNN 3x3 type B", (3, 3), "B", 128),
)


def _median_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up outside the timed region
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def timings(implementation, batch: int, size: int, repeats: int, log=None):
    rows = []
    for name, window, mask_type, c in TIMING_SHAPES:
        x = jax.random.normal(jax.random.PRNGKey(0), (batch, size, size, c))
        k = jax.random.normal(jax.random.PRNGKey(1), (*window, c, c)) * 0.05
        m = pixelcnn_mask(window, mask_type)
        row = {"shape": f"{name}, N={batch}, {size}x{size}, C={c}"}
        for label, conv in _convs(implementation).items():
            with _stage(log, f"timing {row['shape']}: {label}, forward and forward+backward"):
                fwd = jax.jit(lambda x, k, conv=conv: conv(x, k, m))
                both = jax.jit(jax.grad(lambda x, k, conv=conv: (conv(x, k, m) ** 2).sum(), (0, 1)))
                row[label] = (_median_ms(fwd, (x, k), repeats), _median_ms(both, (x, k), repeats))
        rows.append(row)
    return rows


@contextmanager
def _stage(log, name: str):
    """Announces a stage on ``log`` (a text stream, or None for silence) and its time when done."""
    if log is None:
        yield
        return
    print(f"  {name} ...", end="", file=log, flush=True)
    start = time.perf_counter()
    yield
    print(f" {time.perf_counter() - start:.1f} s", file=log, flush=True)


EXACTNESS_CHECKS = {
    "gradient leak (seed 1)": gradient_leak,
    "zeros-over-ones output (seed 2)": zeros_over_ones,
    "non-finite outputs, inf in the future": nan_isolation,
    "6-layer stack gradient leak (audit, every pixel)": stack_gradient_leak,
    "6-layer stack pixels changed by NaN in the future (audit)": stack_nan_leak,
}


def run(quick: bool = False, log=None) -> dict:
    """Measures everything; announces each stage on ``log`` (e.g. ``sys.stderr``) if given."""
    backend = jax.default_backend()
    devices = jax.devices()
    x = jnp.zeros((1, 32, 32, 64))
    impl = implementation_for(make_spec(x, jnp.zeros((3, 3, 64, 64)), pixelcnn_mask((3, 3), "B")))
    result = {
        "device": f"{_device_name(devices[0])} ({backend}, {len(devices)} device(s))",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "implementation": impl,
        "exactness": {},
    }
    for label, conv in _convs(impl).items():
        result["exactness"][label] = {}
        for check, measure in EXACTNESS_CHECKS.items():
            with _stage(log, f"exactness: {check}, {label}"):
                result["exactness"][label][check] = measure(conv)
    batch, size, repeats = (2, 16, 3) if quick else (16, 32, 7)
    result["timings"] = timings(impl, batch, size, repeats, log)
    return result


def _device_name(device) -> str:
    if device.platform != "cpu":
        return device.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def format_report(result: dict) -> str:
    labels = list(result["exactness"])
    lines = [
        "maskconv-kernels leak report",
        f"device: {result['device']}  jax {result['jax']}  python {result['python']}",
        f"masked_conv implementation: {result['implementation']}",
        "",
        "Exactness (0 is exact; each measured here):",
        "",
        f"| check | {' | '.join(labels)} |",
        f"|---|{'---:|' * len(labels)}",
    ]
    for check in result["exactness"][labels[0]]:
        cells = [_fmt(result["exactness"][label][check]) for label in labels]
        lines.append(f"| {check} | {' | '.join(cells)} |")
    lines += [
        "",
        "Timing (median ms; speed-up = lax.conv time / masked_conv time; forward, then forward+backward):",
        "",
        "| shape | lax fwd | ours fwd | speed-up | lax fwd+bwd | ours fwd+bwd | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["timings"]:
        (lf, lb), (of, ob) = row[labels[0]], row[labels[1]]
        lines.append(f"| {row['shape']} | {lf:.2f} | {of:.2f} | {lf / of:.2f}x | {lb:.2f} | {ob:.2f} | {lb / ob:.2f}x |")
    return "\n".join(lines)


def _fmt(v):
    return str(v) if isinstance(v, int) else f"{v:.3g}"


HELP = """\
The leak report: how exact and how fast masked_conv is on this machine's default device,
beside the usual lax.conv_general_dilated(x, kernel * mask), each measured here.

Exactness (0 is exact): the original report's two experiments (the gradient reaching
inputs seen only through masked taps; the output of zeros over ones), the number of
non-finite past outputs with inf in masked ("future") pixels, and, by the causality
audit (maskconv_kernels.audit) of a 6-layer PixelCNN stack at every pixel, the gradient
from future inputs and the pixels that NaN in the future changes. Timing: median milliseconds of forward and
forward+backward for three PixelCNN layers (7x7 type A, 5x5 type B, 3x3 type B), N=16,
32x32 images.

Each stage is announced on stderr with its time; the report (markdown tables) goes to
stdout. About half a minute on a 2-core CPU (21 s measured on an AMD EPYC VM with
jax 0.10.2; a loaded machine takes minutes); --quick about 12 seconds there."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m maskconv_kernels", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small timing shapes (N=2, 16x16): seconds, for smoke tests")
    # Opened before measuring: a path that cannot be written fails now, not after the run.
    parser.add_argument("--json", metavar="PATH", type=argparse.FileType("w"), help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    print("maskconv-kernels leak report: measuring on the default device (stages on stderr) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    result = run(quick=args.quick, log=sys.stderr)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(format_report(result))
    if args.json:
        with args.json as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
