"""Launching the Triton kernels from JAX: the launch problem, jax-triton calls, autotune.

Imports ``triton`` (through :mod:`.kernels`) at module import and ``jax_triton`` at the
first compiled launch (interpreted launches, :mod:`.interpret`, need only ``triton``);
:mod:`.conv` imports this module only when it runs or compiles a kernel, so choosing a
backend never needs either.
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

from ...._core.hardware import COMPUTE_CAPABILITY
from ..kernel_problem import KernelProblem, kernel_problem
from ..spec import ConvSpec
from . import config as _config
from .config import Config, Launch
from .kernels import conv_dw_kernel, conv_dx_kernel, conv_fwd_kernel

__all__ = ["Problem", "problem", "kernel_args", "timings", "tuned", "forward", "input_grad", "weight_grad", "KERNELS"]

KERNELS = {"fwd": conv_fwd_kernel, "dx": conv_dx_kernel, "dw": conv_dw_kernel}

_TRITON_TYPES = {np.dtype("float32"): "fp32", np.dtype(jnp.bfloat16): "bf16", np.dtype("float16"): "fp16"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One launch problem: the shared 2-D kernel problem with its batch, dtypes and dot precision.

    ``kernel`` (:class:`~..kernel_problem.KernelProblem`) names the active taps
    only; masked taps appear nowhere below this point.
    """

    kernel: KernelProblem
    n: int
    precision: str  # tl.dot input_precision
    dtype: str  # x and kernel
    out_dtype: str
    interpret: bool = False  # run in Triton's interpreter on the host (see .interpret)

    h = property(lambda self: self.kernel.in_hw[0])
    w = property(lambda self: self.kernel.in_hw[1])
    oh = property(lambda self: self.kernel.out_hw[0])
    ow = property(lambda self: self.kernel.out_hw[1])
    c_in = property(lambda self: self.kernel.c_in)
    c_out = property(lambda self: self.kernel.c_out)
    window = property(lambda self: self.kernel.window)

    @property
    def taps(self) -> tuple[tuple[int, int, int], ...]:
        """The active taps as the kernels take them: ``(kh, kw, kh * KW + kw)``."""
        return tuple((i, j, f) for (i, j), f in zip(self.kernel.taps, self.kernel.flat_taps))

    def constexprs(self) -> dict:
        k = self.kernel
        return dict(
            N=self.n, H=self.h, W=self.w, C_IN=k.c_in, OH=self.oh, OW=self.ow, C_OUT=k.c_out,
            SH=k.strides[0], SW=k.strides[1], DH=k.dilation[0], DW=k.dilation[1],
            PH=k.pad_lo[0], PW=k.pad_lo[1], TAPS=self.taps, TAP_RUN=-1 if k.tap_run is None else k.tap_run,
            KW=k.window[1], PRECISION=self.precision,
        )

    def gemm(self, kind: str) -> tuple[int, int, int]:
        """(m, n, k) of the kernel ``kind``, as :func:`config.heuristic` takes them."""
        if kind == "fwd":
            return self.n * self.oh * self.ow, self.c_out, self.c_in
        if kind == "dx":
            return self.n * self.h * self.w, self.c_in, self.c_out
        return self.c_in, self.c_out, self.n * self.oh * self.ow


def _input_precision(p: KernelProblem, dtype: np.dtype) -> str:
    """``lax.Precision`` -> ``tl.dot`` input precision: HIGHEST is IEEE, HIGH 3xTF32, else TF32."""
    if dtype != np.float32:
        return "ieee"  # 16-bit products are exact in the float32 accumulator
    if p.highest:
        return "ieee"
    if p.high:
        return "tf32x3"
    return "tf32"


def problem(spec: ConvSpec, batch: int, dtype, interpret: bool = False) -> Problem:
    """The kernels' view of ``spec`` for a batch of ``batch`` inputs of ``dtype``."""
    dtype, kp = np.dtype(dtype), kernel_problem(spec)
    return Problem(
        kernel=kp, n=int(batch), precision=_input_precision(kp, dtype),
        dtype=dtype.name, out_dtype=np.dtype(spec.out_dtype).name, interpret=interpret,
    )


# ----------------------------------------------------------------- kernel arguments


