#!/bin/bash
# bench_online at T = 0 with the head, 3 runs, after the cheaper decision path (throughput's
# greedy draft read off its own top-2; the catch-up argmax skipped when every row is judged).
# Outputs: runN.txt in this folder.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
POL=ar,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,throughput,specdec
out=$(mktemp -d)
for run in 1 2 3; do
  .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
    --temperatures 0 --policies $POL --no-bound --no-assisted --draft models/eagle3-head \
    --artifacts models/eagle3-head --out "$out/run$run" > "$here/run$run.txt" 2>&1
  echo "run $run rc $? $(date +%T)"
done
