"""Test settings: in CI, hypothesis runs derandomized so a red build is reproducible."""

import os

from hypothesis import settings

# tests/e2e runs in its own venv (`make e2e`): it serves a model with vLLM's CPU kernels, which .venv lacks.
collect_ignore = ["e2e"]

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The longest file first, so that under `make test`'s two workers (pytest-xdist, --dist loadfile) the rest
# runs beside it rather than after it.
FIRST = "test_make_prove.py"


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: every other test keeps its order
