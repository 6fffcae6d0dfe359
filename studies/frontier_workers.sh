#!/usr/bin/env bash
# One tier of the frontier study as parallel processes that share one machine (its GPU and
# cores): each worker trains its own seeds, one `python -m studies.frontier --seeds=S` at a
# time, and every finished run leaves its record in RECORDS, as a single process would.
#
#   studies/frontier_workers.sh TIER SECOND_ARM RECORDS OUT SEEDS [SEEDS ...]
#   studies/frontier_workers.sh N 'noisy_topk_anneal-45@confirm_n' records out 23,28 24,29
#
# Each SEEDS (comma-separated) is one worker. A seed's two runs alternate their order between
# seeds and workers (SECOND_ARM, the tier's selection arm, runs first where the worker index
# plus the position of that seed in its list is odd), so that neither side always runs first,
# on a cold compilation cache, or last, on a quieter machine. Even so, the seconds of runs
# that shared a machine measure the sharing as much as the policy: the records mark them
# uneven. A failed call stops its worker; rerunning the command continues from the records.
# Extra arguments for every `studies.frontier` call (e.g. --data-dir, --manual-dir) come from
# FRONTIER_ARGS. Each worker's output goes to OUT/worker<i>.log; the device memory each takes
# is XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.8 / the number of workers).
set -euo pipefail
if [ $# -lt 5 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
tier=$1 second_arm=$2 records=$3 out=$4
shift 4
mkdir -p "$out"
python=${PYTHON:-python}
read -r -a extra <<< "${FRONTIER_ARGS:-}"
workers=$#
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(
  "$python" -c "print(round(0.8 / $workers, 3))")}

study() {  # study WORKER SEED [ARGS...]: one call of the study for one seed.
  local worker=$1 seed=$2
  shift 2
  "$python" -m studies.frontier --tiers="$tier" --seeds="$seed" --records="$records" \
    --out="$out/worker$worker" "${extra[@]}" "$@"
}

# Prepared once here: workers that each found it missing would prepare it at the same time.
"$python" -m studies.frontier --prepare-data "${extra[@]}"
worker=0
pids=()
for seeds in "$@"; do
  (
    place=0
    for seed in ${seeds//,/ }; do
      if (( (worker + place) % 2 == 1 )); then
        study "$worker" "$seed" --arms="$second_arm"  # The selection arm first, then the rest.
      fi
      study "$worker" "$seed"
      place=$((place + 1))
    done
  ) > "$out/worker$worker.log" 2>&1 &
  pids+=($!)
  worker=$((worker + 1))
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
echo "workers done (exit status $status); logs in $out/worker*.log"
exit $status
