"""Serve prompts through vLLM 0.33's real ``Scheduler``, built the way ``EngineCore`` builds it, in a process
of its own; ``tests/adapter/test_scheduler_plugin.py`` runs it once per plugin mode and compares.

    python -m tests.adapter.scheduler_run OUT.json MODELS_DIR [--load-plugins] [--vllm-version V]

What is vLLM's own code here: ``ModelConfig`` / ``SpeculativeConfig`` / ``VllmConfig`` built from local
``config.json`` files (no weights, no network), the KV-cache planner (``get_global_kv_cache_groups``,
``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config``) and the block-size resolution as
``EngineCore._initialize_kv_caches`` runs them, the ``Scheduler`` itself, the request block hasher
``EngineCore`` makes, and vLLM's plugin loader (``--load-plugins``: ``vllm.plugins.load_general_plugins()``,
what ``EngineCore.__init__`` calls first; without it kvhit is never imported).

What stands in for the GPU worker: the per-layer KV-cache specs a model's layers would report
(``Attention.get_kv_cache_spec`` / ``MambaBase.get_kv_cache_spec``; building the layers needs the model's
kernels), the KV-cache memory layout they support (it places bytes, not prefixes), a fixed memory budget
instead of profiling, and the model runner's outputs: every step that completes a request's known tokens
samples ``SAMPLED_TOKEN_ID``, the drafter then proposes ``k`` tokens ``DRAFT_TOKEN_ID`` and the next step
rejects them all (as vLLM's scheduler tests feed ``ModelRunnerOutput`` and ``DraftTokenIds``). The platform
is vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``); the core install has no kernels, none is called.

A scenario serves its prompt lengths in order, one request at a time; equal lengths are the same prompt, so
the second is the first repeat.

Writes one JSON document: per scenario the KV-cache groups the planner made, the sizes the scheduler
resolved, each served request's ``num_cached_tokens`` (``EngineCoreOutput.prefill_stats``, what the API
reports as ``cached_tokens``) with the hash boundaries the block pool held for its prompt just before it
was added, a trace of every ``SchedulerOutput`` and ``EngineCoreOutput``, and with ``KVHIT_STATUS_FILE`` set
the status file kvhit wrote when the scenario's scheduler was built (``kvhit_status``); kvhit's counters
in the process (``kvhit_counters``); and the modules of kvhit and z3 the process imported (``modules``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import sys
import types
from collections.abc import Callable

# Token ids the stand-in model runner produces; prompts avoid them (see ``_prompt``).
SAMPLED_TOKEN_ID = 0
DRAFT_TOKEN_ID = 1
DECODE_STEPS = 3

# A tiny Llama target and an EAGLE-1 draft head (tests/e2e/make_models.py writes the same shapes with weights).
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
    "num_hidden_layers": 2, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
# A tiny Nemotron-H: Mamba-2 and attention layers, with two MTP modules (one attention layer each).
_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 512,
    "hidden_size": 128, "hybrid_override_pattern": "M*MM", "mtp_hybrid_override_pattern": "*-",
    "num_nextn_predict_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1,
    "conv_kernel": 4, "expand": 1, "max_position_embeddings": 16384, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
# One KV head (and 8 query heads): vLLM accepts decode context parallelism for GQA/MQA only when the
# tensor-parallel size exceeds the KV heads, and needs the query heads divisible by it (up to 8).
_MQA = {"num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 256}
_LLAMA_MQA = {**_LLAMA, **_MQA}
MODELS = {
    "llama": _LLAMA,
    "llama_eagle_draft": {**_LLAMA, "num_hidden_layers": 1},
    # For prompts past 16384 tokens (the DeepSeek-V4 report layout aligns hits to 16384)
    "llama_long": {**_LLAMA, "max_position_embeddings": 65536},
    "llama_long_eagle_draft": {**_LLAMA, "num_hidden_layers": 1, "max_position_embeddings": 65536},
    "llama_mqa": _LLAMA_MQA,
    "llama_mqa_eagle_draft": {**_LLAMA_MQA, "num_hidden_layers": 1},
    "nemotron_h_mtp": _NEMOTRON_H,
    "nemotron_h_mtp_mqa": {**_NEMOTRON_H, **_MQA},
    # With mixture-of-experts layers (no KV cache of their own): vLLM accepts auxiliary outputs (routed
    # experts) only for MoE models. A Mixtral of the tiny Llama's attention shapes, and a Nemotron-H.
    "mixtral": {**_LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "nemotron_h_moe_mtp": {**_NEMOTRON_H, "hybrid_override_pattern": "M*MME", "n_routed_experts": 4,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                           "moe_shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1},
}


def lookahead_hashes() -> bool:
    """Whether the installed vLLM has lookahead block hashes, the spec marker ``is_draft`` and the planner
    module ``kv_cache_planning`` (0.33; 0.32 has none of them: docs/notes/vllm-0.32-policy.md, D1 and D4)."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.core.kv_cache_planning") is not None


