#!/usr/bin/env bash
# tensorscope on a GPU box, in one go: build the C++ extensions, run `tensorscope check` on CUDA
# under both scope engines, then the tests marked gpu. Run from the repository root:
#
#     bash tools/gpu_check.sh            # results under $OUT if set, else a temporary directory
#
# Every step runs whatever failed before it (no `set -e`); everything goes to stdout too. The whole
# script ends within TOTAL_SECONDS (default 570: one 10-minute command): the build gets at most
# 240 s, each engine's check at most CHECK_SECONDS (default 180) of what is left, the gpu tests
# the rest (at least 60 s are kept for them). Knobs: PYTHON (default python3), TOTAL_SECONDS,
# CHECK_SECONDS, TS_SKIP_BUILD=1 (use extensions already in tensorscope/ that import),
# CHECK_SIZE (full or small).

cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
TOTAL_SECONDS="${TOTAL_SECONDS:-570}"
CHECK_SECONDS="${CHECK_SECONDS:-180}"
CHECK_SIZE="${CHECK_SIZE:-full}"
RESULTS="${OUT:-$(mktemp -d -t tensorscope-gpu-check-XXXXXX)}"
mkdir -p "$RESULTS"
START=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( TOTAL_SECONDS - ($(date +%s) - START) )); }  # seconds the script has left
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

say "results in $RESULTS; repository $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
"$PY" - <<'PY' 2>&1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 | head -5

# 1. the C++ extensions (tensorscope._fast: the scope engine and the op path; tensorscope._storage:
#    the storage door torch < 2.13 needs for every residency move)
extensions_ok() {
    "$PY" -c "import torch, tensorscope._fast, tensorscope._storage" 2>&1
}
if [ "${TS_SKIP_BUILD:-0}" = 1 ] && extensions_ok >/dev/null; then
    say "TS_SKIP_BUILD=1 and the extensions import: no build"
else
    say "building the C++ extensions (log: $RESULTS/build.log)"
    MAX_JOBS="${MAX_JOBS:-16}" timeout 240 "$PY" setup.py build_ext --inplace 2>&1 | tee "$RESULTS/build.log"
    say "build exit status ${PIPESTATUS[0]} (optional extensions: a failed compile still exits 0)"
fi
BUILT=0
if problem=$(extensions_ok); then
    BUILT=1
    say "extensions import: the C++ engine runs the first check"
else
    say "the extensions do not import; the checks run with the Python engine only:"
    echo "$problem" | tail -5
fi
"$PY" -c "from tensorscope._torch import STORAGE_DOOR, storage_door_missing as m; print('storage door:', STORAGE_DOOR or 'MISSING', m() or '')" 2>&1

# 2. tensorscope check on CUDA, both engines
run_check() {  # $1: engine name, $2: json file, $3: how many checks are still to run (1 or 2)
    local budget
    budget=$(min "$CHECK_SECONDS" $(( ($(left) - 60) / $3 - 15 )))
    if [ "$budget" -lt 30 ]; then
        say "no time left for the check with engine $1"
        return
    fi
    say "tensorscope check --device cuda, engine $1 (at most ${budget}s)"
    timeout --kill-after=10 $(( budget + 15 )) "$PY" -m tensorscope.check --device cuda \
        --size "$CHECK_SIZE" --time-limit "$budget" --json "$RESULTS/$2" 2>&1
    say "check ($1) exit status $? (0: all passed; 1: some did not; 2: no CUDA device; 124/137: killed)"
}
if [ "$BUILT" = 1 ]; then
    run_check c++ check.json 2
    TENSORSCOPE_ENGINE=python run_check python check-python.json 1
else
    TENSORSCOPE_ENGINE=python run_check python check-python.json 1
fi

# 3. the tests that need a GPU
say "pytest -m gpu (engine: $([ "$BUILT" = 1 ] && echo c++ || echo python))"
timeout --kill-after=5 $(( $(left) > 20 ? $(left) - 10 : 10 )) "$PY" -m pytest -q -x -m gpu -p no:cacheprovider \
    tests/residency/test_lifecycle.py tests/fit/test_offload.py 2>&1 | tee "$RESULTS/pytest-gpu.log"
say "pytest exit status ${PIPESTATUS[0]}"
ls -l "$RESULTS"
say "done"
