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
# The vLLM integration tests likewise (vLLM's CPU build serves there: scripts/setup_vllm.sh and
# scripts/vllm-requirements.txt). KVBRIDGE_REQUIRE_VLLM=1 turns a missing vLLM into a failure
# instead of a skip (tests/conftest.py).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvbridge-vllm-installed
VLLM_TESTS := tests/integrations/vllm

.PHONY: setup setup-sglang setup-vllm demo test test-sglang test-vllm bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/_uv.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

# the synthetic run, then one tiny model colocated vs disaggregated (about 30 s more on 2 cores)
demo: setup
	$(VENV)/bin/kvbridge demo
	$(VENV)/bin/kvbridge demo --model tiny-deepseek-v3 --cp 2
	$(VENV)/bin/kvbridge demo --model tiny-deepseek-v4

$(SGLANG_STAMP): pyproject.toml scripts/setup_sglang.sh scripts/_venv_space.sh scripts/_uv.sh scripts/sglang-requirements.txt | $(STAMP)
	MAIN_VENV=$(VENV) SGLANG_VENV=$(SGLANG_VENV) bash scripts/setup_sglang.sh
	touch $(SGLANG_STAMP)

setup-sglang: $(SGLANG_STAMP)

$(VLLM_STAMP): pyproject.toml scripts/setup_vllm.sh scripts/_venv_space.sh scripts/_uv.sh scripts/vllm-requirements.txt | $(STAMP)
	MAIN_VENV=$(VENV) VLLM_VENV=$(VLLM_VENV) bash scripts/setup_vllm.sh
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# Everything but the SGLang and vLLM tests in .venv, started at once; the SGLang and vLLM venvs
# are built beside it (each behind its stamp), then their suites run in them, one after the
# other (at most two suites on the cores at a time). Each suite prints its own summary; the target fails when any fails
# (scripts/run_tests.sh).
test: setup
	@MAKE="$(MAKE)" VENV=$(VENV) SGLANG_VENV=$(SGLANG_VENV) VLLM_VENV=$(VLLM_VENV) bash scripts/run_tests.sh

test-sglang: setup setup-sglang
	$(SGLANG_VENV)/bin/python -m pytest -q $(SGLANG_TESTS)

test-vllm: setup setup-vllm
	KVBRIDGE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q $(VLLM_TESTS)

bench: setup
	$(VENV)/bin/kvbridge bench --quick

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .pytest_cache .hypothesis build *.egg-info
