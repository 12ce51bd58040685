"""Which of vLLM 0.33.0's tests run, and the one list of what is kept out, each with its reason.

Paths are relative to the unpacked folder (``build/vllm-0.33.0-tests``), as pytest names them there.

* :data:`DEFAULT` (``make vllm-tests``): every file of ``tests/v1/core`` that builds a ``KVCacheManager``, a
  ``Scheduler`` or vLLM's single-type managers (the classes kvhit's seams live in), and the two files of
  ``tests/v1/spec_decode`` that build a ``Scheduler``.
* :data:`LONG` (``make vllm-tests-long``): all of ``tests/v1/core`` (adds the planner, the encoder cache,
  metrics and output tests, which never reach a seam) and the same two spec_decode files.
* :data:`EXCLUDED`: what cannot run offline on this machine's CPU (no GPU, no Triton, no hub, no model
  weights, no CPU kernels in ``.venv``). A file is not collected; a test id without ``[parameters]`` is
  deselected with all its parameters. Every reason is a :class:`Why`. Everything else runs in every mode.
"""

from __future__ import annotations

import enum

DEFAULT: tuple[str, ...] = (
    "tests/v1/core/prefix_cache",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
)
"""Files (or folders) of ``make vllm-tests``."""

LONG: tuple[str, ...] = (
    "tests/v1/core",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
)
"""Files (or folders) of ``make vllm-tests-long``."""

SELECTIONS = {"default": DEFAULT, "long": LONG}


class Why(enum.Enum):
    """Why a file or test cannot run offline on a CPU here."""

    SERVES_A_MODEL = ("runs a real engine (LLM, LLMEngine or the OpenAI server) on a model from the hub: "
                      "needs its weights and tokenizer (no hub here) and vLLM's CPU kernels (vllm._C, not "
                      "in .venv)")
    MULTIMODAL_PROCESSOR = ("a multimodal model: the Scheduler sizes its encoder budget with the model's "
                            "multimodal processor, which loads the model's tokenizer and image processor "
                            "from the hub (only config.json is made here); importing the model class also "
                            "needs packages .venv lacks (llava: mistral_common)")
    NEEDS_TRITON = ("async scheduling with pipeline parallelism needs Model Runner V2, which needs Triton: "
                    "without it vLLM picks the V1 model runner and VllmConfig rejects the combination")


_SCHEDULER = "tests/v1/core/test_scheduler.py::"

# test_scheduler.py's tests that build create_scheduler(model="llava-hf/llava-1.5-7b-hf").
_LLAVA_TESTS = (
    "test_schedule_multimodal_requests",
    "test_schedule_partial_requests",
    "test_encoder_only_prompt_longer_than_budget_is_chunked",
    "test_same_step_duplicate_encoder_input_stays_cached",
    "test_no_mm_input_chunking",
    "test_no_mm_input_chunking_for_same_step_duplicate",
    "test_no_mm_input_chunking_at_item_boundary",
    "test_ec_connector_text_only_request",
    "test_ec_connector_cache_hit_external_load",
    "test_ec_connector_cache_miss_computes_locally",
    "test_ec_connector_with_partial_cache_hit_multi_round",
    "test_ec_connector_schedule_multiple_requests",
    "test_ec_connector_unable_to_allocate",
    "test_priority_scheduling_ec_connector_preemption_and_resumption",
    "test_ec_connector_allocate_encoder_tokens_with_external_load",
    "test_ec_connector_update_connector_output_called",
    "test_eagle3_mm_encoder_cache_with_shift",
    "test_free_encoder_inputs_respects_unconfirmed_placeholders",
    "test_free_encoder_inputs_notifies_the_ec_connector",
    "test_unavailable_encoder_input_fails_the_request_as_retryable",
    "test_encoder_cache_accepts_matching_embed_count",
    "test_encoder_cache_rejects_mismatched_embed_count",
    "test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
    "test_encoder_cache_rejects_mismatched_embed_count_within_request",
    "test_free_encoder_inputs_unchanged_without_spec_decode",
    "test_waiting_encoder_stall_does_not_starve_later_requests",
    "test_waiting_encoder_stall_is_counted_as_deferred",
    "test_waiting_encoder_stall_kv_holder_keeps_drain_priority",
    "test_encoder_cache_retained_across_preemption_and_resume",
    "test_encoder_cache_recomputed_when_evicted_during_preemption",
    "test_ec_connector_ensure_cache_available_defers_request",
    "test_ec_connector_waits_for_embeddings_in_prefix_replay",
    "test_ec_connector_defers_running_request_for_async_reload",
    "test_cpu_encoder_input_updates_wait_for_completed_prefill",
    "test_cpu_encoder_input_updates_resume_and_abort",
    "test_cpu_encoder_input_updates_restore_after_kv_load_failure",
    "test_cpu_encoder_input_updates_preserve_shm_handles",
)

EXCLUDED: dict[str, Why] = {
    # Qwen/Qwen3.5-0.8B through `vllm serve` (tests.utils.RemoteOpenAIServer; also imports httpx).
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py": Why.SERVES_A_MODEL,
    "tests/v1/core/test_reset_prefix_cache_e2e.py": Why.SERVES_A_MODEL,     # LLMEngine, Qwen/Qwen3-0.6B
    "tests/v1/core/test_scheduler_e2e.py": Why.SERVES_A_MODEL,        # LLM, hmellor/tiny-random-LlamaForCausalLM
    # Qwen/Qwen2.5-VL-3B-Instruct, with random image items.
    "tests/v1/core/test_priority_scheduler_random.py": Why.MULTIMODAL_PROCESSOR,
    **{_SCHEDULER + name: Why.MULTIMODAL_PROCESSOR for name in _LLAVA_TESTS},
    _SCHEDULER + "test_async_scheduling_pp_allows_rescheduling_with_output_placeholders": Why.NEEDS_TRITON,
}
"""File or test id -> why it is not run (in any mode)."""


def excluded_reasons() -> dict[str, str]:
    """:data:`EXCLUDED` as the plugin reads it (``--kvhit-exclude``): id -> the reason's text."""
    return {entry: why.value for entry, why in EXCLUDED.items()}


def in_selection(entry: str, paths: tuple[str, ...]) -> bool:
    """Whether the file or test id ``entry`` lies under one of ``paths``."""
    file = entry.split("::", 1)[0]
    return any(file == path or file.startswith(path.rstrip("/") + "/") for path in paths)
