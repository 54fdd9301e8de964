"""Every benchmark's harness (the jobs jobs.bench_* are thin over these).

Offline and online decoding in this process: online, runs, domains, decoding, rows, scoring,
guard, online_bound, price_drift (jobs.bench_online), tree_bound (jobs.bench_tree), batch
(jobs.bench_batch), extract_batching and tail_modes (jobs.bench_extract), oracle
(jobs.bench_oracle).

Serving: serve (jobs.bench_serve) and the concurrency sweep (jobs.bench_serve_sweep):
serve_sweep, its clients serve_sweep_client, serve_sweep_compare, serve_sweep_report, and
vllm_app_launcher (the vLLM app started from this environment). These drive the research
endpoint (serving) from outside: the one part of pipeline that may import serving.

vLLM (jobs.bench_vllm): vllm, vllm_engine, vllm_tables in this environment; vllm_run_cells
and vllm_cells run in the vLLM environment (.venv-vllm), started by pipeline.bench.vllm as
``python -m pipeline.bench.vllm_run_cells``, and import nothing of this environment's.
vLLM's own client against the vLLM app (jobs.bench_vllm_serve): vllm_bench_serve (prompts
through the project's readers, ``vllm bench serve`` runs) and vllm_bench_serve_table.
"""
