#!/usr/bin/env bash
# The GPU check: one command, under 8 minutes on one H200 (jax preinstalled, no network).
#
#   MASKCONV_COMMIT=<sha> bash benchmarks/gpu_check.sh        # from the repository root
#
# Stages, each under its own timeout so that one slow stage cannot eat the others:
#   1. machine and versions (nvidia-smi, jax, jaxlib, triton, commit)      -> env.json
#   2. the original report's two experiments verbatim, lax.conv and masked_conv,
#      eager and jitted (python -m benchmarks.seed_experiment)             -> the log
#   2b. the leak report's experiments, lax.conv/cuDNN beside masked_conv
#      (python -m maskconv_kernels): the most informative minute, first    -> leak_report.json
#   3. the benchmark grid against cuDNN, the headline shapes' fwd+bwd for the
#      default backend first, with a time budget (python -m
#      maskconv_kernels.bench conv --preset gpu; no chart and no .md: render
#      writes both from the rows)                                           -> <gpu>.jsonl
#   4. causal_conv1d's fused Pallas kernels beside the XLA shift-and-add and
#      cuDNN's depthwise convolution at Mamba-2/GDN shapes, each with the HBM
#      roofline (python -m maskconv_kernels.bench sequence)                 -> short_conv.jsonl
#   5. causal_conv against jnp.pad + lax.conv (cuDNN) at video VAE and audio
#      codec layers, full pass and one streamed chunk, with each executable's
#      memory (python -m maskconv_kernels.bench causal_conv --preset gpu)   -> causal_conv.jsonl
#   5b. a serving scheduler's step (causal_conv1d_step: decode rows, prefill
#      chunks mixed in, prefix caching) against its memory roofline and gather +
#      lax.conv + scatter (python -m maskconv_kernels.bench serving --preset
#      gpu); its rows are printed into the log (8 files already)           -> the log
#   6. the kernel test suites, compiled on the GPU (PYTEST_PATHS), in
#      parallel workers when pytest-xdist is there                          -> pytest.txt
#   7. per-kernel timings on the headline shapes: cuDNN's fwd/dx/dw beside
#      ours, Mosaic GPU's default tiles, Pallas tiles swept, Triton's autotune,
#      Mosaic GPU tiles swept (python -m benchmarks.tune)                    -> tune.json
#   8. the summary tables, printed last
# Everything goes to $OUT (default benchmarks/results/gpu-check), with the full log in
# gpu_check.log: 8 files, the most the device machine returns.
#
# The device machine's copy of the tree has no .git: pass the commit as MASKCONV_COMMIT.
# Python packages the image lacks (jax-triton 0.3.1, the release that fits its triton
# 3.6.0) travel as wheels in .whl/ (git-ignored; carry=[".whl"]), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl jax-triton==0.3.1
# and installed by this script into /tmp/site.
# Override the interpreter with PYTHON=..., the stage limits with *_TIMEOUT (seconds).
# GPU_CHECK_ALLOW_CPU=1 lets the script run without a GPU (to test the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/gpu-check}
SEED_TIMEOUT=${SEED_TIMEOUT:-45}
TUNE_TIMEOUT=${TUNE_TIMEOUT:-80}
TUNE_BUDGET=${TUNE_BUDGET:-55}      # kernels started after this many seconds are skipped
TUNE_ARGS=${TUNE_ARGS:-}            # e.g. "--dtypes bfloat16"
PYTEST_K=${PYTEST_K:-}              # a pytest -k expression, e.g. "triton or pallas"
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-90}
REPORT_TIMEOUT=${REPORT_TIMEOUT:-45}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-120}
BENCH_BUDGET=${BENCH_BUDGET:-80}    # cells started after this many seconds are skipped
BENCH_ARGS=${BENCH_ARGS:-}
SHORT_CONV_TIMEOUT=${SHORT_CONV_TIMEOUT:-75}
SHORT_CONV_BUDGET=${SHORT_CONV_BUDGET:-50}  # cells started after this many seconds are skipped
CAUSAL_CONV_TIMEOUT=${CAUSAL_CONV_TIMEOUT:-60}
CAUSAL_CONV_BUDGET=${CAUSAL_CONV_BUDGET:-35}  # cells started after this many seconds are skipped
SERVING_TIMEOUT=${SERVING_TIMEOUT:-45}
SERVING_BUDGET=${SERVING_BUDGET:-25}  # cells started after this many seconds are skipped
mkdir -p "$OUT"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl && PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# shellcheck source=benchmarks/check_preamble.sh
source "$ROOT/benchmarks/check_preamble.sh" gpu_check.log

