"""Launching the Triton kernels from JAX: the problem, jax-triton calls, autotune, custom VJP.

Imports ``triton`` (through :mod:`.kernels`) at module import and ``jax_triton`` at the
first compiled launch (interpreted launches, :mod:`.interpret`, need only ``triton``); :mod:`maskconv_kernels.triton` imports this module only when it runs or
compiles a kernel, so the core package never needs either.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec import ConvSpec
from . import config as _config
from .config import Config
from .kernels import conv_dw_kernel, conv_dx_kernel, conv_fwd_kernel

__all__ = ["Problem", "problem", "conv", "kernel_args", "timings", "KERNELS"]

KERNELS = {"fwd": conv_fwd_kernel, "dx": conv_dx_kernel, "dw": conv_dw_kernel}

_TRITON_TYPES = {np.dtype("float32"): "fp32", np.dtype(jnp.bfloat16): "bf16", np.dtype("float16"): "fp16"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One masked convolution as the kernels see it: 2-D, channels-last, ungrouped.

    A 1-D problem is the 2-D one with ``h = kh = 1``. ``taps`` holds the active taps
    only, as ``(kh, kw, kh * KW + kw)``; masked taps appear nowhere below this point.
    """

    n: int
    h: int
    w: int
    c_in: int
    oh: int
    ow: int
    c_out: int
    strides: tuple[int, int]
    dilation: tuple[int, int]
    pad_lo: tuple[int, int]
    window: tuple[int, int]
    taps: tuple[tuple[int, int, int], ...]
    precision: str  # tl.dot input_precision
    dtype: str  # x and kernel
    out_dtype: str
    interpret: bool = False  # run in Triton's interpreter on the host (see .interpret)

    def constexprs(self) -> dict:
        return dict(
            N=self.n, H=self.h, W=self.w, C_IN=self.c_in, OH=self.oh, OW=self.ow, C_OUT=self.c_out,
            SH=self.strides[0], SW=self.strides[1], DH=self.dilation[0], DW=self.dilation[1],
            PH=self.pad_lo[0], PW=self.pad_lo[1], TAPS=self.taps, TAP_RUN=self.tap_run, KW=self.window[1],
            PRECISION=self.precision,
        )

    @property
    def tap_run(self) -> int:
        """The first flat tap when the active taps are one raster run (computed, not searched), else -1."""
        flat = [f for _, _, f in self.taps]
        return flat[0] if flat == list(range(flat[0], flat[0] + len(flat))) else -1

    def gemm(self, kind: str) -> tuple[int, int, int]:
        """(m, n, k) of the kernel ``kind``, as :func:`config.heuristic` takes them."""
        if kind == "fwd":
            return self.n * self.oh * self.ow, self.c_out, self.c_in
        if kind == "dx":
            return self.n * self.h * self.w, self.c_in, self.c_out
        return self.c_in, self.c_out, self.n * self.oh * self.ow


def _input_precision(precision, dtype: np.dtype) -> str:
    """``lax.Precision`` -> ``tl.dot`` input precision: HIGHEST is IEEE, HIGH 3xTF32, else TF32."""
    if dtype != np.float32:
        return "ieee"  # 16-bit products are exact in the float32 accumulator
    ps = precision if isinstance(precision, tuple) else (precision,)
    ps = tuple(lax.Precision(p) if isinstance(p, str) else p for p in ps)
    if lax.Precision.HIGHEST in ps:
        return "ieee"
    if lax.Precision.HIGH in ps:
        return "tf32x3"
    return "tf32"


