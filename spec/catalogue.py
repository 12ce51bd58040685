"""Real KV-cache layouts the proofs enumerate and the tests drive (see the README's catalogue table)."""

from .domain import Group, Kind, Layout

FULL, SWA, MAMBA, CHUNKED = Kind.FULL, Kind.SWA, Kind.MAMBA, Kind.CHUNKED


def _dsv4(mla_blocks, mla_states, swa_block, name):
    """DeepSeek-V4: compressed MLA groups (full attention, ``tokens_per_state`` 4 or 128), the SWA-MLA
    cache that also holds the MTP layer (the EAGLE group), and the compressor states (SWA-MLA blocks 8
    and 4, windows 128 and 8)."""
    mla = tuple(Group(FULL, b, tokens_per_state=t) for b, t in zip(mla_blocks, mla_states))
    return Layout(mla + (Group(SWA, swa_block, window=128, eagle=True),
                         Group(SWA, 8, window=128), Group(SWA, 4, window=8)), name=name)


CATALOGUE = {
    layout.name: layout
    for layout in (
        # plain full attention (Llama-like), one group
        Layout((Group(FULL, 16),), name="full16"),
        # Llama with an EAGLE draft: a sharded target group and a replicated draft group
        Layout((Group(FULL, 16), Group(FULL, 16, dcp_sharded=False, eagle=True)), name="llama_eagle"),
        # Gemma-like: full attention + sliding window
        Layout((Group(FULL, 64), Group(SWA, 32, window=512)), name="gemma"),
        # Qwen3-Next-like: full attention + Mamba/GDN in align mode
        Layout((Group(FULL, 1600), Group(MAMBA, 1600)), name="qwen3next"),
        Layout((Group(FULL, 1600), Group(MAMBA, 1600)), prefix_match_unit=160, name="qwen3next_pmu160"),
        # three kinds at once
        Layout((Group(FULL, 1600), Group(MAMBA, 1600), Group(SWA, 160, window=512)), name="three_kind"),
        # DeepSeek-V4 as vLLM 0.33 builds it on CUDA
        _dsv4((256, 256, 256), (4, 128, 4), 64, "dsv4_cuda"),
        # DeepSeek-V4 as in the report: alignment 16384
        _dsv4((16384, 512, 512), (128, 4, 4), 128, "dsv4_report"),
        # Llama-4-like chunked local attention, one group
        Layout((Group(CHUNKED, 16, chunk=64),), name="chunked64"),
        # Llama 4 as vLLM 0.33 plans it: full-attention (NoPE) layers beside chunked local attention
        Layout((Group(FULL, 16), Group(CHUNKED, 16, chunk=64)), name="llama4"),
    )
}
