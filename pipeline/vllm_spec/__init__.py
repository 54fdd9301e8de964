"""specbound inside vLLM: the cost-aware scheduler over vLLM's own drafters, the plugin that
runs a step at k = 0 as a step without speculation, and the step-cost calibration's instrument.

Runs inside vLLM's engine processes, in the separate vLLM environment (``make vllm-env``:
vLLM's CPU build pins a torch and a transformers of its own), so these import only torch,
numpy, transformers and the pipeline modules that need nothing else: ``scheduler`` (the
cost-aware draft length, ``ours``) with ``step_planner``, ``planner_config`` (its settings),
``online_step_cost``, ``row_acceptance``, ``priors`` and ``request_args``; ``plugin`` with
``free_when_off`` (a step at k = 0 run without speculation) and ``catch_up_draft`` (no draft
forward at k = 0, the draft caught up later; ``catch_up_inputs``, its extended first pass),
``stats`` (its counters) and ``cpu_kernels``; ``calibration_drafter`` (random draft lengths,
every step recorded) with ``contract`` (what vLLM calls), ``rows`` (states found by tokens),
``draft`` (packed draft forwards) and ``router_hook`` (experts per step); ``step_cost`` (the
step cost model), ``calibration_run``; the bench cells that drive vLLM live in pipeline.bench
(``vllm_cells``, ``vllm_run_cells``).

Run in the project's own environment, reaching vLLM by subprocess: ``env`` (where the vLLM
environment is), ``calibration`` and ``step_fit`` (jobs.calibrate_vllm).
"""