def _attention_layers(block_size: int, n_target: int, n_draft: int, num_kv_heads: int, head_size: int) -> dict:
    import torch

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def spec(is_draft):
        draft = {"is_draft": is_draft} if lookahead_hashes() else {}  # 0.32: the planner finds the draft
        return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                 dtype=torch.float32, **draft)

    layers = {f"model.layers.{i}.self_attn.attn": spec(False) for i in range(n_target)}
    layers.update({f"draft.layers.{i}.self_attn.attn": spec(True) for i in range(n_draft)})
    return layers


def llama_layers(vllm_config) -> dict:
    """The Llama target (2 layers) alone, full attention at ``cache_config.block_size``."""
    c = MODELS["llama"]
    return _attention_layers(vllm_config.cache_config.block_size, c["num_hidden_layers"], 0,
                             c["num_key_value_heads"], c["head_dim"])


def llama_eagle_layers(vllm_config) -> dict:
    """Llama target (2 layers) + EAGLE-1 draft (1 layer), full attention at ``cache_config.block_size``."""
    c = MODELS["llama"]
    return _attention_layers(vllm_config.cache_config.block_size, c["num_hidden_layers"], 1,
                             c["num_key_value_heads"], c["head_dim"])


def llama_swa_eagle_layers(vllm_config, drafts: int = 1) -> dict:
    """A Gemma-like target: layer 0 full attention, layer 1 a 64-token sliding window; EAGLE-1 draft (1
    full-attention layer; none when ``drafts`` is 0)."""
    import torch

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    c = MODELS["llama"]
    block = vllm_config.cache_config.block_size
    layers = _attention_layers(block, 1, drafts, c["num_key_value_heads"], c["head_dim"])
    layers["model.layers.1.self_attn.attn"] = SlidingWindowSpec(
        block_size=block, num_kv_heads=c["num_key_value_heads"], head_size=c["head_dim"], dtype=torch.float32,
        sliding_window=64)
    return layers


def llama_mqa_eagle_layers(vllm_config) -> dict:
    """The one-KV-head Llama (2 layers) + EAGLE-1 draft (1 layer). Under decode context parallelism every
    layer's cache is sharded (``dcp_sharded``), the draft's too, as vLLM's worker reports an EAGLE drafter's."""
    c = MODELS["llama_mqa"]
    return _attention_layers(vllm_config.cache_config.block_size, c["num_hidden_layers"], 1,
                             c["num_key_value_heads"], c["head_dim"])


def llama_mqa_replicated_draft_layers(vllm_config) -> dict:
    """As :func:`llama_mqa_eagle_layers`, with the draft's cache replicated across the DCP ranks
    (``dcp_sharded=False``: what vLLM's GPU model runner reports for a draft kept at DCP 1): the catalogue's
    ``llama_eagle`` layout, a sharded target group and a replicated EAGLE group."""
    import dataclasses

    return {name: dataclasses.replace(spec, dcp_sharded=False) if name.startswith("draft.") else spec
            for name, spec in llama_mqa_eagle_layers(vllm_config).items()}


def nemotron_h_mtp_layers(vllm_config, model: str = "nemotron_h_mtp", drafts: int | None = None) -> dict:
    """Nemotron-H (3 Mamba-2 layers, 1 attention layer) + its MTP modules (1 attention layer each), at one
    block size for both kinds (``mamba_cache_mode="align"``) and one page size (the Mamba page padded to the
    attention page, as ``HybridAttentionMambaModelConfig`` arranges). Under decode context parallelism the
    attention caches are sharded and the Mamba states are not (``dcp_sharded`` as vLLM's specs default)."""
    import torch

    from vllm.v1.kv_cache_interface import MambaSpec

    c = MODELS[model]
    block = vllm_config.cache_config.block_size
    drafts = c["num_nextn_predict_layers"] if drafts is None else drafts
    layers = _attention_layers(block, c["hybrid_override_pattern"].count("*"), drafts,
                               c["num_key_value_heads"], c["head_dim"])
    page = next(iter(layers.values())).page_size_bytes
    inner = c["mamba_num_heads"] * c["mamba_head_dim"]
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    for i in range(c["hybrid_override_pattern"].count("M")):
        layers[f"model.layers.mamba{i}.mixer"] = MambaSpec(
            block, ((conv_dim, c["conv_kernel"] - 1), (c["mamba_num_heads"], c["mamba_head_dim"],
                                                      c["ssm_state_size"])),
            (torch.float32, torch.float32), page_size_padded=page, mamba_cache_mode="align",
            num_speculative_blocks=vllm_config.num_speculative_tokens)
    if not lookahead_hashes():
        # vLLM 0.32's planner flags the group of the last registered layer as the MTP group (D4); a real
        # model registers its MTP layers after its own, as 0.33's is_draft marks them.
        layers = {**{n: s for n, s in layers.items() if not n.startswith("draft.")},
                  **{n: s for n, s in layers.items() if n.startswith("draft.")}}
    return layers


def nemotron_h_mtp_swa_layers(vllm_config) -> dict:
    """:func:`nemotron_h_mtp_layers` and one sliding-window layer of a tenth of the block (window 512), with
    ten times the KV heads so that its page is the attention page: the catalogue's ``three_kind`` (full
    attention 1600, Mamba 1600, sliding window 160), read at the window's block, 160 tokens."""
    import torch

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    c = MODELS["nemotron_h_mtp"]
    layers = nemotron_h_mtp_layers(vllm_config)
    block = vllm_config.cache_config.block_size
    layers["model.layers.swa0.self_attn.attn"] = SlidingWindowSpec(
        block_size=block // 10, num_kv_heads=10 * c["num_key_value_heads"], head_size=c["head_dim"],
        dtype=torch.float32, sliding_window=512)
    return layers


