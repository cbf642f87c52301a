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

$(VLLM_STAMP): pyproject.toml scripts/setup_vllm.sh scripts/vllm-requirements.txt | $(STAMP)
	VLLM_VENV=$(VLLM_VENV) bash scripts/setup_vllm.sh
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# Everything but the SGLang and vLLM tests in .venv, those in .venv-sglang and .venv-vllm, side by
# side (the suites mostly wait on the processes they start); each prints its own summary, and the
# target fails when any fails. The two engine venvs are built side by side too (downloads and
# unpacking overlap; each behind its stamp, so a built one costs nothing).
test: setup
	@$(MAKE) --no-print-directory -j2 setup-sglang setup-vllm
	@$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider $(SGLANG_TESTS) > .sglang-tests.log 2>&1 & sgl=$$!; \
	KVBRIDGE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS) > .vllm-tests.log 2>&1 & vll=$$!; \
	$(PY) -m pytest -q --ignore=$(SGLANG_TESTS) --ignore=$(VLLM_TESTS); main=$$?; \
	wait $$sgl; sglrc=$$?; echo "== SGLang suite (.venv-sglang)"; cat .sglang-tests.log; rm -f .sglang-tests.log; \
	wait $$vll; vllrc=$$?; echo "== vLLM suite (.venv-vllm)"; cat .vllm-tests.log; rm -f .vllm-tests.log; \
	test $$main = 0 && test $$sglrc = 0 && test $$vllrc = 0

test-sglang: setup setup-sglang
	$(SGLANG_VENV)/bin/python -m pytest -q $(SGLANG_TESTS)

test-vllm: setup setup-vllm
	KVBRIDGE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q $(VLLM_TESTS)

bench: setup
	$(VENV)/bin/kvbridge bench --quick

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .pytest_cache .hypothesis build *.egg-info
