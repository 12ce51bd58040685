"""The one conversion between the spec's domain types and the generated refimpl's.

``kvhit.spec.domain`` and ``kvhit.refimpl`` each define ``Group``, ``Layout`` and ``Speculation`` (and the
``Kind`` and ``Mode`` enums): refimpl is generated from the spec and imports nothing of ours, so the classes
are the same but not shared. :func:`to_refimpl` and :func:`to_spec` move a value between them, field by
field: the fields are read from the dataclasses, so a field one side gains is carried (or, when the other
side lacks it, refused), never silently dropped, and the enums are carried by value.

Imports no z3 and, until :func:`to_spec` is called, nothing of the spec: the operator tools and the
adapter's serving process import it beside ``kvhit.refimpl``.
"""

from dataclasses import fields, is_dataclass
from enum import Enum

from kvhit import refimpl

CLASSES = ("Group", "Layout", "Speculation")


def to_refimpl(value):
    """A spec ``Group``, ``Layout`` or ``Speculation`` as the refimpl's (a refimpl value is returned as is)."""
    return _convert(value, refimpl)


def to_spec(value):
    """A refimpl ``Group``, ``Layout`` or ``Speculation`` as the spec's (a spec value is returned as is)."""
    from kvhit.spec import domain

    return _convert(value, domain)


def _convert(value, target):
    name = type(value).__name__
    if name not in CLASSES or not is_dataclass(value):
        raise TypeError(f"cannot convert {value!r}: not one of {', '.join(CLASSES)}")
    cls = getattr(target, name)
    if type(value) is cls:
        return value
    names = [f.name for f in fields(value)]
    if names != [f.name for f in fields(cls)]:
        raise TypeError(f"{name}: fields {names} do not match {cls.__module__}.{name}'s "
                        f"{[f.name for f in fields(cls)]} (regenerate refimpl: make gen)")
    return cls(**{n: _field(getattr(value, n), target) for n in names})


def _field(value, target):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple) and value and all(is_dataclass(v) for v in value):
        return tuple(_convert(v, target) for v in value)
    return value
