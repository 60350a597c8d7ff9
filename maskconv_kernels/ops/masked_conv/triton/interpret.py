"""The Triton kernels run by Triton's own interpreter, on the host, behind ``jax.pure_callback``.

``implementation="triton", interpret=True``: the very ``triton.jit`` functions of
:mod:`.kernels`, with the same arguments, grid and configs as on a GPU, executed by
``triton.runtime.interpreter`` (NumPy, any machine, slow). This is how CI checks the
kernels' arithmetic, masks and exactness on a machine without a GPU; jax-triton is not
needed.

Triton decides at import whether ``triton.jit`` functions (its own standard library's
too) are compiled or interpreted (``TRITON_INTERPRET=1``), and the two cannot share a
process. So the interpreted kernels run in one helper process, started on first use
with the variable set; this process keeps compiling (for ``triton.compile`` and GPU
launches) as usual; as with any ``multiprocessing`` "spawn" start, a script that uses
it needs the ``if __name__ == "__main__":`` guard. The interpreter calls a few ``torch.Tensor`` methods on pointer
arguments; :class:`_HostArray` provides them over a NumPy array, so PyTorch is not
needed either.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import functools
import multiprocessing
import os

import jax
import numpy as np

__all__ = ["launch"]


@functools.lru_cache(maxsize=None)
def _worker() -> concurrent.futures.ProcessPoolExecutor:
    # "spawn": a fresh interpreter that imports triton only after _init_worker has run
    # (a forked child would inherit this process's compiled-mode triton).
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_init_worker)
    # Shut down before the interpreter tears modules down, which the pool's own
    # clean-up would otherwise run into ("'NoneType' object has no attribute 'util'").
    atexit.register(pool.shutdown)
    return pool


def _init_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"


def launch(args: dict, *arrays: jax.Array) -> jax.Array:
    """Runs one kernel launch described by ``ops.kernel_args`` in the interpreter.

    The output starts as NaN (the kernels' outputs are floating point), so an element
    the kernel fails to write cannot pass a comparison with a reference.
    """
    out = args["out"]
    call = functools.partial(
        _run, args["kernel"].__name__, args["grid"], args["constexprs"], out.shape, np.dtype(out.dtype)
    )

    def host(*host_arrays):
        return _worker().submit(call, *(np.ascontiguousarray(a) for a in host_arrays)).result()

    return jax.pure_callback(host, out, *arrays, vmap_method="sequential")


def _run(kernel: str, grid, constexprs: dict, out_shape, out_dtype, *arrays: np.ndarray) -> np.ndarray:
    """In the helper process: one interpreted launch of ``kernels.<kernel>``."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from . import kernels  # imports triton, in interpreter mode

    _patch_bf16_dot()
    _patch_bf16_rounding()
    out = np.full(out_shape, np.nan, out_dtype)
    getattr(kernels, kernel)[grid](*map(_HostArray, arrays), _HostArray(out), **constexprs)
    return out


@functools.lru_cache(maxsize=None)
def _patch_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` multiply bfloat16 tiles as numbers.

    Triton's interpreter stores bfloat16 as ``uint16`` bits, and its ``create_dot``
    (triton 3.6 to 3.9) hands those bits to ``np.matmul`` as integers. In this helper
    process only, bfloat16 operands are widened to float32 first, as tensor cores do
    (the products of two bfloat16 numbers are exact in float32).
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    builder.create_dot = create_dot


@functools.lru_cache(maxsize=None)
def _patch_bf16_rounding() -> None:
    """Make the interpreter round float32 to bfloat16 to nearest, as compiled Triton does.

    Compiled, ``acc.to(tl.bfloat16)`` rounds to nearest even (``cvt.rn.bf16.f32``); the
    interpreter's ``cast_impl`` (triton 3.6 to 3.9) passes no rounding mode and truncates,
    one ulp toward zero, which made an interpreted bfloat16 output twice as far from the
    exact result as ``lax.conv``'s. In this helper process only, that one conversion is
    done by ml_dtypes, which rounds as the hardware does.
    """
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(data, tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl


class _Storage:
    def __init__(self, array: np.ndarray):
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):  # the data never left the host: nothing to copy back
        del other


class _HostArray:
    """The ``torch.Tensor`` methods Triton's interpreter calls, over a C-contiguous NumPy array."""

    def __init__(self, array: np.ndarray):
        assert array.flags.c_contiguous
        self.array = array

    @property
    def dtype(self):
        return self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return _Storage(self.array)

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self