def problem(spec: ConvSpec, batch: int, dtype, interpret: bool = False) -> Problem:
    """The kernels' view of ``spec`` for a batch of ``batch`` inputs of ``dtype``."""
    dtype = np.dtype(dtype)
    if spec.ndim == 1:  # a 1-D problem is a 2-D one with one row: H = KH = 1, tap row 0, no row padding
        ones = lambda t: (1, *t)
        zeros = lambda t: (0, *t)
    else:
        ones = zeros = tuple
    window = ones(spec.window)
    taps = tuple((kh, kw, kh * window[1] + kw) for kh, kw in map(zeros, spec.mask.active_taps))
    (h, w), (oh, ow) = ones(spec.in_spatial), ones(spec.out_spatial)
    return Problem(
        n=int(batch), h=h, w=w, c_in=spec.c_in, oh=oh, ow=ow, c_out=spec.c_out,
        strides=ones(spec.strides), dilation=ones(spec.dilation),
        pad_lo=zeros(tuple(lo for lo, _ in spec.padding)),
        window=window, taps=taps,
        precision=_input_precision(spec.precision, dtype),
        dtype=dtype.name, out_dtype=np.dtype(spec.out_dtype).name, interpret=interpret,
    )


# ----------------------------------------------------------------- kernel arguments


def _dw_chunk(p: Problem, c: Config) -> tuple[int, int]:
    """(pixels per split, number of splits) of the weight gradient."""
    pixels = p.n * p.oh * p.ow
    chunk = -(-pixels // c.split)
    chunk = -(-chunk // c.block_k) * c.block_k
    return chunk, -(-pixels // chunk)


def kernel_args(p: Problem, kind: str, c: Config) -> dict:
    """Everything one launch of ``kind`` needs, shared by the jax-triton call and the compile test.

    Returns a dict with ``kernel`` (the ``triton.jit`` function), ``signature`` (every
    parameter name -> Triton type, ``"constexpr"`` for the static ones, as
    ``triton.compiler.ASTSource`` takes it), ``constexprs`` (name -> value), ``grid``,
    ``out`` (``jax.ShapeDtypeStruct``), ``options`` (``num_warps``, ``num_stages``) and
    ``attrs`` (the pointer alignment jax-triton declares, for ``ASTSource``).
    """
    x_t, o_t = np.dtype(p.dtype), np.dtype(p.out_dtype)
    consts = p.constexprs()
    consts.update(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k)
    if kind == "fwd":
        ptrs = (x_t, x_t, o_t)
        out = jax.ShapeDtypeStruct((p.n, p.oh, p.ow, p.c_out), o_t)
        grid = (math.ceil(p.n * p.oh * p.ow / c.block_m), math.ceil(p.c_out / c.block_n))
    elif kind == "dx":
        ptrs = (o_t, x_t, x_t)
        out = jax.ShapeDtypeStruct((p.n, p.h, p.w, p.c_in), x_t)
        grid = (math.ceil(p.n * p.h * p.w / c.block_m), math.ceil(p.c_in / c.block_n))
    elif kind == "dw":
        chunk, splits = _dw_chunk(p, c)
        consts["CHUNK"] = chunk
        ptrs = (x_t, o_t, np.dtype("float32"))
        out = jax.ShapeDtypeStruct((splits, len(p.taps), p.c_in, p.c_out), np.float32)
        grid = (math.ceil(p.c_in / c.block_m) * math.ceil(p.c_out / c.block_n), len(p.taps), splits)
    else:
        raise ValueError(f"kind must be one of {tuple(KERNELS)}, got {kind!r}")
    fn = KERNELS[kind]
    signature = {name: "*" + _TRITON_TYPES[t] for name, t in zip(fn.arg_names, ptrs)}
    unknown = set(consts) - set(fn.arg_names)
    assert not unknown, f"{kind} kernel has no parameters {unknown}"
    signature.update({name: "constexpr" for name in fn.arg_names[len(ptrs):]})
    return dict(
        kernel=fn, signature=signature, constexprs=consts, grid=grid, out=out,
        # Fusion on, stated rather than defaulted: it is jax-triton's default at launch, so
        # the compile test builds the kernel that runs (and triton 3.9 warns when it is left
        # unset, as its default will change). Our float math is the dots and casts.
        options=dict(num_warps=c.num_warps, num_stages=c.num_stages, enable_fp_fusion=True),
        # What jax-triton tells Triton about JAX's buffers: 16-byte aligned pointers.
        # Without it Triton cannot prove a load vectorisable and emits scalar loads.
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))},
    )


# ----------------------------------------------------------------------- launching


