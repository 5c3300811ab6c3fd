"""What ``serve`` checks before any child starts, which is all that ``serve --check`` runs: past the
schema (config_load.py), what only this machine can tell: the device, the model folder and its
config.json, the KV budget for this model, the runtime dir and token file, and every child's own
config as it will be built. Each problem is a ConfigError naming its key (both exit 2: systemd
never restarts a config that will not fix itself)."""
from __future__ import annotations

import glob
import os
import tempfile
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from supervisor.config import UnderstudyConfig
from supervisor.config_load import ConfigError


@dataclass(frozen=True)
class Plan:
    """What serve runs with: the model folder (None: the built-in preset, not made yet) and device."""

    model_path: Path | None
    device: str


def check(cfg: UnderstudyConfig, source: str, make_model: bool) -> Plan:
    """Every check; ``make_model``: make the built-in preset if missing (serve), else skip what needs
    it (--check). Raises ConfigError: ``source: key: what``, one line per problem found."""
    problems: list[str] = []
    external = cfg.engines.kind == "external"
    device = (cfg.device if cfg.device != "auto" else "external") if external else _device(cfg, problems)
    if external:  # an external engine resolves its own model (a folder or a hub id), passed as {model}
        model_path: Path | None = Path(cfg.model.path or cfg.model.name or "external")
    else:
        model_path = _model(cfg, make_model, problems)
        if model_path is not None and not problems:
            _model_fits(cfg, model_path, problems)
        elif model_path is None and not problems:  # the built-in preset, made on first run: its shapes are known
            from models.presets import preset_args
            _args_fit(cfg, preset_args(cfg.model.preset), f"the built-in {cfg.model.preset} model", problems)
    if problem := cfg.heartbeat_problem(device):  # (the schema checked it where the device was known without torch)
        problems.append(problem)
    _runtime_dir(cfg.resolved_runtime_dir(), problems)
    _token_file(cfg, problems)
    if not problems:
        _child_configs(cfg, model_path or Path("unmade-preset"), device, problems)
    if not problems and cfg.daemon_ranks() and external:
        _daemon_program(cfg, problems)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return Plan(model_path, device)


def _device(cfg: UnderstudyConfig, problems: list[str]) -> str:
    """``auto`` resolved; ``cuda`` with no GPU, or gpu_ids past the GPUs there are, is a problem
    (counted from the NVIDIA driver, without torch; where it cannot tell, the engines will)."""
    device = cfg.resolved_device()
    if device != "cuda":
        return device
    count = visible_gpus()
    if count == 0:
        problems.append("device: 'cuda', but no GPU is visible here (no NVIDIA GPU, or CUDA_VISIBLE_DEVICES "
                        "hides them all; set device: cpu or auto)")
        return device
    bad = [g for g in cfg.resolved_gpu_ids() if count is not None and not 0 <= g < count]
    if bad:
        problems.append(f"gpu_ids: expected ids below {count} (the GPUs visible here), got {bad}")
    return device


def visible_gpus() -> int | None:
    """The GPUs CUDA would show this process: the NVIDIA driver's (/proc/driver/nvidia/gpus), as many
    as CUDA_VISIBLE_DEVICES names if it is set; 0 with no NVIDIA device node either; None where
    device nodes exist but the driver's list is not readable (a container may not show it)."""
    try:
        driver = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None if glob.glob("/dev/nvidia[0-9]*") else 0
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return driver
    names = [x for x in shown.split(",") if x.strip()]
    return min(driver, len(names))


def _model(cfg: UnderstudyConfig, make_model: bool, problems: list[str]) -> Path | None:
    """The checkpoint folder, checked (ModelError messages name model.path)."""
    from supervisor.model_prep import ModelError, existing_model, make_preset, preset_dir
    try:
        found = existing_model(cfg)
        if found is None and (why := uncreatable(preset_dir(cfg))) is not None:
            problems.append(f"cache_dir: the built-in {cfg.model.preset} model cannot be made there: {why}")
            return None
        return make_preset(cfg) if make_model and found is None else found  # (None: serve makes it on first run)
    except ModelError as e:
        problems.append(str(e) if str(e).startswith("model.") else f"model.preset: {e}")
    except OSError as e:  # (making the preset: a full disk, a folder removed meanwhile)
        problems.append(f"cache_dir: the built-in {cfg.model.preset} model could not be made: {e}")
    return None


def _model_fits(cfg: UnderstudyConfig, model_path: Path, problems: list[str]) -> None:
    """config.json readable, the model's shapes whole at tp_size, and the KV budget holding one
    sequence of max_model_len (the engine's and the daemon's own checks, made before anything
    starts, without torch: a restarted supervisor serves again the sooner)."""
    from models import CheckpointError, UnknownArchError, read_model_args
    from models.args import block_problem
    from models.checkpoint.check import quant_problem
    try:
        args = read_model_args(model_path)
    except (CheckpointError, UnknownArchError, ValueError) as e:
        problems.append(f"model.path: {e}")
        return
    m, e = cfg.model, cfg.engines
    if args.quant and args.quant.block and (why := block_problem(args, m.tp_size)) is not None:
        problems.append(f"model.path: {model_path}/config.json: quantization_config.weight_block_size "
                        f"{list(args.quant.block)}: {why}")
        return
    try:
        if (why := quant_problem(model_path, args)) is not None:
            problems.append(f"model.path: {why}")
            return
    except CheckpointError as err:
        problems.append(f"model.path: {err}")
        return
    _args_fit(cfg, args, model_path.name, problems)


