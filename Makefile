# sprout: every target builds .venv first, so a fresh clone needs only python3.
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
MIRROR  ?= $(abspath ../shared/data)
DEMO    ?= runs/demo

.PHONY: venv test test-fast demo docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# 2 pytest-xdist workers (JOBS=N for another count); tests/conftest.py says how tests are grouped
JOBS    ?= 2

test: venv
	$(PYBIN) -m pytest -q -n $(JOBS) --dist loadgroup --durations=30

test-fast: venv
	$(PYBIN) -m pytest -q -n $(JOBS) --dist loadgroup -m "not slow"

demo: venv
	$(PYBIN) scripts/run_pipeline.py --preset demo --out $(DEMO) --mirror $(MIRROR)

# docs/reference/config.md from the config dataclasses (tests/test_docs.py checks it is current)
docs: venv
	$(PYBIN) scripts/config_reference.py

bench: venv
	SPROUT_MIRROR=$(MIRROR) $(PYBIN) benchmarks/prep_throughput.py
	SPROUT_MIRROR=$(MIRROR) $(PYBIN) benchmarks/train_throughput.py
	SPROUT_MIRROR=$(MIRROR) $(PYBIN) benchmarks/generate_throughput.py
	SPROUT_MIRROR=$(MIRROR) $(PYBIN) benchmarks/preference_throughput.py
	SPROUT_MIRROR=$(MIRROR) $(PYBIN) benchmarks/rl_throughput.py

clean:
	rm -rf $(VENV) runs
