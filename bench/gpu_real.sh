#!/usr/bin/env bash
# The GPU measurement in one command (issue 40): on one GPU, any CUDA build of torch, <= 8 minutes.
#   1. the CUDA-marked tests (tests marked `cuda`; docs/architecture.md lists what each covers);
#   2. bench/gpu_real.py: builds the random-weight Qwen3-30B-A3B-shaped checkpoint, then measures
#      cache 1.0 against transformers, fetch-all / speed-first / MoE-SpAc / SpecPrefetch at a 24 GiB
#      budget against fetch-all and accelerate's offload, host syncs and H2D bytes per token, and
#      copy bandwidth against the pinned peak; writes docs/benchmarks/gpu_real.json.
# --dry-run: the same on a CPU at toy sizes (writes .cache/gpu_real/dry_run.json; CI's slow tests
# run it). Other arguments go to bench/gpu_real.py (--out, --layers, --work). Uses the python that
# holds torch: PYTHON=..., else .venv/bin/python where it exists, else python3; this checkout on
# PYTHONPATH (no install: a GPU machine may have no network). With $OUT set (the device tool), the
# JSON and the test log are copied there too.
#
#   bash bench/gpu_real.sh [--dry-run] [--out FILE] [--layers N]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Wheels carried to a machine with no network (the device tool's .whl/ folder): installed beside, not over.
if ls .whl/*.whl > /dev/null 2>&1; then
  site="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$site" || { echo "gpu_real.sh: could not install the wheels in .whl/"; exit 1; }
fi
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
work=.cache/gpu_real
mkdir -p "$work"
if [ $dry = 0 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_real.sh: no CUDA GPU visible to $PY; run on a GPU machine, or bash bench/gpu_real.sh --dry-run on a CPU')" || exit 1
fi
missing=$("$PY" -c "
import importlib.util as u
need = ['torch', 'transformers', 'safetensors', 'tokenizers', 'accelerate', 'yaml', 'tqdm', 'numpy', 'pytest']
print(' '.join(n for n in need if u.find_spec(n) is None))")
if [ -n "$missing" ]; then
  echo "gpu_real.sh: missing Python packages: $missing (pip install them, or carry them as wheels)"; exit 1
fi
"$PY" -c "import torch, transformers, accelerate; print('torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"
LOG=$work/cuda_tests.log
files=$(grep -l "mark.cuda" tests/test_*.py)
echo "== CUDA-marked tests: $files"
# Under a timeout of their own: a hung test must not eat the measurement's minutes (on a dry run they are
# only collected and skipped, which a loaded 2-core machine may take minutes to import).
limit=100; [ $dry = 1 ] && limit=400
timeout $limit "$PY" -m pytest -q -m cuda -n 0 -p no:cacheprovider $files > "$LOG" 2>&1
tests=$?
[ $tests = 124 ] && echo "gpu_real.sh: the CUDA-marked tests ran past ${limit} s" | tee -a "$LOG"
tail -3 "$LOG"
echo "== bench/gpu_real.py"
timeout 360 "$PY" -m bench.gpu_real --tests-log "$LOG" "$@"
status=$?
if [ -n "${OUT:-}" ]; then
  cp "$LOG" "$OUT"/ 2>/dev/null
  if [ $dry = 1 ]; then cp .cache/gpu_real/dry_run.json "$OUT"/ 2>/dev/null; else cp docs/benchmarks/gpu_real.json "$OUT"/ 2>/dev/null; fi
fi
# Skipped tests are no failure (a dry run skips them all); failed ones are (exit 1 or 2; 5: none collected).
if [ $tests -ne 0 ] && [ $tests -ne 5 ]; then echo "gpu_real.sh: CUDA-marked tests failed (see $LOG)"; [ $status -eq 0 ] && status=1; fi
exit $status
