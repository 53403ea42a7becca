#!/usr/bin/env bash
# The GPU check (issue 15 §6), ready for the day a CUDA machine is lent: under 5 minutes on one GPU.
#   1. the CUDA-marked tests (parity on the GPU, the copy stream and its events);
#   2. bench/gpu_check.py: H2D GB/s pinned and pageable against each other, copy/compute overlap on a side
#      stream, the engine's own transfer rate, decode tok/s at cache 1.0 and 0.25 against transformers on
#      the mid peers checkpoint, and greedy tokens against transformers;
#   3. speculative decoding and CPU-run experts: bench/spac_bench.py on the host-memory tier over PCIe;
#   4. bench/gpu_profile.py: where a decode token's time goes, transformers against the engine.
# Uses the python3 that holds a CUDA torch (PYTHON=... to choose), with this checkout on PYTHONPATH (no
# install: the machine may have no network). Writes docs/benchmarks/gpu_check.md, gpu_spac.md, gpu_profile.md (+ .json),
# and with $OUT set (the device tool) copies them and the test log there.
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=${OUT:-docs/benchmarks}/gpu_check_tests.log
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU visible to this python3; run on a GPU machine (or PYTHON=... for another interpreter)')" || exit 1
missing=$("$PY" -c "
import importlib.util as u
need = ['transformers', 'safetensors', 'tokenizers', 'yaml', 'tqdm', 'numpy', 'pytest', 'prometheus_client']
print(' '.join(n for n in need if u.find_spec(n) is None))")
if [ -n "$missing" ]; then
  echo "gpu_check.sh: missing Python packages: $missing (pip install them, or carry them as wheels)"; exit 1
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))"
status=0
# 1. CUDA-marked tests: only the files that hold some (the server tests import fastapi, which a GPU image may lack).
files=$(grep -l "mark.cuda" tests/test_*.py)
echo "== CUDA tests: $files"
timeout 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider $files 2>&1 | tee "$LOG" | tail -5 || status=1
# 2. Transfers and decode speed.
echo "== bench/gpu_check.py"
timeout 150 "$PY" -m bench.gpu_check --tokens 64 --rounds 2 --out docs/benchmarks/gpu_check.md || status=1
# 3. Speculative decoding and CPU-run experts over PCIe (the host-memory tier).
echo "== bench/spac_bench.py --settings ram"
timeout 90 "$PY" -m bench.spac_bench --settings ram --streams 1,8 --rounds 1 --tokens 24 --threads 4 \
  --device cuda --out docs/benchmarks/gpu_spac.md || status=1
# 4. Where a decode token's time goes (kernels, GPU busy time, host-device syncs, host operators).
echo "== bench/gpu_profile.py"
timeout 90 "$PY" -m bench.gpu_profile --tokens 32 --out docs/benchmarks/gpu_profile.md || status=1
if [ -n "${OUT:-}" ]; then
  cp docs/benchmarks/gpu_check.md docs/benchmarks/gpu_check.json docs/benchmarks/gpu_spac.md docs/benchmarks/gpu_spac.json \
     docs/benchmarks/gpu_profile.md docs/benchmarks/gpu_profile.json "$OUT"/ 2>/dev/null
fi
exit $status
