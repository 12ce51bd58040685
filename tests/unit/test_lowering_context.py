"""The term language knows its lowerings only through terms.Lowering: each lowering installs itself for a
block (terms.installed), in one context, and leaves nothing behind."""

import ast
import threading
from pathlib import Path

import pytest

from kvhit.spec import terms
from kvhit.spec.lower_z3 import Z3Lowering, lowering
from kvhit.spec.stage import StagedLowering, stage
from kvhit.spec.terms import SpecError, active, max_, max_aligned

SPEC = Path(terms.__file__).parent


def _spec_imports(path: Path) -> set[str]:
    """The spec modules ``path`` imports anywhere in it (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvhit.spec"):
            out.add(node.module.rsplit(".", 1)[-1])
    return out


def test_the_term_language_imports_none_of_its_lowerings():
    imports = _spec_imports(SPEC / "terms.py")
    assert not imports & {"stage", "lower_z3", "cache"}, imports
    assert imports <= {"runtime"}, imports  # the Python helpers only (written() lives with Held in cache.py)


def test_no_module_reads_the_term_languages_lowering_state():
    for path in SPEC.glob("*.py"):
        if path.name != "terms.py":
            assert "_ACTIVE" not in path.read_text() and "_LOWERING" not in path.read_text(), path.name


def _scan(cache, n):
    return max_aligned(16, n, lambda x: max_(x, 0) <= 64)


def test_a_lowering_is_in_force_only_inside_its_block():
    assert active() is None
    with lowering():
        assert isinstance(active(), Z3Lowering)
        with lowering():  # nested: the inner block's, then the outer one's again
            inner = active()
        assert isinstance(active(), Z3Lowering) and active() is not inner
    assert active() is None

    def fails(cache, n):
        assert isinstance(active(), StagedLowering)
        raise ValueError("the spec rejects it")

    with pytest.raises(ValueError):
        stage(fails, 0)
    assert active() is None


def test_staging_inside_the_z3_lowering_is_refused():
    with lowering():
        with pytest.raises(SpecError, match="staging inside another lowering"):
            stage(_scan, 0)


def test_a_lowering_in_one_thread_is_not_seen_in_another():
    seen = []
    with lowering():
        thread = threading.Thread(target=lambda: seen.append(active()))
        thread.start()
        thread.join()
    assert seen == [None]


def test_each_stage_names_its_scan_variables_from_x0():
    from kvhit.spec.stage import N

    first, _ = stage(_scan, N, name="scan")
    again, fn = stage(_scan, N, name="scan")
    assert first == again and "x0" in first and "x1" not in first
    assert fn(100, None) == (64,)
