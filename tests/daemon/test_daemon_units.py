"""Daemon building blocks without a daemon: frames, runtime dir, fingerprint, arena, loader, quant."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from daemon.arena import ALIGN, ArenaError, bind, build_views, check_materialised, layout
from daemon.fingerprint import content_digest, make_cache_config
from daemon.framing import MAX_FRAME_BYTES, FrameError, PeerClosed, recv_frame, send_frame
from daemon.loader import load_checkpoint_into
from daemon.quant import quant_of
from models.quant import PROCESSING_VERSION
from daemon.runtime_dir import RuntimeDirError, ensure_private_dir
from models import CheckpointError, build_model, read_model_args, torch_dtype


# ---- framing ---------------------------------------------------------------------------------
def test_frames_carry_json_and_fds():
    a, b = socket.socketpair()
    r, w = os.pipe()
    with a, b:
        send_frame(a, {"op": "ping", "text": "héllo"}, [w])
        obj, fds = recv_frame(b)
        assert obj == {"op": "ping", "text": "héllo"} and len(fds) == 1
        os.write(fds[0], b"ok")
        assert os.read(r, 2) == b"ok"
        for fd in (*fds, r, w):
            os.close(fd)
        a.close()
        with pytest.raises(PeerClosed):
            recv_frame(b)


@pytest.mark.parametrize("raw, message", [
    ((MAX_FRAME_BYTES + 1).to_bytes(4, "big"), "exceeds"),
    ((0).to_bytes(4, "big"), "empty frame"),
    ((3).to_bytes(4, "big") + b"[1]", "must hold a JSON object"),
    ((3).to_bytes(4, "big") + b"\xff\xfe\x00", "not UTF-8 JSON"),
    ((8).to_bytes(4, "big") + b"{}", "closed inside a frame body"),
    (b"\x00\x01", "closed inside a frame header"),
])
def test_bad_frames_raise_one_line_errors(raw, message):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=message) as e:
            recv_frame(b)
        assert "\n" not in str(e.value)


def test_oversized_frames_are_not_sent():
    a, b = socket.socketpair()
    with a, b, pytest.raises(FrameError, match="exceeds"):
        send_frame(a, {"blob": "x" * MAX_FRAME_BYTES})


# ---- runtime dir -----------------------------------------------------------------------------
def test_runtime_dir_is_private(tmp_path):
    p = ensure_private_dir(tmp_path / "a" / "rt")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
    assert ensure_private_dir(p) == p
    os.chmod(p, 0o755)
    with pytest.raises(RuntimeDirError, match="mode 0755"):
        ensure_private_dir(p)
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeDirError, match="not a directory"):
        ensure_private_dir(tmp_path / "file")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown")
def test_runtime_dir_of_another_user_is_refused(tmp_path):
    p = tmp_path / "theirs"
    p.mkdir(mode=0o700)
    os.chown(p, 65534, 65534)
    with pytest.raises(RuntimeDirError, match="owned by uid 65534"):
        ensure_private_dir(p)


# ---- fingerprint and quant -------------------------------------------------------------------
def test_content_digest_follows_the_bytes_not_the_metadata(make_tiny, tmp_path):
    model_dir = make_tiny(seed=21)
    cache = tmp_path / "cache"
    first = content_digest(model_dir, cache)
    assert len(list((cache / "digests").iterdir())) == 2  # config.json and model.safetensors, cached
    os.utime(model_dir / "model.safetensors")  # touched, same bytes: re-hashed, same digest
    assert content_digest(model_dir, cache) == first
    assert len(list((cache / "digests").iterdir())) == 3  # a new (path, inode, size, mtime) key
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert content_digest(model_dir, cache) != first
    with pytest.raises(CheckpointError, match="does not exist"):
        content_digest(tmp_path / "missing", cache)
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        make_cache_config(tmp_path)


def test_cache_config_names_differing_fields(tiny_model):
    a = make_cache_config(tiny_model)
    assert a.device_capability == "cpu" and a.quant_method is None
    b = a.model_copy(update={"dtype": "bfloat16", "tp_rank": 1})
    assert a.differing_fields(b) == ["tp_rank", "dtype"]


def test_the_fingerprint_names_the_quantization_and_its_processing():
    assert quant_of({}) == (None, "", "")
    method, digest, processing = quant_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert method == "fp8" and processing == PROCESSING_VERSION
    assert digest != quant_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})[1]
    with pytest.raises(ValueError, match="no quant_method"):
        quant_of({"quantization_config": {"bits": 4}})


# ---- arena -----------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, device="meta")
        self.head = nn.Linear(6, 10, bias=False, device="meta")
        self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(6, device="meta", dtype=torch.bfloat16)
        self.register_buffer("table", torch.empty(5, 3, device="meta"), persistent=False)
        self.register_buffer("steps", torch.empty(3, dtype=torch.int64, device="meta"))


def test_layout_aligns_dedupes_ties_and_keeps_buffers():
    m = layout(Tied())
    assert m.aliases == {"head.weight": "emb.weight"}
    assert all(off % ALIGN == 0 for off in m.offsets)
    assert dict(zip(m.names, m.kinds))["table"] == "buffer"
    assert dict(zip(m.names, m.persistent)) == {"emb.weight": True, "norm.weight": True, "norm.bias": True,
                                                 "table": False, "steps": True}
    ends = sorted(zip(m.offsets, m.nbytes))
    assert all(a + n <= b for (a, n), (b, _) in zip(ends, ends[1:])), "tensors overlap"


def test_views_bind_without_copy_and_keep_ties():
    model = Tied()
    m = layout(model)
    region = torch.zeros(m.total_bytes, dtype=torch.uint8)
    views = build_views(region, m)
    bind(model, views, m)
    check_materialised(model, m.entries(), torch.device("cpu"))
    assert model.head.weight is model.emb.weight
    model.emb.weight.data.fill_(1.5)
    model.norm.weight.data.fill_(2.0)
    off = m.offsets[m.names.index("emb.weight")]
    assert region[off:off + 4].view(torch.float32).item() == 1.5
    assert model.norm.weight.dtype == torch.bfloat16 and model.steps.dtype == torch.int64


def test_bad_manifests_and_regions_are_refused():
    m = layout(Tied())
    with pytest.raises(ArenaError, match="cannot hold"):
        build_views(torch.zeros(m.total_bytes - 1, dtype=torch.uint8), m)
    bad = m.model_dump()
    bad["offsets"][1] += 4
    with pytest.raises(ValueError, match="unaligned"):
        type(m).model_validate(bad)
    model = Tied()
    with pytest.raises(ArenaError, match="model tensor .* is on meta, expected cpu"):
        check_materialised(model, m.entries(), torch.device("cpu"))


# ---- loader ----------------------------------------------------------------------------------
def materialise(model_dir: Path, tp_rank: int = 0, tp_size: int = 1, dtype: str = "float32"):
    model = build_model(read_model_args(model_dir), tp_rank=tp_rank, tp_size=tp_size,
                        dtype=torch_dtype(dtype), device="meta")
    m = layout(model)
    bind(model, build_views(torch.empty(m.total_bytes, dtype=torch.uint8), m), m)
    return model


@pytest.mark.parametrize("tp_size, dtype", [(1, "float32"), (2, "float32"), (2, "bfloat16")])
def test_loader_fills_every_rank_with_its_shard(tiny_model, tp_size, dtype):
    ref = load_file(tiny_model / "model.safetensors")
    for rank in range(tp_size):
        model = materialise(tiny_model, rank, tp_size, dtype)
        seen = []
        stats = load_checkpoint_into(model, tiny_model, progress=seen.append, threads=2)
        assert seen[-1].bytes_done == seen[-1].bytes_total == stats.bytes > 0
        for key, spec in model.checkpoint_targets().items():
            want = ref[key]
            if spec.shard_dim is not None:
                width = want.shape[spec.shard_dim] // tp_size
                want = want.narrow(spec.shard_dim, rank * width, width)
            got = model.get_parameter(spec.param).narrow(0, spec.dst_offset, want.shape[0])
            assert torch.equal(got, want.to(got.dtype)), key
        assert torch.count_nonzero(model.model.rope_cos) > 0  # init_buffers ran


def corrupt_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def rewrite(model_dir: Path, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


KEY = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("name, edit, message", [
    ("no-folder", lambda d: shutil.rmtree(d), r"model folder .* does not exist"),
    ("no-weights", lambda d: (d / "model.safetensors").unlink(), r"has no \*\.safetensors file"),
    ("missing-tensor", lambda d: rewrite(d, lambda t: t.pop(KEY)), rf"model.safetensors: tensor {KEY} is missing"),
    ("wrong-shape", lambda d: rewrite(d, lambda t: t.update({KEY: t[KEY][:, :7].clone()})),
     rf"model.safetensors: tensor {KEY} has shape \(64, 7\), expected \(64, 128\)"),
    ("wrong-dtype", lambda d: rewrite(d, lambda t: t.update({KEY: t[KEY].to(torch.int32)})),
     rf"model.safetensors: tensor {KEY} is torch.int32"),
    ("truncated", lambda d: os.truncate(d / "model.safetensors", os.path.getsize(d / "model.safetensors") - 100),
     r"model.safetensors: truncated: tensor .* ends at byte"),
    ("corrupt-header", lambda d: _poke(d / "model.safetensors", 8, b"\x00garbage"), r"model.safetensors: corrupt"),
    ("index-to-missing-file", lambda d: _index_to(d, "model-00002-of-00002.safetensors"),
     r"model-00002-of-00002.safetensors: checkpoint file does not exist"),
])
def test_loader_errors_name_file_and_tensor(tiny_model, tmp_path, name, edit, message):
    broken = corrupt_copy(tiny_model, tmp_path / name, edit)
    model = materialise(tiny_model)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint_into(model, broken)
    assert "\n" not in str(e.value)


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _index_to(model_dir: Path, missing_file: str) -> None:
    keys = list(load_file(model_dir / "model.safetensors"))
    weight_map = {k: "model.safetensors" for k in keys}
    weight_map[KEY] = missing_file
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_loader_refuses_a_model_still_on_meta(tiny_model):
    model = build_model(read_model_args(tiny_model), device="meta")
    with pytest.raises(CheckpointError, match="still on meta"):
        load_checkpoint_into(model, tiny_model)
