#!/usr/bin/env bash
# The GPU tier in one command, for a GPU machine with no package index (the lent H100/H200):
#   tests/gpu/run_tier.sh [OUT_DIR]
# 1. installs the project from the wheelhouse carried with the tree (.wheelhouse/, built here by
#    `make wheelhouse NODE_HAS=tests/gpu/node-packages.txt`; WHEELHOUSE=DIR for another) into the
#    interpreter that holds the node's torch (GPU_PYTHON, default python3), with pip --no-index;
# 2. runs `make test-gpu`'s pytest (tests/gpu -m gpu) under a time limit (TIER_TIMEOUT_S, 480),
#    with the checkout first on the path (the code under test is the tree, not the bundled wheel);
# 3. writes OUT_DIR/gpu_tier.json (tests/gpu/tier_report.py), the JUnit XML and the logs.
# OUT_DIR defaults to $OUT (the device tool's folder that comes back), else ./gpu-tier-out.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$REPO/gpu-tier-out}}
PY=${GPU_PYTHON:-python3}
WH=${WHEELHOUSE:-$REPO/.wheelhouse}
mkdir -p "$OUT_DIR"
cd "$REPO" || exit 1
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/nvidia-smi.csv" 2>&1 || true
install_rc=
if [ -f "$WH/wheelhouse.json" ]; then
  $PY slurm/wheelhouse.py install --wheelhouse "$WH" > "$OUT_DIR/install.log" 2>&1
  install_rc=$?
  echo "offline install from $WH: exit $install_rc ($(( $(date +%s) - t0 )) s)"
else
  echo "no wheelhouse at $WH: using what $PY already has"
fi
t1=$(date +%s)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout -k 10 "${TIER_TIMEOUT_S:-480}" $PY -m pytest tests/gpu -m gpu -v -rA -p no:cacheprovider \
  --junitxml "$OUT_DIR/gpu_tier.junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
$PY tests/gpu/tier_report.py --junit "$OUT_DIR/gpu_tier.junit.xml" --out "$OUT_DIR/gpu_tier.json" \
  ${install_rc:+--wheelhouse "$WH" --install-rc "$install_rc" --install-s $(( t1 - t0 ))} \
  --pytest-rc "$rc" --wall-s $(( $(date +%s) - t0 ))
exit "$rc"
