"""Every ``xla`` strategy compiles and runs on XLA:CPU over a grid of small 16-bit problems,
each grid in a child process, so that a compiler abort fails one test instead of killing pytest.

jaxlib 0.12.1's CPU code generator aborted the process on a bfloat16 fusion of ours (a
caller's layout transpose fused with a box's slice; the design notes' CPU compiler abort).
The project's suites passed on it: they compile at LLVM's -O0 in xdist's workers
(tests/conftest.py), where the abort does not happen. The child compiles at XLA's default,
as users do. The grid is :mod:`support.compile_grid`'s, in :data:`PARTS` parts (a child
each, so xdist's workers share them); ``.ci/run`` runs it by halves on the newest jax,
whose compiler aborted, and by quarters on the oldest
(``MASKCONV_GRID_PART``: the slow tier's quarter ``k`` chooses parts ``k`` and ``k + 2``,
then ``k``), so two consecutive commits compile all of it on the newest and four on the
oldest; the README's command runs the regressions only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from support import compile_grid

from maskconv_kernels.ops.masked_conv import xla

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(os.path.dirname(HERE), "support")
GRID = os.path.join(SUPPORT, "compile_grid.py")

STRATEGIES = ("auto", "conv", "matmul", "gemm", "conv_blocks")
# The grid's: "auto" on CPU is "conv" at its channel counts (test_auto_is_conv_on_the_grid).
GRID_STRATEGIES = ("conv", "matmul", "gemm", "conv_blocks")
DTYPES = ("bfloat16", "float16")
# The grid's parts: part k is the problems whose index is k modulo PARTS.
PARTS = 4


def _child_env() -> dict:
    """This process's environment for XLA:CPU at its default optimization level, one device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_backend_optimization_level" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(SUPPORT), env.get("PYTHONPATH")) if p)
    return env


def run_child(args: list[str], timeout: int = 900) -> None:
    """Runs ``python *args``, which prints ``case <id>`` before each case and ``done`` at the end;
    fails naming the case it was on when it dies (an abort, a signal) or raises."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_child_env(), timeout=timeout)
    lines = out.stdout.splitlines()
    if out.returncode == 0 and lines[-1:] == ["done"]:
        return
    cases = [line[5:] for line in lines if line.startswith("case ")]
    where = f"while on case {cases[-1]}" if cases else "before its first case"
    how = (
        f"was killed by {signal.Signals(-out.returncode).name}" if out.returncode < 0
        else f"exited with status {out.returncode}"
    )
    tail = "\n".join(out.stderr.strip().splitlines()[-12:])
    pytest.fail(f"the child {how} {where}:\n{tail}", pytrace=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_regressions_compile_and_match_lax(dtype):
    """The problems that once aborted a compiler (support.compile_grid.REGRESSIONS), every strategy."""
    run_child([GRID, "--regressions", "--strategies", ",".join(STRATEGIES), dtype])


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_grid(dtype, part):
    """A part of the grid under every strategy, one child per dtype and part (the reference
    computed once per problem). ``MASKCONV_GRID_PART=k,...``: only those parts run."""
    only = os.environ.get("MASKCONV_GRID_PART") or None
    if only is not None and part not in {int(k) % PARTS for k in only.split(",")}:
        pytest.skip(f"MASKCONV_GRID_PART={only}: not part {part} of the grid")
    indices = [str(p["index"]) for p in compile_grid.problems() if p["index"] % PARTS == part]
    run_child([GRID, "--strategies", ",".join(GRID_STRATEGIES), dtype, *indices])


def test_auto_is_conv_on_the_grid():
    """So the grid need not compile "auto" again: lowered for CPU it runs "conv" for every map there."""
    for p in compile_grid.problems():
        spec = compile_grid.spec(p)
        assert {xla.cpu_strategy(spec, kind) for kind in xla.MAPS} == {"conv"}, compile_grid.case_id(p)


def test_an_abort_fails_the_test_naming_its_case(tmp_path):
    """The harness itself: a child that dies mid-case is a failure that names the case."""
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print("case 1:fine", flush=True); print("ok", flush=True)
        print("case 2:fatal", flush=True)
        sys.stderr.write("LLVM ERROR: Cannot select\\n"); sys.stderr.flush()
        os.abort()
    """))
    with pytest.raises(pytest.fail.Exception) as failure:
        run_child([str(script)], timeout=60)
    message = str(failure.value)
    assert "killed by SIGABRT while on case 2:fatal" in message and "LLVM ERROR" in message
