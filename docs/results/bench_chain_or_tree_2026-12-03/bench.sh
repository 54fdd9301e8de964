#!/bin/bash
# bench_online with the embedded pair (the 1-layer draft), 3 runs: bench.sh TEMPERATURE PREFIX
# POLICIES writes <PREFIX>runN.txt in this folder. The runs of 2026-12-03 (README.md):
#   bench.sh 0 t0_ ar,fixed:k=2,fixed:k=3,fixed:k=4,throughput,chain-or-tree
#   bench.sh 1 t1_ ar,fixed:k=1,fixed:k=2,fixed:k=3,fixed:k=4,chain-or-tree,specdec
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=$(mktemp -d)
for run in 1 2 3; do
  .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
    --temperatures "$1" --policies "$3" --no-bound --no-assisted --out "$out/run$run" \
    > "$here/$2run$run.txt" 2>&1
  echo "run $run rc $? $(date +%T)"
done
