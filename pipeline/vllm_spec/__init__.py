"""specbound inside vLLM: the cost-aware draft length as a vLLM ``custom_class`` proposer.

Runs inside vLLM's engine processes, in the separate vLLM environment (``make vllm-env``:
vLLM's CPU build pins a torch and a transformers of its own), so these import only torch,
numpy, transformers and the pipeline modules that need nothing else (the acceptance model,
the batch cost model, the slot cache): ``contract`` (what vLLM calls), ``config`` (settings
and artifact checks), ``rows`` (states found by tokens), ``draft`` (packed draft forwards),
``router_hook`` (experts per step, calibration), ``stats``, ``step_cost`` (the step cost
model), ``proposer``, ``calibration_run``; the bench cells that drive vLLM live in
pipeline.bench (``vllm_cells``, ``vllm_run_cells``).

Run in the project's own environment, reaching vLLM by subprocess: ``env`` (where the vLLM
environment is), ``calibration`` and ``step_fit`` (jobs.calibrate_vllm).
"""
