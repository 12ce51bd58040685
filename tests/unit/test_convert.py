"""The conversion between the spec's domain types and the refimpl's (``kvhit.convert``) carries every field."""

from dataclasses import MISSING, field, fields, make_dataclass
from enum import Enum

import pytest

from kvhit import refimpl
from kvhit.convert import to_refimpl, to_spec
from kvhit.proofs import domains
from kvhit.spec import domain
from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Group, Kind, Layout, Mode, Speculation

LAYOUTS = list(CATALOGUE.values()) + domains.layouts(True)
SPECULATIONS = (domains.READ_SPECULATIONS + domains.WRITE_SPECULATIONS
                + (Speculation(Mode.DROP, 3, multi_module_mtp=True, label="mtp3"),))
# Between them, a non-default value in every field of Group (checked below, so a new field needs one here).
GROUPS = (
    Group(Kind.SWA, 32, window=64, eagle=True, tokens_per_state=4),
    Group(Kind.CHUNKED, 16, chunk=64, dcp_sharded=False),
    Group(Kind.MAMBA, 128),
    Group(Kind.FULL, 16, dcp_sharded=True, eagle=True, tokens_per_state=128),
)


def _values(value):
    """Every field (``compare=False`` ones too), the groups' nested, enums by value."""
    out = {}
    for f in fields(value):
        v = getattr(value, f.name)
        out[f.name] = v.value if isinstance(v, Enum) else [_values(g) for g in v] if f.name == "groups" else v
    return out


def _round_trip(value):
    there = to_refimpl(value)
    assert type(there) is getattr(refimpl, type(value).__name__)
    assert _values(there) == _values(value)
    back = to_spec(there)
    assert type(back) is type(value)
    return back


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{lay.name}-dcp{lay.dcp}" for lay in LAYOUTS])
def test_every_catalogue_layout_keeps_every_field_through_refimpl_and_back(layout):
    assert _values(_round_trip(layout)) == _values(layout)


@pytest.mark.parametrize("speculation", SPECULATIONS, ids=[s.describe() for s in SPECULATIONS])
def test_every_speculation_keeps_every_field_through_refimpl_and_back(speculation):
    assert _values(_round_trip(speculation)) == _values(speculation)


@pytest.mark.parametrize("group", GROUPS, ids=[g.kind.value for g in GROUPS])
def test_a_group_with_non_default_fields_keeps_them_through_refimpl_and_back(group):
    assert _values(_round_trip(group)) == _values(group)
    layout = Layout((group,), dcp=2 if group.kind is Kind.FULL else 1, prefix_match_unit=16, name="odd")
    assert _values(_round_trip(layout)) == _values(layout)


def test_the_groups_above_set_every_field_of_group_away_from_its_default():
    covered = {f.name for g in GROUPS for f in fields(g)
               if f.default is MISSING or getattr(g, f.name) != f.default}
    assert covered == {f.name for f in fields(Group)}
    assert {g.kind for g in GROUPS} == set(Kind)
    assert {g.dcp_sharded for g in GROUPS} == {True, False}


def test_a_field_the_other_side_lacks_is_refused_not_dropped():
    # a spec Group that gained a field the generated refimpl does not have yet
    grown = make_dataclass("Group", [(f.name, f.type, field(default=f.default)) for f in fields(Group)]
                           + [("compressed", bool, field(default=False))], frozen=True)
    with pytest.raises(TypeError, match="compressed"):
        to_refimpl(grown(Kind.FULL, 16))


def test_a_value_already_on_the_target_side_is_returned_as_is():
    layout = CATALOGUE["qwen3next"]
    assert to_spec(layout) is layout
    there = to_refimpl(layout)
    assert to_refimpl(there) is there and to_spec(there) == layout and isinstance(to_spec(there), domain.Layout)
