"""`understudy make-model DIR --preset NAME`: a random-weight HF checkpoint, byte-for-byte reproducible.

For one seed and one `--device` the bytes are the same.
Writes config.json, *.safetensors (sharded with model.safetensors.index.json above 2 GB), a real
byte-level BPE tokenizer.json trained on text shipped in the package, and tokenizer_config.json
with a chat template. Weights are scaled so that greedy decoding has clear winners (random
weights, but stable argmax across batch sizes and tensor-parallel layouts). Dense presets are
Llama-family (`--arch llama|qwen2|mistral`); the moe-* presets are Qwen3-MoE or Mixtral
(`--arch qwen3_moe|mixtral`). `--quant` writes the FP8 layouts as HF checkpoints ship them:
`fp8-block` (DeepSeek-V3/Qwen3-FP8: each projection's weight float8_e4m3fn with a float32
`weight_scale_inv` per block) or `fp8-tensor` (one `weight_scale` per tensor, dynamic activations).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from models import build_model, read_model_args, torch_dtype
from models.checkpoint.check import SCALES
from models.presets import PRESETS

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE = ("qwen3_moe", "mixtral")
QUANTS = ("none", "fp8-block", "fp8-tensor")
FP8_MAX = 448.0
SHARD_ABOVE_BYTES = 2 * 10**9
SHARD_BYTES = 10**9
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the shipped corpus, padded to `vocab_size` with reserved tokens.

    The corpus yields fewer merges than a large vocabulary has rows; the reserved tokens
    (`<|reserved_N|>`, plain text when decoded) make every id the model can emit printable.
    Deterministic for a given vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[BOS, EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = CORPUS.read_text().splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<|reserved_{i}|>", special=False, normalized=False) for i in range(missing)])
    return tok


def hf_config(preset: str, arch: str, tok: Tokenizer, quant: str = "none", block: int | None = None) -> dict:
    cfg = dict(PRESETS[preset])
    experts, top_k, expert_ffn = cfg.pop("num_experts", 0), cfg.pop("num_experts_per_tok", 0), cfg.pop("expert_ffn", 0)
    if (arch in MOE) != bool(experts):
        raise ValueError(f"arch {arch!r} does not fit preset {preset!r} (moe-* presets take --arch qwen3_moe or "
                         "mixtral, the others llama, qwen2 or mistral)")
    cfg.update(architectures=[ARCHS[arch]], model_type=arch, rms_norm_eps=1e-5,
               rope_theta=cfg.get("rope_theta", 10000.0), tie_word_embeddings=False,
               bos_token_id=tok.token_to_id(BOS), eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
               hidden_act="silu", initializer_range=0.02, attention_dropout=0.0,
               head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]), use_cache=True)
    if arch == "qwen3_moe":
        cfg.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                   use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"],
                   router_aux_loss_coef=0.001, output_router_logits=False)
    if arch == "mixtral":
        cfg.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=expert_ffn,
                   sliding_window=None, router_jitter_noise=0.0, router_aux_loss_coef=0.02, output_router_logits=False)
    if quant == "fp8-block":
        size = block or (128 if cfg["hidden_size"] >= 1024 else 32)
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [size, size]}
    elif quant == "fp8-tensor":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch == "mistral":
        cfg.update(sliding_window=None)
    if arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    return cfg


def random_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator,
                  device: str = "cpu") -> torch.Tensor:
    """Random weights with scales that keep activations O(1) and logits well separated."""
    randn = torch.randn(shape, generator=gen, device=device)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * randn
    if name.endswith(".bias"):
        return 0.1 * randn
    if name == "model.embed_tokens.weight":
        return randn
    if name == "lm_head.weight":
        return randn * (3.0 / hidden ** 0.5)
    return randn / shape[-1] ** 0.5


def make_weights(model_dir: Path, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, random; FP8 where config.json's quantization_config says (the weight
    quantized per block or per tensor, its scale beside it)."""
    args = read_model_args(model_dir)
    dtype = torch_dtype(args.torch_dtype)
    meta = build_model(args)
    out: dict[str, torch.Tensor] = {}
    weights = [(name, spec) for name, spec in sorted(meta.checkpoint_targets().items())
               if not name.endswith(SCALES)]  # (the scales are written with their weight)
    for index, (name, spec) in enumerate(weights):
        gen = torch.Generator(device).manual_seed(seed * 1_000_003 + index)
        t = random_tensor(name, spec.full_shape, args.hidden_size, gen, device).to(dtype)
        param = meta.get_parameter(spec.param)
        if param.dtype == torch.float8_e4m3fn:
            q, scale = quantize_fp8(t, args.quant.block)
            out[name], out[name[:-len("weight")] + args.quant.scale_name] = q.cpu(), scale.cpu()
        else:
            out[name] = t.cpu().contiguous()
    return out


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale): one scale per block (amax / 448), or one for the tensor."""
    w = w.float()
    if block is None:
        scale = (w.abs().max().clamp(min=1e-12) / FP8_MAX).reshape(())
        return (w / scale).to(torch.float8_e4m3fn), scale
    (n, k), (bn, bk) = w.shape, block
    blocks = w.view(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [n / bn, k / bk]
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q.contiguous(), scale.contiguous()


def write_safetensors(model_dir: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}
    if total <= SHARD_ABOVE_BYTES:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        save_file(shard, str(model_dir / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def make_model(model_dir: str | Path, preset: str = "tiny", arch: str | None = None, seed: int = 0,
               quant: str = "none", block: int | None = None, device: str = "cpu") -> Path:
    """Write a checkpoint to `model_dir` (created; existing checkpoint files are replaced); `arch`
    defaults to llama, or qwen3_moe for the moe-* presets."""
    arch = arch or ("qwen3_moe" if preset.startswith("moe-") else "llama")
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is unknown (expected one of {', '.join(PRESETS)})")
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is unknown (expected one of {', '.join(ARCHS)})")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r} is unknown (expected one of {', '.join(QUANTS)})")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for old in model_dir.glob("*.safetensors"):
        old.unlink()
    tok = train_tokenizer(PRESETS[preset]["vocab_size"])
    tok.save(str(model_dir / "tokenizer.json"))
    cfg = hf_config(preset, arch, tok, quant, block)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
               "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
               "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n")
    write_safetensors(model_dir, make_weights(model_dir, seed, device))
    return model_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="understudy make-model", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="folder to write the checkpoint into")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="its size: tiny (2 layers of 64), small (4 of 256), 1b (16 of 2048), 8b (Llama-3-8B's "
                             "shape), moe-tiny, moe-a1b (OLMoE-1B-7B's shape), moe-30b-a3b (Qwen3-30B-A3B's) "
                             "(%(default)s)")
    parser.add_argument("--arch", choices=list(ARCHS), default=None,
                        help="the architecture config.json names (llama; qwen3_moe for moe-* presets)")
    parser.add_argument("--quant", choices=QUANTS, default="none",
                        help="FP8 weights: fp8-block (a scale per block), fp8-tensor (one per tensor) (%(default)s)")
    parser.add_argument("--block", type=int, default=None,
                        help="fp8-block's block size (128; 32 below a hidden size of 1024)")
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: fast for the "
                        "large presets; each device gives its own bytes) (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed: one seed, the same bytes (%(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        out = make_model(ns.dir, ns.preset, ns.arch, ns.seed, ns.quant, ns.block, ns.device)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {ns.preset} {read_model_args(out).arch} {ns.quant} checkpoint to {out} ({size / 1e6:.1f} MB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
