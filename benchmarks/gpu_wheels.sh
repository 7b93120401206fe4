#!/usr/bin/env bash
# The Python packages specjax needs that the GPU image lacks (pure Python: gguf, qwix), as
# wheels at this checkout's venv versions, into .whl/ (ignored through .git/info/exclude), for
# the device tool's `carry` (/work/.library/device/README.md):
#
#   bash benchmarks/gpu_wheels.sh            # here, once per session (needs PyPI)
#   # the device command, with carry [".whl"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"
rm -rf .whl && mkdir .whl
for name in gguf qwix; do
  version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
ls .whl
echo "device command (carry [\".whl\"]): python3 -m pip install -q --no-index --no-deps --no-compile" \
  "--no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_suite.sh"