# name -> (target, speculative config (draft paths relative to the models folder; None for none), layer specs,
#          block size, prompts served in order: a length (one prompt per length: equal lengths repeat it), or
#          ``(length, shared, variant)``, a prompt whose first ``shared`` tokens are the scenario's system prompt;
#          two with the same ``shared`` and ``variant`` share the shorter one's tokens)
SCENARIOS = {
    "eagle-drop": ("llama", {"method": "eagle", "model": "llama_eagle_draft", "num_speculative_tokens": 1,
                             "disable_lookahead_block_hashes": True}, llama_eagle_layers, 16, (1024, 1024, 1024)),
    "eagle-lookahead": ("llama", {"method": "eagle", "model": "llama_eagle_draft", "num_speculative_tokens": 1},
                        llama_eagle_layers, 16, (1024, 1024, 1024)),
    "mtp2-drop": ("nemotron_h_mtp", {"method": "mtp", "num_speculative_tokens": 2,
                                     "disable_lookahead_block_hashes": True},
                  nemotron_h_mtp_layers, 1600, (8000, 8000, 8000, 11910, 11910)),
    "mtp2-lookahead": ("nemotron_h_mtp", {"method": "mtp", "num_speculative_tokens": 2},
                       nemotron_h_mtp_layers, 1600, (8000, 8000, 8000, 11910, 11910)),
    "swa-eagle-drop": ("llama", {"method": "eagle", "model": "llama_eagle_draft", "num_speculative_tokens": 1,
                                 "disable_lookahead_block_hashes": True},
                       llama_swa_eagle_layers, 16, (1000, 1000, 1000)),
}
# Decode context parallelism 2, 4 and 8 (reusing the tensor-parallel ranks): scenario -> (DCP, layer specs)
_DCP = {f"{label}-drop-dcp{dcp}": (dcp, layers) for dcp in (2, 4, 8) for label, layers in (
    ("eagle", llama_mqa_eagle_layers), ("eagle-replicated", llama_mqa_replicated_draft_layers))}