def _dw_chunk(p: Problem, c: Launch) -> tuple[int, int]:
    """(pixels per split, number of splits) of the weight gradient."""
    pixels = p.n * p.oh * p.ow
    chunk = -(-pixels // c.split)
    chunk = -(-chunk // c.block_k) * c.block_k
    return chunk, -(-pixels // chunk)


def kernel_args(p: Problem, kind: str, c: Launch) -> dict:
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


def _launch(kind: str, p: Problem, c: Launch, *arrays):
    a = kernel_args(p, kind, c)
    if p.interpret:
        from . import interpret

        return interpret.launch(a, *arrays)
    import jax_triton

    # Lowered for cuda on a host without a GPU (an export), there is no device to ask.
    capability = None if _has_gpu() else COMPUTE_CAPABILITY
    return jax_triton.triton_call(
        *arrays,
        kernel=a["kernel"],
        grid=a["grid"],
        name=f"maskconv_triton_{kind}",
        compute_capability=capability,
        **_call_keywords(a["out"], a["options"]),
        **a["constexprs"],
    )


@functools.lru_cache(maxsize=None)
def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _operands(kind: str, p: Problem):
    x_t, o_t = np.dtype(p.dtype), np.dtype(p.out_dtype)
    x = ((p.n, p.h, p.w, p.c_in), x_t)
    w = ((*p.window, p.c_in, p.c_out), x_t)
    y = ((p.n, p.oh, p.ow, p.c_out), o_t)
    return {"fwd": (x, w), "dx": (y, w), "dw": (x, y)}[kind]


def _select(kind: str, p: Problem, chosen: Config | None = None) -> Launch:
    """The config of ``kind`` for ``p``: the caller's, else tuned once per process and problem, else the heuristic."""
    given = getattr(chosen, kind) if chosen is not None else None
    if given is not None:
        return given
    key = (kind, p)
    if key in _TUNED:
        return _TUNED[key]
    m, n, k = p.gemm(kind)
    itemsize = np.dtype(p.dtype).itemsize
    configs = _config.candidates(kind, m, n, k, itemsize, len(p.taps))
    timed = _config.autotune_enabled() and len(configs) > 1 and not p.interpret and _has_gpu()
    best = _time(kind, p, configs) if timed else configs[0]
    _TUNED[key] = best
    return best


# (kind, problem) -> Launch, filled at the first launch of each problem.
_TUNED: dict[tuple, Launch] = {}


def tuned() -> dict[tuple, Launch]:
    """A copy of this process's autotune cache: ``(kind, Problem) -> Launch``."""
    return dict(_TUNED)


def _time(kind: str, p: Problem, configs: list[Launch], samples: int = 3, calls: int = 5) -> Launch:
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


# (kind, problem) -> {Launch: seconds} of every autotuned launch, for benchmarks/tune.py.
_TIMINGS: dict[tuple, dict[Launch, float]] = {}


def timings() -> dict[tuple, dict[Launch, float]]:
    """A copy of this process's autotune measurements (best of repeats, seconds)."""
    return {key: dict(t) for key, t in _TIMINGS.items()}


# The three kernels the maps (maskconv_kernels.ops.masked_conv.maps) lower, on the 2-D problem. Operands
# take the dtypes the launch declares: x and kernel in the primal dtype, y / dy in the
# output dtype.


def _launch_problem(job, batch: int) -> Problem:
    return problem(job.spec, batch, job.dtype, job.interpret)


def forward(x, w, job, out_dtype):
    p = _launch_problem(job, x.shape[0])
    x, w = x.astype(p.dtype), w.astype(p.dtype)
    return _launch("fwd", p, _select("fwd", p, job.config), x, w).astype(out_dtype)


def input_grad(dy, w, job, out_dtype):
    p = _launch_problem(job, dy.shape[0])
    dy, w = dy.astype(p.out_dtype), w.astype(p.dtype)
    return _launch("dx", p, _select("dx", p, job.config), dy, w).astype(out_dtype)


def weight_grad(x, dy, job, out_dtype):
    """``[splits, T, C_in, C_out]`` float32 partial sums for the active taps only."""
    del out_dtype  # the core casts after adding the splits
    p = _launch_problem(job, x.shape[0])
    x, dy = x.astype(p.dtype), dy.astype(p.out_dtype)
    return _launch("dw", p, _select("dw", p, job.config), x, dy)
