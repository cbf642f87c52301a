# The two commands: `make demo` (the main job) and `make test`.
# Both create or reuse .venv and install what they need, system packages included.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbridge-installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvbridge demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/kvbridge bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
