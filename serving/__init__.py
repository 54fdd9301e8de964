"""An OpenAI-compatible completions endpoint over the speculative engine, on Ray Serve; thin
over pipeline.decode (the engine, GenerationStream, the policy registry).

serving.protocol     the HTTP contract: request models, body reading, length checks, bodies
serving.speculation  the request's policy and knobs, validated from the policy registry
serving.errors       OpenAI-shaped errors, the catch-all that keeps tracebacks from clients
serving.app          the FastAPI ingress deployment, the app builder (`serve run serving.app:app`)
serving.bench        the serving benchmark's harness (jobs.bench_serve)
"""
