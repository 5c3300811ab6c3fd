"""One engine process: startup phases, TP worker ranks, the scheduler loop and the HTTP server.

Rank 0 forks ranks 1..N-1 before anything touches CUDA or starts a thread. All ranks share the
engine's process group (rank 0 makes itself the group leader if its starter did not), and if any
worker rank dies the whole group is killed: an engine outlives none of its ranks.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from daemon.client import WeightCacheError

from .config import BOOT_ERROR_EXIT, EngineConfig
from .control import ControlChannel
from .engine import LLMEngine
from .forked import fork_into
from .guarded_http import guarded_config
from .limits import BodyLimit
from .loopback import QuietServer, free_port
from .models import CheckpointError, read_model_args
from .runner import KVBudgetError, ModelRunner, init_distributed
from .server import OpenAIServer, build_app
from .startup import StartupTimer
from .tokenizer import Tokenizer, TokenizerError
from .weights import load_rank_weights

log = logging.getLogger("engines.main")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def bind_rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    """This rank's device, made current. On CUDA, attention avoids cuDNN's SDPA: it builds an
    execution plan per new prompt length (hundreds of ms on first sight of a shape)."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", cfg.gpu_ids[rank] if cfg.gpu_ids else rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def max_model_len(cfg: EngineConfig, max_positions: int) -> int:
    return min(cfg.max_model_len, max_positions)


def _set_process_name(name: str) -> None:
    """Name this process in `ps -o comm` / top (engines forked by the spawn server share its cmdline)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _become_group_leader() -> None:
    """Own a process group so killing the group takes every rank and nothing else."""
    if os.getpgrp() != os.getpid():
        os.setsid()


def _setup_env() -> None:
    """Before any fork: settings every rank inherits."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off


def _set_threads(cfg: EngineConfig) -> None:
    """After the fork (OpenMP pools do not survive one): share the cores between CPU ranks."""
    if cfg.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tp_size))


# ---- worker ranks ---------------------------------------------------------------------------
def _fork_workers(cfg: EngineConfig, dist_port: int) -> dict[int, int]:
    """Fork ranks 1..N-1 (before CUDA or threads exist); returns {pid: rank}."""
    pids = {}
    for rank in range(1, cfg.tp_size):
        pids[fork_into(lambda rank=rank: _run_worker(cfg, rank, dist_port))] = rank
    return pids


# Problems of configuration or checkpoint: the engine exits BOOT_ERROR_EXIT, and a restart would not help.
BOOT_ERRORS = (CheckpointError, TokenizerError, KVBudgetError, WeightCacheError, ValueError, FileNotFoundError)


def _run_worker(cfg: EngineConfig, rank: int, dist_port: int) -> int:
    try:
        return _worker_main(cfg, rank, dist_port)
    except BOOT_ERRORS as e:
        print(f"engine {cfg.name} rank {rank}: failed to start: {e}", file=sys.stderr, flush=True)
        return BOOT_ERROR_EXIT


def _worker_main(cfg: EngineConfig, rank: int, dist_port: int) -> int:
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before prctl took effect
        return 1
    _set_process_name(f"engine-{cfg.name}-r{rank}")
    for sig in (signal.SIGTERM, signal.SIGINT):  # a group signal means "drain": rank 0 decides, then says EXIT
        signal.signal(sig, signal.SIG_IGN)
    _set_threads(cfg)
    args = read_model_args(cfg.model_path)
    device = bind_rank_device(cfg, rank)
    group = init_distributed(rank, cfg.tp_size, device, dist_port)
    weights = load_rank_weights(cfg, args, rank, device)
    log.info("rank %d weights: %s", rank, weights.source)
    dist.barrier(group=group)
    runner = ModelRunner(weights.model, device, rank, cfg.tp_size, group, cfg.fused_kernels)
    use_graphs = cfg.cuda_graphs and device.type == "cuda"
    slots = runner.allocate_kv_cache(cfg.kv_cache_bytes, max_model_len(cfg, args.max_position_embeddings),
                                     cfg.max_num_seqs, reserve_pad_slot=use_graphs)
    if use_graphs:
        runner.capture_graphs(slots)
    runner.worker_loop()
    dist.destroy_process_group()
    return 0


def _watch_workers(pids: dict[int, int], shutting_down: threading.Event) -> None:
    """Any worker rank exiting outside shutdown kills the engine's whole process group."""
    def wait(pid: int, rank: int) -> None:
        _, status = os.waitpid(pid, 0)
        if not shutting_down.is_set():
            code = os.waitstatus_to_exitcode(status)
            log.error("rank %d (pid %d) exited with %s; killing the engine", rank, pid,
                      f"signal {-code}" if code < 0 else f"code {code}")
            if code == BOOT_ERROR_EXIT:  # say so to the supervisor; the other workers die with us (PDEATHSIG)
                sys.stderr.flush()
                os._exit(BOOT_ERROR_EXIT)
            os.killpg(os.getpgrp(), signal.SIGKILL)
    for pid, rank in pids.items():
        threading.Thread(target=wait, args=(pid, rank), name=f"watch-rank{rank}", daemon=True).start()