SCENARIOS.update({name: ("llama_mqa", {"method": "eagle", "model": "llama_mqa_eagle_draft",
                                       "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True},
                         layers, 16, (1024, 1024, 1024)) for name, (_, layers) in _DCP.items()})
_MTP_DCP = {f"mtp2-{mode}-dcp{dcp}": (dcp, mode) for dcp in (2, 4, 8) for mode in ("drop", "lookahead")}
SCENARIOS.update({name: ("nemotron_h_mtp_mqa",
                         {"method": "mtp", "num_speculative_tokens": 2, **(
                             {"disable_lookahead_block_hashes": True} if mode == "drop" else {})},
                         lambda vllm_config: nemotron_h_mtp_layers(vllm_config, "nemotron_h_mtp_mqa"), 1600,
                         (8000, 8000, 8000, 11910, 11910)) for name, (_, mode) in _MTP_DCP.items()})
PARALLEL = {name: {"tensor_parallel_size": dcp, "decode_context_parallel_size": dcp}
            for name, (dcp, _) in (_DCP | _MTP_DCP).items()}
# A shared system prompt: four prompts of one length share their first tokens and then diverge (the
# commonest chat workload), then the first is sent again. Under vLLM's default retention 0 and dense, on a
# Mamba hybrid and a sliding-window one, with and without speculation.
_MAMBA_SYSTEM = tuple((8000, 4800, i) for i in range(4)) + ((8000, 4800, 0),)
_SWA_SYSTEM = tuple((1000, 480, i) for i in range(4)) + ((1000, 480, 0),)
_SHARED = {
    "shared-mamba": (None, lambda c: nemotron_h_mtp_layers(c, drafts=0), _MAMBA_SYSTEM),
    "shared-mtp2-drop": ({"method": "mtp", "num_speculative_tokens": 2, "disable_lookahead_block_hashes": True},
                         nemotron_h_mtp_layers, _MAMBA_SYSTEM),
    "shared-mtp2-lookahead": ({"method": "mtp", "num_speculative_tokens": 2}, nemotron_h_mtp_layers,
                              _MAMBA_SYSTEM),
    "shared-swa": (None, lambda c: llama_swa_eagle_layers(c, drafts=0), _SWA_SYSTEM),
    "shared-swa-eagle-drop": ({"method": "eagle", "model": "llama_eagle_draft", "num_speculative_tokens": 1,
                               "disable_lookahead_block_hashes": True}, llama_swa_eagle_layers, _SWA_SYSTEM),
}
RETENTION: dict = {}  # scenario -> prefix_cache_retention_interval (vLLM's default 0 when absent)
for _name, (_spec, _layers, _prompts) in _SHARED.items():
    _target = "nemotron_h_mtp" if "swa" not in _name else "llama"
    for _retention, _suffix in ((0, "r0"), (None, "dense")):
        SCENARIOS[f"{_name}-{_suffix}"] = (_target, _spec, _layers, 1600 if _target != "llama" else 16,
                                           _prompts)
        RETENTION[f"{_name}-{_suffix}"] = _retention
# Streams of prompts sharing prefixes on the Nemotron-H with one KV head under DCP 2 (full attention 3200 across
# the ranks, Mamba 1600), retention 0: where the reference's own junction and resume points alone kept less
# than stock vLLM (spec.policy FINE_JUNCTION_ONLY, WITHOUT_VLLM_CHECKPOINT; the prover's counterexamples).
# Without a drafter: a prompt, its first 6400 tokens (vLLM's junction lands at 3200, a full-attention block
# below the reference's 4800), then a prompt sharing 3200. With two MTP modules, lookahead: a prompt of 6401, a
# longer one sharing it, then one sharing 9601 with that one (vLLM keeps its prompt checkpoint, 4800, above the
# reference's resume point, 3200).
_DCP_STREAMS = {
    "stream-dcp2-r0": (None, lambda c: nemotron_h_mtp_layers(c, "nemotron_h_mtp_mqa", drafts=0),
                       ((16002, 16002, 0), (6400, 6400, 0), (9599, 3200, 1))),
    "stream-mtp2-lookahead-dcp2-r0": ({"method": "mtp", "num_speculative_tokens": 2},
                                      lambda c: nemotron_h_mtp_layers(c, "nemotron_h_mtp_mqa"),
                                      ((6401, 6401, 0), (11201, 6401, 1), (9601, 6401, 1))),
}
for _name, (_spec, _layers, _prompts) in _DCP_STREAMS.items():
    SCENARIOS[_name] = ("nemotron_h_mtp_mqa", _spec, _layers, 1600, _prompts)
    PARALLEL[_name] = {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}
# Mamba read at hash granularity (its states inside a block are partial tails), by prefix_match_unit 160 (the
# catalogue's qwen3next_pmu160) or by a sliding window of block 160 (three_kind), with the MTP layers in the
# full-attention group: with one MTP module in drop mode enforced (tests/adapter/test_fine_mamba.py), with two
# left wholly to vLLM (tests/adapter/test_whole_layout_stock.py). A prompt, its resend twice, a longer sibling
# (the prompt and 1090 tokens more), two prompts sharing its first 6000 tokens, and the prompt once more.
_FINE_MAMBA_STREAM = ((11910, 11910, 0),) * 3 + ((13000, 11910, 1), (11910, 6000, 2), (11910, 6000, 3),
                                                  (11910, 11910, 0))
_MTP2_DROP = {"method": "mtp", "num_speculative_tokens": 2, "disable_lookahead_block_hashes": True}
SCENARIOS["pmu160-mtp2-drop"] = ("nemotron_h_mtp", _MTP2_DROP, nemotron_h_mtp_layers, 1600, _FINE_MAMBA_STREAM)
SCENARIOS["three-kind-mtp2-drop"] = ("nemotron_h_mtp", _MTP2_DROP, nemotron_h_mtp_swa_layers, 1600,
                                     _FINE_MAMBA_STREAM)
_MTP1_DROP = {"method": "mtp", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
SCENARIOS["pmu160-mtp1-drop"] = ("nemotron_h_mtp", _MTP1_DROP, nemotron_h_mtp_layers, 1600, _FINE_MAMBA_STREAM)
SCENARIOS["three-kind-mtp1-drop"] = ("nemotron_h_mtp", _MTP1_DROP, nemotron_h_mtp_swa_layers, 1600,
                                     _FINE_MAMBA_STREAM)
# scenario -> CacheConfig.prefix_match_unit (None when absent)
PREFIX_MATCH_UNIT = {"pmu160-mtp2-drop": 160, "pmu160-mtp1-drop": 160}
# A block-aligned prompt and a longer sibling on full attention + a sliding window, no drafter, retention 0:
# stock vLLM's sibling loses a block (W2), enforce's does not; with a connector beside the sliding window the
# layout is vLLM's.
SCENARIOS["swa-sibling"] = ("llama", None, lambda c: llama_swa_eagle_layers(c, drafts=0), 16,
                            ((1024, 1024, 0), (1120, 1024, 1), (1024, 1024, 0), (1104, 1024, 2)))
# KV connectors (tests/adapter/test_connectors.py): scenario -> (vLLM's connector as kv_transfer_config names
# it, its kv_connector_module_path or None, whether its storage holds the scenario's first prompt, the
# scenario whose model and prompts it serves). No worker
# runs here, so a connector loads only what its scheduler side says it holds: ExampleConnector whatever
# prefix its shared folder has a subfolder for (vLLM's own naming), DecodeBenchConnector everything (it fills
# dummy values), SimpleCPUOffloadConnector nothing (no worker ever copies a block to its CPU pool).
CONNECTORS = {
    "connector-example-eagle-drop": ("ExampleConnector", None, False, "eagle-drop"),
    "connector-example-loads-eagle-drop": ("ExampleConnector", None, True, "eagle-drop"),
    "connector-bench-eagle-drop": ("DecodeBenchConnector", None, False, "eagle-drop"),
    "connector-cpu-eagle-drop": ("SimpleCPUOffloadConnector", None, False, "eagle-drop"),
    # a connector kvhit has not checked: vLLM's ExampleConnector, loaded by module path
    "connector-module-eagle-drop": ("ExampleConnector", "vllm.distributed.kv_transfer.kv_connector.v1."
                                    "example_connector", False, "eagle-drop"),
    "connector-cpu-swa-sibling": ("SimpleCPUOffloadConnector", None, False, "swa-sibling"),
    # the one connector whose worker runs on these machines beside a sliding-window or Mamba group
    # (docs/adapter.md, "KV connectors"): every request starts at N - 1 whatever its local hit
    "connector-bench-swa-sibling": ("DecodeBenchConnector", None, False, "swa-sibling"),
    "connector-bench-shared-mamba-r0": ("DecodeBenchConnector", None, False, "shared-mamba-r0"),
}
SCENARIOS.update({name: SCENARIOS[base] for name, (*_, base) in CONNECTORS.items()})
# Auxiliary outputs (routed experts; vLLM 0.33 accepts them for MoE models on model runner V2, which the CPU
# platform has): their connector caps each lookup at the leading blocks of the full-attention group it
# holds rows for. Enforced on the MTP layout (full attention read at its block: the cap never binds below
# the reference hit) and at hash granularity with one MTP module (prefix_match_unit 160: a hit inside a block
# passes the cap's whole blocks); with two, left wholly to vLLM (refimpl.CAPPED_FINE_MAMBA_MTP_DROP). The
# stand-in model runner returns a routed-experts row per token.
SCENARIOS["aux-eagle-drop"] = ("mixtral",) + SCENARIOS["eagle-drop"][1:]
_MOE_MTP_LAYERS = functools.partial(nemotron_h_mtp_layers, model="nemotron_h_moe_mtp")
SCENARIOS["aux-mtp2-drop"] = ("nemotron_h_moe_mtp", _MTP2_DROP, _MOE_MTP_LAYERS, 1600,
                              (8000, 8000, 8000, 11910, 11910) + _MAMBA_SYSTEM)
SCENARIOS["aux-pmu160-mtp1-drop"] = ("nemotron_h_moe_mtp", _MTP1_DROP, _MOE_MTP_LAYERS, 1600, _FINE_MAMBA_STREAM)
SCENARIOS["aux-pmu160-mtp2-drop"] = ("nemotron_h_moe_mtp", _MTP2_DROP, _MOE_MTP_LAYERS, 1600, _FINE_MAMBA_STREAM)
PREFIX_MATCH_UNIT.update({"aux-pmu160-mtp1-drop": 160, "aux-pmu160-mtp2-drop": 160})


def _extra_config(name: str, models_dir: str) -> dict:
    """The scenario's ``VllmConfig`` arguments besides the model, cache, parallel, scheduler and speculative
    configs."""
    if name.startswith("aux-"):
        from vllm.config import AuxOutputConfig

        return {"aux_output_config": AuxOutputConfig(enable_return_routed_experts=True)}
    if name in CONNECTORS:
        return {"kv_transfer_config": _connector_config(name, models_dir)}
    return {}


def _connector_config(name: str, models_dir: str):
    """The scenario's ``KVTransferConfig``; for ExampleConnector a shared folder of the scenario's own, which
    holds the scenario's first prompt (the folder vLLM's connector names for its aligned prefix) if
    ``CONNECTORS`` says so."""
    from vllm.config import KVTransferConfig

    connector, module, holds_first, _ = CONNECTORS[name]
    storage = os.path.join(models_dir, f"kv_connector_storage-{name}")
    os.makedirs(storage, exist_ok=True)
    if holds_first:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
            align_to_block_size,
        )

        tokens = _prompt(name, SCENARIOS[name][4][0])
        held = align_to_block_size(len(tokens) - 1, SCENARIOS[name][3])
        ExampleConnector._generate_foldername_debug(types.SimpleNamespace(_storage_path=storage),
                                                    torch.tensor(tokens[:held]), [], create_folder=True)
    return KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_module_path=module,
                            kv_connector_extra_config={"shared_storage_path": storage})


