"""`understudy make-model DIR --preset tiny|small|1b`: a random-weight HF checkpoint, byte-for-byte reproducible.

Writes config.json, *.safetensors (sharded with model.safetensors.index.json above 2 GB), a real
byte-level BPE tokenizer.json trained on text shipped in the package, and tokenizer_config.json
with a chat template. Weights are scaled so that greedy decoding has clear winners (random
weights, but stable argmax across batch sizes and tensor-parallel layouts).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engines.models import build_model, read_model_args, torch_dtype

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, torch_dtype="float32"),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048, torch_dtype="float32"),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, torch_dtype="bfloat16",
               rope_theta=500000.0),
}
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
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


def hf_config(preset: str, arch: str, tok: Tokenizer) -> dict:
    cfg = dict(PRESETS[preset])
    cfg.update(architectures=[ARCHS[arch]], model_type=arch, rms_norm_eps=1e-5,
               rope_theta=cfg.get("rope_theta", 10000.0), tie_word_embeddings=False,
               bos_token_id=tok.token_to_id(BOS), eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
               hidden_act="silu", initializer_range=0.02, attention_dropout=0.0,
               head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], use_cache=True)
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch == "mistral":
        cfg.update(sliding_window=None)
    if arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    return cfg


def random_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Random weights with scales that keep activations O(1) and logits well separated."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    if name == "lm_head.weight":
        return torch.randn(shape, generator=gen) * (3.0 / hidden ** 0.5)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def make_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    args = read_model_args(model_dir)
    dtype = torch_dtype(args.torch_dtype)
    meta = build_model(args)
    out: dict[str, torch.Tensor] = {}
    for index, (name, spec) in enumerate(sorted(meta.checkpoint_targets().items())):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        out[name] = random_tensor(name, spec.full_shape, args.hidden_size, gen).to(dtype).contiguous()
    return out


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


def make_model(model_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Write a checkpoint to `model_dir` (created; existing checkpoint files are replaced)."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is unknown (expected one of {', '.join(PRESETS)})")
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is unknown (expected one of {', '.join(ARCHS)})")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for old in model_dir.glob("*.safetensors"):
        old.unlink()
    tok = train_tokenizer(PRESETS[preset]["vocab_size"])
    tok.save(str(model_dir / "tokenizer.json"))
    cfg = hf_config(preset, arch, tok)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
               "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
               "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n")
    write_safetensors(model_dir, make_weights(model_dir, seed))
    return model_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="understudy make-model", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="folder to write the checkpoint into")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="its size: tiny (2 layers of 64), small (4 of 256), 1b (16 of 2048) (%(default)s)")
    parser.add_argument("--arch", choices=list(ARCHS), default="llama",
                        help="the architecture config.json names (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed: one seed, the same bytes (%(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    out = make_model(ns.dir, ns.preset, ns.arch, ns.seed)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {ns.preset} {ns.arch} checkpoint to {out} ({size / 1e6:.1f} MB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
