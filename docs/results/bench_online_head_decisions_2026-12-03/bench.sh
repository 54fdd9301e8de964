#!/bin/bash
# bench_online at T = 0 with the head, 3 runs: bench.sh PREFIX POLICIES writes PREFIXrunN.txt
# in this folder. The runs of 2026-12-03 (README.md):
#   bench.sh "" ar,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,throughput,specdec
#   bench.sh state_only_ ar,fixed:k=3,...,fixed:k=8,throughput,throughput:state_only=true,specdec
#   bench.sh default_ ar,fixed:k=3,...,fixed:k=8,throughput,throughput:state_only=false,specdec
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=$(mktemp -d)
for run in 1 2 3; do
  .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
    --temperatures 0 --policies "$2" --no-bound --no-assisted --draft models/eagle3-head \
    --artifacts models/eagle3-head --out "$out/run$run" > "$here/${1}run$run.txt" 2>&1
  echo "run $run rc $? $(date +%T)"
done