MAX_MODEL_LEN = 16384
MAX_NUM_BATCHED_TOKENS = 8192


def write_models(models_dir: str) -> None:
    """One folder with a ``config.json`` per model in ``MODELS``."""
    for name, config in MODELS.items():
        os.makedirs(os.path.join(models_dir, name), exist_ok=True)
        with open(os.path.join(models_dir, name, "config.json"), "w") as f:
            json.dump(config, f, indent=1)


def build_scheduler(name: str, models_dir: str, prefix_match_unit: int | None = None):
    """The ``Scheduler`` of scenario ``name`` and the block hasher ``EngineCore`` gives its requests
    (``prefix_match_unit``: vLLM's ``CacheConfig.prefix_match_unit``, finer prefix-cache keys)."""
    target, speculative, layers_of, block_size, _ = SCENARIOS[name]
    setup = SchedulerSetup(
        target=target, speculative=speculative, layers_of=layers_of, block_size=block_size,
        parallel=PARALLEL.get(name, {}), retention=RETENTION.get(name, 0),
        prefix_match_unit=PREFIX_MATCH_UNIT.get(name, prefix_match_unit),
        extra=lambda: _extra_config(name, models_dir))
    if not name.startswith("aux-"):
        return build_scheduler_for(setup, models_dir)
    # vLLM accepts auxiliary outputs on model runner V2 only (VllmConfig checks it; the scheduler reads it
    # when built); the other scenarios of the process keep V1.
    saved = os.environ.get(_V2_RUNNER)
    os.environ[_V2_RUNNER] = "1"
    try:
        return build_scheduler_for(setup, models_dir)
    finally:
        if saved is None:
            del os.environ[_V2_RUNNER]
        else:
            os.environ[_V2_RUNNER] = saved


