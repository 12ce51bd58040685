"""What an EAGLE user's upgrade changes, as ``kvhit diff vllm_0_32 vllm_0_33 --b-mode lookahead`` reports it
(vLLM 0.32 serves the drafter with the drop, 0.33 with lookahead block hashes), replayed on the engine of
this venv: under vLLM 0.33.0 (``make test``) each reported first repeat, served with lookahead hashes
through 0.33.0's own classes, hits the row's ``vllm_0_33`` hit; under 0.32.0 (``make conformance-032``),
served with the drop through 0.32.0's, the row's ``vllm_0_32`` hit. So one reported difference is checked
against both engines' real classes.

The rows' numbers are also derived by hand: on ``qwen3next`` (full 1600 + Mamba 1600) at vLLM's default
retention 0, the least prompt that tells the two apart is one block and ``Lp`` tokens long. With the drop
the resend's candidate is its one cached block, which the drop recomputes: 0. With lookahead hashes that
block's hash covers the ``Lp`` tokens past it (a shorter prompt has no hash for it), and the resend hits the
block: 1600.
"""

import contextlib
import io
import json

import pytest

from kvhit.cli import main as kvhit
from kvhit.refimpl import Speculation
from kvhit.spec.catalogue import CATALOGUE

from .differential import to_refimpl
from .vllm_harness import VLLM_VERSION
from .write_side import WriteScenario, WriteStats, run_write_scenario

# The drafters of the write-side domain in drop mode: (draft tokens, multi-module MTP), by kvhit's label.
DRAFTERS = {"drop Lp=1": (1, False), "drop Lp=2 mtp2": (2, True)}
# This venv's engine: its policy and the mode it serves the drafter in.
ENGINE = {"0.33.0": ("vllm_0_33", "lookahead"), "0.32.0": ("vllm_0_32", "drop")}[VLLM_VERSION]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """The R = 0 rows the command prints (run once for both tests)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert kvhit(["diff", "vllm_0_32", "vllm_0_33", "--b-mode", "lookahead", "--layout", "qwen3next",
                      "--json", "--jobs", "1"]) == 0
    return [r for r in json.loads(out.getvalue()) if r["retention"] == 0]


def test_the_upgrade_rows_are_the_hand_derived_ones(rows):
    assert {r["mode"]: (r["mode_b"], r["identical"], r["N"], r["hits"]) for r in rows} == {
        "drop Lp=1": ("lookahead Lp=1", False, 1601, {"vllm_0_32": 0, "vllm_0_33": 1600}),
        "drop Lp=2 mtp2": ("lookahead Lp=2 mtp2", False, 1602, {"vllm_0_32": 0, "vllm_0_33": 1600}),
    }


def test_each_upgrade_row_is_what_this_engine_hits(rows):
    policy, mode = ENGINE
    assert rows
    for row in rows:
        tokens, mtp = DRAFTERS[row["mode"]]
        scenario = WriteScenario(to_refimpl(CATALOGUE["qwen3next"]), Speculation(mode, tokens, mtp), 0, row["N"],
                                 (("resend",),), seed=row["N"])
        history = run_write_scenario(scenario, WriteStats())  # vLLM against the model, request by request
        assert history[1][2] == row["hits"][policy], (row, history)
