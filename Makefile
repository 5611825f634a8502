# sprout: every target builds .venv first, so a fresh clone needs only python3.
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
MIRROR  ?= $(abspath ../shared/data)
DEMO    ?= runs/demo

.PHONY: venv venv-vllm test test-fast demo docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# rollout.engine: vllm needs a GPU and an environment of its own: vLLM pins transformers below the
# export/import extras' pin (pyproject.toml). With peft, TensorBoard, pytest and TRL 1.16, whose GRPO
# with use_vllm is the comparison (docs/gpus.md#vllm-as-the-rollout-engine)
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm,lora,track]' trl==1.16.0 'pytest>=8,<9.2'
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

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
	rm -rf $(VENV) $(VLLM_VENV) runs
