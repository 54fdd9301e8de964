#!/bin/bash
# bench_online at T = 0 with the head, 3 runs: throughput as it is beside throughput reading
# acceptance off the head's state alone (state_only=true), specdec and fixed K.
# Outputs: state_only_runN.txt in this folder.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
POL=ar,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,throughput,throughput:state_only=true,specdec
out=$(mktemp -d)
for run in 1 2 3; do
  .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
    --temperatures 0 --policies $POL --no-bound --no-assisted --draft models/eagle3-head \
    --artifacts models/eagle3-head --out "$out/run$run" > "$here/state_only_run$run.txt" 2>&1
  echo "run $run rc $? $(date +%T)"
done
