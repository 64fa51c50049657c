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
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
# a .pth puts the carried packages first in every python3, the `flockfl` subprocesses included
# (the tests give those PYTHONPATH=<repo>, which would drop a PYTHONPATH entry)
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "import sys; sys.path.insert(0, '/tmp/site')" > "$SP/000-flockfl-carry.pth"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, prefect, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'prefect', prefect.__version__, 'pydantic', pydantic.VERSION)" | tee -a "$OUT/device.txt"

T_TESTS=${T_TESTS:-240} T_SPEED=${T_SPEED:-200}
echo "== pytest -m gpu (${T_TESTS}s cap)"
timeout "$T_TESTS" python3 -m pytest -m gpu tests/test_gpu.py -q -n 8 -p no:cacheprovider --timeout 200 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -40
echo "== gpu_speed (${T_SPEED}s cap)"
timeout "$T_SPEED" python3 benchmarks/gpu_speed.py --device cuda --repeats 5 --flock-run 2>&1 | tee "$OUT/gpu_speed.log"
timeout 90 python3 benchmarks/gpu_speed.py --device cuda --repeats 5 --fast-math --engines vectorized 2>&1 \
  | tee "$OUT/gpu_speed_fast.log"