_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


@dataclasses.dataclass(frozen=True)
class SchedulerSetup:
    """What a scheduler is built from (see :func:`build_scheduler_for`).

    Attributes:
        target: The target model's folder in ``MODELS``.
        speculative: ``SpeculativeConfig`` arguments (draft paths relative to the models folder), or None.
        layers_of: ``vllm_config -> {layer name: KVCacheSpec}``, the stand-in for the workers' layer specs.
        block_size: ``CacheConfig.block_size``.
        parallel: ``ParallelConfig`` arguments.
        retention: ``CacheConfig.prefix_cache_retention_interval``.
        prefix_match_unit: ``CacheConfig.prefix_match_unit``.
        max_num_batched_tokens: The scheduler's token budget per step.
        max_model_len: ``ModelConfig.max_model_len``.
        num_gpu_blocks: ``CacheConfig.num_gpu_blocks_override`` (None: room for four requests of
            ``max_model_len``).
        max_num_seqs: ``SchedulerConfig.max_num_seqs``.
        extra: ``() -> dict`` of further ``VllmConfig`` arguments.
        async_scheduling: ``SchedulerConfig.async_scheduling``: ``EngineCore`` then builds an
            ``AsyncScheduler`` and schedules a step before the previous step's output is in
            (:func:`tests.adapter.serving.serve_stream` steps it so).
    """

    target: str
    speculative: dict | None
    layers_of: Callable
    block_size: int
    parallel: dict = dataclasses.field(default_factory=dict)
    retention: int | None = 0
    prefix_match_unit: int | None = None
    max_num_batched_tokens: int = 0  # 0: MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 0  # 0: MAX_MODEL_LEN
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 4
    extra: Callable = dict
    async_scheduling: bool = False


def build_scheduler_for(setup: SchedulerSetup, models_dir: str):
    """The ``Scheduler`` ``setup`` describes and the block hasher ``EngineCore`` gives its requests."""
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = setup.block_size
    max_model_len = setup.max_model_len or MAX_MODEL_LEN
    model_config = ModelConfig(model=os.path.join(models_dir, setup.target), skip_tokenizer_init=True,
                               dtype="float32", max_model_len=max_model_len, seed=0)
    parallel_config = ParallelConfig(**setup.parallel)
    speculative = setup.speculative
    if speculative is not None:
        speculative = dict(speculative)
        if not lookahead_hashes():  # vLLM 0.32: no lookahead hashes to disable, every drafter drops
            speculative.pop("disable_lookahead_block_hashes", None)
        if "model" in speculative:
            speculative["model"] = os.path.join(models_dir, speculative["model"])
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                 prefix_match_unit=setup.prefix_match_unit,
                                 prefix_cache_retention_interval=setup.retention,
                                 mamba_cache_mode="align" if model_config.is_hybrid else "none",
                                 num_gpu_blocks_override=setup.num_gpu_blocks),
        parallel_config=parallel_config,
        scheduler_config=SchedulerConfig(max_num_seqs=setup.max_num_seqs,
                                         max_num_batched_tokens=setup.max_num_batched_tokens
                                         or MAX_NUM_BATCHED_TOKENS,
                                         max_model_len=max_model_len, is_encoder_decoder=False,
                                         async_scheduling=setup.async_scheduling),
        speculative_config=None if speculative is None else SpeculativeConfig(
            target_model_config=model_config, target_parallel_config=parallel_config, **speculative),
        **setup.extra(),
    )

    # EngineCore._initialize_kv_caches, with the layers' specs, the layout list and a memory budget in place of
    # what the workers report (the layout places bytes in memory; it plays no part in prefix caching).
    layers = setup.layers_of(vllm_config)
    resolve_kv_cache_layout(vllm_config, [["LBNHC"]], list(layers.values()))
    page = sum(spec.page_size_bytes for spec in layers.values())
    memory = [page * (4 * max_model_len // block_size + 8)]
    if lookahead_hashes():
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        kv_cache_configs = get_kv_cache_configs(vllm_config, [layers], memory,
                                                get_global_kv_cache_groups(vllm_config, [layers]))
    else:  # vLLM 0.32: the groups are planned inside get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        kv_cache_configs = get_kv_cache_configs(vllm_config, [layers], memory)
    kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if g.kv_cache_spec.prefix_cacheable)
    vllm_config.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size)

    scheduler_cls = Scheduler
    if setup.async_scheduling:  # as EngineCore picks it on a GPU (vLLM's CPU platform turns it off)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as scheduler_cls

        vllm_config.scheduler_config.async_scheduling = True
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), log_stats=True,
                          block_size=block_size, hash_block_size=hash_block_size)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    lookahead = (vllm_config.num_hash_lookahead_tokens,) if lookahead_hashes() else ()
    block_hasher = get_request_block_hasher(hash_block_size, hash_fn, *lookahead)
    return scheduler, block_hasher


