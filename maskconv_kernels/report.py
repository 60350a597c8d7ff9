"""The leak report: ``python -m maskconv_kernels``.

Runs, on the local default device, the two experiments of JAX's bug report "Gradient
leakage through masked convolutions" (a gradient through masked taps; zeros over ones),
a NaN-isolation test and the causality audit of a 6-layer PixelCNN, for the usual
``lax.conv_general_dilated(x, kernel * mask)`` and for :func:`masked_conv` side by side,
then a small timing table. Every figure is measured in this process, with the leak
measurements of :mod:`maskconv_kernels.leaks`; the report says under its table what each
experiment measures, its exact value and where the baseline leaks (:data:`EXPERIMENTS`),
in words for someone who has not read this code: a table's lines are "experiments", a
"row" is always a row of pixels of the test image. Each stage is announced on stderr as
it starts, with its time when it ends; the report goes to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import textwrap
import time
from contextlib import contextmanager
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import leaks
from .audit import audit_causal
from .bench.machine import device_name
from .bench.timing import median_times
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


# ------------------------------------------------------------------------------ experiments


def masked_tap_gradient(conv, channels: int = 128) -> float:
    """Experiment 1: the largest ``|d out[2, 2] / d x|`` over image rows 3-4, reached only through masked taps.

    A 5x5 image, a 3x3 kernel whose bottom row of taps is masked, ``SAME`` padding:
    out[2, 2] reads image rows 1-3, and row 3 only through the masked taps. Exact: 0.0.
    """
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 5, 5, channels))
    k = jax.random.normal(jax.random.PRNGKey(2), (3, 3, channels, channels)) / np.sqrt(9 * channels)
    g = jax.jit(jax.grad(lambda x: conv(x, k, LAST_ROW_MASKED)[:, 2, 2, :].sum()))(x)
    below = np.zeros((5, 5), bool)
    below[3:] = True
    return leaks.forbidden_gradient(g, below[None, :, :, None])


def zeros_over_ones(conv, channels: int = 128) -> float:
    """Experiment 2: image rows 0-2 zeros, rows 3-4 ones; the largest ``|out|`` on row 2 (exactly 0 if exact).

    Row 2 reads zeros through its active taps and ones only through the masked taps.
    """
    x = jnp.concatenate([jnp.zeros((1, 3, 5, channels)), jnp.ones((1, 2, 5, channels))], axis=1)
    k = jax.random.normal(jax.random.PRNGKey(2), (3, 3, channels, channels)) / np.sqrt(9 * channels)
    return float(jnp.abs(jax.jit(lambda x: conv(x, k, LAST_ROW_MASKED))(x)[:, 2]).max())


def nan_isolation(conv, channels: int = 16) -> int:
    """Experiment 3: inf on image rows 3-4; the number of non-finite outputs on rows 0-2 (which reach
    them only through masked taps)."""
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
    return float(audit_causal(net, x, include_current=False, checks=("gradient",)).check("gradient").value.max())


def stack_nan_leak(conv) -> int:
    """Model level, by the causality audit: output pixels of the stack that change when every
    input at or after them (in raster order) is NaN."""
    net, x = _stack(conv)
    return int(audit_causal(net, x, include_current=False, checks=("nan",)).check("nan").failing.sum())


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One exactness experiment of the report (a line of its table): its measurement and the words that explain it.

    Attributes:
      key: the experiment's name in the JSON (``exactness[conv][key]``).
      title: its label in the table.
      measure: ``conv -> number`` (``conv(x, kernel, mask)``); 0 is exact.
      what: what is measured, in a sentence or two.
      exact: the value an exact convolution gives.
      baseline: where ``lax.conv(kernel*mask)`` leaks.
      everywhere: whether the baseline leaks on every device (not only under cuDNN).
    """

    key: str
    title: str
    measure: Callable
    what: str
    exact: str
    baseline: str
    everywhere: bool


_CUDNN = ("on NVIDIA GPUs, where cuDNN may pick a Winograd or FFT algorithm: those transform the input and "
          "the kernel before multiplying, so a zero weight no longer cancels its input exactly")

