"""Write a tiny random Llama target and a random EAGLE-1 draft head for vLLM CPU e2e tests.

Usage: venv/bin/python make_models.py [OUT_DIR]   (default: ./models next to this file)
Writes OUT_DIR/target (LlamaForCausalLM, hidden 128, 2 layers, 4 heads x 32, vocab 512, fp32,
WordLevel tokenizer with ids 0..511) and OUT_DIR/draft (EAGLE-1 head: 1 decoder layer + fc,
weights named as vLLM's EagleLlamaForCausalLM.load_weights expects: "layers.0.*", "fc.weight";
embed_tokens/lm_head are omitted so vLLM shares the target's). Deterministic (fixed seeds).
``make_granite`` writes a tiny GraniteMoeHybrid (Mamba-2 + attention, the Granite 4.0-H architecture) for
the hybrid end-to-end test on vLLM 0.32.0 (test_granite_serve.py).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=4, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False, torch_dtype="float32",
)


def make_tokenizer(path):
    # ids 0..3 are specials, the rest are words "t4".."t511"; "t123 t45" <-> [123, 45]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(path)


def make_target(path):
    torch.manual_seed(1234)
    cfg = LlamaConfig(num_hidden_layers=2, **COMMON)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)


def make_granite(path):
    """A tiny random GraniteMoeHybridForCausalLM: layers mamba, attention, mamba, attention (hidden 128,
    4 attention heads of 32, 2 KV heads, 4 Mamba heads of 64, state 16), no experts (a shared MLP only),
    tied embeddings, vocab 512, fp32. The weights are drawn at 0.05 so that greedy outputs vary."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(1234)
    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=4, mamba_d_head=64,
        mamba_expand=2, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=256,
        mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=2048,
        position_embedding_type="nope", rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    model = GraniteMoeHybridForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(4321)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)


def make_draft(path):
    torch.manual_seed(5678)
    os.makedirs(path, exist_ok=True)
    cfg = LlamaConfig(num_hidden_layers=1, **COMMON)
    layer_model = LlamaForCausalLM(cfg).to(torch.float32)
    sd = {k[len("model."):]: v.contiguous() for k, v in layer_model.state_dict().items()
          if k.startswith("model.layers.0.")}
    # EAGLE-1: fc maps concat(embedding, target hidden) [2H] -> H; no input_layernorm in layer 0
    # (vLLM replaces it by Identity; an extra weight would be rejected), no final norm.
    sd = {k: v for k, v in sd.items() if "input_layernorm" not in k}
    sd["fc.weight"] = torch.randn(COMMON["hidden_size"], 2 * COMMON["hidden_size"]) * 0.02
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    make_tokenizer(path)  # not read by vLLM for the draft, but keeps the folder self-contained


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
    make_target(os.path.join(out, "target"))
    make_draft(os.path.join(out, "draft"))
    for sub in ("target", "draft"):
        print(sub, sorted(os.listdir(os.path.join(out, sub))))
    print(json.dumps({"target": os.path.join(out, "target"), "draft": os.path.join(out, "draft")}))