stage "1. machine and versions"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 || echo "nvidia-smi: not available"
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
timeout 60 "$PYTHON" - "$OUT/env.json" <<'EOF'
import json, os, platform, subprocess, sys
import jax, jaxlib
def smi(field):
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or None
    except OSError:
        return None
env = {
    "gpu": smi("name"), "driver": smi("driver_version"), "memory_total": smi("memory.total"),
    "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
    "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
    "commit": os.environ.get("MASKCONV_COMMIT"),
}
try:
    import triton
    env["triton"] = triton.__version__
except Exception as e:
    env["triton"] = f"not importable: {e}"
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
if env["backend"] != "gpu" and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("jax sees no GPU (backend %r): this check is meant for the device machine" % env["backend"])
EOF
STATUS[env]=$?
[ "${STATUS[env]}" = 0 ] || { echo "no usable jax on a GPU: stopping"; exit 1; }
TAG=$(echo "${GPU_NAME:-cpu}" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9\n' '-' | sed 's/--*/-/g; s/-$//')

stage "2. the original report's experiments verbatim: lax.conv (cuDNN) and masked_conv, eager and jitted (limit ${SEED_TIMEOUT}s)"
timeout "$SEED_TIMEOUT" "$PYTHON" -m benchmarks.seed_experiment
STATUS[seed]=$?

stage "2b. the leak report's experiments: lax.conv (cuDNN) and masked_conv side by side (limit ${REPORT_TIMEOUT}s)"
timeout "$REPORT_TIMEOUT" "$PYTHON" -m maskconv_kernels --quick --json "$OUT/leak_report.json"
STATUS[leak_report]=$?

stage "3. benchmark grid against cuDNN (budget ${BENCH_BUDGET}s, limit ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086
# stdout (the table) is re-rendered below; of stderr keep the progress bar's last state and any traceback.
timeout "$BENCH_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench conv --preset gpu --time-budget "$BENCH_BUDGET" \
  --no-chart --out "$OUT" --name "$TAG" $BENCH_ARGS 2>&1 >/dev/null | tr '\r' '\n' | grep -v '^ *$' | tail -25
STATUS[bench]=${PIPESTATUS[0]}
rm -f "$OUT/$TAG.md"  # render rewrites it from the rows; the device returns 8 files at most

stage "4. causal_conv1d's fused kernels, the shift-and-add and cuDNN depthwise (budget ${SHORT_CONV_BUDGET}s, limit ${SHORT_CONV_TIMEOUT}s)"
# Its table is printed again in the summary.
timeout "$SHORT_CONV_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench sequence --preset gpu \
  --time-budget "$SHORT_CONV_BUDGET" --no-chart --out "$OUT" --name short_conv | tail -3
STATUS[short_conv]=${PIPESTATUS[0]}
rm -f "$OUT/short_conv.md"  # its table is in the log (the summary); the device returns 8 files at most

stage "5. causal_conv and its stream against jnp.pad / a concatenating cache + lax.conv (budget ${CAUSAL_CONV_BUDGET}s, limit ${CAUSAL_CONV_TIMEOUT}s)"
# Its tables are printed again in the summary.
timeout "$CAUSAL_CONV_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench causal_conv --preset gpu \
  --time-budget "$CAUSAL_CONV_BUDGET" --no-chart --out "$OUT" --name causal_conv | tail -3
STATUS[causal_conv]=${PIPESTATUS[0]}
rm -f "$OUT/causal_conv.md"  # its tables are in the log (the summary); the device returns 8 files at most

stage "5b. a serving step against its memory roofline and gather + lax.conv + scatter (budget ${SERVING_BUDGET}s, limit ${SERVING_TIMEOUT}s)"
# The device returns 8 files at most: the rows go into the log, after the table.
SERVING_DIR=$(mktemp -d)
timeout "$SERVING_TIMEOUT" "$PYTHON" -m maskconv_kernels.bench serving --preset gpu \
  --time-budget "$SERVING_BUDGET" --no-chart --out "$SERVING_DIR" --name serving
STATUS[serving]=$?
echo "serving rows (jsonl):"; cat "$SERVING_DIR/serving.jsonl" 2>/dev/null

stage "6. pytest, compiled on the GPU (limit ${PYTEST_TIMEOUT}s)"
# -v: each test's name and result as it ends, so a run cut by its limit still names its
# failures (2026-12-04: ~30 failed before the limit, unnamed under -q); --session-timeout
# (pytest-timeout >= 2.3) ends the session in time to print the failures' tracebacks.
PYTEST_ARGS=(-v -p no:cacheprovider -p no:benchmark --durations=10 -rfEs --tb=short)
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout=60)
"$PYTHON" -m pytest --help 2>/dev/null | grep -q -- --session-timeout && PYTEST_ARGS+=(--session-timeout=$((PYTEST_TIMEOUT - 20)))
# Compilation dominates: spread the tests over worker processes, which then share the
# GPU, so none may preallocate most of its memory.
"$PYTHON" -c "import xdist" 2>/dev/null && PYTEST_ARGS+=(-n "${PYTEST_WORKERS:-8}")
# The suites where the compiled GPU backends (pallas, triton, mosaic gpu, and xla's matmul
# path) run; the rest (flax, sharding on forced CPU devices, masks, errors) is what CI
# checks on CPU. Mosaic GPU's own suite goes first: it has never run compiled, and the
# whole list did not finish in the first run's limit. Missing files are dropped (pytest
# would stop at a path that does not exist).
PYTEST_PATHS=${PYTEST_PATHS:-tests/masked_conv/test_pallas_mosaic_gpu.py tests/masked_conv/test_agreement.py tests/masked_conv/test_exactness.py tests/masked_conv/test_transforms.py tests/masked_conv/test_pallas_triton.py tests/masked_conv/test_triton.py tests/masked_conv/test_dispatch.py tests/causal_conv1d/test_causal_conv1d_pallas_triton.py}
PYTEST_PATHS=$(for f in $PYTEST_PATHS; do [ -e "$f" ] && echo "$f"; done | tr '\n' ' ')
[ -n "$PYTEST_K" ] && PYTEST_ARGS+=(-k "$PYTEST_K")
# shellcheck disable=SC2086
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest "${PYTEST_ARGS[@]}" $PYTEST_PATHS 2>&1 \
  | grep -v -e PytestBenchmarkWarning -e "warnings.warn" | tee "$OUT/pytest.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -60
