"""Test settings: in CI, hypothesis runs derandomized so a red build is reproducible."""

import os

from hypothesis import settings

# tests/e2e runs in its own venv (`make e2e`): it serves a model with vLLM's CPU kernels, which .venv lacks.
collect_ignore = ["e2e"]

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
