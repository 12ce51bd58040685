# kvhit: two commands set everything up on a fresh machine.
#   make prove   creates .venv (Python 3.11, kvhit + z3) and runs the main job: every invariant, every policy
#   make test    installs what the tests need (vLLM 0.33.0's core included) and runs every test
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

# Scenarios the long conformance run asks hypothesis for (CI runs the default of
# tests/conformance/test_hit_tokens_matches_vllm.py). Hypothesis runs a few percent fewer than it is asked
# for (a request for 50,000 ran 49,287), so the long run asks for 52,000 to run at least 50,000.
CONFORMANCE_LONG_SCENARIOS ?= 52000
# Write-side scenarios (tests/conformance/test_write_side_matches_vllm.py; CI runs its default of 2,000).
CONFORMANCE_LONG_WRITE_SCENARIOS ?= 20000

.PHONY: prove test setup gen check-gen venv conformance conformance-long clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e ".[test]"
	touch $@

# vLLM 0.33.0's core, pinned, without its dependency resolver: the vLLM wheel pins a CUDA torch, the lock
# pins the CPU torch pip finds locally (see the README, "Conformance against vLLM 0.33"). `make prove`
# does not need it.
$(VENV)/.vllm-installed: requirements/vllm-033-core.txt $(VENV)/.installed
	$(PIP) install --no-deps -r requirements/vllm-033-core.txt
	$(PY) -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')"
	touch $@

venv: $(VENV)/.installed

setup: $(VENV)/.vllm-installed

prove: venv
	$(VENV)/bin/kvhit prove

test: setup
	$(PY) -m pytest -q

conformance: setup
	$(PY) -m pytest -q tests/conformance

conformance-long: setup
	KVHIT_CONFORMANCE_SCENARIOS=$(CONFORMANCE_LONG_SCENARIOS) \
	KVHIT_WRITE_SCENARIOS=$(CONFORMANCE_LONG_WRITE_SCENARIOS) $(PY) -m pytest -q tests/conformance

gen: venv
	$(PY) -m kvhit.spec.codegen

check-gen: venv
	$(PY) -m kvhit.spec.codegen --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
