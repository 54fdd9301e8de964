#!/bin/bash
# bench_online at T = 0 for three pairs (or the pairs named as arguments), 3 interleaved runs
cd /work/main
POL=ar,fixed:k=1,fixed:k=2,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,heuristic:max_k=12,throughput,specdec
for run in 1 2 3; do
  for pair in ${@:-draft draft-2layer eagle3-head}; do
    if [ $pair = draft ]; then extra=""; else extra="--draft models/$pair --artifacts models/$pair"; fi
    echo "=== run $run pair $pair $(date +%T)"
    .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 --temperatures 0 \
      --policies $POL --bound-at 0 --no-assisted $extra --out /tmp/bo/${pair}_run$run \
      > /tmp/bo/${pair}_run$run.txt 2>&1
    echo "rc $?"
  done
done
echo "all done $(date +%T)"