@functools.lru_cache(maxsize=None)
def _call_parameters() -> frozenset:
    import jax_triton

    return frozenset(inspect.signature(jax_triton.triton_call).parameters)


def _call_keywords(out, options: dict) -> dict:
    """``triton_call`` keywords for the output and compile options, across jax-triton versions.

    jax-triton 0.4 renamed ``out_shape=`` to ``out_type=`` and moved compiler options
    such as ``enable_fp_fusion`` from keywords into ``backend_options=`` (0.3.x, the
    release that fits triton 3.6, has only the former of each).
    """
    params = _call_parameters()
    options = dict(options)
    keywords = {"out_type" if "out_type" in params else "out_shape": out}
    fusion = options.pop("enable_fp_fusion")
    if "enable_fp_fusion" in params:
        keywords["enable_fp_fusion"] = fusion
    else:
        keywords["backend_options"] = {"enable_fp_fusion": fusion}
    return {**keywords, **options}


def _launch(kind: str, p: Problem, c: Config, *arrays):
    a = kernel_args(p, kind, c)
    if p.interpret:
        from . import interpret

        return interpret.launch(a, *arrays)
    import jax_triton

    return jax_triton.triton_call(
        *arrays,
        kernel=a["kernel"],
        grid=a["grid"],
        name=f"maskconv_triton_{kind}",
        **_call_keywords(a["out"], a["options"]),
        **a["constexprs"],
    )


def _operands(kind: str, p: Problem):
    x_t, o_t = np.dtype(p.dtype), np.dtype(p.out_dtype)
    x = ((p.n, p.h, p.w, p.c_in), x_t)
    w = ((*p.window, p.c_in, p.c_out), x_t)
    y = ((p.n, p.oh, p.ow, p.c_out), o_t)
    return {"fwd": (x, w), "dx": (y, w), "dw": (x, y)}[kind]


def _select(kind: str, p: Problem) -> Config:
    """The config of ``kind`` for ``p``: tuned once per process and problem, else the heuristic."""
    key = (kind, p)
    if key in _config._TUNED:
        return _config._TUNED[key]
    m, n, k = p.gemm(kind)
    itemsize = np.dtype(p.dtype).itemsize
    configs = _config.candidates(kind, m, n, k, itemsize, len(p.taps))
    timed = _config.autotune_enabled() and len(configs) > 1 and not p.interpret
    best = _time(kind, p, configs) if timed else configs[0]
    _config._TUNED[key] = best
    return best


def _time(kind: str, p: Problem, configs: list[Config], samples: int = 3, calls: int = 5) -> Config:
    """Times every candidate on this device and returns the fastest.

    Runs at trace time (the first launch of a problem), outside the trace being built,
    on random operands of the right shapes (never constants: they can run faster than
    real data). A sample is ``calls`` back-to-back launches and one block, so launch
    latency is not what is measured; the best of ``samples`` counts. A candidate that
    fails to compile (too much shared memory for this GPU, say) is skipped, as
    ``triton.autotune`` prunes configs that run out of resources; if all fail, the first
    error is raised.
    """
    timings, first_error = {}, None
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.PRNGKey(0), 2)
        args = [jax.random.normal(key, shape, jnp.float32).astype(dtype)
                for key, (shape, dtype) in zip(keys, _operands(kind, p))]
        for c in configs:
            fn = jax.jit(functools.partial(_launch, kind, p, c))
            try:
                jax.block_until_ready(fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised below when no config works
                first_error = first_error or e
                continue
            best = math.inf
            for _ in range(samples):
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = fn(*args)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - t0) / calls)
            timings[c] = best
    if not timings:
        raise first_error
    _TIMINGS[(kind, p)] = timings
    return min(timings, key=timings.get)


# (kind, problem) -> {Config: seconds} of every autotuned launch, for benchmarks/tune.py.
_TIMINGS: dict[tuple, dict[Config, float]] = {}


def timings() -> dict[tuple, dict[Config, float]]:
    """A copy of this process's autotune measurements (best of repeats, seconds)."""
    return {key: dict(t) for key, t in _TIMINGS.items()}


