"""A local Hugging Face hub cache holding only the ``config.json`` of the models vLLM's tests name.

vLLM's scheduler tests build ``ModelConfig(model="facebook/opt-125m")`` and the like: vLLM reads the model's
``config.json`` (architecture, sizes, context length) and nothing else of it; no weights, no tokenizer. With
``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at the folder :func:`write_hub` makes, ``huggingface_hub``
finds each file in the cache layout (``models--ORG--NAME/snapshots/REV/config.json``, ``refs/main`` naming
``REV``) and never opens a connection. A model missing here fails its test with vLLM's "Invalid repository
ID or local directory" error, the same in every mode.

The values are the published configs' (trimmed to the keys vLLM and transformers read).
"""

from __future__ import annotations

import json
from pathlib import Path

REVISION = "0" * 40
"""The one snapshot every model has (the tests ask for the default revision, ``main``)."""

_QWEN_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645, "vocab_size": 151936}

CONFIGS: dict[str, dict] = {
    # tests/v1/core/utils.py create_scheduler's default model, and test_deferred_block_free.py's.
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
        "do_layer_norm_before": True, "ffn_dim": 3072, "hidden_size": 768, "max_position_embeddings": 2048,
        "num_attention_heads": 12, "num_hidden_layers": 12, "word_embed_proj_dim": 768, "vocab_size": 50272,
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
        "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0,
        "init_std": 0.02, "use_cache": True,
    },
    # test_priority_preemption_bug.py.
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
        "do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024, "max_position_embeddings": 2048,
        "num_attention_heads": 16, "num_hidden_layers": 24, "word_embed_proj_dim": 512, "vocab_size": 50272,
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
        "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0,
        "init_std": 0.02, "use_cache": True,
    },
    # vLLM's ModelConfig() default model (tests that build ModelConfig(max_model_len=...)).
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 1024,
        "intermediate_size": 3072, "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8,
        "num_hidden_layers": 28, "max_window_layers": 28, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, **_QWEN_TOKENS,
    },
    # test_dflash_lookahead.py's target.
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 36, "max_window_layers": 36, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, **_QWEN_TOKENS,
    },
    # tests/v1/spec_decode/test_dflash_lookahead.py: the DFlash draft of Qwen/Qwen3-8B (5 layers reading the
    # target's layers 1, 9, 17, 25, 33; block 16). Its `auto_map` (remote code) is left out: vLLM's DFlash
    # support reads only the keys below.
    "z-lab/Qwen3-8B-DFlash-b16": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 5, "num_target_layers": 36,
        "max_window_layers": 5, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "rope_scaling": None, "sliding_window": None, "use_sliding_window": False, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        **_QWEN_TOKENS,
    },
    # test_kv_cache_utils.py (max concurrency, max model length from memory).
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
        "num_hidden_layers": 32, "max_window_layers": 28, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "bos_token_id": 151643, "eos_token_id": 151643, "vocab_size": 151936,
    },
    # test_scheduler.py (a hybrid: Gated DeltaNet layers and full attention every 4th layer).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 5120, "head_dim": 256, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 48, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
        "num_experts": 512, "num_experts_per_tok": 10, "shared_expert_intermediate_size": 512,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06, "rope_theta": 10000000, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, **_QWEN_TOKENS,
    },
    # test_scheduler.py's multimodal tests.
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "ignore_index": -100,
        "image_token_index": 32000, "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
            "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32064,
    },
    # test_priority_scheduler_random.py.
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 36, "max_window_layers": 70,
        "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "sliding_window": 32768,
        "use_sliding_window": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2, "temporal_patch_size": 2,
        },
        **_QWEN_TOKENS,
    },
}
"""Model id -> its ``config.json``; the comment above each entry names the tests that build it."""


def write_hub(cache: Path) -> Path:
    """Write :data:`CONFIGS` into ``cache`` in ``huggingface_hub``'s cache layout (idempotent).

    Returns:
        ``cache``, for ``HF_HUB_CACHE``.
    """
    for model, config in CONFIGS.items():
        repo = cache / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        (snapshot / "config.json").write_text(json.dumps({"_name_or_path": model, **config}, indent=1) + "\n")
    return cache