def _prompt(name: str, entry) -> list[int]:
    """The tokens of a scenario's prompt entry (see ``SCENARIOS``)."""
    if isinstance(entry, int):
        rng = random.Random(f"{name}/{entry}")
        return [rng.randrange(3, 512) for _ in range(entry)]
    n, shared, variant = entry
    system = random.Random(f"{name}/system")
    rng = random.Random(f"{name}/{shared}/{variant}")  # one variant of one shared length: prefixes of each other
    return [system.randrange(3, 512) for _ in range(shared)] + [rng.randrange(3, 512) for _ in range(n - shared)]


def _retained(scheduler, request) -> list[list[int]]:
    """Per KV-cache group, the boundaries ``(j + 1) * h`` whose block hash the pool holds for that group
    (what a lookup of ``request`` can find; the conformance harness's ``VllmHarness.retained``)."""
    pool = scheduler.kv_cache_manager.block_pool
    h = scheduler.hash_block_size
    return [[(j + 1) * h for j, block_hash in enumerate(request.block_hashes)
             if pool.get_cached_block(block_hash, [g]) is not None]
            for g in range(len(scheduler.kv_cache_config.kv_cache_groups))]


def _step_record(scheduler_output, engine_outputs) -> dict:
    """What one step scheduled and reported, in plain data (block ids included)."""
    new = [{"req_id": r.req_id, "block_ids": [list(g) for g in r.block_ids],
            "num_computed_tokens": r.num_computed_tokens} for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    outputs = []
    for engine_core_outputs in engine_outputs.values():
        for o in engine_core_outputs.outputs:
            stats = o.prefill_stats
            outputs.append({"req_id": o.request_id, "new_token_ids": list(o.new_token_ids),
                            "finish_reason": None if o.finish_reason is None else str(o.finish_reason),
                            "prefill_stats": None if stats is None else vars(stats)})
    return {
        "num_scheduled_tokens": dict(scheduler_output.num_scheduled_tokens),
        "scheduled_spec_decode_tokens": {k: list(v) for k, v in
                                         scheduler_output.scheduled_spec_decode_tokens.items()},
        "new_reqs": new,
        "cached_reqs": {"req_ids": list(cached.req_ids),
                        "new_block_ids": [None if b is None else [list(g) for g in b] for b in cached.new_block_ids],
                        "num_computed_tokens": list(cached.num_computed_tokens)},
        "outputs": outputs,
    }


def new_request(request_id: str, tokens: list[int], block_hasher, max_tokens: int = DECODE_STEPS):
    """A request that decodes ``max_tokens`` tokens, hashed as ``EngineCore`` hashes it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   arrival_time=0.0, block_hasher=block_hasher)


def sampling(scheduler, scheduler_output) -> dict[str, bool]:
    """Per request of a step just scheduled, whether its forward samples a token: every request but a
    partial prefill chunk (``Request.is_prefill_chunk``, which the next ``schedule()`` changes)."""
    return {r: not scheduler.requests[r].is_prefill_chunk for r in scheduler_output.num_scheduled_tokens}


def step(scheduler, scheduler_output=None, samples: dict[str, bool] | None = None):
    """One engine step: ``schedule()`` (unless ``scheduler_output`` is its result already), the stand-in
    model runner's output, the drafter's proposals. Returns ``(scheduler_output, engine_outputs)``.

    Under async scheduling (an ``AsyncScheduler``, ``samples`` read by :func:`sampling` when the step was
    scheduled, a later step scheduled since): the output only, as ``EngineCore.step_with_batch_queue``
    hands it over; the worker proposes drafts itself, and the scheduler schedules placeholders for them."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    if scheduler_output is None:
        scheduler_output = scheduler.schedule()
    if samples is None:
        samples = sampling(scheduler, scheduler_output)
    req_ids = list(scheduler_output.num_scheduled_tokens)
    # A partial prefill chunk samples nothing; otherwise one token, every draft rejected.
    sampled = [[SAMPLED_TOKEN_ID] if samples[r] else [] for r in req_ids]
    engine_outputs = scheduler.update_from_output(scheduler_output, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
        **_aux_outputs(scheduler, req_ids)))
    k = scheduler.num_spec_tokens
    if k and not scheduler.scheduler_config.async_scheduling:
        drafting = [r for r in req_ids if r in scheduler.requests]
        scheduler.update_draft_token_ids(DraftTokenIds(drafting, [[DRAFT_TOKEN_ID] * k for _ in drafting]))
    return scheduler_output, engine_outputs


def _aux_outputs(scheduler, req_ids) -> dict:
    """The stand-in worker's auxiliary outputs for a step, with a scheduler that has them: every scheduled
    request's routed-experts rows from its first token (one row a token, as many as any request has)."""
    if getattr(scheduler, "aux_output_connector", None) is None:
        return {}
    import numpy as np
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    rows = np.zeros((scheduler.vllm_config.model_config.max_model_len + 64, 1), dtype=np.int16)
    return {"aux_output_connector_output": {r: AuxRequestOutput(token_start=0, rows=rows) for r in req_ids}}


