"""The settings an operator controls, made from a layout and validated by the domain (``kvhit.layouts.configure``,
``refimpl.derive_sizes`` and ``check_retention``)."""

from dataclasses import dataclass, field

from kvhit import refimpl
from kvhit.layouts import LayoutError, configure
from kvhit.refimpl import Mode, Speculation


@dataclass
class Setting:
    """One combination of operator settings and what it gives.

    Attributes:
        label: the settings as a person writes them.
        layout, speculation, sizes: what the setting makes of the layout (refimpl types).
        retention: the retention interval (None: dense retention; ``"dense"``: the dense cache, not a
            setting).
        same_as: labels of other settings that derive identical sizes (evaluated once).
        mean: per policy, expected cached tokens per request.
        states: per policy, retained states (Mamba states and sliding-window blocks) per request on average.
        past_hashes: per policy, requests whose lookups read past ``|H| * h`` (vLLM raises IndexError).
    """
    label: str
    block_size: int | None
    prefix_match_unit: object
    mode: str
    layout: object
    speculation: object
    sizes: object
    retention: object = 0
    same_as: list = field(default_factory=list)
    mean: dict = field(default_factory=dict)
    states: dict = field(default_factory=dict)
    past_hashes: dict = field(default_factory=dict)


@dataclass
class Candidates:
    settings: list
    rejected: list  # (label, reason)
    intervals: list = field(default_factory=list)  # retention intervals still to try (in scheduler blocks or None)
    replay: dict = field(default_factory=dict)  # (sizes, policy) -> {P: replay boundaries}, for every interval


def _default_units(layout):
    """``none`` (the GCD rule), the layout's own unit, and every multiple of 16 dividing the GCD of the
    effective blocks (a single-group layout has no choice: its unit is its block)."""
    if len(layout.groups) == 1:
        return [layout.prefix_match_unit or "none"]
    blocks = refimpl.derive_sizes(layout, refimpl.NO_SPECULATION).effective_blocks
    g = refimpl.gcd_all(blocks)
    units = ["none"] + ([layout.prefix_match_unit] if layout.prefix_match_unit else [])
    units += [u for u in range(16, g, 16) if g % u == 0 and u not in units]
    return units


DEFAULT_INTERVALS = (None, 0, 1, 2, 4)  # retention intervals: None, 0 and multiples of the scheduler block S


def _interval_label(r):
    return "R none" if r is None else f"R {r}"


def candidates(layout, spec, dcp=None, block_sizes=None, operator_groups=(), prefix_match_units=None,
               cache="written", retention_intervals=None):
    """Every combination of the operator's settings, validated by the domain (an impossible one is kept in
    ``rejected`` with the domain's reason); settings that derive identical sizes are merged.

    With the written cache each setting is made at retention interval 0 (vLLM's default; ``dense`` cache:
    no retention at all); ``retention_intervals`` (``None`` or multiples of ``S`` in scheduler blocks, given
    as ``("S", k)``, or plain token counts) are kept for :func:`with_retention`."""
    if cache not in ("written", "dense"):
        raise ValueError(f"unknown cache {cache!r} (known: written, dense)")
    if block_sizes is not None and not operator_groups:
        configure(layout, block_size=block_sizes[0], operator_groups=())  # raises the clear error
    modes = ["none"] if spec.mode is Mode.NONE else ["lookahead", "drop"]
    settings, rejected, seen = [], [], {}
    for b in block_sizes or [None]:
        try:
            base = configure(layout, dcp=dcp, block_size=b, operator_groups=operator_groups)
            units = prefix_match_units or _default_units(base)
        except ValueError as e:
            rejected.append((f"block {b}", str(e)))
            continue
        for u in units:
            for mode in modes:
                label = ", ".join(([f"block {b}"] if b is not None else []) + [f"pmu {u}", mode]
                                  + (["R 0"] if cache == "written" else []))
                try:
                    lay = configure(base, prefix_match_unit=u)
                    sp = Speculation(mode, spec.num_speculative_tokens, spec.multi_module_mtp)
                    sizes = refimpl.derive_sizes(lay, sp)
                    if cache == "written":
                        refimpl.check_retention(sizes, 0)
                except (ValueError, LayoutError) as e:
                    rejected.append((label, str(e)))
                    continue
                if sizes in seen:
                    seen[sizes].same_as.append(label)
                    continue
                s = Setting(label, b, u, mode, lay, sp, sizes, 0 if cache == "written" else "dense")
                seen[sizes] = s
                settings.append(s)
    if not settings:
        raise ValueError("no valid setting: " + "; ".join(f"{label}: {why}" for label, why in rejected))
    intervals = []
    if cache == "written":
        intervals = list(DEFAULT_INTERVALS if retention_intervals is None else retention_intervals)
    return Candidates(settings, rejected, intervals)


def with_retention(cands, ranked, top, explicit=False):
    """Add the best ``top`` settings of ``ranked`` at each other retention interval of ``cands.intervals``
    (``None``, or a multiple of ``S`` in scheduler blocks), to evaluate next. An interval the spec refuses
    (``refimpl.check_retention``) is listed as rejected when the operator asked for it (``explicit``) and
    skipped when it is one of the defaults (None on a layout without sliding-window or Mamba groups)."""
    added = []
    for base in ranked[:top]:
        for r in cands.intervals:
            interval = None if r is None else r * base.sizes.scheduler_block
            if interval == base.retention:
                continue
            label = base.label.replace("R 0", _interval_label(interval))
            try:
                refimpl.check_retention(base.sizes, interval)
            except ValueError as e:
                if explicit:
                    cands.rejected.append((label, str(e)))
                continue
            s = Setting(label, base.block_size, base.prefix_match_unit, base.mode, base.layout, base.speculation,
                        base.sizes, interval)
            cands.settings.append(s)
            added.append(s)
    return added
