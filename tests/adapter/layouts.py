"""What the adapter tests compare against, built independently of the adapter.

* :func:`harness_layout` turns a catalogue layout (``kvhit.spec.catalogue``) into the conformance harness's
  layout dict, so vLLM's real classes are built from the catalogue, not from the adapter's mapping.
* :func:`expected_reference_hit` is the oracle: ``kvhit.refimpl.hit(..., "reference")`` on the catalogue
  layout and on the cache as the harness reads it out of vLLM's block pool (``VllmHarness.retained``).
* :func:`unsound_blocks` checks the blocks a lookup returns against the block pool and the request's hashes.
"""

from __future__ import annotations

from dataclasses import replace

import kvhit.refimpl as R
from kvhit.convert import to_refimpl
from kvhit.spec.catalogue import CATALOGUE
from tests.conformance.differential import to_harness
from tests.conformance.vllm_harness import VllmHarness, with_prefill_checkpoints


def harness_layout(name, dcp: int = 1, prefill_checkpoint: bool = False) -> dict:
    """A spec layout (a catalogue name, or a ``kvhit.spec`` Layout) at DCP ``dcp``, in the harness's
    format (:func:`tests.conformance.differential.to_harness`: DeepSeek-V4 groups are MLA / SWA-MLA specs,
    as vLLM builds them); with ``prefill_checkpoint``, every Mamba group declares a backend-internal prefill
    checkpoint, as vLLM's Mamba-2 layers do."""
    layout = CATALOGUE[name] if isinstance(name, str) else name
    out = to_harness(replace(layout, dcp=dcp))
    return with_prefill_checkpoints(out) if prefill_checkpoint else out


def refimpl_layout(name: str, dcp: int = 1) -> R.Layout:
    """The catalogue layout ``name`` at DCP ``dcp`` as a ``kvhit.refimpl.Layout``."""
    return to_refimpl(replace(CATALOGUE[name], dcp=dcp))


def speculation(mode: str, num_speculative_tokens: int = 1, multi_module_mtp: bool = False) -> R.Speculation:
    """The harness mode as a ``kvhit.refimpl.Speculation``."""
    if mode == "none":
        return R.Speculation("none")
    return R.Speculation(mode, num_speculative_tokens, multi_module_mtp)


def expected_reference_hit(harness: VllmHarness, layout: R.Layout, spec: R.Speculation,
                           tokens: list[int]) -> int:
    """The reference hit of ``tokens`` on the cache the harness finds in vLLM's block pool."""
    return expected_reference_lookup(harness, layout, spec, tokens)[0]


def expected_reference_lookup(harness: VllmHarness, layout: R.Layout, spec: R.Speculation,
                              tokens: list[int]) -> tuple[int, int]:
    """``(hit, shared-prefix boundary)`` of the reference lookup of ``tokens`` on the cache the harness
    finds in vLLM's block pool, the boundary as vLLM's ``get_computed_blocks`` reports it (0 for none).

    A spec group holds a boundary when every KV-cache group it merges does.
    """
    retained = harness.retained(tokens)
    sizes = R.derive_sizes(layout, spec)
    cache = [set.intersection(*(set(retained[m]) for m in sg.members)) for sg in sizes.groups]
    hit, _, longest, _ = R.hit_tokens(R.as_cache(cache), sizes, len(tokens), R.REFERENCE)
    return hit, (longest if longest > hit else 0)


def unsound_blocks(harness: VllmHarness, tokens: list[int], blocks: tuple[list, ...], hit: int) -> list[str]:
    """Why the blocks a lookup returned for ``tokens`` cannot serve ``hit`` tokens (empty if they can).

    For every KV-cache group with effective block ``b``: each non-null block at index ``i`` is the block
    the pool holds for one of the request's hashes ending in ``(i*b, (i+1)*b]``; full attention returns
    ``cdiv(hit, b)`` blocks, none null; a sliding window returns ``hit / b`` blocks whose last
    ``ceil((W-1)/b)`` are not null; Mamba returns ``cdiv(hit, b)`` blocks whose last is not null.
    """
    manager = harness.manager
    pool = manager.block_pool
    h = harness.sizes["h"]
    hashes = harness._new_request(tokens).block_hashes
    problems = []
    for g, (group_blocks, mgr) in enumerate(zip(blocks, manager.coordinator.single_type_managers)):
        b = mgr.block_size
        kind = harness.layout["groups"][g]["kind"]
        for i, block in enumerate(group_blocks):
            if block.is_null:
                continue
            ends = range(i * b + h, min((i + 1) * b, len(hashes) * h) + 1, h)
            if not any((found := pool.get_cached_block(hashes[x // h - 1], [g])) and found[0] is block
                       for x in ends):
                problems.append(f"group {g}: block {block.block_id} at index {i} is not the request's")
        need = -(-hit // b)
        if kind == "full" and (len(group_blocks) != need or any(x.is_null for x in group_blocks)):
            problems.append(f"group {g}: full attention returned {len(group_blocks)} blocks "
                            f"for hit {hit} (block {b})")
        if kind == "swa" and hit:
            window = -(-(harness.layout["groups"][g]["window"] - 1) // b)
            tail = group_blocks[max(0, hit // b - window):]
            if len(group_blocks) != hit // b or any(x.is_null for x in tail):
                problems.append(f"group {g}: sliding window lacks its window before {hit}")
        if kind == "mamba" and hit and (len(group_blocks) != need or group_blocks[-1].is_null):
            problems.append(f"group {g}: Mamba has no state at {hit}")
        if not hit and group_blocks:
            problems.append(f"group {g}: blocks for a zero hit")
    return problems
