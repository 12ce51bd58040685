"""The configurations the proofs enumerate: the catalogue and a wider band around it.

Layout values (block sizes, windows, DCP sizes, lookahead) are enumerated here; prompt length and cache
state are symbolic and unbounded in every check.
"""

from dataclasses import replace

from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Group, Kind, Layout, Mode, Speculation

from .model import Config, Scenario

# The read side sees a speculative setting only through L (lookahead) and whether EAGLE groups drop;
# the prefill lookahead Lp matters on the write side. So drop is enumerated once.
SPECULATIONS = (
    Speculation(Mode.NONE),
    Speculation(Mode.LOOKAHEAD, 1),                          # L = 1 (EAGLE, single-module MTP)
    Speculation(Mode.LOOKAHEAD, 2, multi_module_mtp=True),   # L = 2 (two MTP modules)
    Speculation(Mode.DROP, 1),
)
WIDE_SPECULATIONS = SPECULATIONS + (
    Speculation(Mode.LOOKAHEAD, 4, multi_module_mtp=True),   # L = 4, on the small layouts
)


def _beyond_catalogue():
    """Layouts outside the catalogue: other block sizes, windows and DCP sizes."""
    F, S, M = Kind.FULL, Kind.SWA, Kind.MAMBA
    out = []
    for b in (32, 48):
        out.append(Layout((Group(F, b),), name=f"full{b}"))
    for window in (64, 100):
        out.append(Layout((Group(F, 32), Group(S, 16, window=window)), name=f"full32_swa16w{window}"))
    out.append(Layout((Group(F, 64), Group(S, 64, window=200, eagle=True)), name="full64_swa64w200_eagle"))
    out.append(Layout((Group(S, 16, window=64),), name="swa16w64"))
    out.append(Layout((Group(S, 32, window=64), Group(M, 64)), name="swa32_mamba64"))
    out.append(Layout((Group(F, 64), Group(M, 64), Group(M, 128)), name="full64_mamba64_mamba128"))
    out.append(Layout((Group(F, 128), Group(M, 128)), prefix_match_unit=32, name="full128_mamba128_pmu32"))
    return out


def layouts():
    base = list(CATALOGUE.values()) + _beyond_catalogue()
    out = []
    for layout in base:
        out.append(layout)
    for dcp in range(2, 9):
        out.append(replace(CATALOGUE["full16"], dcp=dcp))
        out.append(replace(CATALOGUE["llama_eagle"], dcp=dcp))
    for dcp in (2, 4, 8):
        out.append(replace(CATALOGUE["qwen3next"], dcp=dcp))
    return out


# Layouts of three or more spec groups make each check one to two orders of magnitude harder (the
# candidate scan's intervals multiply across groups, and vLLM's loop unrolls more passes). They are
# checked by `kvhit prove --extended`; the default run keeps the report's DeepSeek-V4 scenario.
HEAVY = ("three_kind", "dsv4_cuda", "dsv4_report", "full64_mamba64_mamba128")


def configs(extended: bool = False):
    """Every (layout, speculation) pair the spec accepts (rejected pairs are skipped: the spec raises)."""
    out = []
    for layout in layouts():
        if layout.name in HEAVY and not extended:
            continue
        small = len(layout.groups) <= 2
        for speculation in WIDE_SPECULATIONS if small else SPECULATIONS:
            try:
                from kvhit.spec.sizes import derive_sizes

                derive_sizes(layout, speculation)
            except ValueError:
                continue
            out.append(Config(layout, speculation))
    return out


SCENARIOS = (
    Scenario("dsv4_report_46240", "eagle_loses_at_most_one_block_beyond_alignment",
             Config(CATALOGUE["dsv4_report"], Speculation(Mode.DROP, 1)), 46240),
)
