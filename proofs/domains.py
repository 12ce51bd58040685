"""The configurations the proofs enumerate: the catalogue and a wider band around it.

Layout values (block sizes, windows, DCP sizes, lookahead) are enumerated here; prompt length and cache
state are symbolic and unbounded in every check.
"""

from dataclasses import replace

from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Group, Kind, Layout, Mode, Speculation

from .model import Config, Scenario

# The read side sees a speculative setting only through L (lookahead) and whether EAGLE groups drop;
# the prefill lookahead Lp matters on the write side. So drop is enumerated once: drop with two MTP modules
# (Lp = 2) reads as drop (Lp = 1) on every layout, its lookups' sizes equal but for Lp
# (tests/properties/test_read_twin.py), so the read side's "drop Lp=1" verdicts are its verdicts too.
SPECULATIONS = (
    Speculation(Mode.NONE),
    Speculation(Mode.LOOKAHEAD, 1),                          # L = 1 (EAGLE, single-module MTP)
    Speculation(Mode.LOOKAHEAD, 2, multi_module_mtp=True),   # L = 2 (two MTP modules)
    Speculation(Mode.DROP, 1),
)
READ_SPECULATIONS = SPECULATIONS + (
    Speculation(Mode.LOOKAHEAD, 4, multi_module_mtp=True),   # L = 4 (four MTP modules)
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
    # One Mamba group: the Unitary coordinator over a kind that never drops (a repaired Unitary margin once
    # took it past N - 1).
    out.append(Layout((Group(M, 16),), name="mamba16"))
    # Qwen3.5/3.6-like ([GDN x3, full attention] x k and an MTP layer): one full-attention KV-cache group
    # holding the MTP layer (the EAGLE group) and three GDN groups of one spec, which vLLM's coordinator looks
    # up together (one spec group of three members); with prefix_match_unit too. The real Scheduler builds
    # full attention beside three Mamba groups for Nemotron-H without MTP (tests/adapter/test_scheduler_plugin.py,
    # "shared-mamba"); this exact grouping of Qwen3.5's layers by vLLM's planner is not checked here
    qwen35 = (Group(F, 1600, eagle=True),) + (Group(M, 1600),) * 3
    out.append(Layout(qwen35, name="qwen35"))
    out.append(Layout(qwen35, prefix_match_unit=160, name="qwen35_pmu160"))
    # Auxiliary outputs (routed experts, vLLM 0.33) on a Nemotron-H-like MoE with MTP, as the real Scheduler
    # builds it (tests/adapter/test_scheduler_plugin.py, "aux-pmu160-mtp1-drop"): full attention holding the
    # MTP layers, read at hash granularity, caps every lookup at its leading whole blocks
    out.append(Layout((Group(F, 1600, eagle=True), Group(M, 1600)), prefix_match_unit=160, aux_cap_group=0,
                      name="full1600e_mamba1600_pmu160_aux"))
    return out


def layouts(extended: bool = True):
    """The catalogue, the band beyond it, and DCP sizes: 2, 4 and 8 by default, 2 to 8 when extended."""
    base = list(CATALOGUE.values()) + _beyond_catalogue()
    out = []
    for layout in base:
        out.append(layout)
    for dcp in (range(2, 9) if extended else (2, 4, 8)):
        out.append(replace(CATALOGUE["full16"], dcp=dcp))
        out.append(replace(CATALOGUE["llama_eagle"], dcp=dcp))
    for dcp in (2, 4, 8):
        out.append(replace(CATALOGUE["qwen3next"], dcp=dcp))
    return out


# Layouts on which vLLM's Hybrid loop runs beyond its simple case (three or more spec groups, or no
# full-attention group to cap the Mamba and sliding-window scans): its passes over four or five groups make
# a check of vLLM's policies cost up to billions of units (vllm_0_33's validity on dsv4_cuda in drop mode was
# still undecided after 8.7 G), so the default run checks only the reference's read side on them (176 checks,
# 6.4 s of checks under the scans' contracts, 2026-12-05), and of the reference's write side on three_kind and
# the DeepSeek-V4 layouts what is cheap there (CORE_WRITE); vLLM's policies, the known-bad variants and the rest
# of the write side there are `kvhit prove --extended`'s.
HEAVY = ("three_kind", "dsv4_cuda", "dsv4_report", "full64_mamba64_mamba128", "swa32_mamba64",
         # a second plain full-attention block size adds nothing full32 does not cover
         "full48")


def reference_only(config, extended: bool) -> bool:
    """Whether a run checks only the reference on ``config``: a HEAVY layout's read side, by default."""
    return not extended and config.layout.name in HEAVY


# The write side also sees the prefill lookahead Lp (the reprefillable tail of multi-module MTP), so drop
# mode is enumerated with Lp = 1 and Lp = 2 (the Qwen3-Next report: MTP with two speculative tokens).
WRITE_SPECULATIONS = SPECULATIONS + (Speculation(Mode.DROP, 2, multi_module_mtp=True),)


def retention_intervals(sizes):
    """Dense, the replay boundaries only (vLLM's default), and one interval of two scheduler blocks."""
    return (None, 0, 2 * sizes.scheduler_block)


# The write side's default run: the Qwen3-Next report's layout, a sliding window (Gemma) and an EAGLE sliding
# window with every retention interval (dense, 0 and 2S), and chunked local attention (alone and beside full
# attention, as in Llama 4) at vLLM's default retention 0. Writing and then reading three times makes a check
# several times costlier than a read-side one; `--extended` covers every layout with a sliding-window, Mamba or
# chunked-local group with every interval. The two sliding-window layouts' dense and 2S settings (20
# configurations) cost the default run about 0.6 G units on 2026-12-07; the other write-side layouts at every
# interval (the one-group and hash-granular ones, full32_swa16w64/w100, qwen35) left two chunks running
# after 20 minutes that day. Measured alone that day, one check at a time: the Qwen3.5-like layout's write
# side (15 configurations, every row of the default run) about 125 s of checks while another job ran;
# full32_swa16w64's about 100 s, its dominance lemma 66 s of it (5-18 s at R = 0, like gemma's);
# qwen3next_pmu160's dominance lemma 206 s and 2.5 G units dense without speculation, and its junction claim
# undecided after 3 minutes on that configuration. So qwen35 is in, and the sliding-window and hash-granular
# layouts beyond gemma and the EAGLE sliding window are --extended's.
CORE_WRITE = {"qwen3next": (None, 0, 2), "qwen35": (None, 0, 2), "gemma": (None, 0, 2),
              "full64_swa64w200_eagle": (None, 0, 2), "chunked64": (0,), "llama4": (0,),
              # one-group layouts: every claim, each check at most a few seconds measured alone (2026-12-07;
              # mamba16's drop mode is left to vLLM: spec.retention.write_side_unmodelled)
              "swa16w64": (None, 0, 2), "mamba16": (None, 0, 2),
              # without the three-request claims (STREAM_CLAIMS_EXTENDED)
              "full32_swa16w64": (None, 0, 2), "full32_swa16w100": (None, 0, 2),
              # HEAVY: the reference only (reference_only), its first repeat's claim and sparseness
              "dsv4_cuda": (None, 0, 2), "dsv4_report": (None, 0, 2), "three_kind": (None, 0, 2)}

# Layouts whose write side the default run checks without the claims over three requests (the dominance lemma,
# and so the composed reference_never_below_vllm; the junction claim), which `--extended` checks: on HEAVY
# they were not decided within minutes a configuration, and on the two sliding-window layouts beyond gemma and
# the EAGLE window the dominance lemma alone would add about 66 s of checks each (2026-12-07), where the
# first-repeat claim and sparseness of both take 5.6 s (HEAVY's figures: proofs/retention.py::_heavy_layout).
STREAM_CLAIMS_EXTENDED = HEAVY + ("full32_swa16w64", "full32_swa16w100")


def write_configs(extended: bool = False):
    """Configurations of the write side: the layouts with a sliding-window or Mamba group, each
    speculative setting and retention interval the spec accepts (the core set unless ``extended``)."""
    from kvhit.spec.retention import check_retention, write_side_unmodelled
    from kvhit.spec.sizes import derive_sizes

    out = []
    for layout in layouts(extended):
        if not any(g.kind in (Kind.SWA, Kind.MAMBA, Kind.CHUNKED) for g in layout.groups):
            continue
        if not extended and (layout.name not in CORE_WRITE or layout.dcp > 1):
            continue
        for speculation in WRITE_SPECULATIONS:
            try:
                sizes = derive_sizes(layout, speculation)
            except ValueError:
                continue
            if not extended and write_side_unmodelled(sizes):
                continue  # the adapter leaves it to vLLM: no claim of kvhit's (--extended refutes it)
            intervals = retention_intervals(sizes)
            if not extended:
                intervals = [None if r is None else r * sizes.scheduler_block for r in CORE_WRITE[layout.name]]
            for interval in intervals:
                try:
                    check_retention(sizes, interval)
                except ValueError:
                    continue
                out.append(Config(layout, speculation, interval))
    return out


def configs(extended: bool = False):
    """Every (layout, speculation) pair the spec accepts (rejected pairs are skipped: the spec raises),
    then the write side's configurations."""
    return read_configs(extended) + write_configs(extended)


def read_configs(extended: bool = False):
    """Every (layout, speculation) pair the spec accepts for the read side (on a HEAVY layout the default
    run checks only the reference: :func:`reference_only`)."""
    out = []
    for layout in layouts(extended):
        for speculation in READ_SPECULATIONS:
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
    # The same DeepSeek-V4 request on the write side at vLLM's default retention 0: vLLM 0.33's replay
    # boundaries sit one 16384-token scheduler block low, so the first repeat still hits 16384 (W4).
    Scenario("dsv4_report_46240_retention0", "scheduler_and_mask_boundaries_agree",
             Config(CATALOGUE["dsv4_report"], Speculation(Mode.DROP, 1), 0), 46240,
             pinned=(("N2", 46240 + 16384),), concrete=True),  # a sibling one scheduler block longer
    # Qwen3.8-27B-FP8 (1600-token blocks, MTP with two speculative tokens), vLLM's default retention 0.
    Scenario("qwen3next_11910", "scheduler_and_mask_boundaries_agree",
             Config(CATALOGUE["qwen3next"], Speculation(Mode.DROP, 2, multi_module_mtp=True), 0), 11910),
)
