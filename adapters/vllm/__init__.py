# SPDX-License-Identifier: Apache-2.0
"""The kvhit plugin for vLLM: install kvhit's ``reference`` hit-length policy into the scheduler.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of its processes (front end,
engine core, workers) and calls it with no arguments; :func:`register` is kvhit's. It reads ``KVHIT_MODE``:

* ``off`` (the default): nothing is patched; installing kvhit changes nothing.
* ``shadow``: vLLM computes hits as it always does; the reference hit is computed beside it and every
  divergence is counted (``kvhit_hit_divergences_total``) and logged at a bounded rate.
* ``enforce``: the hit length of the scheduler's prefix-cache lookup follows the reference policy
  (computed by the generated ``kvhit.refimpl``); vLLM's own classes still provide the blocks.

The same is reachable from Python::

    from kvhit.adapters import vllm as kvhit_vllm
    kvhit_vllm.install("enforce")          # or "shadow"; "off" == uninstall()
    kvhit_vllm.uninstall()                 # restores every original
    with kvhit_vllm.enabled("shadow"):     # installs, then restores the previous mode
        ...

The supported vLLM versions are the keys of :data:`RELEASES`: any other version is
refused with one log line and left untouched. This module imports no vLLM internals: the seams of each
version live in its own module (``v0_32``, ``v0_33``), which with the version-independent ``engine`` is
imported only after the version check.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator

MODES = ("off", "shadow", "enforce")
"""Values of ``KVHIT_MODE`` and of :func:`install`'s ``mode``."""

RELEASES = {"0.32.0": "v0_32", "0.33.0": "v0_33"}
"""vLLM version -> the module of this package that holds its seams: the versions whose internals the
adapter was written and tested against."""

ENV_VAR = "KVHIT_MODE"

# A child of vLLM's "vllm" logger, so that the lines reach vLLM's log handler and format in `vllm serve`
# (vLLM configures only that logger, with propagate=False).
logger = logging.getLogger("vllm.kvhit")

_logged_once: set[str] = set()


def log_once(level: int, msg: str, *args: object) -> None:
    """Log ``msg % args`` at ``level`` the first time this exact line comes up in this process."""
    line = msg % args if args else msg
    if line in _logged_once:
        return
    _logged_once.add(line)
    logger.log(level, "%s", line)


def installed_vllm_version() -> str | None:
    """``vllm.__version__``, or None if vLLM cannot be imported."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means "no usable vLLM"
        return None
    return getattr(vllm, "__version__", None)


def _engine():
    """The engine if a version module imported it (that is only after the version check)."""
    return sys.modules.get(f"{__name__}.engine")


def current_mode() -> str:
    """The installed mode: ``off``, ``shadow`` or ``enforce``."""
    engine = _engine()
    return engine.current_mode() if engine is not None else "off"


def install(mode: str) -> bool:
    """Install kvhit's hit-length policy into vLLM in ``mode``.

    Idempotent: installing the installed mode does nothing; installing another mode switches to it;
    ``off`` is :func:`uninstall`.

    Args:
        mode: one of :data:`MODES`.

    Returns:
        True if the mode is now active; False if vLLM was left untouched (``off``; a vLLM version that is
        not in :data:`RELEASES`, or a seam another plugin already replaced, each logged once).

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"kvhit mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "off":
        uninstall()
        return False
    version = installed_vllm_version()
    if version not in RELEASES:
        log_once(logging.ERROR,
                 "kvhit: vLLM %s is not a version kvhit's adapter was built and tested against (%s); "
                 "vLLM is left untouched (KVHIT_MODE=%s ignored)",
                 version if version is not None else "(not importable)", ", ".join(RELEASES), mode)
        return False
    seams = importlib.import_module(f"{__name__}.{RELEASES[version]}").SEAMS
    from . import engine  # imported by the version module

    return engine.install(mode, seams)


def uninstall() -> None:
    """Restore every vLLM attribute kvhit replaced. A no-op when nothing is installed."""
    engine = _engine()
    if engine is not None:
        engine.uninstall()


@contextlib.contextmanager
def enabled(mode: str = "enforce") -> Iterator[bool]:
    """Install ``mode`` for the duration of a ``with`` block, then restore the previous mode.

    Yields:
        What :func:`install` returned.
    """
    previous = current_mode()
    try:
        yield install(mode)
    finally:
        if previous == "off":
            uninstall()
        else:
            install(previous)


def mode_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The mode ``KVHIT_MODE`` asks for, or None (with one error log line) if it is not a valid mode.

    Unset or empty means ``off``; surrounding blanks and letter case are ignored.
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    mode = raw.strip().lower() or "off"
    if mode not in MODES:
        log_once(logging.ERROR, "kvhit: %s=%r is not one of %s; kvhit stays off",
                 ENV_VAR, raw, ", ".join(MODES))
        return None
    return mode


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the mode ``KVHIT_MODE`` asks for.

    vLLM calls this once per process, before the scheduler and its KV cache manager exist. It never
    raises: a bad ``KVHIT_MODE`` or an unsupported vLLM version is logged once and vLLM runs stock.
    """
    mode = mode_from_env()
    if mode is None or mode == "off":
        return
    install(mode)