def serve(scheduler, block_hasher, request_id: str, tokens: list[int], trace: list) -> dict:
    """Add one request and step the scheduler until it finishes; returns its ``num_cached_tokens`` and the
    pool's boundaries for its prompt at admission."""
    request = new_request(request_id, tokens, block_hasher)
    retained = _retained(scheduler, request)
    aux = getattr(scheduler, "aux_output_connector", None)
    # The cap auxiliary outputs put on its lookup (vLLM's own max_cache_hit, which the scheduler calls again
    # at admission: it only refreshes its store's LRU order, the same in every run)
    aux_cap = None if aux is None else aux.max_cache_hit(request)
    scheduler.add_request(request)
    stats = None
    while scheduler.has_unfinished_requests():
        record = _step_record(*step(scheduler))
        trace.append(record)
        for o in record["outputs"]:
            if o["req_id"] == request_id and o["prefill_stats"] is not None:
                stats = o["prefill_stats"]
    assert stats is not None, f"{request_id}: no EngineCoreOutput carried prefill_stats"
    return {"prompt_len": len(tokens), "num_cached_tokens": stats["num_cached_tokens"],
            # of which from the local prefix cache, and loaded by a KV connector
            "num_local_cached_tokens": stats["num_local_cached_tokens"],
            "num_external_cached_tokens": stats["num_external_cached_tokens"], "retained": retained,
            "shared_prefix_boundary": request.shared_prefix_boundary,
            **({} if aux is None else {"aux_cap": aux_cap})}


def run_scenario(name: str, models_dir: str) -> dict:
    status_file = os.environ.get("KVHIT_STATUS_FILE")
    if status_file and os.path.exists(status_file):
        os.remove(status_file)  # so that the one read below is this scenario's
    scheduler, block_hasher = build_scheduler(name, models_dir)
    status = None
    if status_file and os.path.exists(status_file):
        with open(status_file) as f:
            status = json.load(f)
    spec = scheduler.vllm_config.speculative_config
    trace: list = []
    served = []
    for i, entry in enumerate(SCENARIOS[name][4]):
        served.append(serve(scheduler, block_hasher, f"{name}-{i}", _prompt(name, entry), trace))
        served[-1]["prompt"] = entry
    return {
        "kv_cache_groups": [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
                             "dcp_sharded": g.kv_cache_spec.dcp_sharded, "is_eagle_group": g.is_eagle_group,
                             "num_layers": len(g.layer_names)}
                            for g in scheduler.kv_cache_config.kv_cache_groups],
        "scheduler": {"block_size": scheduler.block_size, "hash_block_size": scheduler.hash_block_size,
                      "coordinator": type(scheduler.kv_cache_manager.coordinator).__name__,
                      "use_eagle_block_drop": scheduler.use_eagle_block_drop,
                      "num_hash_lookahead_tokens": getattr(scheduler, "num_hash_lookahead_tokens", 0),
                      "num_prefill_lookahead": scheduler.num_prefill_lookahead,
                      "num_spec_tokens": scheduler.num_spec_tokens,
                      "method": spec and spec.method,
                      "multi_module_mtp": bool(spec and spec.use_multi_module_mtp())},
        "served": served,
        "trace": trace,
        **({"kvhit_status": status} if status is not None else {}),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("models_dir")
    parser.add_argument("--load-plugins", action="store_true",
                        help="call vllm.plugins.load_general_plugins() first, as EngineCore does")
    parser.add_argument("--vllm-version", help="pretend vLLM is this version (vllm.__version__)")
    parser.add_argument("--scenario", action="append", help="run only these scenarios")
    args = parser.parse_args(argv)

    # vLLM's CPU platform: the unspecified platform (no device found) turns the hybrid KV-cache manager off,
    # which Mamba layouts need; like the GPU platforms, the CPU platform supports it. Model folders are local.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import vllm
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # as vLLM's entry points do, so INFO lines (kvhit's included) show

    if args.vllm_version:
        vllm.__version__ = args.vllm_version
    if args.load_plugins:
        import vllm.plugins

        vllm.plugins.load_general_plugins()
    if not all(os.path.exists(os.path.join(args.models_dir, m, "config.json")) for m in MODELS):
        write_models(args.models_dir)
    result = {"scenarios": {name: run_scenario(name, args.models_dir) for name in args.scenario or SCENARIOS}}
    result["kvhit_imported"] = "kvhit.adapters.vllm" in sys.modules
    # kvhit's and z3's modules this serving process imported (the adapter may import only kvhit.refimpl)
    result["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("kvhit", "z3"))
    if result["kvhit_imported"]:
        import kvhit.adapters.vllm as kvhit_vllm

        result["kvhit_mode"] = kvhit_vllm.current_mode()
        if result["kvhit_mode"] != "off":
            from prometheus_client import REGISTRY

            result["kvhit_counters"] = {  # kvhit's counters in this process, summed over their labels
                name: sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
                          if sample.name == f"{name}_total")
                for name in ("kvhit_unmodelled_layouts", "vllm:kvhit_lookups", "kvhit_enforce_fallbacks")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
