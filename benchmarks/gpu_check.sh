#!/usr/bin/env bash
# The device checks of a lent GPU machine, in one call: the `gpu`-marked tests, then
# benchmarks/gpu_speed.py (both trainers, deterministic numerics; then fast math, vectorised).
#
# The machine's image has PyTorch but no pydantic/Prefect: carry them as wheels built for its
# Python (3.12), from this checkout's root:
#   echo /.whl/ >> .git/info/exclude
#   python -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .whl prefect==3.9.1 pydantic==2.14.4 'fastapi<0.155' 'sqlalchemy>=2.0,<2.1'
#   (then delete pytest*, pluggy*, iniconfig*: the image's pytest and its plugins stay)
# and run `bash benchmarks/gpu_check.sh` there with `.whl` carried. Logs land in $OUT (or ./gpu-out).
#
# Its last stage is NIID-Bench's Fashion-MNIST table at the paper's budget (`flockfl repro
# niid_bench_fmnist --budget paper --seeds 0 1 2`, cells stacked, MLflow off), which no 15-minute
# lease finishes: it stops at its time cap with SIGINT (each cell keeps its checkpoints), packs the
# table's folder into $OUT/repro.tgz and prints where it stands. Carry, besides `.whl`:
#   data/raw/fashion_mnist   (cp -r /usr/share/datasets/fashion-mnist data/raw/fashion_mnist)
#   gpu-carry                (mkdir gpu-carry; after a call, copy that call's $OUT/repro.tgz into it)
# and the next call continues the table where the last one stopped (finished cells kept as they are,
# the others resumed from their checkpoints). T_TESTS=0 T_SPEED=0 skip straight to the table;
# REPRO_PARALLEL (default 2) is the table's processes.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then  # a machine whose Python has the stack already (a CPU dry run) carries none
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  # a .pth puts the carried packages first in every python3, the `flockfl` subprocesses included
  # (the tests give those PYTHONPATH=<repo>, which would drop a PYTHONPATH entry)
  SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "import sys; sys.path.insert(0, '/tmp/site')" > "$SP/000-flockfl-carry.pth"
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, prefect, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'prefect', prefect.__version__, 'pydantic', pydantic.VERSION)" | tee -a "$OUT/device.txt"

T_TESTS=${T_TESTS:-240} T_SPEED=${T_SPEED:-200}
if [ "$T_TESTS" -gt 0 ]; then
  echo "== pytest -m gpu (${T_TESTS}s cap)"
  timeout "$T_TESTS" python3 -m pytest -m gpu tests/test_gpu.py -q -n 8 -p no:cacheprovider --timeout 200 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ "$T_SPEED" -gt 0 ]; then
  echo "== gpu_speed (${T_SPEED}s cap)"
  timeout "$T_SPEED" python3 benchmarks/gpu_speed.py --device cuda --repeats 5 --flock-run 2>&1 | tee "$OUT/gpu_speed.log"
  timeout 90 python3 benchmarks/gpu_speed.py --device cuda --repeats 5 --fast-math --engines vectorized 2>&1 \
    | tee "$OUT/gpu_speed_fast.log"
fi

T_REPRO=${T_REPRO:-300}
REPRO=runs/repro-gpu
[ -f gpu-carry/repro.tgz ] && tar xzf gpu-carry/repro.tgz && echo "continuing the table from gpu-carry/repro.tgz"
echo "== repro niid_bench_fmnist ${REPRO_ARGS:---budget paper --seeds 0 1 2} (${T_REPRO}s cap; continues next call)"
REPRO_ARGS=${REPRO_ARGS:---budget paper --seeds 0 1 2}  # a CPU dry run: a tiny budget (docs/benchmarks.md)
# stacks in two processes (flows/sweep_workers.py): each launches its own stacks' kernels, so one
# stack's Python (its cells' evaluation, selection, checkpoints) overlaps the other's GPU work
REPRO_PARALLEL=${REPRO_PARALLEL:-2}
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=60 "$T_REPRO" python3 -m flows.cli repro niid_bench_fmnist $REPRO_ARGS \
  --parallel "$REPRO_PARALLEL" --out "$REPRO" --set tracking.enabled=false --no-progress 2>&1 | tee "$OUT/repro.log" | tail -30
[ -d "$REPRO" ] && tar czf "$OUT/repro.tgz" "$REPRO"
python3 - "$REPRO" <<'PY' | tee -a "$OUT/repro.log"
import json, sys
from pathlib import Path
runs = json.loads((Path(sys.argv[1]) / "runs" / "sweep.json").read_text()).get("runs", {}) \
    if (Path(sys.argv[1]) / "runs" / "sweep.json").exists() else {}
done = [k for k, v in runs.items() if v["status"] == "finished"]
print(f"where it stands: {len(done)} of {len(runs) or 60} cells finished; "
      + ("the rest resume next call" if len(done) < (len(runs) or 60) else "the table is complete"))
PY