STATUS[pytest]=${PIPESTATUS[0]}

stage "7. per-kernel timings and tile sweep on the headline shapes (budget ${TUNE_BUDGET}s, limit ${TUNE_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout "$TUNE_TIMEOUT" "$PYTHON" -m benchmarks.tune --budget "$TUNE_BUDGET" --out "$OUT/tune.json" $TUNE_ARGS
STATUS[tune]=$?

stage "8. summary"
# Re-rendered from the rows written so far, so an interrupted grid still gets its table.
if [ -s "$OUT/$TAG.jsonl" ]; then
  timeout 60 "$PYTHON" -m maskconv_kernels.bench render "$OUT/$TAG.jsonl" | sed -n '/^## Summary/,$p'
else
  echo "no benchmark rows"
fi
if [ -s "$OUT/short_conv.jsonl" ]; then
  echo; echo "causal_conv1d (python -m maskconv_kernels.bench sequence):"
  timeout 60 "$PYTHON" -m maskconv_kernels.bench render "$OUT/short_conv.jsonl"
fi
if [ -s "$OUT/causal_conv.jsonl" ]; then
  echo; echo "causal_conv (python -m maskconv_kernels.bench causal_conv):"
  timeout 60 "$PYTHON" -m maskconv_kernels.bench render "$OUT/causal_conv.jsonl" | sed -n '/^## Targets/,$p'
