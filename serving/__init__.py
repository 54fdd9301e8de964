"""An OpenAI-compatible completions endpoint over the speculative engine, on Ray Serve.

serving.schema   the HTTP contract: request models, validation, OpenAI-shaped errors, bodies
serving.decode   incremental decoding over the engine (text deltas for streams)
serving.app      the FastAPI ingress deployment, the app builder (`serve run serving.app:app`)
"""
