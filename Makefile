# kvhit: two commands set everything up on a fresh machine.
#   make prove   creates .venv (Python 3.11, kvhit + z3) and runs the main job: every invariant, every policy
#   make test    installs what the tests need and runs every test
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: prove test gen check-gen venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e ".[test]"
	touch $@

venv: $(VENV)/.installed

prove: venv
	$(VENV)/bin/kvhit prove

test: venv
	$(PY) -m pytest -q

gen: venv
	$(PY) -m kvhit.spec.codegen

check-gen: venv
	$(PY) -m kvhit.spec.codegen --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
