"""Layouts for the operator tools: a catalogue name or a JSON file, as the generated refimpl's types.

The file format is documented in ``docs/layout-format.md``. Validation reuses the domain's own checks
(``refimpl.Group`` / ``refimpl.Layout`` / ``refimpl.derive_sizes`` raise ``ValueError`` naming the problem);
this module adds what a file can get wrong before those run (not JSON, unknown fields, wrong types) and
prefixes every message with where the problem is.
"""

import json
from dataclasses import replace
from pathlib import Path

from kvhit import refimpl
from kvhit.convert import to_refimpl
from kvhit.refimpl import Group, Kind, Layout

KINDS = tuple(k.value for k in Kind)
GROUP_FIELDS = {
    "kind": str, "block_size": int, "window": int, "chunk": int, "dcp_sharded": bool, "eagle": bool,
    "tokens_per_state": int, "operator_block_size": bool,
}
LAYOUT_FIELDS = {"name": str, "groups": list, "dcp": int, "prefix_match_unit": int, "aux_cap_group": int}


class LayoutError(ValueError):
    """A layout that cannot be used, with the place and the problem in the message."""


def catalogue():
    """The spec's catalogue (``kvhit.spec.catalogue``: pure data, no z3) as refimpl layouts."""
    from kvhit.spec.catalogue import CATALOGUE

    return {name: to_refimpl(layout) for name, layout in CATALOGUE.items()}


def load(source):
    """A layout and the indices of its groups that follow vLLM's ``--block-size``.

    Args:
        source: a catalogue name, or the path of a JSON layout file.

    Raises:
        LayoutError: unknown name, unreadable or malformed file, or a layout the domain rejects.
    """
    known = catalogue()
    if source in known:
        return known[source], ()
    path = Path(source)
    if not path.exists():
        raise LayoutError(f"{source!r} is neither a catalogue layout ({', '.join(known)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LayoutError(f"{source}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except OSError as e:
        raise LayoutError(f"{source}: cannot read: {e.strerror}") from None
    try:
        return parse(data, default_name=path.stem)
    except ValueError as e:
        raise LayoutError(f"{source}: {e}") from None


def parse(data, default_name=""):
    """A layout from the decoded JSON of a layout file (see ``docs/layout-format.md``).

    Returns:
        ``(layout, operator_groups)``: the refimpl layout, and the indices of the groups marked
        ``operator_block_size``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a layout file holds a JSON object, got {type(data).__name__}")
    _check_fields(data, LAYOUT_FIELDS, "layout")
    if "groups" not in data:
        raise ValueError("missing field 'groups' (a list of KV-cache groups)")
    groups, operator = [], []
    for i, g in enumerate(data["groups"]):
        where = f"group {i}"
        if not isinstance(g, dict):
            raise ValueError(f"{where}: a group is a JSON object, got {type(g).__name__}")
        _check_fields(g, GROUP_FIELDS, where)
        for required in ("kind", "block_size"):
            if required not in g:
                raise ValueError(f"{where}: missing field {required!r}")
        if g["kind"] not in KINDS:
            raise ValueError(f"{where}: unknown kind {g['kind']!r} (known: {', '.join(KINDS)})")
        fields = {k: v for k, v in g.items() if k != "operator_block_size"}
        if g.get("operator_block_size"):
            operator.append(i)
        try:
            groups.append(Group(**fields))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    layout = Layout(tuple(groups), data.get("dcp", 1), data.get("prefix_match_unit"),
                    data.get("name", default_name), data.get("aux_cap_group"))
    refimpl.derive_sizes(layout, refimpl.NO_SPECULATION)
    return layout, tuple(operator)


def _check_fields(obj, fields, where):
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(fields)})")
    for key, want in fields.items():
        value = obj.get(key)
        if value is None:
            continue
        if want is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        if want is not int and not isinstance(value, want):
            raise ValueError(f"{where}: {key} must be a {want.__name__}, got {value!r}")


def configure(layout, dcp=None, prefix_match_unit=None, block_size=None, operator_groups=()):
    """The layout with an operator's settings applied; ``None`` keeps the layout's own value.

    Args:
        prefix_match_unit: a positive int, or ``"none"`` for the GCD rule.
        block_size: the ``--block-size`` value, applied to the groups in ``operator_groups``.
    """
    groups = layout.groups
    if block_size is not None:
        if not operator_groups:
            raise LayoutError("no group of this layout follows --block-size: mark groups with "
                              "\"operator_block_size\": true in the layout file or name them with --operator-groups")
        for i in operator_groups:
            if not 0 <= i < len(groups):
                raise LayoutError(f"--operator-groups: no group {i} (the layout has {len(groups)})")
        groups = tuple(replace(g, block_size=block_size) if i in operator_groups else g
                       for i, g in enumerate(groups))
    pmu = layout.prefix_match_unit
    if prefix_match_unit == "none":
        pmu = None
    elif prefix_match_unit is not None:
        pmu = prefix_match_unit
    try:
        return Layout(groups, layout.dcp if dcp is None else dcp, pmu, layout.name, layout.aux_cap_group)
    except ValueError as e:
        raise LayoutError(str(e)) from None


def describe_group(g):
    """One group as a person writes it: ``swa 128 (window 128, eagle)``."""
    extra = []
    if g.window is not None:
        extra.append(f"window {g.window}")
    if g.chunk is not None:
        extra.append(f"chunk {g.chunk}")
    if g.eagle:
        extra.append("eagle")
    if g.kind is not Kind.MAMBA and not g.dcp_sharded:
        extra.append("replicated")
    if g.tokens_per_state != 1:
        extra.append(f"{g.tokens_per_state} tokens/state")
    return f"{g.kind.value} {g.block_size}" + (f" ({', '.join(extra)})" if extra else "")


def to_json(layout):
    """The layout in the file format (round-trips through :func:`parse`)."""
    groups = []
    for g in layout.groups:
        d = {"kind": g.kind.value, "block_size": g.block_size}
        if g.window is not None:
            d["window"] = g.window
        if g.chunk is not None:
            d["chunk"] = g.chunk
        if g.dcp_sharded != (g.kind is not Kind.MAMBA):
            d["dcp_sharded"] = g.dcp_sharded
        if g.eagle:
            d["eagle"] = True
        if g.tokens_per_state != 1:
            d["tokens_per_state"] = g.tokens_per_state
        groups.append(d)
    out = {"name": layout.name, "groups": groups, "dcp": layout.dcp, "prefix_match_unit": layout.prefix_match_unit}
    if layout.aux_cap_group is not None:
        out["aux_cap_group"] = layout.aux_cap_group
    return out