def _args_fit(cfg: UnderstudyConfig, args, name: str, problems: list[str]) -> None:  # noqa: ANN001 (ModelArgs)
    """The model's shapes against the config: deterministic mode, tp_size, the KV budget."""
    from models.args import deterministic_refusal, kv_bytes_per_block, tp_problem
    m, e = cfg.model, cfg.engines
    if e.deterministic and (beyond := args.beyond_plain()) is not None:
        problems.append(deterministic_refusal(beyond))
    if (why := tp_problem(args, m.tp_size)) is not None:
        problems.append(f"model.tp_size: {m.tp_size} does not fit {name}: {why}")
        return
    length = min(e.max_model_len, args.max_position_embeddings)
    need = -(-length // e.kv_block_size)
    per_block = kv_bytes_per_block(args, m.tp_size, e.kv_block_size, m.dtype)
    if cfg.shares_kv():
        from daemon.kv_layout import plan_layout
        try:
            usable = len(plan_layout(e.kv_cache_bytes, e.kv_block_size, args.num_hidden_layers,
                                     args.num_key_value_heads // m.tp_size, args.head_dim, m.dtype,
                                     e.count).shared_blocks)
        except ValueError as err:
            problems.append(f"engines.kv_cache_bytes: {err}")
            return
        what = "the shared pool"
    else:
        usable = e.kv_cache_bytes // per_block - 1  # (block 0: padding rows)
        what = "each engine's cache"
    if usable < need:
        capped = "" if length == e.max_model_len else ", capped at the model context"
        problems.append(f"engines.kv_cache_bytes: {e.kv_cache_bytes} bytes give {what} {max(usable, 0)} blocks of "
                        f"{e.kv_block_size} tokens; one sequence of {length} tokens (engines.max_model_len="
                        f"{e.max_model_len}{capped}) needs {need} ({need * per_block} "
                        f"bytes per rank for {name}): raise kv_cache_bytes or lower max_model_len")


def _runtime_dir(path: Path, problems: list[str]) -> None:
    """What ensure_private_dir will refuse, found without creating anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if (why := uncreatable(path)) is not None:
            problems.append(f"runtime_dir: {path} does not exist and cannot be made: {why}")
        return
    except OSError as e:
        problems.append(f"runtime_dir: {path}: {e.strerror}")
        return
    if not stat.S_ISDIR(st.st_mode):
        problems.append(f"runtime_dir: {path} is not a directory (a symlink or file is in the way)")
    elif st.st_uid != os.getuid():
        problems.append(f"runtime_dir: {path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    elif st.st_mode & 0o077:
        problems.append(f"runtime_dir: {path} has mode {stat.S_IMODE(st.st_mode):04o}; expected 0700")


def _token_file(cfg: UnderstudyConfig, problems: list[str]) -> None:
    """An existing token file must be readable, ours alone and non-empty; a missing one, makeable."""
    from wire.secret_file import TokenError, read_token
    path = cfg.resolved_token_file()
    if not path.exists():
        if (why := uncreatable(path)) is not None:
            problems.append(f"admin.token_file: {path} cannot be made: {why}")
        return
    try:
        read_token(path)
    except TokenError as e:
        problems.append(f"admin.token_file: {e}")


def uncreatable(path: Path) -> str | None:
    """Why ``path`` (missing) could not be made with its parent folders, or None: the nearest
    existing ancestor must be a folder this user may write."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable by this user"
    if os.geteuid() == 0:  # access() says yes to root everywhere: /proc and /sys refuse all the same
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".understudy-check-", dir=parent))
        except OSError as e:
            return f"{parent} refuses new folders ({e.strerror})"
    return None


def _child_configs(cfg: UnderstudyConfig, model_path: Path, device: str, problems: list[str]) -> None:
    """Each engine's EngineConfig (or an external engine's command and URL) as serve will build it."""
    from supervisor.effects.child_configs import ChildConfigs
    configs = ChildConfigs(cfg, model_path, device, cfg.resolved_runtime_dir(), "ipc://check")
    external = cfg.engines.kind == "external"
    for name in cfg.engines.slot_names():
        try:
            if external:
                configs.external_engine(name, 1)
            else:
                configs.engine(name, 0, 0)
        except ValidationError as e:
            for err in e.errors():
                field = ".".join(str(p) for p in err["loc"])
                problems.append(f"engines: engine {name!r} cannot be configured: {field}: {err['msg']}")
        except (KeyError, ValueError, IndexError) as e:  # (a template field external.command names)
            problems.append(f"engines{'.external' if external else ''}: engine {name!r}: {e}")


def _daemon_program(cfg: UnderstudyConfig, problems: list[str]) -> None:
    """An external engine's daemon command names a program that is there (as its start would find it)."""
    import shlex
    import shutil
    ext = cfg.engines.external
    program = shlex.split(ext.daemon_command)[0]
    path = ext.env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(program, path=path) is None:
        where = "no such executable file" if "/" in program else "not found on PATH"
        problems.append(f"engines.external.daemon_command: expected a program that can run here, got {program!r} "
                        f"({where})")
