"""Fixtures of the adapter tests: every test starts and ends with kvhit uninstalled."""

import logging

import pytest

import kvhit.adapters.vllm as kvhit_vllm


@pytest.fixture(autouse=True)
def stock_vllm():
    """Uninstall kvhit before and after each test."""
    kvhit_vllm.uninstall()
    yield
    kvhit_vllm.uninstall()


@pytest.fixture
def kvhit_log(caplog):
    """kvhit's log lines, with the log-once memory and the rate limits reset so each test sees its own
    first lines.

    kvhit logs under vLLM's "vllm" logger; once vLLM has configured logging that logger no longer
    propagates to the root logger pytest captures, and the capture handler is attached to it directly.
    """
    kvhit_vllm._logged_once.clear()
    from kvhit.adapters.vllm import engine

    for bounded in (engine._divergence_log, engine._fallback_log):
        bounded.next_time, bounded.suppressed = 0.0, 0
    attach = not logging.getLogger("vllm").propagate
    if attach:
        kvhit_vllm.logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=kvhit_vllm.logger.name)
    yield caplog
    if attach:
        kvhit_vllm.logger.removeHandler(caplog.handler)
