"""Moving layouts between the generated refimpl's domain types and the spec's."""

from kvhit.spec import domain


def to_spec(layout, speculation):
    groups = tuple(domain.Group(g.kind.value, g.block_size, g.window, g.chunk, g.dcp_sharded, g.eagle,
                                g.tokens_per_state) for g in layout.groups)
    return (domain.Layout(groups, layout.dcp, layout.prefix_match_unit, layout.name),
            domain.Speculation(speculation.mode.value, speculation.num_speculative_tokens,
                               speculation.multi_module_mtp))
