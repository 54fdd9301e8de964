#!/bin/bash
# bench_online at T = 0 with the EAGLE-3 head, 3 runs: head.sh writes head_runN.txt here.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=$(mktemp -d)
for run in 1 2 3; do
  .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
    --temperatures 0 --no-bound --no-assisted --draft models/eagle3-head \
    --artifacts models/eagle3-head --out "$out/run$run" \
    --policies ar,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,throughput,chain-or-tree \
    > "$here/head_run$run.txt" 2>&1
  echo "run $run rc $? $(date +%T)"
done
