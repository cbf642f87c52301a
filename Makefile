# The two commands: `make demo` (the main job) and `make test`.
# Both create or reuse .venv and install what they need, system packages included.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbridge-installed
# The SGLang integration tests run in a venv of their own (SGLang pins a CUDA
# build of torch; see scripts/setup_sglang.sh and scripts/sglang-requirements.txt).
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvbridge-sglang-installed
SGLANG_TESTS := tests/integrations/sglang

.PHONY: setup setup-sglang demo test test-sglang bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

# the synthetic run, then one tiny model colocated vs disaggregated (about 30 s more on 2 cores)
demo: setup
	$(VENV)/bin/kvbridge demo
	$(VENV)/bin/kvbridge demo --model tiny-deepseek-v3 --cp 2

$(SGLANG_STAMP): pyproject.toml scripts/setup_sglang.sh scripts/sglang-requirements.txt | $(STAMP)
	SGLANG_VENV=$(SGLANG_VENV) bash scripts/setup_sglang.sh
	touch $(SGLANG_STAMP)

setup-sglang: $(SGLANG_STAMP)

# Everything but the SGLang tests in .venv, and those in .venv-sglang, side by side (both
# suites mostly wait on the processes they start); each prints its own summary, and the
# target fails when either fails.
test: setup setup-sglang
	@$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider $(SGLANG_TESTS) > .sglang-tests.log 2>&1 & sgl=$$!; \
	$(PY) -m pytest -q --ignore=$(SGLANG_TESTS); main=$$?; \
	wait $$sgl; sglrc=$$?; echo "== SGLang suite (.venv-sglang)"; cat .sglang-tests.log; rm -f .sglang-tests.log; \
	test $$main = 0 && test $$sglrc = 0

test-sglang: setup setup-sglang
	$(SGLANG_VENV)/bin/python -m pytest -q $(SGLANG_TESTS)

bench: setup
	$(VENV)/bin/kvbridge bench --quick

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .hypothesis build *.egg-info
