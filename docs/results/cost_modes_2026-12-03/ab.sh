#!/bin/bash
# bench_online at one temperature ($1: 0 or 1), runs ($2, default 1) of the greedy-only cost
# model (costmodel_greedy_only.json, committed before) and the two-mode one (models/
# costmodel.json) interleaved, the same acceptance model beside each. Outputs t<T>_{old,new}_run<N>.txt here.
# The committed outputs: ./ab.sh 1 2 and ./ab.sh 0 1 (policies fixed:k=1 added at T = 1).
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
temp=${1:?temperature}
old=$(mktemp -d) new=$(mktemp -d)
cp "$here/costmodel_greedy_only.json" "$old/costmodel.json"
cp models/costmodel.json "$new/costmodel.json"
for d in "$old" "$new"; do cp models/acceptance.json models/policy.json "$d/"; done
POL=ar,fixed:k=2,fixed:k=3,fixed:k=4,throughput,specdec
for run in $(seq 1 "${2:-1}"); do
  for cm in old new; do
    if [ $cm = old ]; then a=$old; else a=$new; fi
    .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
      --temperatures "$temp" --policies $POL --no-bound --no-assisted --artifacts "$a" \
      --out "$a/out_$run" > "$here/t${temp}_${cm}_run$run.txt" 2>&1
    echo "$cm $run rc $? $(date +%T)"
  done
done
