"""One engine process: startup phases, TP worker ranks, the scheduler loop and the HTTP server.

Rank 0 forks ranks 1..N-1 before anything touches CUDA or starts a thread. All ranks share the
engine's process group (rank 0 makes itself the group leader if its starter did not), and if any
worker rank dies the whole group is killed: an engine outlives none of its ranks.
"""
from __future__ import annotations

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
from daemon.kv_attach import KVPoolMapping

from wire.engine_config import BOOT_ERROR_EXIT, EngineConfig, step_token_budget
from engines.core.control import ControlChannel
from engines.core.engine import LLMEngine
from .forked import fork_into
from engines.core import first_use, heap
from wire import gc_pauses
from wire.loopback import free_port
from models import CheckpointError, read_model_args
from models.numerics import check_numerics
from engines.core.runner import KVBudgetError, ModelRunner, init_distributed
from engines.core.core_link import CoreLink, endpoints
from wire.link_sockets import remove_sockets
from .front_end import run_frontend
from .startup import StartupTimer
from .teardown import TEARDOWN_BUDGET_S, exit_deadline, leave_group
from engines.core.tokenizer import TokenizerError, load as load_tokenizer
from .pool_attach import attach_rank_pool
from engines.core.shared_pool import SharedPool
from .weights import RankWeights, engine_source, gather_sources, load_rank_weights

log = logging.getLogger("engines.process.main")
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


GIL_SWITCH_INTERVAL_S = float(os.environ.get("UNDERSTUDY_GIL_SWITCH_S", "0.0005"))


def max_model_len(cfg: EngineConfig, max_positions: int) -> int:
    return min(cfg.max_model_len, max_positions)