def _forward(x, w, p: Problem):
    return _launch("fwd", p, _select("fwd", p), x, w)


def _input_grad(dy, w, p: Problem):
    return _launch("dx", p, _select("dx", p), dy, w)


def _weight_grad(x, dy, p: Problem):
    parts = _launch("dw", p, _select("dw", p), x, dy)
    # Splits are added in a fixed order (elementwise adds, no reduction kernel whose
    # order could vary), so the weight gradient has the same bits run to run.
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    # Masked taps were never computed: they are exact zeros.
    zeros = jnp.zeros((p.c_in, p.c_out), jnp.float32)
    by_tap = {flat: j for j, (_, _, flat) in enumerate(p.taps)}
    full = jnp.stack([total[by_tap[t]] if t in by_tap else zeros for t in range(p.window[0] * p.window[1])])
    return full.reshape(*p.window, p.c_in, p.c_out).astype(p.dtype)


# The forward, the input gradient and the weight gradient are three linear maps, each
# under its own custom VJP built from the other two (as in the Pallas backend), so
# gradients of gradients run the same kernels; a kernel launch itself has no derivative,
# so the forward rules call the custom-VJP functions too, never a bare launch.
#   y  = _conv(x, w):     dx = _conv_dx(dy, w),    dw = _conv_dw(x, dy)
#   dx = _conv_dx(dy, w): d dy = _conv(ddx, w),    dw = _conv_dw(ddx, dy)
#   dw = _conv_dw(x, dy): dx = _conv_dx(dy, ddw),  d dy = _conv(x, ddw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv(x, w, p: Problem):
    return _forward(x, w, p)


def _conv_fwd(x, w, p: Problem):
    return _conv(x, w, p), (x, w)


def _conv_bwd(p: Problem, residuals, dy):
    x, w = residuals
    return _conv_dx(dy, w, p), _conv_dw(x, dy, p)


_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_dx(dy, w, p: Problem):
    return _input_grad(dy, w, p)


def _conv_dx_fwd(dy, w, p: Problem):
    return _conv_dx(dy, w, p), (dy, w)


def _conv_dx_bwd(p: Problem, residuals, ddx):
    dy, w = residuals
    return _conv(ddx, w, p), _conv_dw(ddx, dy, p)


_conv_dx.defvjp(_conv_dx_fwd, _conv_dx_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_dw(x, dy, p: Problem):
    return _weight_grad(x, dy, p)


def _conv_dw_fwd(x, dy, p: Problem):
    return _conv_dw(x, dy, p), (x, dy)


def _conv_dw_bwd(p: Problem, residuals, ddw):
    x, dy = residuals
    # The weight gradient only has active taps; its transpose reads only those of ddw.
    return _conv_dx(dy, ddw, p), _conv(x, ddw, p)


_conv_dw.defvjp(_conv_dw_fwd, _conv_dw_bwd)


def conv(x: jax.Array, kernel: jax.Array, spec: ConvSpec, interpret: bool = False) -> jax.Array:
    """Masked convolution through the Triton kernels (forward and both gradients).

    Args:
      x: ``[N, *spatial, C_in]`` with 1 or 2 spatial dims; float32, bfloat16 or float16.
      kernel: ``[*window, C_in, C_out]``, same dtype as ``x``.
      spec: a problem :func:`maskconv_kernels.triton.unsupported` accepts.
      interpret: run the kernels in Triton's interpreter on the host (tests; slow).

    Returns:
      ``[N, *out_spatial, C_out]`` in ``spec.out_dtype``, accumulated in float32.
    """
    p = problem(spec, x.shape[0], x.dtype, interpret)
    out_shape = (x.shape[0], *spec.out_spatial, spec.c_out)
    if 0 in x.shape or 0 in kernel.shape or not p.taps:
        # Every output is an empty sum: exact zeros, and zero gradients, with nothing read.
        return jnp.zeros(out_shape, spec.out_dtype)
    x4 = x.reshape(p.n, p.h, p.w, p.c_in)
    w4 = kernel.reshape(*p.window, p.c_in, p.c_out)
    return _conv(x4, w4, p).reshape(out_shape)
