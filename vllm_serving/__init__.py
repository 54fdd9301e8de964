"""specbound's endpoint on vLLM: Ray Serve runs vLLM's engine with the cost-aware scheduler
(``ours``; or vLLM's own speculation, or none), OpenAI-compatible, one or more replicas.

Runs in the vLLM environment (`.venv-vllm`, `make vllm-env`); the research endpoint
(`serving`, every policy per request, trees, per-response statistics) runs in the project's.

vllm_serving.settings     the app's settings (VllmAppArgs): models and their speculation,
                          engine and replica sizes, deadline, API key
vllm_serving.llm_configs  the settings as ray.serve.llm LLMConfigs (speculative_config, env)
vllm_serving.deadline     a stream past its deadline ends with finish_reason "deadline"
vllm_serving.cancellation a request's engine calls, cancelled and confirmed to end
vllm_serving.health       each model id's state (running, starting, not placeable, failed)
                          for /healthz, /v1/models and a prompt 503
vllm_serving.placement    whether the cluster can hold the engine replicas (refused at build)
vllm_serving.limits       request limits and body checks (stated in /v1/models)
vllm_serving.refusals     client errors in OpenAI's shape, in the user's words
vllm_serving.ingress      the OpenAI router with /healthz, the API key and the deadline
vllm_serving.app          the app builder (`serve run vllm_serving.app:build_app`)
"""
