"""The block index of a shared KV pool: one memfd beside the pool, mapped read-write by the daemon and
every engine of the rank. Fixed-width fields (numpy over the mapping), never pickle.

Header: magic, version, the pool's layout and identity, the digest of the weights' fingerprint (a pool
never serves another model), and the writer: epoch, pid and start time. Per block: a state word
(state | checksum << 32), a generation (bumped at every allocation), the writer epoch that allocated
it, an LRU stamp, the 128-bit key of its tokens and all before them, and the digest of its keys and
values when sealed (0: not known; engines/kv/integrity.py). After the entries, the token ids of every
block's positions (`block_size` int32 a block).

A block that is not SEALED may hold a sequence's *tail*: its positions after the sequence's last full
block. Its entry then says how many of them are complete (`fill`: written by steps that completed on
the device), under which key they follow (`parent`: the key of the block before, or the root), which
block came before it in the sequence (`prev`), and the token ids hold them. A continued stream takes
them (copied to a block of its own: the dead writer's last kernels may still be writing the positions
after `fill`) and recomputes one token instead of the rest of its last block (engines/core/tail_publisher.py).
A SEALED block that began as a tail keeps its parent and token ids: a tail's `prev` names it, for a
continuation whose client had not got all of it when the writer died; so does the block allocated after
it (`prev` is written at allocation), until a completed step names that block's own tail.

States: FREE (nobody writes it), OWNED (a writer allocated it and may be writing it: it holds no
usable data), SEALED (its keys and values are complete and keyed; nobody writes it until a writer
takes it back, which first marks it OWNED).

Crash consistency, with a single writer: a block is marked OWNED (word first) before any step that
writes it is launched; it is SEALED (fields first, word last, one 8-byte store) only once the step
that filled it has completed on the device. So a writer killed at any instant leaves every block
either FREE, OWNED (torn or unfinished: never reused as data) or SEALED and whole. A SEALED entry
whose checksum does not match was not written by this protocol: the whole index is distrusted.

One writer: `claim` takes the role at a new epoch once the previous writer process runs no more user
code (fenced: SIGKILLed and exiting, or gone, or it released the role); every later write checks that
the header still names this writer, so a writer fenced by a newer epoch stops instead of writing.
Blocks the previous writer left OWNED may still be written by its last kernels on the device (a
process's GPU work outlives its last user instruction): the new writer quarantines them until the
supervisor says that writer's whole process group is gone (`engines/core/block_manager.py`).
"""
from __future__ import annotations

import mmap
import os
import resource
import time
from dataclasses import dataclass

import numpy as np

from .kv_layout import KVLayout
from wire.proc import runs_user_code, start_ticks

MAGIC = int.from_bytes(b"USKVIDX1", "little")
VERSION = 3  # 2: tails (parent, fill, token ids); 3: the blocks' digests
HEADER_BYTES = 4096
FREE, OWNED, SEALED = 0, 1, 2
_MASK64 = (1 << 64) - 1

HEADER = np.dtype([
    ("magic", "<u8"), ("version", "<u8"), ("num_blocks", "<u8"), ("block_size", "<u8"), ("layers", "<u8"),
    ("kv_heads", "<u8"), ("head_dim", "<u8"), ("dtype", "S16"), ("scratch_slots", "<u8"),
    ("scratch_blocks", "<u8"), ("fingerprint", "S32"), ("pool_id", "S16"),
    ("writer_epoch", "<u8"), ("writer_pid", "<u8"), ("writer_start", "<u8"),
])
ENTRY = np.dtype([("word", "<u8"), ("gen", "<u8"), ("epoch", "<u8"), ("stamp", "<u8"),
                  ("key_lo", "<u8"), ("key_hi", "<u8"), ("parent_lo", "<u8"), ("parent_hi", "<u8"),
                  ("fill", "<u8"), ("prev", "<u8"), ("digest", "<u8")])
TOKEN = np.dtype("<i4")
_LAYOUT_FIELDS = ("num_blocks", "block_size", "layers", "kv_heads", "head_dim", "scratch_slots", "scratch_blocks")


class UntrustedIndex(Exception):
    """The index cannot be trusted (wrong magic, layout or fingerprint, corrupt entries)."""


class FencedError(Exception):
    """This engine is no longer the writer: a newer epoch claimed the pool."""


class PreviousWriterAlive(Exception):
    """The previous writer still runs user code: it was not fenced, so the role cannot be taken."""


