#!/usr/bin/env bash
# Every GPU check and figure in one command, for a machine with a CUDA device (issue 23).
#
#   bash benchmarks/gpu.sh          # log and figures under $OUT when it is set, else a temporary folder
#
# It runs `pytest -m gpu` (every test that needs a GPU) and benchmarks/gpu.py (figures),
# in well under 8 minutes. The GPU machine has torch with CUDA, numpy, msgpack,
# cloudpickle, psutil, pytest and pytest-timeout, but no pyzmq and no network: a pyzmq
# wheel for CPython 3.12 manylinux x86_64 travels in .whl/ (fetched beforehand, kept out
# of git: see benchmarks/README.md, "On a GPU") and is installed into a target folder on
# PYTHONPATH. Ray is too large to carry: the Ray GPU test stays skipped there.
# Without a GPU (here) every check is skipped with its reason, and it exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
echo "== gpu.sh $(date -u +%FT%TZ) on $(hostname), in $PWD; log and figures in $OUT"
if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not on this machine"; fi
if ! python3 -c "import zmq" 2>/dev/null; then
  if ls .whl/pyzmq-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu.sh: pyzmq is not installed and no wheel is in .whl/: soma.Local cannot run here"
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY'
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count(),
          *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
except ImportError:
    print("torch: not installed")
try:
    import ray  # noqa: F401
    print("ray: installed")
except ImportError:
    print("ray: not installed (too large to carry): the Ray GPU test is skipped, saying so")
PY
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --junitxml="$OUT/gpu-tests.xml" tests
tests_rc=$?
timeout 240 python3 benchmarks/gpu.py --json "$OUT/gpu.json"
figures_rc=$?
echo "== gpu.sh: tests exit code $tests_rc, figures exit code $figures_rc"
[ "$tests_rc" -eq 0 ] && [ "$figures_rc" -eq 0 ]