def allocate_kv_cache(runner: ModelRunner, cfg: EngineConfig, mml: int, weights: RankWeights, rank: int,
                      group: dist.ProcessGroup | None) -> tuple[KVPoolMapping | None, str]:
    """The paged KV cache (the rank's shared pool, or our own) and the step buffers as the config
    says; returns the pool (None: our own) and the KV source (`shared`, `own`, `own:<reason>`)."""
    if cfg.kv_block_size & (cfg.kv_block_size - 1):
        raise ValueError(f"kv_block_size={cfg.kv_block_size} is not a power of two")
    pool, source = attach_rank_pool(cfg, weights.model, weights.cache_config, rank, runner.device, group)
    runner.allocate_kv_cache(cfg.kv_cache_bytes, cfg.kv_block_size, mml, cfg.max_num_seqs, step_token_budget(cfg),
                             pool)
    return pool, source


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
    """After the fork (OpenMP pools do not survive one): share the cores between CPU ranks.
    The scheduler thread and the HTTP thread share the GIL: a short switch interval hands it back
    to the scheduler soon after its GPU wait ends, instead of after the default 5 ms."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
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
    for sig in (signal.SIGTERM, signal.SIGINT):  # a group signal means "drain": rank 0 decides, then says EXIT
        signal.signal(sig, signal.SIG_IGN)
    _set_process_name(f"engine-{cfg.name}-r{rank}")
    _set_threads(cfg)
    args = read_model_args(cfg.model_path)
    device = bind_rank_device(cfg, rank)
    group = init_distributed(rank, cfg.tp_size, device, dist_port)
    weights = load_rank_weights(cfg, args, rank, device)
    log.info("rank %d weights: %s", rank, weights.source)
    gather_sources(weights.source, group, cfg.tp_size)  # rank 0 reports every rank's source
    runner = ModelRunner(weights.model, device, rank, cfg.tp_size, group, cfg.fused_kernels, cfg.deterministic)
    allocate_kv_cache(runner, cfg, max_model_len(cfg, args.max_position_embeddings), weights, rank, group)
    check_numerics(weights.model, device).raise_if_failed()  # (with rank 0: the products sum across ranks)
    if cfg.cuda_graphs and device.type == "cuda":
        runner.capture_graphs()
    gc_pauses.freeze_startup()
    runner.worker_loop()
    exit_deadline(0)
    leave_group(group)  # with rank 0, at once (NCCL's destroy is collective: engines/process/teardown.py)
    return 0


def _watch_workers(pids: dict[int, int], shutting_down: threading.Event, runtime_dir: str) -> None:
    """Any worker rank exiting outside shutdown kills the engine's whole process group (its link
    sockets removed first: they are still there if the front end had not connected yet)."""
    def wait(pid: int, rank: int) -> None:
        _, status = os.waitpid(pid, 0)
        if not shutting_down.is_set():
            code = os.waitstatus_to_exitcode(status)
            log.error("rank %d (pid %d) exited with %s; killing the engine", rank, pid,
                      f"signal {-code}" if code < 0 else f"code {code}")
            remove_sockets(runtime_dir, os.getpid())
            if code == BOOT_ERROR_EXIT:  # say so to the supervisor; the other workers die with us (PDEATHSIG)
                sys.stderr.flush()
                os._exit(BOOT_ERROR_EXIT)
            os.killpg(os.getpgrp(), signal.SIGKILL)
    for pid, rank in pids.items():
        threading.Thread(target=wait, args=(pid, rank), name=f"watch-rank{rank}", daemon=True).start()


# ---- rank 0 ---------------------------------------------------------------------------------
def run_engine(cfg: EngineConfig) -> int:
    """Start rank 0 (fork the HTTP front end and the other ranks), serve until drained; returns
    the exit code."""
    _become_group_leader()
    _set_process_name(f"engine-{cfg.name}")
    _setup_env()
    gc_pauses.watch()  # (the front end, forked from here, inherits it)
    timer = StartupTimer()
    workers: dict[int, int] = {}
    shutting_down = threading.Event()
    control: ControlChannel | None = None
    link: CoreLink | None = None
    try:
        if cfg.device == "cuda" and cfg.gpu_ids and len(cfg.gpu_ids) != cfg.tp_size:
            raise ValueError(f"gpu_ids has {len(cfg.gpu_ids)} entries but tp_size is {cfg.tp_size} "
                             "(one GPU per rank, or leave gpu_ids empty for cuda:0..tp_size-1)")
        warm_first_use = first_use.asked()
        with timer.phase("tokenizer"):
            args = read_model_args(cfg.model_path)  # first: names a missing folder as such
            tokenizer = load_tokenizer(cfg.model_path)
            mml = max_model_len(cfg, args.max_position_embeddings)
            names = [cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model_path)), cfg.model_path]
            link_eps = endpoints(cfg.runtime_dir)
            me = os.getpid()
            frontend = fork_into(lambda: run_frontend(cfg, tokenizer, names, mml, args.vocab_size, *link_eps, me))
            workers[frontend] = -1  # killed with the workers on a boot error
        with timer.phase("dist_init"):
            port = cfg.dist_port or free_port()
            ranks = _fork_workers(cfg, port)
            workers.update(ranks)
            _watch_workers(ranks, shutting_down, cfg.runtime_dir)
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
            sources = gather_sources(weights.source, group, cfg.tp_size)
            timer.weights_source = engine_source(sources)
            if len(set(sources)) > 1:
                log.warning("weights by rank: %s", ", ".join(f"rank {r} {s}" for r, s in enumerate(sources)))
        control.state("WARMING")
        runner = ModelRunner(weights.model, device, 0, cfg.tp_size, group, cfg.fused_kernels, cfg.deterministic)
        use_graphs = cfg.cuda_graphs and device.type == "cuda"
        with timer.phase("kv_cache"):
            pool, timer.kv_source = allocate_kv_cache(runner, cfg, mml, weights, 0, group)
            timer.kv_pool_id = pool.pool_id if pool else None
        with timer.phase("numerics"):
            numerics = check_numerics(weights.model, device)
            log.info("numerics against float32 PyTorch: %s", numerics.summary())
            numerics.raise_if_failed()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # its float32 references (an LM head, experts) are not the graphs' to keep
        with timer.phase("graph_capture"):
            if use_graphs:
                runner.capture_graphs(defer=cfg.cuda_graphs_before_ready == "largest" and cfg.tp_size == 1)
        log.info("KV cache: %d blocks of %d tokens (%s; max_model_len %d); step budget %d tokens; CUDA graphs: %s; "
                 "fused decode kernels: %s; deterministic: %s; torch's allocator holds %s",
                 runner.num_blocks, cfg.kv_block_size, timer.kv_source, mml, runner.max_rows,
                 (f"{runner.graph_sizes}" + (f" ({len(runner.pending_graphs)} more when the engine has time)"
                                             if runner.pending_graphs else "")) if use_graphs else "off",
                 runner.fused_decode_status, runner.deterministic_status,
                 f"{torch.cuda.memory_reserved(device) / 2**20:.0f} MiB" if device.type == "cuda" else "none on a GPU")
        if pool:
            heap.keep_freed_memory()  # (before the pool's first read: a promotion then touches no new page)
        engine = LLMEngine(runner, tokenizer, mml, cfg.max_num_seqs, control, cfg.heartbeat_interval_s,
                           cfg.prefix_caching, SharedPool(pool, cfg.kv_slot, cfg.kv_tails) if pool else None)
        engine.scheduler.prefill_cap = cfg.max_prefill_tokens_per_step
        log.info("prefill beside decode rows: %s tokens a step", engine.scheduler.prefill_cap or "the budget's")
        first_use.warm(engine, warm_first_use)
        link = CoreLink(engine, *link_eps)
        gc_pauses.freeze_startup()
        rc = _serve(cfg, engine, link, frontend, timer, control)
    except BOOT_ERRORS as e:
        print(f"engine {cfg.name}: failed to start: {e}", file=sys.stderr, flush=True)
        shutting_down.set()  # the watchers must not turn our clean boot-error exit into a group SIGKILL
        _kill_workers(workers)
        return BOOT_ERROR_EXIT
    except BaseException:
        shutting_down.set()
        _kill_workers(workers)
        raise
    finally:
        if link is not None:
            link.close()
    shutting_down.set()
    deadline = exit_deadline(rc) if group is not None else None
    runner.shutdown()
    if group is not None:
        leave_group(group)  # before waiting for the workers: they are in the same collective destroy
    for pid in ranks:
        _wait_pid(pid, timeout=TEARDOWN_BUDGET_S)
    control.close()
    if deadline is not None:
        deadline.cancel()
    return rc


def _serve(cfg: EngineConfig, engine: LLMEngine, link: CoreLink, frontend: int, timer: StartupTimer,
           control: ControlChannel) -> int:
    """Run the scheduler loop with the front end serving HTTP, until a drain completes (0), or the
    loop or the front end dies (1)."""
    drained = threading.Event()

    def drain_begun() -> None:  # scheduler thread
        link.send({"op": "drain"})
        control.state("DRAINING")
    engine.on_drain_begin = drain_begun
    engine.on_drained = drained.set
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: engine.begin_drain())

    with timer.phase("server_ready"):
        link.start()
        engine.start()
        deadline = time.monotonic() + FRONTEND_START_S
        sent = False
        while not link.frontend_ready.wait(0.002):
            sent = sent or link.send({"op": "serve", "startup": timer.summary()})  # taken once it connects
            if _exited(frontend) is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front end did not start on {cfg.host}:{cfg.port} (see above)")
    link.send({"op": "serve", "startup": timer.summary()})  # now with server_ready
    if engine.draining:  # begun before the front end connected: that message was dropped
        link.send({"op": "drain"})
    control.send("startup", **timer.summary())
    control.state("SERVING", port=link.port)
    print(timer.table(), flush=True)
    print("ENGINE_READY " + json.dumps({"name": cfg.name, "port": link.port, "pid": os.getpid(),
                                        "weights_source": timer.weights_source, "kv_source": timer.kv_source}),
          flush=True)
    rc = 0
    while not drained.wait(0.2):
        if engine.stopped.is_set() and not engine.draining:
            log.error("scheduler loop exited unexpectedly; stopping")
            rc = 1
            break
        code = _exited(frontend)
        if code is not None:  # like any rank of the engine: the whole engine goes
            log.error("the HTTP front end exited (%s); killing the engine", code)
            sys.stderr.flush()
            os.killpg(os.getpgrp(), signal.SIGKILL)
    link.send({"op": "stop"})  # it finishes its responses (all complete after a drain) and exits
    deadline = time.monotonic() + FRONTEND_STOP_S
    while _exited(frontend) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.stop()
    return rc


FRONTEND_START_S, FRONTEND_STOP_S = 60.0, 10.0


def _exited(pid: int) -> int | None:
    """The child's exit code once it has exited (reaped here), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status) if done else None


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
