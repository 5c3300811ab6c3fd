"""The shapes `make-model` writes (models/make_model.py), and a preset's ModelArgs without making
it (no torch: the supervisor's preflight checks the built-in model's KV budget before its first run)."""
from __future__ import annotations

from .args import ModelArgs

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, torch_dtype="float32"),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048, torch_dtype="float32"),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, torch_dtype="bfloat16",
               rope_theta=500000.0),
    # the shape of Llama-3-8B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, torch_dtype="bfloat16",
               rope_theta=500000.0),
    # Mixture-of-Experts: expert_ffn is each expert's width (Mixtral's intermediate_size)
    "moe-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, torch_dtype="float32",
                     num_experts=8, num_experts_per_tok=2, expert_ffn=64),
    # the shape of OLMoE-1B-7B
    "moe-a1b": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=16, vocab_size=50304, max_position_embeddings=4096, torch_dtype="bfloat16",
                    num_experts=64, num_experts_per_tok=8, expert_ffn=1024),
    # the shape of Qwen3-30B-A3B
    "moe-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                        torch_dtype="bfloat16", rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                        expert_ffn=768),
}


def preset_args(preset: str) -> ModelArgs:
    """The ModelArgs of `make-model --preset NAME` (its default architecture, unquantized)."""
    cfg = dict(PRESETS[preset])
    experts, top_k, ffn = cfg.pop("num_experts", 0), cfg.pop("num_experts_per_tok", 0), cfg.pop("expert_ffn", 0)
    arch = "Qwen3MoeForCausalLM" if experts else "LlamaForCausalLM"
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if experts:
        cfg.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn, qk_norm=True)
    return ModelArgs(arch=arch, **cfg)
