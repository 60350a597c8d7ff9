#!/usr/bin/env bash
# The TPU check: one command, under 9 minutes on one TPU v5e (jax preinstalled, no network).
#
#   MASKCONV_COMMIT=<sha> bash benchmarks/tpu_check.sh        # from the repository root
#
# Stages, each under its own timeout so that one slow stage cannot eat the others:
#   1. machine and versions (jax's devices, jax, jaxlib, libtpu, commit)    -> env.json
#   2. the original report's two experiments verbatim, lax.conv and masked_conv,
#      eager and jitted (python -m benchmarks.seed_experiment)             -> the log
#   3. the leak report: lax.conv beside masked_conv, exactness and timing
#      (python -m maskconv_kernels)                                         -> leak_report.json
#   4. the benchmark grid against lax.conv(kernel * mask) at device-filling
#      batches, the headline shapes first, every row with its leak and NaN
#      isolation measured on the timed executables and its peak memory
#      (python -m maskconv_kernels.bench conv --preset tpu)                 -> tpu_v5e.jsonl
#   5. causal_conv against jnp.pad + lax.conv at video VAE and audio codec layers,
#      full pass and one streamed chunk, with each executable's memory
#      (python -m maskconv_kernels.bench causal_conv --preset tpu)          -> causal_conv.jsonl
#   6. causal_conv1d against lax.conv and XLA's shift-and-add at Mamba-2 layers, with
#      the HBM roofline (python -m maskconv_kernels.bench sequence --preset tpu) -> sequence.jsonl
#   7. the suites named by PYTEST_PATHS (default: the two Mosaic TPU kernel suites)
#      compiled on the TPU, in one process (one program at a time may hold the chip),
#      at the default matmul precision                                      -> pytest.txt
#   8. the benchmarks' tables, printed last
# Everything goes to $OUT (default benchmarks/results/tpu-check), with the full log in
# tpu_check.log: 7 files, of the 8 the device machine returns.
#
# The device machine's copy of the tree has no .git: pass the commit as MASKCONV_COMMIT.
# Test dependencies come from the machine's own package index (PIP_INDEX, default
# file:///opt/pypi/simple) into /tmp/site, after its jax on PYTHONPATH.
# Override the interpreter with PYTHON=..., the stage limits with *_TIMEOUT (seconds).
# TPU_CHECK_ALLOW_CPU=1 lets the script run without a TPU (to test the script itself).
#
# The limits add up to under 9 minutes with stage 1's ~20 s and the summary (538 s): a stage that
# runs long is cut, not the check. On 2026-12-07 (fifth session, commit 7656f1e) it ended by
# itself in 471 s with every stage's rows (fourth session, commit 3ae983d: 427 s). On a warm TPU v5e (2026-12-07, commit 52ce080) the check
# ended by itself in 509 s: the seed took 19 s, the leak report 91 s, causal_conv 50 s; the
# grid wrote no row in 130 s (its first cell compiled lax.conv in 25 s and xla in 42 s), the
# kernel suites were cut at 69 of 71 tests (85 s), so the grid now times the default kernel
# beside lax.conv at forward+backward, bfloat16, and the suites have 100 s. The whole grid:
# bench conv --preset tpu.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/tpu-check}
SEED_TIMEOUT=${SEED_TIMEOUT:-25}
# The report took 89-97 s on a TPU v5e, its 7x7 type A timing compiling the xla path (the
# TPU's default there since 2026-12-07).
REPORT_TIMEOUT=${REPORT_TIMEOUT:-110}
# The grid took 113 s at 7656f1e with its budget of 90 s, after two of its three cells (5x5
# type B skipped); the stage now has 25 s of what the suites and the report did not use.
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
BENCH_BUDGET=${BENCH_BUDGET:-100}   # cells started after this many seconds are skipped
# Only the default kernel beside lax.conv, forward+backward in bfloat16 (the issue's targets),
# headline layers first: on 2026-12-07 the first cell's compiles with xla beside it (lax.conv
# 25 s, xla 42 s) outlasted the stage's limit and it wrote no row. More with BENCH_ARGS, e.g.
# "--shapes C256_32x32 --xla-strategies conv matmul" (every implementation, both dtypes).
BENCH_ARGS=${BENCH_ARGS:---shapes C256_32x32 --implementations pallas_mosaic_tpu --modes fwd+bwd --dtypes bfloat16}
CAUSAL_CONV_TIMEOUT=${CAUSAL_CONV_TIMEOUT:-45}  # it took 41 s on 2026-12-07
CAUSAL_CONV_BUDGET=${CAUSAL_CONV_BUDGET:-27}  # cells started after this many seconds are skipped
CAUSAL_CONV_ARGS=${CAUSAL_CONV_ARGS:---dtypes bfloat16}
SEQUENCE_TIMEOUT=${SEQUENCE_TIMEOUT:-45}
SEQUENCE_BUDGET=${SEQUENCE_BUDGET:-23}  # cells started after this many seconds are skipped (the L2048 cells took 25 s)
SEQUENCE_ARGS=${SEQUENCE_ARGS:---dtypes bfloat16 --modes fwd+bwd fwd --shapes _W4}
PYTEST_PATHS=${PYTEST_PATHS-tests/masked_conv/test_pallas_mosaic_tpu.py tests/causal_conv1d/test_causal_conv1d_pallas_mosaic_tpu.py}  # "" skips stage 7
PYTEST_K=${PYTEST_K:-}
PYTEST_SHARD=${PYTEST_SHARD:-}      # k/n: the tests whose node id hashes to k modulo n (tests/conftest.py)
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-100}  # 83 tests took 73 s at 7656f1e (the process about 85 s)
PIP_INDEX=${PIP_INDEX:-file:///opt/pypi/simple}
mkdir -p "$OUT"
# shellcheck source=benchmarks/check_preamble.sh
source "$ROOT/benchmarks/check_preamble.sh" tpu_check.log

stage "1. machine and versions"
timeout 90 "$PYTHON" - "$OUT/env.json" <<'EOF'
import importlib.metadata, json, os, platform, sys
import jax, jaxlib
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
env = {
    "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
    "jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": version("libtpu") or version("libtpu-nightly"),
    "python": platform.python_version(), "commit": os.environ.get("MASKCONV_COMMIT"),
}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
if env["backend"] != "tpu" and os.environ.get("TPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("jax sees no TPU (backend %r): this check is meant for the device machine" % env["backend"])
EOF
STATUS[env]=$?
[ "${STATUS[env]}" = 0 ] || { echo "no usable jax on a TPU: stopping"; exit 1; }
TAG=$("$PYTHON" -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null | tr '[:upper:]' '[:lower:]' \
  | sed 's/tpu v5 lite/tpu v5e/' | tr -c 'a-z0-9\n' '_' | sed 's/__*/_/g; s/_$//')

stage "2. the original report's experiments verbatim: lax.conv and masked_conv, eager and jitted (limit ${SEED_TIMEOUT}s)"
timeout "$SEED_TIMEOUT" "$PYTHON" -m benchmarks.seed_experiment
STATUS[seed]=$?

stage "3. the leak report: lax.conv and masked_conv side by side (limit ${REPORT_TIMEOUT}s)"
timeout "$REPORT_TIMEOUT" "$PYTHON" -m maskconv_kernels --json "$OUT/leak_report.json"
STATUS[leak_report]=$?

stage "4. the benchmark grid against lax.conv(kernel * mask) (budget ${BENCH_BUDGET}s, limit ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086
# stdout (the tables) is printed in the summary; of stderr keep the last lines and any traceback.
timeout "$BENCH_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench conv --preset tpu --time-budget "$BENCH_BUDGET" \
  --no-chart --out "$OUT" --name "$TAG" $BENCH_ARGS 2>&1 >/dev/null | tr '\r' '\n' | grep -v '^ *$' | tail -40
STATUS[bench]=${PIPESTATUS[0]}

stage "5. causal_conv and its stream against jnp.pad / a concatenating cache + lax.conv (budget ${CAUSAL_CONV_BUDGET}s, limit ${CAUSAL_CONV_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout "$CAUSAL_CONV_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench causal_conv --preset tpu \
  --time-budget "$CAUSAL_CONV_BUDGET" --no-chart --out "$OUT" --name causal_conv $CAUSAL_CONV_ARGS 2>&1 >/dev/null \
  | tr '\r' '\n' | grep -v '^ *$' | tail -20
STATUS[causal_conv]=${PIPESTATUS[0]}

stage "6. causal_conv1d against lax.conv and the shift-and-add (budget ${SEQUENCE_BUDGET}s, limit ${SEQUENCE_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout "$SEQUENCE_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench sequence --preset tpu \
  --time-budget "$SEQUENCE_BUDGET" --no-chart --out "$OUT" --name sequence $SEQUENCE_ARGS 2>&1 >/dev/null \
  | tr '\r' '\n' | grep -v '^ *$' | tail -20
STATUS[sequence]=${PIPESTATUS[0]}

if [ -n "$PYTEST_PATHS" ]; then
  stage "7. the suites on the TPU, compiled, one process (limit ${PYTEST_TIMEOUT}s)"
  PIP_CONFIG_FILE=/dev/null timeout 35 "$PYTHON" -m pip install -q --isolated --only-binary=:all: \
    --index-url "$PIP_INDEX" --target /tmp/site flax optax pytest-timeout >/dev/null 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  # -v: each test's name and outcome as it ends, so a run cut by the limit still names them.
  # shellcheck disable=SC2086
  MASKCONV_SHARD="$PYTEST_SHARD" timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest -p no:xdist -p no:cacheprovider \
    -o addopts="" -m "not slow" -v -rf --tb=short ${PYTEST_K:+-k "$PYTEST_K"} $PYTEST_PATHS 2>&1 \
    | tee "$OUT/pytest.txt" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -60
  STATUS[pytest]=${PIPESTATUS[0]}
fi

stage "8. summary"
"$PYTHON" -m maskconv_kernels.bench render "$OUT/$TAG.jsonl" 2>/dev/null
"$PYTHON" -m maskconv_kernels.bench render "$OUT/causal_conv.jsonl" 2>/dev/null
"$PYTHON" -m maskconv_kernels.bench render "$OUT/sequence.jsonl" 2>/dev/null
rm -f "$OUT/$TAG.md" "$OUT/causal_conv.md" "$OUT/sequence.md"  # render writes both again from the rows; 8 files come back at most
for key in "${!STATUS[@]}"; do echo "status $key: ${STATUS[$key]}"; done
echo "total: $(( $(date +%s) - START ))s"
