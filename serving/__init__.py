"""OpenAI-compatible completions and chat over the speculative engine, on Ray Serve; thin over
pipeline.decode (the engine, GenerationStream, the policy registry and its step limits).

serving.settings     the deployment's settings (AppArgs): limits, deadline, stall, auth, plugins
serving.protocol     the HTTP contract: request models (completions, chat), body reading
serving.fields       item-level checks of prompts, stops and chat content, naming the item
serving.checks       the checks that need the model: token ids, lengths, max_tokens
serving.responses    response bodies and stream chunks (completions and chat, n choices)
serving.chat         chat messages to prompt ids through the tokenizer's chat template
serving.speculation  the request's policy and knobs, validated from the policy registry
serving.auth         optional API-key (Bearer) auth; /healthz stays open
serving.errors       OpenAI-shaped errors, the catch-all that keeps tracebacks from clients
serving.batched_worker  continuous batching: packed forwards for every generation, seats
serving.worker       the replica's decoding thread at max_batch=1: round robin, heartbeat
serving.prepare      a parsed request as a Job: prompts, policy, limits, seeds, deadline
serving.generation   a request's generations on that thread, answered as a body or a stream
serving.metrics      Ray metrics (Prometheus): requests, latency, tokens, speculation
serving.app          the FastAPI ingress deployment, the app builder (`serve run serving.app:app`)

The benchmarks that drive this endpoint (jobs.bench_serve, jobs.bench_serve_sweep) live in
pipeline.bench (serve, serve_sweep*).
"""
