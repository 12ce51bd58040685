"""The adapter's version-independent engine on vLLM 0.32.0 (``make conformance-032``, in .venv-vllm032; not
collected under 0.33.0): it imports only vLLM names 0.32.0 has too (docs/adapter.md, "Supporting a new vLLM
version"), and 0.32.0, not in ``RELEASES``, is refused: installing there patches nothing."""

import logging

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import engine

from .vllm_harness import VLLM_VERSION


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_engine_imports_on_vllm_0_32_and_an_unregistered_release_is_refused():
    assert VLLM_VERSION == engine.VLLM_VERSION == "0.32.0"
    lines = _Lines()
    kvhit_vllm.logger.addHandler(lines)
    try:
        assert kvhit_vllm.install("enforce") is False
    finally:
        kvhit_vllm.logger.removeHandler(lines)
    assert kvhit_vllm.current_mode() == "off"
    assert any("vLLM 0.32.0 is not a version kvhit's adapter was built and tested against (0.33.0)" in line
               for line in lines.lines), lines.lines