EXPERIMENTS = (
    Experiment(
        "masked_tap_gradient", "1. gradient through masked taps", masked_tap_gradient,
        "a 5x5 image with 128 channels and a 3x3 kernel whose bottom row of taps is masked: the largest "
        "gradient of output pixel (2, 2) with respect to image rows 3-4, which that output reaches only "
        "through the masked taps.", "0",
        f"about 1e-7 {_CUDNN}; XLA's direct convolution on CPUs gives 0.", everywhere=False),
    Experiment(
        "zeros_over_ones", "2. zeros over ones", zeros_over_ones,
        "the same kernel on an image of zeros in image rows 0-2 and ones in image rows 3-4: the largest "
        "|output| on image row 2, the last one that must not see the ones (it reads them only through the "
        "masked taps).", "0",
        "about 1e-7 under the same cuDNN algorithms: an output shifted by inputs it must not see; 0 on CPUs.",
        everywhere=False),
    Experiment(
        "nan_isolation", "3. NaN isolation", nan_isolation,
        "inf in image rows 3-4 of a 5x5 image (16 channels): the number of non-finite outputs on image rows "
        "0-2, which reach those rows only through masked taps.", "0",
        "on every device: a masked weight is 0, and 0 * inf = NaN.", everywhere=True),
    Experiment(
        "stack_gradient", "4. 6-layer stack, gradient (audit)", stack_gradient_leak,
        "a 6-layer PixelCNN (a 7x7 type-A mask, then five 3x3 type-B, tanh between) on a 9x9 image, checked "
        "by the causality audit (maskconv_kernels.audit) at every pixel: the largest gradient of any output "
        "pixel with respect to any input at or after it in raster order.", "0",
        "where experiment 1 leaks (NVIDIA GPUs under cuDNN's algorithms), and stacked layers spread it to "
        "every later pixel; 0 on CPUs.", everywhere=False),
    Experiment(
        "stack_nan", "5. 6-layer stack, NaN (audit)", stack_nan_leak,
        "the same stack and audit: the number of output pixels that change when every input at or after them "
        "in raster order is NaN.", "0",
        "on every device (0 * NaN = NaN).", everywhere=True),
)


TIMING_SHAPES = (
    # name, window, mask type, channels
    ("PixelCNN 7x7 type A", (7, 7), "A", 64),
    ("PixelCNN 5x5 type B", (5, 5), "B", 64),
    ("PixelCNN 3x3 type B", (3, 3), "B", 128),
)


def timings(batch: int, size: int, repeats: int, log=None):
    """Per shape, median ms of ``lax.conv(kernel*mask)`` and ``masked_conv`` (the implementation
    ``implementation=None`` takes for it here, named in the row), forward and forward+backward,
    the four timed in interleaved samples (:func:`~maskconv_kernels.bench.timing.median_times`)."""
    rows = []
    for name, window, mask_type, c in TIMING_SHAPES:
        x = jax.random.normal(jax.random.PRNGKey(0), (batch, size, size, c))
        k = jax.random.normal(jax.random.PRNGKey(1), (*window, c, c)) * 0.05
        m = pixelcnn_mask(window, mask_type)
        implementation = implementation_for(make_spec(x, k, m))
        convs = _convs(implementation)
        row = {"shape": f"{name}, N={batch}, {size}x{size}, C={c}", "implementation": implementation}
        fns = {}
        for label, conv in convs.items():
            fns[label, "fwd"] = jax.jit(lambda x, k, conv=conv: conv(x, k, m))
            fns[label, "fwd+bwd"] = jax.jit(jax.grad(lambda x, k, conv=conv: (conv(x, k, m) ** 2).sum(), (0, 1)))
        with _stage(log, f"timing {row['shape']}: {', '.join(convs)}, forward and forward+backward"):
            times = median_times(fns, [(x, k)], repeats)
        for label in convs:
            row[label] = (1e3 * times[label, "fwd"], 1e3 * times[label, "fwd+bwd"])
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