def index_bytes(num_blocks: int, block_size: int) -> int:
    return HEADER_BYTES + num_blocks * (ENTRY.itemsize + block_size * TOKEN.itemsize)


_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def checksum(key_lo, key_hi, gen, epoch):  # noqa: ANN001, ANN201 (ints, or uint64 arrays for a whole index)
    """32 bits mixed from a sealed entry's fields (the same arithmetic on Python ints and on numpy
    uint64 arrays, which wrap): an entry not written whole by `sealed` fails it."""
    if isinstance(key_lo, int):
        m = ((key_lo * _MIX[0]) ^ (key_hi * _MIX[1]) ^ (gen * _MIX[2]) ^ (epoch * _MIX[3])) & _MASK64
        return m >> 32
    c = [np.uint64(x) for x in _MIX]
    return ((key_lo * c[0]) ^ (key_hi * c[1]) ^ (gen * c[2]) ^ (epoch * c[3])) >> np.uint64(32)


@dataclass
class Tails:
    """Blocks whose entries name a tail (arrays, one row a block): the first `fill` positions are
    complete and follow the key `parent`; `tokens` holds each one's token ids. Not SEALED, or SEALED
    and the block before a tail (`prev`): whole."""

    blocks: np.ndarray
    gens: np.ndarray  # their generations (a block allocated again since holds another sequence)
    parent_lo: np.ndarray
    parent_hi: np.ndarray
    fill: np.ndarray
    tokens: np.ndarray  # [blocks, block_size] int32


@dataclass
class Taken:
    """The writer role, taken (`BlockIndex.take`): its epoch, how long it waited for the previous
    writer to stop, and why the index was emptied first (None: it was not)."""

    epoch: int
    waited_s: float
    reset_reason: str | None = None


@dataclass
class Adoption:
    """What a new writer finds (arrays, read in one pass): keyed blocks with their keys' two halves
    (sorted by key_lo, for lookups), the order of their stamps (for eviction), free blocks, and blocks
    a previous writer may still be writing (quarantined until it is gone)."""

    sealed: np.ndarray  # block ids, by key_lo
    key_lo: np.ndarray
    key_hi: np.ndarray
    stamps: np.ndarray  # their stamps (the order they were sealed in: eviction goes oldest first)
    free: np.ndarray
    quarantined: np.ndarray
    gens: np.ndarray  # the generation of every shared block, from layout.shared_start on
    next_stamp: int
    tails: Tails
    reset_reason: str | None = None  # why the index was distrusted and emptied, if it was
    waited_s: float = 0.0  # how long the claim waited for the previous writer to stop running
    sort_s: float = 0.0  # of the claim, putting the keys in order (`_key_order`)
    sort_cpu_s: float = 0.0  # of that, this thread's CPU time (the rest it waited: off CPU, or for the GIL)
    sort_faults: int = 0  # page faults it took


def _faults() -> int:
    """Page faults this thread has taken (minor and major; 0 where the system cannot say)."""
    try:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return 0
    return usage.ru_minflt + usage.ru_majflt


def _key_order(lo: np.ndarray, hi: np.ndarray, stamp: np.ndarray) -> np.ndarray:
    """The order that sorts keys by (lo, hi, stamp): equal keys adjacent, the newest last. ``lo``
    (random 64-bit halves) is sorted by a radix pass on its top 16 bits, then a stable sort of what
    is then nearly sorted (timsort's runs); only runs of equal lo (a key sealed twice, by two writers
    both whole, or halves that clash: a few blocks a failover) are sorted by (hi, stamp). A promotion
    waits for this: 1.4 ms for 65k keys on the dev VM, where one quicksort took 3.7, and a lexsort of
    the three (done whenever one lo was repeated: most failovers) 15."""
    by_top = np.argsort((lo >> np.uint64(48)).astype(np.uint16), kind="stable")
    order = by_top[np.argsort(lo[by_top], kind="stable")]
    ordered = lo[order]
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(repeated):
        at = np.union1d(repeated, repeated + 1)  # (the places of each run, in lo order)
        run = order[at]
        order[at] = run[np.lexsort((stamp[run], hi[run], lo[run]))]
    return order