fi
if [ -s "$OUT/leak_report.json" ]; then
  echo; echo "The leak report's experiments (python -m maskconv_kernels):"
  "$PYTHON" - "$OUT/leak_report.json" <<'EOF' || echo "(leak_report.json not in the expected format)"
import json, sys
r = json.load(open(sys.argv[1]))
ex = r["exactness"]
labels = list(ex)
print(r.get("device", ""), "| masked_conv implementation:", r.get("implementation"))
print("| check | " + " | ".join(labels) + " |")
print("|---|" + "---:|" * len(labels))
titles = {k: e["title"] for k, e in r.get("experiments", {}).items()}
for check in ex[labels[0]]:
    print(f"| {titles.get(check, check)} | " + " | ".join(f"{ex[l][check]:.3g}" for l in labels) + " |")
EOF
fi
if [ -s "$OUT/tune.json" ]; then
  echo; echo "Per-kernel ms (python -m benchmarks.tune): cuDNN, Pallas and Mosaic GPU default tile / best tile, Triton's pick"
  echo "(mosaic predicted: benchmarks/predict_mgpu.py's time for the default tiles, made before any GPU run)"
  "$PYTHON" - "$OUT/tune.json" <<'EOF' || echo "(tune.json not in the expected format)"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("| shape | dtype | kernel | cuDNN | pallas default | pallas best (tile) | triton | mosaic predicted "
      "| mosaic default | mosaic best (tile) |")
print("|---|---|---|---:|---:|---|---:|---:|---:|---|")
for key in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
    sub = [r for r in rows if (r["shape"], r["dtype"]) == key and "ms" in r]
    for kind in ("fwd", "dx", "dw", "step"):
        get = lambda impl, f=None: [r for r in sub if r["impl"] == impl and r["kind"] == kind and (f is None or f(r))]
        base, tri = get("baseline"), get("triton")
        fmt = lambda rs: f"{rs[0]['ms']:.3f}" if rs else "-"
        best = lambda rs: f"{rs[0]['ms']:.3f} ({','.join(map(str, rs[0]['tile']))})" if rs else "-"
        pal, pal_d = sorted(get("pallas_triton"), key=lambda r: r["ms"]), get("pallas_triton", lambda r: r.get("default"))
        mg, mg_d = sorted(get("pallas_mosaic_gpu"), key=lambda r: r["ms"]), get("pallas_mosaic_gpu", lambda r: r.get("default"))
        pred = [r["predicted_ms"] for r in rows if (r["shape"], r["dtype"]) == key and r["impl"] == "pallas_mosaic_gpu"
                and r["kind"] == kind and r.get("default") and r.get("predicted_ms")]
        print(f"| {key[0]} | {key[1]} | {kind} | {fmt(base)} | {fmt(pal_d)} | {best(pal)} | {fmt(tri)} "
              f"| {f'{pred[0]:.3f}' if pred else '-'} | {fmt(mg_d)} | {best(mg)} |")
unsupported = {(r["impl"], r["error"]) for r in rows if r.get("error", "").startswith("unsupported:")}
for impl, why in sorted(unsupported):
    print("not run:", impl, why[:160])
for r in [r for r in rows if "error" in r and not r["error"].startswith("unsupported:")][:8]:
    print("error:", r["impl"], r["kind"], r.get("tile"), r["error"][:160])
EOF
fi
echo
echo "| stage | exit status |"
echo "|---|---|"
for s in env seed leak_report bench short_conv causal_conv serving pytest tune; do echo "| $s | ${STATUS[$s]} $( [ "${STATUS[$s]}" = 124 ] && echo '(timed out)') |"; done
grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -1
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "total $(( $(date +%s) - START ))s"
