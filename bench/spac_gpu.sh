#!/usr/bin/env bash
# MoE-SpAc on a CUDA machine: the benchmark of docs/benchmarks/spac.md with the host-memory tier
# over the real PCIe link, where CPU-run experts can show their benefit (on a CPU-only box the
# "fast device" is the CPU too). Self-contained: installs the project into .venv-gpu if needed,
# checks for a GPU, runs in under 5 minutes and writes docs/benchmarks/spac_gpu.md (+ .json);
# with $OUT set (the device tool), copies both there too.
#
#   bash bench/spac_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if ! python3 -c "import torch, transformers, safetensors" 2>/dev/null; then
    python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install -q torch -e .  # the default PyPI torch wheel is the CUDA build
    PY=.venv-gpu/bin/python
  else
    PY=python3
    "$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
  fi
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'spac_gpu.sh: no CUDA GPU visible; run bench/spac_bench.py on CPU instead')"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 280 "$PY" -m bench.spac_bench --settings ram,disk --streams 1,8 --rounds 2 --tokens 32 --threads 4 \
  --out docs/benchmarks/spac_gpu.md
if [ -n "${OUT:-}" ]; then cp docs/benchmarks/spac_gpu.md docs/benchmarks/spac_gpu.json "$OUT"/; fi
