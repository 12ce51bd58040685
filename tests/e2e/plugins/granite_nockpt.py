"""A vLLM general plugin for the Granite end-to-end test only (on PYTHONPATH, never installed): it turns off
the Mamba-2 layers' mid-prefill checkpoints, which vLLM 0.32.0 cannot run on the CPU.

``MambaMixer2.get_kv_cache_spec`` always asks for one prefill checkpoint block; a final prefill chunk longer
than a block then stores the state at its last block boundary with ``store_prefill_checkpoint`` (a Triton
kernel, ops/ssd_checkpoint.py) from the scan's intermediate states, which the CPU scan does not return (it
returns one state per sequence), so the first prompt longer than a block raises IndexError in
``mamba_mixer2.py`` and kills the engine. With no checkpoint blocks the scheduler stops each prefill at the
Mamba block boundaries itself (align mode), which the CPU runs.
"""

import os
from dataclasses import replace


def register():
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.kv_cache_interface import MambaSpec

    if getattr(MambaMixer2, "_granite_nockpt", False):
        return
    original = MambaMixer2.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if isinstance(spec, MambaSpec):
            spec = replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
        return spec

    MambaMixer2.get_kv_cache_spec = get_kv_cache_spec
    MambaMixer2._granite_nockpt = True
    print(f"granite_nockpt: Mamba-2 prefill checkpoints off (pid {os.getpid()})", flush=True)
