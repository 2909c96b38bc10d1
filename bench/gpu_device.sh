#!/usr/bin/env bash
# The prepared GPU check (issue 30) on a lent GPU machine, as ONE call of the device tool from
# the repo root: `bash bench/gpu_device.sh`, carrying `.whl` (docs/benchmarks.md, CUDA section,
# says how to fill it). That machine has torch, numpy, uvloop, xxhash and pytest but no network:
# the packages it lacks come as wheels in .whl/, the C modules are built in place (no build
# isolation: it would fetch setuptools; a carried one new enough for pyproject.toml is used).
# What comes back ($OUT, at most 8 files): the report (markdown and JSON) and every part's
# results and log in one archive.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/asynctron-site .whl/*.whl
    export PYTHONPATH=/tmp/asynctron-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$python" setup.py -q build_ext --inplace >/dev/null
export PYTHONUNBUFFERED=1
out=${OUT:-$PWD/asynctron-bench}
results=/tmp/asynctron-gpu-check
status=0
"$python" -m asynctron bench gpu --quick --results "$results" "$@" || status=$?
mkdir -p "$out"
if [ -d "$results" ]; then
    cp "$results"/gpu_report.md "$results"/gpu_report.json "$out"/ 2>/dev/null || true
    tar czf "$out/gpu_check.tgz" -C "$results" .
fi
exit "$status"