def _repeated_keys(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For keys sorted so that equal ones are adjacent: True where the next key is the same one."""
    dup = np.zeros(len(lo), dtype=bool)
    if len(lo) > 1:
        dup[:-1] = (lo[1:] == lo[:-1]) & (hi[1:] == hi[:-1])
    return dup


class BlockIndex:
    """One rank's index over a writable mapping of its memfd (the daemon creates, engines attach)."""

    def __init__(self, fd: int, size: int, layout: KVLayout) -> None:
        n, bs = layout.num_blocks, layout.block_size
        if size != index_bytes(n, bs) or os.fstat(fd).st_size < size:
            raise UntrustedIndex(f"KV index fd holds {os.fstat(fd).st_size} bytes ({size} said), expected "
                                 f"{index_bytes(n, bs)} for {n} blocks of {bs} tokens")
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.header = np.ndarray((), HEADER, buffer=self._map, offset=0)
        self.entries = np.ndarray((n,), ENTRY, buffer=self._map, offset=HEADER_BYTES)
        self.tokens = np.ndarray((n, bs), TOKEN, buffer=self._map, offset=HEADER_BYTES + n * ENTRY.itemsize)
        self._token_at = self.tokens.reshape(-1)  # by KV slot (block * block_size + offset)
        # Each field as its own array: one block's field writes ~3x faster through it than through the
        # block's entry (0.5 against 1.3 us an allocation's `owned` on the dev VM).
        self._f = {name: self.entries[name] for name in ENTRY.names}
        self.digests = self._f["digest"]  # (read-only outside `digested`: what each block held when sealed)
        self.epoch = 0  # ours, once we hold the writer role
        self._pid = os.getpid()

    # ---- the daemon ------------------------------------------------------------------------
    def initialise(self, layout: KVLayout, fingerprint: bytes, pool_id: bytes) -> None:
        """Write a fresh header (every block FREE) for a new pool."""
        h = self.header
        self.entries[:] = 0
        for name in _LAYOUT_FIELDS:
            h[name] = getattr(layout, name)
        h["dtype"], h["fingerprint"], h["pool_id"] = layout.dtype.encode(), fingerprint, pool_id
        h["writer_epoch"] = h["writer_pid"] = h["writer_start"] = 0
        h["version"] = VERSION
        h["magic"] = MAGIC  # last: a half-written header is never taken for a valid one

    @property
    def pool_id(self) -> bytes:
        return bytes(self.header["pool_id"])

    # ---- checks ----------------------------------------------------------------------------
    def problem(self, layout: KVLayout, fingerprint: bytes) -> str | None:
        """Why this index does not describe a pool of `layout` for these weights, if it does not."""
        h = self.header
        if int(h["magic"]) != MAGIC or int(h["version"]) != VERSION:
            return f"bad magic or version ({int(h['magic']):#x}, {int(h['version'])})"
        if bytes(h["fingerprint"]) != fingerprint:
            return "the index belongs to other weights (fingerprint differs)"
        for name in _LAYOUT_FIELDS:
            if int(h[name]) != getattr(layout, name):
                return f"layout {name} is {int(h[name])}, expected {getattr(layout, name)}"
        if h["dtype"].item().decode() != layout.dtype:
            return f"layout dtype is {h['dtype'].decode()!r}, expected {layout.dtype!r}"
        if len(self.entries) < layout.num_blocks:
            return f"{len(self.entries)} entries for {layout.num_blocks} blocks"
        return None

    def peek(self, layout: KVLayout, fingerprint: bytes) -> Adoption | str:
        """What a claim would adopt now (or why it would distrust the index), without claiming.

        A peek reads beside a running writer, so it sees some SEALED entries mid-write (a bad
        checksum: half of the standbys' first reads under load on the H200 did): it leaves those out
        and goes on, where a claim would distrust the index. It then runs the claim's whole path,
        sort included, and a parked standby's rehearsal (engines/core/engine.py `_rehearse`) warms
        what its claim will use. Rehearsals that stopped at the first torn entry are the likely
        reason why one claim in 20 still sorted on memory it had never touched (74 ms, 4,030 page
        faults; bench/RESULTS.md, 2026-12-03)."""
        reason = self.problem(layout, fingerprint)
        if reason is not None:
            return reason
        try:
            return self._read(layout, int(self.header["writer_epoch"]) + 1, strict=False)
        except UntrustedIndex as e:
            return str(e)

    # ---- the writer role -------------------------------------------------------------------
    def claim(self, layout: KVLayout, fingerprint: bytes, wait_s: float = 2.0) -> Adoption:
        """Become the writer at the next epoch and read what the pool holds (`take`, then `adopt`).
        Waits (up to `wait_s`) for the previous writer to run no more user code; PreviousWriterAlive
        if it still does."""
        return self.adopt(layout, fingerprint, self.take(layout, fingerprint, wait_s))

    def take(self, layout: KVLayout, fingerprint: bytes, wait_s: float = 2.0) -> Taken:
        """The writer role alone, at the next epoch (a header that does not describe this pool is
        emptied first): once the previous writer runs no more user code, nobody else writes the index,
        so what it holds can be read afterwards (`adopt`), while the node already routes to us.
        PreviousWriterAlive if the previous writer still runs after `wait_s`."""
        h = self.header
        reason = self.problem(layout, fingerprint)
        epoch = int(h["writer_epoch"]) + 1 if reason is None else 1
        pid, started = int(h["writer_pid"]), int(h["writer_start"])
        began = time.monotonic()
        deadline = began + wait_s
        while pid != self._pid and runs_user_code(pid, started):
            if time.monotonic() >= deadline:
                raise PreviousWriterAlive(f"the pool's writer (pid {pid}, epoch {int(h['writer_epoch'])}) still "
                                          f"runs: it must be fenced before epoch {epoch} takes over")
            time.sleep(0.001)
        waited = time.monotonic() - began
        if reason is not None:  # distrusted: an empty pool, never served from
            self.initialise(layout, fingerprint, self.pool_id)
        self._stamp_writer(epoch)
        return Taken(epoch, waited, reason)

    def adopt(self, layout: KVLayout, fingerprint: bytes, taken: Taken) -> Adoption:
        """What the pool holds, read by the writer that `take` made us (an index whose entries cannot be
        trusted is emptied: nothing it held is served)."""
        reason = taken.reset_reason
        adoption = None
        if reason is None:
            try:
                adoption = self._read(layout, taken.epoch)
            except UntrustedIndex as e:
                reason = str(e)
                self.initialise(layout, fingerprint, self.pool_id)
                self._stamp_writer(taken.epoch)
        if adoption is None:
            adoption = self._read(layout, taken.epoch)
            adoption.reset_reason = reason
        adoption.waited_s = taken.waited_s
        return adoption

    def _stamp_writer(self, epoch: int) -> None:
        h = self.header
        h["writer_pid"], h["writer_start"] = self._pid, start_ticks(self._pid) or 0
        h["writer_epoch"] = epoch
        self.epoch = epoch

    def release(self) -> None:
        """Give the writer role up (a planned demotion: every step has completed)."""
        self._check()
        self.header["writer_pid"] = self.header["writer_start"] = 0
        self.epoch = 0

    def _read(self, layout: KVLayout, epoch: int, strict: bool = True) -> Adoption:
        """Every shared block's state, checked (vectorised: a pool of 100k blocks reads in ms). Not
        `strict` (a peek): SEALED entries with a bad checksum are left out instead of distrusted."""
        e = self.entries[layout.shared_start:layout.num_blocks]
        ids = np.arange(layout.shared_start, layout.num_blocks)
        word = e["word"]
        state = word & np.uint64(0xFFFFFFFF)
        bad = (state > SEALED) | (e["epoch"] >= epoch)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UntrustedIndex(f"block {int(ids[i])} has state {int(state[i])} and epoch {int(e['epoch'][i])} "
                                 f"(the pool's writer epoch is {epoch - 1})")
        s = state == SEALED
        lo, hi, gen, ep, stamp = e["key_lo"][s], e["key_hi"][s], e["gen"][s], e["epoch"][s], e["stamp"][s]
        torn = ((word[s] >> np.uint64(32)) != checksum(lo, hi, gen, ep)) | (lo == 0)  # (lo 0: no key)
        if torn.any():
            if strict:
                raise UntrustedIndex(f"block {int(ids[s][torn][0])} is SEALED with a bad checksum")
            s[np.flatnonzero(s)[torn]] = False
            lo, hi, gen, ep, stamp = (x[~torn] for x in (lo, hi, gen, ep, stamp))
        sorting, cpu, faults = time.perf_counter(), time.thread_time(), _faults()
        order = _key_order(lo, hi, stamp)
        sort = {"sort_s": time.perf_counter() - sorting, "sort_cpu_s": time.thread_time() - cpu,
                "sort_faults": _faults() - faults}
        dup = _repeated_keys(lo[order], hi[order])
        keep = order[~dup]
        sealed_ids, free = ids[s], ids[state == FREE]
        if dup.any():
            free = np.sort(np.concatenate([free, sealed_ids[order[dup]]]))
        next_stamp = int(stamp.max()) + 1 if s.any() else 1
        return Adoption(sealed_ids[keep], lo[keep], hi[keep], stamp[keep], free, ids[state == OWNED],
                        e["gen"].copy(), next_stamp, self._tails(layout, ids, state), **sort)

    def _tails(self, layout: KVLayout, ids: np.ndarray, state: np.ndarray) -> Tails:
        start, e = layout.shared_start, self.entries[layout.shared_start:layout.num_blocks]
        fill, parent = e["fill"], e["parent_lo"]
        t = (state != SEALED) & (fill > 0) & (fill <= layout.block_size) & (parent != 0)
        # the blocks before the tails, and before blocks allocated but not yet written by a completed
        # step (their sequence's last block was sealed just before the writer died), as positions in `e`
        prev = e["prev"][t | ((state == OWNED) & (fill == 0))].astype(np.int64) - start
        prev = np.unique(prev[(prev >= 0) & (prev < len(e))])
        whole = prev[(state[prev] == SEALED) & (parent[prev] != 0)]
        at = np.concatenate([np.flatnonzero(t), whole])
        return Tails(ids[at], e["gen"][at], parent[at], e["parent_hi"][at],
                     np.where(state[at] == SEALED, layout.block_size, fill[at]), self.tokens[ids[at]])

    def _check(self) -> None:
        h = self.header
        if self.epoch == 0 or int(h["writer_epoch"]) != self.epoch or int(h["writer_pid"]) != self._pid:
            raise FencedError(f"the pool's writer is now epoch {int(h['writer_epoch'])} pid {int(h['writer_pid'])}; "
                              f"this engine (epoch {self.epoch}, pid {self._pid}) may no longer write it")

    # ---- writes (the writer only) ----------------------------------------------------------
    def owned(self, block: int, gen: int, prev: int = 0) -> None:
        """`block` is allocated (generation `gen`), after `prev` in its sequence (0: first): from now on
        it may be written."""
        self._check()
        f = self._f
        f["fill"][block] = 0  # the tail its last user left is no longer there
        f["word"][block] = OWNED
        f["digest"][block] = 0  # first of the rest: a SEALED block stops being one before anything else changes
        f["gen"][block], f["epoch"][block] = gen, self.epoch
        f["parent_lo"][block], f["prev"][block] = 0, prev

    def tail_copied(self, block: int, parent_lo: int, parent_hi: int, tokens: list[int]) -> None:
        """`block` takes another block's tail (copied on the device): its parent key and the token ids
        of its first positions (named complete only once a step after the copy has: its fill)."""
        self._check()
        f = self._f
        f["parent_lo"][block], f["parent_hi"][block] = parent_lo, parent_hi
        self.tokens[block, :len(tokens)] = tokens

    def tails_completed(self, slots: np.ndarray, tokens: np.ndarray, began: list[tuple[int, int, int]],
                        blocks: np.ndarray, fills: np.ndarray) -> None:
        """Tails whose positions completed: the token ids at those KV `slots`, then the parent key of
        each tail that `began` (block, lo, hi), then each tail's `fill`: a fill never covers a position
        whose token or parent is not written yet. (The block before a tail, `prev`, was written when
        the block was allocated: `owned`.)"""
        self._check()
        f = self._f
        self._token_at[slots] = tokens
        for block, lo, hi in began:
            f["parent_lo"][block], f["parent_hi"][block] = lo, hi
        f["fill"][blocks] = fills

    def sealed(self, block: int, gen: int, key_lo: int, key_hi: int, stamp: int) -> None:
        """`block` (still at generation `gen`) holds the complete keys and values of that key."""
        self._check()
        f = self._f
        f["key_lo"][block], f["key_hi"][block], f["stamp"][block] = key_lo, key_hi, stamp
        f["word"][block] = SEALED | checksum(key_lo, key_hi, gen, int(f["epoch"][block])) << 32  # last: one 8-byte store

    def digested(self, block: int, digest: int) -> None:
        """The digest of SEALED `block`'s keys and values (the caller checked it is still at the
        generation that was digested)."""
        self._check()
        self._f["digest"][block] = digest

    def freed(self, block: int, keep_tail: bool = False) -> None:
        """`block` is FREE; its tail stays named only for a sequence handed off (`keep_tail`): a
        continuation will look for it."""
        self._check()
        self._f["word"][block] = FREE
        if not keep_tail:
            self._f["fill"][block] = 0

    def stamped(self, block: int, stamp: int) -> None:
        """A sealed block became unreferenced (its LRU position, read back by the next writer)."""
        self._check()
        self._f["stamp"][block] = stamp

    def close(self) -> None:
        del self.header, self.entries, self.tokens, self._token_at, self._f
        self._map.close()
