# shellcheck shell=bash
# What the device checks (gpu_check.sh, tpu_check.sh) set up alike, sourced after ROOT and
# OUT: the package first on PYTHONPATH, unbuffered Python, the commit, the whole log in
# $OUT/$1, and stage(), which announces a stage with the seconds since the start. Each
# stage's exit status goes in STATUS[name], printed in the summary.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MASKCONV_COMMIT=${MASKCONV_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
exec > >(tee "$OUT/$1") 2>&1
START=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }
declare -A STATUS
