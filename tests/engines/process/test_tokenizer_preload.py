"""The spawn server's preloaded tokenizer: engines take it while the checkpoint's files are unchanged."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from engines.core import tokenizer


def test_a_preloaded_tokenizer_is_taken_until_a_file_of_it_changes(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    tokenizer.preload(model)
    first = tokenizer.load(model)
    assert tokenizer.load(str(model) + "/") is first, "the same folder, however named"
    config = model / "tokenizer_config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    fresh = tokenizer.load(model)
    assert fresh is not first, "a changed file is read again"
    assert fresh.encode("hello world") == first.encode("hello world")


def test_a_folder_never_preloaded_is_read(tiny_model: Path) -> None:
    assert tokenizer.load(tiny_model) is not tokenizer.load(tiny_model)
