"""Config: schema, embedded default, and errors that name the path, the expectation and the value."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config_load import ConfigError, default_config_text, load_config, parse_config

ROOT = Path(__file__).resolve().parents[3]


def err(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(text, "config.yaml")
    return str(e.value)


def test_embedded_default_is_the_shipped_file():
    assert default_config_text() == (ROOT / "configs" / "understudy.yaml").read_text()
    cfg = load_config(None)
    assert cfg.engines.count == 2 and cfg.router.port == 8000 and cfg.admin.port == 8001
    assert cfg.model.path is None and cfg.model.preset == "tiny"
    assert cfg.engines.slot_names() == ["a", "b"]


def test_empty_file_means_defaults():
    assert parse_config("", "x.yaml") == load_config(None)


EXT = "engines:\n  kind: external\n  external:\n    command: vllm serve {model} --port {port}\n"


@pytest.mark.parametrize("text, expected", [
    ("engines:\n  count: two\n", "config.yaml: engines.count: expected an integer >= 1 and <= 16, got 'two'"),
    ("engines:\n  count: 0\n", "config.yaml: engines.count: expected an integer >= 1 and <= 16, got 0"),
    ("router:\n  port: 70000\n", "config.yaml: router.port: expected an integer >= 0 and <= 65535, got 70000"),
    ("device: tpu\n", "config.yaml: device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    ("failover:\n  hold_timeout_s: -1\n", "config.yaml: failover.hold_timeout_s: expected a number > 0, got -1"),
    ("gpu_ids: [0, x]\n", "config.yaml: gpu_ids.1: expected an integer, got 'x'"),
    ("canary:\n  prompt: ''\n", "config.yaml: canary.prompt: expected a non-empty string, got ''"),
    ("model: 3\n", "config.yaml: model: expected a mapping, got 3"),
    ("engines:\n  cuda_graphs_before_ready: null\n",  # (YAML's words, not Python's None)
     "config.yaml: engines.cuda_graphs_before_ready: expected one of 'largest', 'all', got null"),
    ("engines:\n  kind: external\n", "config.yaml: engines.external: required when kind is 'external'"),
    ("engines:\n  names: [x]\n", "config.yaml: engines.names: expected 2 names (engines.count), got 1"),
    ("engines:\n  kind: external\n  external: {command: 'vllm serve {modle} --port {port}'}\n",
     "config.yaml: engines.external.command: unknown placeholder {modle} (known: port, model, name, model_name, "
     "gpu_ids, runtime_dir; write {{ and }} for literal braces)"),
    (EXT + "    daemon_command: vllm preload --model {model}\n",
     "config.yaml: engines.external.daemon_ready: required with daemon_command (when is the daemon READY: "
     "unix:PATH, tcp:HOST:PORT, http://URL or log:REGEX)"),
    (EXT + "    daemon_command: vllm preload --dir {socket_dir}\n    daemon_ready: unix:/x.sock\n",
     "config.yaml: engines.external.daemon_command: unknown placeholder {socket_dir} (known: rank, gpu_id, gpu_ids, "
     "tp_size, model, model_name, runtime_dir; write {{ and }} for literal braces)"),
    (EXT + "    daemon_command: vllm preload\n    daemon_ready: 'socket:/x.sock'\n",
     "config.yaml: engines.external.daemon_ready: expected unix:PATH, tcp:HOST:PORT, http://URL, https://URL or "
     "log:REGEX, got 'socket:/x.sock'"),
    (EXT + "    daemon_command: d\n    daemon_ready: 'log:ready ('\n",
     "config.yaml: engines.external.daemon_ready: expected a regular expression after log:, got 'ready (' (missing "
     "), unterminated subpattern at position 6)"),
    (EXT + "    daemon_ready: 'tcp:127.0.0.1:8010'\n",
     "config.yaml: engines.external.daemon_ready: given without daemon_command"),
    (EXT + "    daemon_command: d\n    daemon_ready: unix:/x\n    daemon_scope: gpu\n",
     "config.yaml: engines.external.daemon_scope: expected one of 'node', 'rank', got 'gpu'"),
    ("router:\n  port: 9000\nadmin:\n  port: 9000\n",
     "config.yaml: admin.port: expected a port other than router.port, got 9000"),
    ("engines:\n  kv_block_size: 3\n", "config.yaml: engines.kv_block_size: expected a power of two (1, 2, 4, ... "
     "1024), got 3"),
    ("engines:\n  names: [a/b, c]\n", "config.yaml: engines.names: expected names of 1-32 letters, digits, '_', '.' "
     "or '-' (a name is part of the engine's file names and log lines), got 'a/b'"),
])
def test_bad_values_name_path_expectation_and_value(text, expected):
    assert err(text) == expected


def test_heartbeat_timeout_defaults_by_device_and_an_explicit_value_wins():
    f = load_config(None).failover
    assert f.heartbeat_timeout_s is None
    assert f.heartbeat_timeout_for("cuda") == 1.0 and f.heartbeat_timeout_for("cpu") == 5.0
    assert f.heartbeat_timeout_for("external") == 5.0
    assert f.for_device("cuda").heartbeat_timeout_s == 1.0
    set_ = parse_config("failover: {heartbeat_timeout_s: 2.5}", "x.yaml").failover
    assert set_.heartbeat_timeout_for("cuda") == set_.for_device("cpu").heartbeat_timeout_s == 2.5


def test_slot_names_follow_the_engines_own_rule():
    from wire.engine_config import EngineConfig
    from supervisor.config import ENGINE_NAME
    meta = EngineConfig.model_fields["name"].metadata
    assert [m.pattern for m in meta if getattr(m, "pattern", None)] == [ENGINE_NAME]
    assert "expected names of 1-32 letters" in err('engines:\n  names: ["a\\n", b]\n')  # ('$' alone allows a newline)


def test_unknown_key_lists_the_known_ones():
    msg = err("engines:\n  cont: 2\n")
    assert msg.startswith("config.yaml: engines.cont: unknown key (expected one of: count, names, kind")


def test_several_errors_are_all_reported():
    msg = err("engines:\n  count: two\nrouter:\n  port: -1\n")
    assert "engines.count" in msg and "router.port" in msg and len(msg.splitlines()) == 2


def test_yaml_syntax_error_has_a_line_number():
    assert err("engines:\n  count: [1\n").startswith("config.yaml: line ")


def test_top_level_must_be_a_mapping():
    assert err("- 1\n") == "config.yaml: expected a mapping at the top level, got list"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def refused_by_serve(cfg: Path, line: str, tmp_path: Path) -> None:
    """`serve --check` and `serve` both exit 2 with `line` naming the key, no traceback, nothing started."""
    for args in (("serve", "--check", "-c", str(cfg)), ("serve", "-c", str(cfg))):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert f"understudy: invalid config: {cfg}: {line}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "config OK" not in r.stdout
    assert not (tmp_path / "rt" / "logs").exists(), "serve started something"


def test_serve_rejects_a_bad_config_before_starting_anything(tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("engines:\n  count: two\n")
    r = _cli("serve", "-c", str(bad))
    assert r.returncode == 2
    assert f"{bad}: engines.count: expected an integer >= 1 and <= 16, got 'two'" in r.stderr
    assert _cli("serve", "--check", "-c", str(bad)).returncode == 2
    good = tmp_path / "good.yaml"
    good.write_text("engines:\n  count: 3\n")
    r = _cli("serve", "--check", "-c", str(good))
    assert r.returncode == 0 and "config OK" in r.stdout


BROKEN = {  # what serve died on (issue 23, item 5) -> the line both serve and serve --check print
    "kv_block_size": ("engines: {{kv_block_size: 3}}", "engines.kv_block_size: expected a power of two"),
    "slash": ("engines: {{names: [a/b, c]}}", "engines.names: expected names of 1-32 letters"),
    "no model": ("model: {{path: {tmp}/no-model}}", "model.path: {tmp}/no-model: no such folder"),
    "kv budget": ("model: {{path: {model}}}\nengines: {{kv_cache_bytes: 65536, shared_kv: false}}",
                  "engines.kv_cache_bytes: 65536 bytes give each engine's cache 7 blocks of 16 tokens"),
    "kv pool": ("model: {{path: {model}}}\nengines: {{kv_cache_bytes: 65536}}",
                "engines.kv_cache_bytes: a KV pool of 65536 bytes holds 8 blocks"),
    "no gpu": ("device: cuda\nmodel: {{path: {model}}}", "device: 'cuda', but no GPU is visible here"),
    "runtime dir": ("runtime_dir: {tmp}/open\nmodel: {{path: {model}}}", "runtime_dir: {tmp}/open has mode 0755"),
    "token file": ("model: {{path: {model}}}\nadmin: {{port: 0, token_file: {tmp}/file/token}}",
                   "admin.token_file: {tmp}/file/token cannot be made: {tmp}/file is not a folder"),
    "nul byte": ('runtime_dir: "{tmp}/a\\0b"\nmodel: {{path: {model}}}', "runtime_dir: expected a path, got one with a NUL"),
    "no such user": ('runtime_dir: "~no-such-user-here/rt"\nmodel: {{path: {model}}}',
                     "runtime_dir: '~no-such-user-here' names no home folder here"),
    "odd token": ("model: {{path: {model}}}\nadmin: {{port: 0, token_file: {tmp}/token}}",
                  "admin.token_file: {tmp}/token: admin token must be printable ASCII without spaces"),
    "cache dir": ("cache_dir: {tmp}/file/cache", "cache_dir: the built-in tiny model cannot be made there: "
                                                   "{tmp}/file is not a folder"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_serve_check_fails_where_serve_would_with_exit_2_and_the_key(tmp_path, tiny_model, case):
    """Exit 2 (systemd's RestartPreventExitStatus) from both, one line naming the key, no traceback,
    and no child started by serve."""
    from supervisor.preflight import visible_gpus
    if case == "no gpu" and visible_gpus() != 0:
        pytest.skip("a GPU is (or may be) present")
    (tmp_path / "open").mkdir(mode=0o755)
    (tmp_path / "open").chmod(0o755)
    (tmp_path / "file").write_text("a file where a folder is wanted\n")
    (tmp_path / "token").write_text("t\u00f6ken\n")
    (tmp_path / "token").chmod(0o600)
    body, line = (t.format(tmp=tmp_path, model=tiny_model) for t in BROKEN[case])
    rt = "" if "runtime_dir" in body else f"runtime_dir: {tmp_path}/rt\n"
    admin = "" if "admin:" in body else "admin: {port: 0}\n"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"{rt}{body}\nrouter: {{port: 0}}\n{admin}")
    refused_by_serve(cfg, line, tmp_path)


def test_serve_check_says_what_serve_would_run(tmp_path, tiny_model):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {tiny_model}}}\n"
                   "router: {port: 0}\nadmin: {port: 0}\n")
    r = _cli("serve", "--check", "-c", str(cfg))
    assert r.returncode == 0, r.stderr
    assert f"2 engines of {tiny_model} on cpu" in r.stdout
    assert not (tmp_path / "rt").exists(), "--check creates nothing"


def test_serve_reports_a_missing_model_folder(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel:\n  path: {tmp_path}/no-model\n")
    r = _cli("serve", "-c", str(cfg))
    assert r.returncode == 2
    assert f"model.path: {tmp_path}/no-model: no such folder" in r.stderr


def test_serve_reports_a_model_folder_without_a_tokenizer(tmp_path, tiny_model):
    import shutil
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").unlink()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel:\n  path: {model}\n")
    r = _cli("serve", "-c", str(cfg))
    assert r.returncode == 2
    assert f"model.path: {model}: expected an HF checkpoint folder, tokenizer.json is missing" in r.stderr


def test_serve_reports_a_port_in_use(tmp_path, tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "config.yaml"
        cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel:\n  path: {tiny_model}\nrouter:\n  port: {port}\n"
                       "admin:\n  port: 0\n")
        r = _cli("serve", "-c", str(cfg))
    assert r.returncode == 2
    assert f"router: cannot listen on 127.0.0.1:{port}: port is already in use" in r.stderr
    assert not list((tmp_path / "rt" / "logs").glob("*.log")), "no child may start when a port is taken"


def test_admin_command_without_a_running_supervisor_is_a_clear_error(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nadmin:\n  port: 1\n  token_file: {tmp_path}/tok\n")
    (tmp_path / "tok").write_text("secret\n")
    (tmp_path / "tok").chmod(0o600)
    r = _cli("status", "-c", str(cfg))
    assert r.returncode == 2 and "cannot reach the admin API at http://127.0.0.1:1" in r.stderr
    (tmp_path / "tok").chmod(0o644)
    r = _cli("status", "-c", str(cfg))
    assert r.returncode == 2 and "must not be readable by group/others" in r.stderr
    bare = tmp_path / "bare.yaml"  # nothing running, no token file: say so, not that the token is unreadable
    bare.write_text(f"runtime_dir: {tmp_path}/rt2\n")
    r = _cli("status", "-c", str(bare))
    assert r.returncode == 2 and "no supervisor is running here" in r.stderr and "token" not in r.stderr, r.stderr


def test_the_builtin_model_is_made_on_first_run_under_the_cache_dir(tmp_path):
    from supervisor.model_prep import resolve_model
    cfg = parse_config(f"cache_dir: {tmp_path}/cache\n", "x.yaml")
    path = resolve_model(cfg)
    assert path == tmp_path / "cache" / "models" / "tiny"
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    mtime = (path / "config.json").stat().st_mtime_ns
    assert resolve_model(cfg) == path and (path / "config.json").stat().st_mtime_ns == mtime  # made once


def test_systemd_unit_matches_the_design_and_the_default_timeouts():
    import configparser
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string((ROOT / "configs" / "understudy.service").read_text())
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["KillMode"] == "process" and svc["OOMPolicy"] == "continue"
    assert svc["Restart"] == "on-failure" and "understudy serve" in svc["ExecStart"]
    f = load_config(None).failover
    assert int(svc["TimeoutStopSec"]) > f.drain_timeout_s + f.stop_timeout_s  # the drain is never cut short
    assert int(svc["WatchdogSec"]) >= 2
    assert svc["RuntimeDirectoryMode"] == "0700"


def test_deterministic_flows_from_the_config_to_every_engine(tmp_path):
    from supervisor.effects.child_configs import ChildConfigs
    cfg = parse_config("engines:\n  deterministic: true\n", "config.yaml")
    assert load_config(None).engines.deterministic is False
    child = ChildConfigs(cfg, tmp_path, "cpu", tmp_path).engine("a", 0, 0)
    assert child.deterministic is True and child.fused_kernels is True  # the runner turns fused decode off


def test_kv_tails_is_off_unless_the_config_turns_it_on_for_every_engine(tmp_path):
    from supervisor.effects.child_configs import ChildConfigs
    assert ChildConfigs(load_config(None), tmp_path, "cpu", tmp_path).engine("a", 0, 0).kv_tails is False
    cfg = parse_config("engines:\n  kv_tails: true\n", "config.yaml")
    assert ChildConfigs(cfg, tmp_path, "cpu", tmp_path).engine("b", 0, 0).kv_tails is True


@pytest.mark.parametrize("key, value, line", [
    ("num_key_value_heads", 0, "num_key_value_heads: expected an integer >= 1, got 0"),
    ("quantization_config", "x", "quantization_config: expected a JSON object, got 'x'"),
])
def test_serve_check_names_config_json_and_the_key_of_a_broken_checkpoint(tmp_path, tiny_model, key, value, line):
    """A hostile config.json: exit 2 from serve --check and serve, the line naming the file and
    the key, no traceback."""
    import json
    import shutil
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, key: value}))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {model}}}\nrouter: {{port: 0}}\nadmin: {{port: 0}}\n")
    refused_by_serve(cfg, f"model.path: {model}/config.json: {line}", tmp_path)


HB = "failover.heartbeat_timeout_s: expected at least 2 x engines.heartbeat_interval_s"


@pytest.mark.parametrize("text, expected", [
    ("device: cuda\n", None),  # the defaults: 1 s against 0.5 s
    ("device: cuda\nengines: {heartbeat_interval_s: 0.6}\n", f"{HB} (2 x 0.6 = 1.2 s), got null (= 1 s on cuda)"),
    ("device: cpu\nengines: {heartbeat_interval_s: 2.5}\n", None),  # 5 s on CPU
    ("device: cpu\nengines: {heartbeat_interval_s: 3}\n", f"{HB} (2 x 3 = 6 s), got null (= 5 s on cpu)"),
    ("failover: {heartbeat_timeout_s: 0.9}\n", f"{HB} (2 x 0.5 = 1 s), got 0.9"),  # explicit: any device
    ("failover: {heartbeat_timeout_s: 1}\n", None),
    ("failover: {heartbeat_timeout_s: 0.2}\nengines: {heartbeat_interval_s: 0.1}\n", None),
    ("device: cuda\nfailover: {heartbeat_timeout_s: 3}\nengines: {heartbeat_interval_s: 1.5}\n", None),
    ("engines: {heartbeat_interval_s: 30}\n", None),  # auto and null: the device decides (preflight)
    ("engines: {kind: external, heartbeat_interval_s: 30, external: {command: 'x {port}'}}\n"
     "failover: {heartbeat_timeout_s: 1}\n", None),  # an external engine sends no heartbeats
])
def test_heartbeat_timeout_must_be_two_heartbeat_intervals(text, expected):
    if expected is None:
        parse_config(text, "config.yaml")
    else:
        assert err(text) == f"config.yaml: {expected}: engines heartbeating that seldom would all look hung; " \
                            "raise failover.heartbeat_timeout_s or lower engines.heartbeat_interval_s"


def test_heartbeat_check_on_the_resolved_device():
    """device auto and a null timeout: checked against the device serve will use."""
    cfg = parse_config("engines: {heartbeat_interval_s: 0.6}\n", "x.yaml")
    assert cfg.heartbeat_problem("cpu") is None
    assert cfg.heartbeat_problem("cuda").startswith(f"{HB} (2 x 0.6 = 1.2 s), got null (= 1 s on cuda)")


def test_serve_check_refuses_a_heartbeat_timeout_under_two_intervals(tmp_path, tiny_model):
    """Through preflight (device auto, resolved here; null timeout) and through the schema (explicit)."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = 1 if device == "cuda" else 5
    cases = {"auto": ("", f"engines: {{heartbeat_interval_s: {timeout * 0.6}}}",
                      f"got null (= {timeout:g} s on {device})"),
             "explicit": ("failover: {heartbeat_timeout_s: 0.5}\n", "engines: {heartbeat_interval_s: 0.4}",
                          "(2 x 0.4 = 0.8 s), got 0.5")}
    for name, (failover, engines, tail) in cases.items():
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {tiny_model}}}\n{failover}{engines}\n"
                       "router: {port: 0}\nadmin: {port: 0}\n")
        for args in (("serve", "--check", "-c", str(cfg)), ("serve", "-c", str(cfg))):
            r = _cli(*args)
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            assert f"understudy: invalid config: {cfg}: {HB} " in r.stderr and tail in r.stderr, r.stderr
            assert "engines.heartbeat_interval_s" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "rt" / "logs").exists(), "serve started something"


