#!/usr/bin/env bash
# The GPU tier in one command, for a GPU machine with no package index (the lent H100/H200):
#   tests/gpu/run_tier.sh [OUT_DIR]
# 1. installs the project from the wheelhouse carried with the tree (.wheelhouse/, built here by
#    `make wheelhouse NODE_HAS=tests/gpu/node-packages.txt`; WHEELHOUSE=DIR for another) into the
#    interpreter that holds the node's torch (GPU_PYTHON, default python3), with pip --no-index;
# 2. runs `make test-gpu`'s pytest one test file at a time (TIER_FILES, default all; each under
#    TIER_FILE_TIMEOUT_S, 300; no file starts after TIER_TIMEOUT_S, 900; TIER_K: a -k
#    expression), with the checkout first
#    on the path (the code under test is the tree, not the bundled wheel);
# 3. writes OUT_DIR/gpu_tier.json (tests/gpu/tier_report.py), pytest.log, and tier-files.tgz: the
#    JUnit XML, the step workers' records (TANDEM_GPU_TIER_RECORDS) and the runs' role logs.
# 4. then runs the benchmarks TIER_BENCH names (';'-separated `module args`, e.g.
#    TIER_BENCH="gpu_speed --shapes 0.5b;logprob_memory --device cuda --tokens 32768"; default
#    none), each under TIER_BENCH_TIMEOUT_S (300), and copies each one's results JSON to
#    OUT_DIR/bench-<i>-<module>.json (i: its place in the list, so that a module named twice keeps
#    both): one device call can measure what the tier has just checked.
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
  if [ "$install_rc" != 0 ]; then
    # pip's resolution refused (say, a node's package older than a bundled one asks for): put the
    # bundle in without resolution so that the tier still runs; install.log says what was wrong.
    $PY -m pip install --no-index --no-deps --no-cache-dir -q "$WH"/*.whl >> "$OUT_DIR/install.log" 2>&1
    echo "  fallback: the bundle installed with --no-deps: exit $?"
  fi
else
  echo "no wheelhouse at $WH: using what $PY already has"
fi
t1=$(date +%s)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=$(mktemp -d)
export TANDEM_GPU_TIER_RECORDS="$WORK/records"
# One pytest per test file, each under its own limit, the end-to-end runs last: a file that hangs
# costs its own limit and leaves the others' reports whole.
files=${TIER_FILES:-$(ls tests/gpu/test_*.py | grep -v run_resume; ls tests/gpu/test_*run_resume*.py)}
rc=0 junits=() timed_out=()
# After each file: the JUnit files, the workers' records and each test's role logs in one file (the
# device's $OUT returns at most 8 files), and gpu_tier.json so far: a lease that ends mid-tier
# still brings back what finished.
report() {
  (cd "$WORK" && find . -type f -size -4M \( -name '*.xml' -o -name '*.log' -o -name '*.jsonl' -o -name '*.yaml' \
    -o -path './records/*' \) | tar czf "$OUT_DIR/tier-files.tgz" -T -)
  $PY tests/gpu/tier_report.py --junit "${junits[@]:-/dev/null}" --out "$OUT_DIR/gpu_tier.json" \
    ${timed_out:+--timed-out "${timed_out[@]}"} \
    ${install_rc:+--wheelhouse "$WH" --install-rc "$install_rc" --install-s $(( t1 - t0 ))} \
    --pytest-rc "$rc" --wall-s $(( $(date +%s) - t0 ))
}
for f in $files; do
  j="$WORK/$(basename "$f" .py).junit.xml"
  timeout -k 10 "${TIER_FILE_TIMEOUT_S:-300}" $PY -m pytest "$f" -m gpu -v -rA --tb=short --durations=0 ${TIER_K:+-k "$TIER_K"} \
    -p no:cacheprovider --basetemp "$WORK/tmp-$(basename "$f" .py)" --junitxml "$j" 2>&1 | tee -a "$OUT_DIR/pytest.log"
  frc=${PIPESTATUS[0]}
  [ "$frc" = 0 ] || rc=$frc
  if [ -s "$j" ]; then junits+=("$j"); else timed_out+=("$f"); fi
  report
  if [ $(( $(date +%s) - t1 )) -ge "${TIER_TIMEOUT_S:-900}" ]; then echo "tier time limit reached after $f"; break; fi
done
IFS=';' read -ra benches <<< "${TIER_BENCH:-}"
i=0
for b in "${benches[@]}"; do
  i=$(( i + 1 ))
  read -ra words <<< "$b"
  [ "${#words[@]}" -gt 0 ] || continue
  name=${words[0]}
  echo "benchmark: $b" | tee -a "$OUT_DIR/pytest.log"
  touch "$WORK/bench-start"   # only results written after this are this entry's
  timeout -k 10 "${TIER_BENCH_TIMEOUT_S:-300}" $PY -m "benchmarks.$name" "${words[@]:1}" 2>&1 | tee -a "$OUT_DIR/pytest.log"
  newest=$(find benchmarks/runs -name "$name.json" -newer "$WORK/bench-start" 2>/dev/null | head -1)
  if [ -n "$newest" ]; then cp "$newest" "$OUT_DIR/bench-$i-$name.json"; else echo "  $name wrote no results"; fi
done
exit "$rc"