# ---- rank 0 ---------------------------------------------------------------------------------
def run_engine(cfg: EngineConfig) -> int:
    """Start rank 0 (and fork the others), serve until drained; returns the exit code."""
    _become_group_leader()
    _set_process_name(f"engine-{cfg.name}")
    _setup_env()
    timer = StartupTimer()
    workers: dict[int, int] = {}
    shutting_down = threading.Event()
    control: ControlChannel | None = None
    try:
        if cfg.device == "cuda" and cfg.gpu_ids and len(cfg.gpu_ids) != cfg.tp_size:
            raise ValueError(f"gpu_ids has {len(cfg.gpu_ids)} entries but tp_size is {cfg.tp_size} "
                             "(one GPU per rank, or leave gpu_ids empty for cuda:0..tp_size-1)")
        with timer.phase("tokenizer"):
            args = read_model_args(cfg.model_path)  # first: names a missing folder as such
            tokenizer = Tokenizer(cfg.model_path)
        with timer.phase("dist_init"):
            port = cfg.dist_port or free_port()
            workers = _fork_workers(cfg, port)
            _watch_workers(workers, shutting_down)
            _set_threads(cfg)
            device = bind_rank_device(cfg, 0)
            group = init_distributed(0, cfg.tp_size, device, port)
        control = ControlChannel(cfg.control_endpoint, cfg.name, cfg.incarnation)
        for name, secs in timer.phases.items():  # the phases that ran before the channel existed
            control.send("phase", phase=name, seconds=secs)
        timer.on_phase = lambda name, secs, src: control.send(
            "phase", phase=name, seconds=secs, **({"source": src} if src else {}))
        control.state("ATTACHING")
        with timer.phase("weights"):
            weights = load_rank_weights(cfg, args, 0, device)
            timer.weights_source = weights.source
            if group is not None:
                dist.barrier(group=group)
        control.state("WARMING")
        runner = ModelRunner(weights.model, device, 0, cfg.tp_size, group, cfg.fused_kernels)
        use_graphs = cfg.cuda_graphs and device.type == "cuda"
        mml = max_model_len(cfg, args.max_position_embeddings)
        with timer.phase("kv_cache"):
            slots = runner.allocate_kv_cache(cfg.kv_cache_bytes, mml, cfg.max_num_seqs, reserve_pad_slot=use_graphs)
        with timer.phase("graph_capture"):
            graph_sizes = runner.capture_graphs(slots) if use_graphs else []
        log.info("KV cache: %d slots of %d tokens; CUDA graphs: %s; fused decode kernels: %s", slots, mml,
                 graph_sizes or "off", runner.fused_decode_status)
        engine = LLMEngine(runner, tokenizer, mml, cfg.max_num_seqs, control, cfg.heartbeat_interval_s)
        names = [cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model_path)), cfg.model_path]
        srv = OpenAIServer(engine, tokenizer, names, mml, args.vocab_size, timer.summary, cfg.limits)
        rc = asyncio.run(_serve(cfg, engine, srv, timer, control))
    except BOOT_ERRORS as e:
        print(f"engine {cfg.name}: failed to start: {e}", file=sys.stderr, flush=True)
        shutting_down.set()  # the watchers must not turn our clean boot-error exit into a group SIGKILL
        _kill_workers(workers)
        return BOOT_ERROR_EXIT
    except BaseException:
        shutting_down.set()
        _kill_workers(workers)
        raise
    shutting_down.set()
    runner.shutdown()
    for pid in workers:
        _wait_pid(pid, timeout=30)
    if group is not None:
        dist.destroy_process_group()
    control.close()
    return rc


async def _serve(cfg: EngineConfig, engine: LLMEngine, srv: OpenAIServer, timer: StartupTimer,
                 control: ControlChannel) -> int:
    """Run uvicorn and the scheduler loop until a drain completes (0) or the loop dies (1)."""
    loop = asyncio.get_running_loop()
    app = BodyLimit(build_app(srv), cfg.limits.max_body_bytes)
    server = QuietServer(guarded_config(app, cfg.listener, f"engine {cfg.name}", host=cfg.host, port=cfg.port,
                                        log_level="warning", lifespan="off", access_log=False))

    def drain_begun() -> None:  # scheduler thread
        srv.accepting = False
        control.state("DRAINING")
    engine.on_drain_begin = drain_begun
    engine.on_drained = lambda: loop.call_soon_threadsafe(setattr, server, "should_exit", True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, engine.begin_drain)

    with timer.phase("server_ready"):
        engine.start()
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError(f"HTTP server did not start on {cfg.host}:{cfg.port}")
            await asyncio.sleep(0.002)
    port = server.servers[0].sockets[0].getsockname()[1]
    control.send("startup", **timer.summary())
    control.state("SERVING", port=port)
    print(timer.table(), flush=True)
    print("ENGINE_READY " + json.dumps({"name": cfg.name, "port": port, "pid": os.getpid(),
                                        "weights_source": timer.weights_source}), flush=True)
    rc = 0
    while not serving.done():
        await asyncio.wait([serving], timeout=0.5)
        if engine.stopped.is_set() and not engine.draining:
            log.error("scheduler loop exited unexpectedly; stopping")
            server.should_exit = server.force_exit = True  # in-flight requests can never finish
            rc = 1
    serving.result()
    engine.stop()
    return rc


def _wait_pid(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    log.warning("worker pid %d did not exit in %.0f s; killing it", pid, timeout)
    os.kill(pid, signal.SIGKILL)


def _kill_workers(workers: dict[int, int]) -> None:
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
