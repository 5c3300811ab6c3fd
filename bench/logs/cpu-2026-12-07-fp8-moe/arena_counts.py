"""Checkpoint tensors against arena tensors (what an attach maps and views) for the MoE presets, on meta."""
from daemon.arena import layout
from engines.models import build_model, torch_dtype
from engines.models.args import ModelArgs, _normalise
from engines.models.make_model import hf_config, train_tokenizer

tok = train_tokenizer(512)
print(f"{'preset':14} {'quant':10} {'checkpoint tensors':>18} {'arena tensors':>13} {'arena GB (bf16)':>15}")
for preset in ("moe-a1b", "moe-30b-a3b"):
    for quant in ("none", "fp8-block"):
        args = ModelArgs.model_validate(_normalise(hf_config(preset, "qwen3_moe", tok, quant)))
        model = build_model(args, dtype=torch_dtype("bfloat16"))
        man = layout(model)
        print(f"{preset:14} {quant:10} {len(model.checkpoint_targets()):18} {len(man.names):13} {man.total_bytes / 1e9:15.2f}")