def run(quick: bool = False, log=None) -> dict:
    """Measures everything; announces each stage on ``log`` (e.g. ``sys.stderr``) if given."""
    backend = jax.default_backend()
    devices = jax.devices()
    x = jnp.zeros((1, 32, 32, 64))
    impl = implementation_for(make_spec(x, jnp.zeros((3, 3, 64, 64)), pixelcnn_mask((3, 3), "B")))
    result = {
        "device": f"{device_name(devices[0])} ({backend}, {len(devices)} device(s))",
        "platform": backend,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "implementation": impl,
        "experiments": {e.key: {"title": e.title, "what": e.what, "exact": e.exact, "baseline": e.baseline}
                        for e in EXPERIMENTS},
        "exactness": {},
    }
    for label, conv in _convs(impl).items():
        result["exactness"][label] = {}
        for e in EXPERIMENTS:
            with _stage(log, f"exactness: {e.title}, {label}"):
                result["exactness"][label][e.key] = e.measure(conv)
    batch, size, repeats = (2, 16, 3) if quick else (16, 32, 7)
    result["timings"] = timings(batch, size, repeats, log)
    return result


def format_report(result: dict) -> str:
    """The report as text: the exactness table and what each experiment means, then the timing table."""
    labels = list(result["exactness"])
    baseline, ours = labels
    impl = result["implementation"]
    experiments = {e.key: e for e in EXPERIMENTS}
    lines = [
        "maskconv-kernels leak report",
        f"device: {result['device']}  jax {result['jax']}  python {result['python']}",
        f"masked_conv implementation: {impl} (a timing row names its own where it differs)",
        "",
    ]
    lines += textwrap.wrap(
        "Exactness, measured here: does an output see inputs that it reaches only through masked taps (in a "
        "PixelCNN, the pixels not generated yet)? Each experiment puts a probe there (a gradient, ones, inf, "
        f"NaN) and measures how much of it reaches the outputs, for {baseline} (the usual masked convolution, "
        f"what flax.linen.Conv(mask=...) runs) and for {ours}.", 100)
    lines += [
        "",
        f"| experiment | {' | '.join(labels)} | exact |",
        f"|---|{'---:|' * len(labels)}---:|",
    ]
    keys = list(result["exactness"][baseline])
    for key in keys:
        e = experiments[key]
        cells = [_fmt(result["exactness"][label][key]) for label in labels]
        lines.append(f"| {e.title} | {' | '.join(cells)} | {e.exact} |")
    lines += ["", EXACT_COLUMN, "", 'What each experiment measures ("row" means a row of pixels of the test image):']
    for key in keys:
        e = experiments[key]
        lines += textwrap.wrap(f"{e.title}: {e.what}", 100, initial_indent="  ", subsequent_indent="     ")
        lines += textwrap.wrap(f"Exact: {e.exact}. Where {baseline} leaks: {e.baseline}", 100,
                               initial_indent="     ", subsequent_indent="     ")
    lines += [""] + textwrap.wrap(_device_note(result, baseline, ours, experiments), 100)
    lines += [
        "",
        "Timing (median ms after compiling; speed-up = lax.conv time / masked_conv time; forward, then "
        "forward+backward):",
        "",
        "| shape | lax fwd | ours fwd | speed-up | lax fwd+bwd | ours fwd+bwd | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["timings"]:
        (lf, lb), (of, ob) = row[labels[0]], row[labels[1]]
        shape = row["shape"] if row.get("implementation", impl) == impl else f"{row['shape']} ({row['implementation']})"
        lines.append(f"| {shape} | {lf:.2f} | {of:.2f} | {lf / of:.2f}x | {lb:.2f} | {ob:.2f} | {lb / ob:.2f}x |")
    return "\n".join(lines)


EXACT_COLUMN = "The exact column: what a convolution that never reads a masked tap gives; any other figure leaks."

# Published figures for the CPU note: what lax.conv(kernel*mask) does on NVIDIA GPUs.
# JAX's bug report "Gradient leakage through masked convolutions" (jax 0.3.14, a GTX
# 1080 Ti) measured about 1e-7; this project's H200 run (jax 0.11.2, 2026-12-04) measured
# 3.27e-8 through experiment 4's stack (benchmarks/results/h200-2026-12-04/README.md).
_GPU_FIGURES = (
    "JAX's bug report \"Gradient leakage through masked convolutions\" measured gradients of about 1e-7 at "
    "masked pixels, and on an H200 (jax 0.11.2), through the 6-layer PixelCNN of experiment 4, {baseline} "
    "leaked 3.27e-8 of gradient and {ours} 0 (benchmarks/results/h200-2026-12-04)"
)


def _device_note(result: dict, baseline: str, ours: str, experiments: dict) -> str:
    """Why the baseline's figures read what they read on this device."""
    figures = result["exactness"][baseline]
    gpu_only = [e for key, e in experiments.items() if key in figures and not e.everywhere]
    everywhere = _numbers(e for key, e in experiments.items() if key in figures and e.everywhere)
    zero = all(figures[e.key] == 0 for e in gpu_only)
    if result.get("platform", "cpu") == "cpu" and zero:
        return (f"On this CPU {baseline} matches {ours} in {_numbers(gpu_only)}: XLA's CPU convolution is "
                "direct, so a zero weight cancels its input exactly. It leaks on NVIDIA GPUs under cuDNN's "
                f"Winograd and FFT algorithms: {_GPU_FIGURES.format(baseline=baseline, ours=ours)}. "
                f"{everywhere.capitalize()} fail on every device: a masked weight is 0, and 0 * inf = 0 * NaN "
                "= NaN.")
    if zero and result.get("platform") != "gpu":
        return (f"{baseline} reads 0 in {_numbers(gpu_only)} on this {result.get('platform')}; on NVIDIA GPUs it "
                "leaks under cuDNN's Winograd and FFT algorithms, and through 0 * inf = NaN on every device "
                f"({everywhere}).")
    if zero:
        return (f"{baseline} reads 0 in {_numbers(gpu_only)} here: cuDNN picked a direct algorithm for these "
                "shapes. It picks per shape and per GPU, and nothing keeps it from a Winograd or FFT algorithm "
                f"elsewhere; {everywhere} fail on every device.")
    leaked = [e for e in gpu_only if figures[e.key] != 0]
    clean = [e for e in gpu_only if figures[e.key] == 0]
    text = (f"{baseline} leaks here in {_numbers(leaked)} (on a GPU: cuDNN's Winograd or FFT algorithms mix the "
            "masked inputs into the outputs they touch)")
    if clean:
        text += f", reads 0 in {_numbers(clean)}"
    return text + f", and {everywhere} fail on every device."


def _numbers(experiments) -> str:
    """``experiment 1`` or ``experiments 1, 2 and 4``: the experiments' numbers, never "rows"."""
    numbers = [e.title.split(".")[0] for e in experiments]
    if len(numbers) == 1:
        return f"experiment {numbers[0]}"
    return "experiments " + ", ".join(numbers[:-1]) + " and " + numbers[-1]


def _fmt(v):
    return str(v) if isinstance(v, int) else f"{v:.3g}"


HELP = """\
The leak report: how exact and how fast masked_conv is on this machine's default device,
beside the usual lax.conv_general_dilated(x, kernel * mask) (what flax.linen.Conv(mask=...)
runs), each figure measured here.

Exactness, five experiments (0 is exact):
  1. the gradient of an output with respect to inputs it reaches only through masked taps;
  2. zeros above, ones below: the output on the last image row that must not see the
     ones is exactly 0;
  3. NaN isolation: non-finite outputs when the inputs only masked taps reach are inf;
  4-5. a 6-layer PixelCNN checked at every pixel by the causality audit
     (maskconv_kernels.audit): the gradient from, and the pixels changed by NaN in,
     inputs at or after each pixel.
The table's exact column is what a convolution that never reads a masked tap gives (0).
Under it the report says what each experiment measures and where the baseline leaks: on
NVIDIA GPUs under cuDNN's Winograd and FFT algorithms (gradients and shifted outputs of
about 1e-7), and on every device through 0 * inf = NaN.

Timing: median milliseconds of forward and forward+backward for three PixelCNN layers
(7x7 type A, 5x5 type B, 3x3 type B), N=16, 32x32 images.

Each stage is announced on stderr with its time; the report (markdown tables and their
explanations) goes to stdout. About half a minute on a 2-core CPU (21 s measured on an
AMD EPYC VM with jax 0.10.2; a loaded machine takes minutes); --quick about 12 seconds
there."""


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
