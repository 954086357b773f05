#!/usr/bin/env bash
# Device check for issue #28 (device maps, offloading, memory plans): run from the repository root.
#
#   bash benchmarks/gpu_check.sh            # every accelerator found, else the CPU; < 8 minutes
#   RSS_GB=0.5 bash benchmarks/gpu_check.sh # a smaller sharded checkpoint for the RSS measure
#
# 1. the device-agnostic tests (tests/test_device_map*.py, tests/test_memory_plan.py) with --device on each
#    accelerator (cuda:N), or on cpu when there is none (the GPU parts are skipped, and said so);
# 2. the forward and trajectory ratio benchmarks (python -m benchmarks, tiny size) on the CPU;
# 3. benchmarks/bench_offload.py: offloaded vs resident forward per device, peak host RSS while loading a sharded
#    checkpoint of RSS_GB GB (written to /tmp, deleted afterwards), memory plan vs measured peak.
# Prints one table at the end. Nothing asserts wall time.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RSS_GB=${RSS_GB:-2.2}  # GB (1e9): a checkpoint of more than 2 GiB
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_DISABLE_PROGRESS_BARS=1
LOG=$(mktemp -d /tmp/gpu_check.XXXXXX)
ROWS=()

n_gpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
fi
DEVICES=()
for ((i = 0; i < n_gpu; i++)); do DEVICES+=("cuda:$i"); done
[ ${#DEVICES[@]} -eq 0 ] && { DEVICES=(cpu); echo "no accelerator found (torch.cuda.device_count()=0): GPU parts skipped, CPU only"; }

step() {  # step NAME DEVICE CMD...: run, time, keep the log, add a table row with the last summary line
  local name=$1 dev=$2; shift 2
  local t0=$SECONDS log="$LOG/$(echo "$name-$dev" | tr -c 'A-Za-z0-9_.-' '_').log"
  "$@" >"$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-70)
  ROWS+=("$(printf '%-28s %-8s %-6s %5ss  %s' "$name" "$dev" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)) "$summary")")
  return $rc
}

TESTS="tests/test_device_map.py tests/test_memory_plan.py tests/test_device_map_families.py"
for dev in "${DEVICES[@]}"; do
  step "device-agnostic tests" "$dev" $PY -m pytest $TESTS -q -p no:cacheprovider --device "$dev"
done
step "forward+trajectory bench" cpu $PY -m benchmarks --only forward,trajectory --size tiny --repeats 1 --no-gqa \
  --no-deep --threads 2 --out -
for dev in "${DEVICES[@]}"; do
  step "offload forward ratio" "$dev" $PY -m benchmarks.bench_offload --only forward --device "$dev" --repeats 3
done
step "load RSS (${RSS_GB} GB) + plan" cpu $PY -m benchmarks.bench_offload --only rss,plan --rss-gb "$RSS_GB"

echo
echo "== benchmark tables =="
for f in "$LOG"/offload*.log "$LOG"/load*.log; do [ -f "$f" ] && grep -E "^(measure|---|forward|load|memory)" "$f"; done
echo
echo "== gpu_check summary (logs: $LOG) =="
printf '%-28s %-8s %-6s %6s  %s\n' step device status time "last line"
printf '%s\n' "${ROWS[@]}"
! printf '%s\n' "${ROWS[@]}" | grep -q " FAIL "
