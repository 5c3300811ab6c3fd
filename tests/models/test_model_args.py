"""read_model_args on a hostile or broken config.json: a CheckpointError (a boot error: the engine
exits 3, serve --check exits 2) naming config.json and the key, never a traceback."""
from __future__ import annotations

import json
import shutil

import pytest

from models import CheckpointError, UnknownArchError, read_model_args

DROP = object()  # the key removed from config.json

BROKEN = [  # config.json edits -> "<dir>/config.json: <this>"
    ({"hidden_size": "abc"}, "hidden_size: expected an integer >= 1, got 'abc'"),
    ({"hidden_size": DROP}, "hidden_size: required key is missing"),
    ({"hidden_size": True}, "hidden_size: expected an integer >= 1, got True"),
    ({"hidden_size": "64"}, "hidden_size: expected an integer >= 1, got '64'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads: expected an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: expected a divisor of num_attention_heads (4), got 3"),
    ({"num_attention_heads": 0, "head_dim": DROP}, "num_attention_heads: expected an integer >= 1, got 0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers: expected an integer >= 1, got -2"),
    ({"vocab_size": 1.5}, "vocab_size: expected an integer >= 1, got 1.5"),
    ({"intermediate_size": None}, "intermediate_size: expected an integer >= 1, got None"),
    ({"head_dim": 0}, "head_dim: expected an integer >= 1, got 0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings: expected an integer >= 1, got 0"),
    ({"quantization_config": "x"}, "quantization_config: expected a JSON object, got 'x'"),
    ({"quantization_config": {"quant_method": 3}}, "quantization_config.quant_method: expected a string, got 3"),
    ({"rope_parameters": "x"}, "rope_parameters: expected a JSON object, got 'x'"),
    ({"rope_scaling": "x"}, "rope_scaling: expected a JSON object, got 'x'"),
    ({"rope_scaling": [1, 2]}, "rope_scaling: expected a JSON object, got [1, 2]"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor: expected a number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 4}},
     "rope_scaling.high_freq_factor: expected a number > low_freq_factor (4.0), got 4.0"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling.rope_type: 'yarn' is not supported"),
    ({"rope_theta": "big"}, "rope_theta: expected a number, got 'big'"),
    ({"attention_bias": "yes"}, "attention_bias: expected true or false, got 'yes'"),
    ({"eos_token_id": "x"}, "eos_token_id: expected a token id or a list of them, got 'x'"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id.1: expected an integer, got 'x'"),
    ({"architectures": 5}, "architectures: expected a list of class names, got 5"),
    ({"architectures": {"a": 1}}, "architectures: expected a list of class names, got {'a': 1}"),
]


def broken_copy(src, dst, edit: dict):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in edit.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, message", BROKEN, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BROKEN)])
def test_a_broken_config_json_names_the_file_and_the_key(tiny_model, tmp_path, edit, message):
    model = broken_copy(tiny_model, tmp_path / "m", edit)
    with pytest.raises(CheckpointError) as e:
        read_model_args(model)
    assert str(e.value).startswith(f"{model / 'config.json'}: {message}"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "expected a JSON object, got list"),
    ("{", "not valid JSON"),
    (b"\xff\xfe{", "not valid JSON"),
])
def test_config_json_that_is_no_object_names_the_file(tiny_model, tmp_path, text, message):
    model = broken_copy(tiny_model, tmp_path / "m", {})
    (model / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=message) as e:
        read_model_args(model)
    assert str(e.value).startswith(f"{model / 'config.json'}: ")


def test_an_unknown_architecture_keeps_its_error_type(tiny_model, tmp_path):
    model = broken_copy(tiny_model, tmp_path / "m", {"architectures": [5]})
    with pytest.raises(UnknownArchError, match=r"config.json: architectures\[0\] is 5; supported: LlamaForCausalLM"):
        read_model_args(model)


def test_head_dim_is_derived_when_absent(tiny_model, tmp_path):
    model = broken_copy(tiny_model, tmp_path / "m", {"head_dim": DROP})
    args = read_model_args(model)
    assert args.head_dim == args.hidden_size // args.num_attention_heads == read_model_args(tiny_model).head_dim
