"""The stream claims on concrete streams: ``reference_never_below_vllm`` and
``a_shared_prefix_is_kept_at_the_junction``, each evaluated through its claim function (the one definition the
prover lowers to Z3) with the generated ``refimpl`` on random prompts and shared lengths: dominance over
the write side's default domain and over every extended configuration with a Mamba group read at hash
granularity (on DeepSeek-V4 the reference does not keep vLLM's lower EAGLE boundaries, see
``kvhit.spec.retention.replay_boundaries``), the junction claim over the extended one (every layout with a
sliding-window or Mamba group, every DCP size and retention interval) but where it is known lost
(``_junction_lost``: such a Mamba group in drop mode, or beside a full-attention group of a finer block)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.proofs.domains import write_configs
from kvhit.proofs.model import Config, ReplayContext
from kvhit.proofs.retention import a_shared_prefix_is_kept_at_the_junction, reference_never_below_vllm
from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Group, Kind, Layout, Mode, Speculation
from kvhit.spec.policy import ALL_POLICIES
from kvhit.refimpl import mamba_at_hash_granularity, policy_rules
from kvhit.refimpl.policy import replay_boundaries, resume_tail

CONFIGS = write_configs(extended=True)
DEFAULT = write_configs(extended=False)


def _fine_mamba(config):
    """Whether a Mamba group of the configuration is read at hash granularity (its states inside a block are
    partial tails, of which vLLM holds one per request)."""
    return mamba_at_hash_granularity(ReplayContext(config, ALL_POLICIES["reference"], {"N": 1}, None).sizes())


def _mamba_drops(config):
    """Whether a Mamba group of the configuration drops (vLLM flags every group when it flags none)."""
    sizes = ReplayContext(config, ALL_POLICIES["reference"], {"N": 1}, None).sizes()
    return any(g.kind.value == "mamba" and g.drops for g in sizes.groups)


# The configurations of those the adapter enforces: all but multi-module MTP in drop mode where the Mamba group
# drops (refimpl.FINE_MAMBA_MTP_DROP; there scheduler_and_mask_boundaries_agree fails, README "Not proved").
FINE_MAMBA = [c for c in CONFIGS if _fine_mamba(c)
              and not (c.speculation.drop and c.speculation.prefill_lookahead >= 2 and _mamba_drops(c))]


def _junction_lost(config):
    """Where concrete streams refute the junction claim for the reference (README, "Not proved"): a Mamba
    group read at hash granularity whose junction inside a block a reader needs, in drop mode (one hash unit
    below the junction: test_on_mamba_read_at_hash_granularity_in_drop_mode_a_junction_inside_a_block_is_lost)
    or beside a full-attention group of a finer block (full64_mamba64_mamba128); vLLM's bookkeeping, which
    the reference keeps there, holds one partial tail per request."""
    if not _fine_mamba(config):
        return False
    full = [g.block_size for g in config.layout.groups if g.kind.value == "full"]
    mamba = [g.block_size for g in config.layout.groups if g.kind.value == "mamba"]
    return config.speculation.drop or (bool(full) and min(full) < max(mamba))


JUNCTION_HOLDS = [c for c in CONFIGS if not _junction_lost(c)]


@st.composite
def streams(draw, configs=CONFIGS):
    """A write-side configuration and the values of a stream's symbols: prompts up to 8 scheduler blocks,
    the second a resend, a longer sibling, a truncation or a diverging prompt, the third following either."""
    config = draw(st.sampled_from(configs))
    s = ReplayContext(config, ALL_POLICIES["reference"], {"N": 1}, None).sizes().scheduler_block
    length = st.integers(1, 8 * s)
    n, n2, n3 = draw(length), draw(length), draw(length)
    kind = draw(st.sampled_from(["resend", "sibling", "diverging"]))
    if kind == "resend":
        n2 = p2 = n
    elif kind == "sibling":
        n2 = max(n2, n + 1)
        p2 = n
    else:
        p2 = draw(st.integers(0, min(n, n2)))
    follows = draw(st.booleans())
    p3 = draw(st.integers(0, min(n3, n2 if follows else n)))
    p = draw(st.integers(1, 8 * s))
    values = {"N": n, "N2": n2, "P2": p2, "N3": n3, "P3": p3, "follows_second": follows,
              "P": p, "N2_diverging": draw(length)}
    return config, values


def _holds(claim, config, policy, values):
    ctx = ReplayContext(config, ALL_POLICIES[policy], values, None)
    assumption, holds = claim(ctx)
    return not assumption or holds, ctx.shown


@settings(max_examples=400, deadline=None)
@given(stream=streams(DEFAULT))
def test_reference_is_never_below_vllm_on_concrete_streams(stream):
    config, values = stream
    holds, shown = _holds(reference_never_below_vllm, config, "reference", values)
    assert holds, (config.label, values, shown)


@settings(max_examples=300, deadline=None)
@given(stream=streams(FINE_MAMBA))
def test_on_mamba_read_at_hash_granularity_the_reference_is_never_below_vllm(stream):
    """The layouts the adapter enforces since the reference keeps vLLM's Mamba bookkeeping there (issue 17;
    the reference that kept a state at every retained point inside a block kept fewer block ends than
    vLLM's mask and gave less than vLLM on these layouts, none of them in the default domain)."""
    config, values = stream
    holds, shown = _holds(reference_never_below_vllm, config, "reference", values)
    assert holds, (config.label, values, shown)


