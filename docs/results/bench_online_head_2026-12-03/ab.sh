#!/bin/bash
# bench_online at T = 0 with the head, 3 interleaved runs of two cost models: the committed one
# (calibrated on HumanEval prompts) and costmodel_domains.json (calibrated on code, prose and
# math prompts: jobs.calibrate --draft models/eagle3-head --source domains --limit 9 --ks 0-12
# --threads 1 --designed-per-round 2). Outputs: old_runN.txt, new_runN.txt in this folder.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
art=$(mktemp -d)
cp models/eagle3-head/policy.json models/eagle3-head/acceptance.json "$art/"
cp "$here/costmodel_domains.json" "$art/costmodel.json"
POL=ar,fixed:k=3,fixed:k=4,fixed:k=5,fixed:k=6,fixed:k=8,throughput,specdec
for run in 1 2 3; do
  for cm in old new; do
    if [ $cm = old ]; then a=models/eagle3-head; else a=$art; fi
    .venv/bin/python -m jobs.bench_online --domains all --limit 8 --max-new-tokens 64 \
      --temperatures 0 --policies $POL --no-bound --no-assisted --draft models/eagle3-head \
      --artifacts $a --out "$art/out_${cm}_$run" > "$here/${cm}_run$run.txt" 2>&1
    echo "$cm $run rc $? $(date +%T)"
  done
done