def test_a_config_that_is_not_utf8_or_nests_too_deep_is_named_not_a_traceback(tmp_path):
    binary, deep = tmp_path / "binary.yaml", tmp_path / "deep.yaml"
    binary.write_bytes(b"\xfa\xfb router: 1\n")
    deep.write_text("[" * 5000 + "\n")
    for cfg, line in ((binary, "cannot read: not UTF-8 text (byte 0xfa at offset 0)"),
                      (deep, "invalid YAML: nested too deeply")):
        for args in (("serve", "--check", "-c", str(cfg)), ("status", "-c", str(cfg))):
            r = _cli(*args)
            assert r.returncode == 2 and f"{cfg}: {line}" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_serve_check_refuses_what_serve_would_die_on_before_the_model_is_made(tmp_path):
    """Issue 52, item 7: a runtime_dir nothing can make (as root too: /proc refuses folders), and a KV
    budget too small for the built-in model not made yet (its shapes are known from the preset)."""
    proc = tmp_path / "proc.yaml"
    proc.write_text(f"runtime_dir: /proc/understudy-x\ncache_dir: {tmp_path / 'cache'}\n")
    r = _cli("serve", "--check", "-c", str(proc))
    assert r.returncode == 2 and "runtime_dir: /proc/understudy-x does not exist and cannot be made" in r.stderr
    small = tmp_path / "small.yaml"
    small.write_text(f"runtime_dir: {tmp_path / 'rt'}\ncache_dir: {tmp_path / 'cache'}\n"
                     "engines: {kv_cache_bytes: 70000, shared_kv: false}\n")
    r = _cli("serve", "--check", "-c", str(small))
    assert r.returncode == 2 and "engines.kv_cache_bytes: 70000 bytes give each engine's cache" in r.stderr, r.stderr
    assert "for the built-in tiny model" in r.stderr and not (tmp_path / "cache" / "models").exists()


def test_the_prefill_cap_reaches_every_engine_and_is_off_by_default(tmp_path):
    from supervisor.effects.child_configs import ChildConfigs
    assert ChildConfigs(load_config(None), tmp_path, "cpu", tmp_path).engine("a", 0, 0).max_prefill_tokens_per_step is None
    cfg = parse_config("engines:\n  max_prefill_tokens_per_step: 256\n", "config.yaml")
    assert ChildConfigs(cfg, tmp_path, "cpu", tmp_path).engine("b", 0, 0).max_prefill_tokens_per_step == 256