def test_with_multi_module_mtp_in_drop_mode_a_short_prompt_keeps_its_tail_where_a_decoded_resend_resumes():
    """Qwen3-Next's layout read at 160-token hash units with the MTP layers in the full-attention group, as
    vLLM's planner builds it, two MTP modules in drop mode, dense retention. A prompt of 320 tokens, a longer
    sibling of 4162, then a prompt sharing 3157 tokens with the sibling. A resend of the 320 tokens resumes
    nowhere right after its prefill (the reprefillable tail keeps full attention's cacheable tokens at 160,
    and the drop needs a unit past the hit); after decoding it resumes at 160, where vLLM keeps its prompt
    checkpoint. The reference keeps its one partial tail there (``resume_tail``), and the third prompt hits
    160 under both; when the tail was the resend's point alone, the reference kept none and hit 0 where vLLM
    hit 160, the reason the adapter left this setting to vLLM. With one MTP module, or two with lookahead
    hashes, the resend resumes right after the prefill, and both hit alike as before."""
    layout = Layout((Group(Kind.FULL, 1600, eagle=True), Group(Kind.MAMBA, 1600)), prefix_match_unit=160)
    values = {"N": 320, "N2": 4162, "P2": 320, "N3": 9010, "P3": 3157, "follows_second": True}
    for speculation, hits in ((Speculation(Mode.DROP, 2, multi_module_mtp=True), (0, 160)),
                              (Speculation(Mode.DROP, 1), (160, 160)),
                              (Speculation(Mode.LOOKAHEAD, 2, multi_module_mtp=True), (160, 1600))):
        config = Config(layout, speculation, None)
        got, shown = _holds(reference_never_below_vllm, config, "reference", values)
        assert (got, shown["hits"], shown["vllm_0_33_hits"]) == (True, hits, hits), speculation
    sizes = ReplayContext(Config(layout, Speculation(Mode.DROP, 2, multi_module_mtp=True), None),
                          ALL_POLICIES["reference"], {"N": 320}, None).sizes()
    boundaries = replay_boundaries(sizes, 320, policy_rules("reference"))
    assert (boundaries[0], boundaries[3], resume_tail(sizes, 320, boundaries, policy_rules("reference"))) == (0, 160, 160)


@settings(max_examples=300, deadline=None)
@given(stream=streams(JUNCTION_HOLDS))
def test_a_prompt_sharing_where_another_diverged_hits_what_dense_retention_gives(stream):
    config, values = stream
    holds, shown = _holds(a_shared_prefix_is_kept_at_the_junction, config, "reference", values)
    assert holds, (config.label, values, shown)


def test_without_the_junction_a_shared_system_prompt_is_lost():
    """Non-vacuity, on the stream vLLM's own tests pin: Qwen3-Next's layout at vLLM's default retention 0,
    three 8000-token prompts sharing a 4800-token system prompt. vLLM gives the third 4800 (the second
    recorded the junction); the reference does too; the reference without its junction gives 0."""
    config = Config(CATALOGUE["qwen3next"], Speculation("none"), 0)
    values = {"N": 8000, "N2": 8000, "P2": 4800, "N3": 8000, "P3": 4800, "follows_second": True,
              "P": 4800, "N2_diverging": 8000}
    for policy, hits in (("reference", (0, 4800)), ("without_junction", (0, 0))):
        holds, shown = _holds(reference_never_below_vllm, config, policy, values)
        assert (holds, shown["hits"], shown["vllm_0_33_hits"]) == (policy == "reference", hits, (0, 4800)), policy


def test_on_mamba_read_at_hash_granularity_in_drop_mode_a_junction_inside_a_block_is_lost():
    """Where the junction claim fails for the reference (README, "Not proved"): Qwen3-Next's layout read at
    160-token hash units (``qwen3next_pmu160``, blocks of 1600), MTP 2 in drop mode, dense retention. A
    prompt of 4800 tokens, a second of 6400 sharing its first 3360, a third sharing those 3360. Full
    attention holds whole blocks up to 3200 of the shared prefix (its partial tails lie past 3360), so after
    the 160-token drop the third can hit at most 3040, which a Mamba state every 160 tokens gives. vLLM's
    bookkeeping, which the reference keeps so that it can be enforced, holds Mamba states only at block ends
    (1600, 3200) and one partial tail per request (past the shared prefix here), so the largest hit with a
    state is 1600, under the reference as under vLLM."""
    config = Config(CATALOGUE["qwen3next_pmu160"], Speculation(Mode.DROP, 2, multi_module_mtp=True), None)
    values = {"N": 4800, "P": 3360, "N2_diverging": 6400, "N3": 6400}
    for policy in ("reference", "vllm_0_33_repaired", "vllm_0_33"):
        holds, shown = _holds(a_shared_prefix_is_kept_at_the_junction, config, policy, values)
        assert (holds, shown) == (False, {"third_hit": 1600, "third_hit_dense": 3040}), policy
