"""Bad input gets a ValueError that names the problem."""

import pytest

from kvhit.refimpl import Group, Layout, Speculation, derive_sizes, hit


@pytest.mark.parametrize("make, message", [
    (lambda: Group("full", 0), "block_size must be positive"),
    (lambda: Group("full", -16), "block_size must be positive"),
    (lambda: Group("swa", 32), "needs a window"),
    (lambda: Group("swa", 32, window=0), "sliding window must be positive"),
    (lambda: Group("chunked", 16, chunk=64, eagle=True), "EAGLE group in chunked local attention"),
    (lambda: Group("mamba", 64, dcp_sharded=True), "cannot be DCP-sharded"),
    (lambda: Group("attention", 16), "is not a valid Kind"),
    (lambda: Layout(()), "at least one KV-cache group"),
    (lambda: Layout((Group("full", 64), Group("swa", 32, window=128)), dcp=2),
     "DCP 2 with a sharded swa group"),
    (lambda: Speculation("drop", 0), "num_speculative_tokens must be positive"),
    (lambda: Speculation("eagle", 1), "is not a valid Mode"),
    (lambda: Layout((Group("full", 16), Group("mamba", 16)), aux_cap_group=1),
     "aux_cap_group 1: a cap by the leading blocks of a mamba group is not modelled"),
    (lambda: Layout((Group("full", 16),), aux_cap_group=1), "aux_cap_group 1 is not a KV-cache group"),
    (lambda: Layout((Group("full", 16),), aux_cap_group=True), "aux_cap_group True is not a KV-cache group"),
])
def test_bad_layouts_are_refused_with_a_named_problem(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_block_sizes_the_hash_unit_does_not_divide_are_refused():
    layout = Layout((Group("full", 1600), Group("mamba", 1600)), prefix_match_unit=96)
    with pytest.raises(ValueError, match="effective block 1600 is not a multiple of the hash unit 96"):
        derive_sizes(layout, Speculation())


def test_scheduler_block_shorter_than_the_prefill_lookahead_is_refused():
    layout = Layout((Group("full", 16, eagle=True),))
    with pytest.raises(ValueError, match="shorter than the prefill lookahead 17"):
        derive_sizes(layout, Speculation("drop", 17, multi_module_mtp=True))


def test_eagle_drop_with_chunked_local_attention_is_refused():
    with pytest.raises(ValueError, match="EAGLE drop with chunked local attention"):
        derive_sizes(Layout((Group("chunked", 16, chunk=64),)), Speculation("drop", 1))


@pytest.mark.parametrize("groups, message", [
    ((Group("swa", 16, window=32), Group("chunked", 16, chunk=64)),
     "chunked local attention beside groups of kind swa is not modelled"),
    ((Group("full", 16), Group("mamba", 16), Group("chunked", 16, chunk=64)),
     "beside groups of kind mamba is not modelled"),
])
def test_chunked_local_attention_beside_anything_but_full_attention_is_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        Layout(groups)


@pytest.mark.parametrize("second", [Group("chunked", 16, chunk=128), Group("chunked", 16, chunk=64, dcp_sharded=False)])
def test_a_second_chunked_local_spec_group_is_refused(second):
    """One chunked-local spec group at most, counted as the spec groups are merged: a second chunk size, or
    the same chunk in a group that is not merged with the first (here: replicated), is refused."""
    with pytest.raises(ValueError, match="beside another chunked-local spec is not modelled"):
        derive_sizes(Layout((Group("full", 16), Group("chunked", 16, chunk=64), second)), Speculation())


def test_llama4_is_refused_where_vllm_builds_no_such_coordinator():
    """Full attention beside chunked local attention (Llama 4): no EAGLE-family mode (vLLM's config turns its
    hybrid manager off then), and no chunked block other than the alignment (vLLM's finder asserts it)."""
    llama4 = Layout((Group("full", 16), Group("chunked", 16, chunk=64)))
    assert derive_sizes(llama4, Speculation()).alignment == 16
    for speculation in (Speculation("lookahead", 1), Speculation("drop", 1)):
        with pytest.raises(ValueError, match="EAGLE-family speculation with chunked local attention beside"):
            derive_sizes(Layout((Group("full", 16, eagle=True), Group("chunked", 16, chunk=64))), speculation)
    with pytest.raises(ValueError, match="chunked-local block 16 differs from the hit alignment 32"):
        derive_sizes(Layout((Group("full", 32), Group("chunked", 16, chunk=64))), Speculation())


def test_non_positive_prompts_and_unknown_policies_are_refused():
    layout = Layout((Group("full", 16),))
    with pytest.raises(ValueError, match="at least one prompt token"):
        hit(layout, Speculation(), 0, [0])
    with pytest.raises(ValueError, match="unknown policy 'vllm'"):
        hit(layout, Speculation(), 10, [10], policy="vllm")


def test_the_auxiliary_outputs_cap_bounds_every_policys_hit_at_the_capped_groups_whole_blocks():
    """``aux_cap_group`` names a KV-cache group; the cap is its spec group's (full attention sorts first)
    leading whole blocks. Full 1600 (MTP) + Mamba 1600 at hash unit 160, every state of an 11910-token
    prompt cached, which holds 7 whole blocks (74 hashes): uncapped the reference hits 11840 without
    speculation and 11680 in drop mode (its drop unit within the hashes); capped, 11200 both (the dropping
    group's unit past the cap is cached), and vLLM 0.33's loop starts there too."""
    groups = (Group("mamba", 1600), Group("full", 1600, eagle=True))
    capped = Layout(groups, prefix_match_unit=160, aux_cap_group=1)
    uncapped = Layout(groups, prefix_match_unit=160)
    assert derive_sizes(capped, Speculation()).cap_group == 0
    assert derive_sizes(uncapped, Speculation()).cap_group is None
    n, every = 11910, [11910, 11910]
    drop = Speculation("drop", 1)
    assert [hit(uncapped, s, n, every) for s in (Speculation(), drop)] == [11840, 11680]
    assert [hit(capped, s, n, every) for s in (Speculation(), drop)] == [11200, 11200]
    assert [hit(capped, s, n, every, policy="vllm_0_33") for s in (Speculation(), drop)] == [11200, 11200]
