"""What a failover costs the new primary's scheduler thread with a full shared pool, part by part, on
this host's CPU (no GPU: a memfd pool): the index claim (read and check every entry), the block
manager's adoption, then the admission of every continued stream (its Sequence and its prefix match),
with its block keys hashed on the scheduler thread, then given as the front end hashes them
(block_manager.prompt_keys), then the prefix matches alone, all at once (block_manager.match_many), in
the same run.

The pool holds `--streams` sequences' blocks keyed as an engine keys them (blake2b: keys in random
order, as a real pool's are), the rest filled with other random keys.

With `--tails`, each stream's last partial block is left OWNED and named as the dead writer names a
tail (engines/kv/tails.py): a continuation then copies it and recomputes one token.

    python bench/probes/promote_cost.py [--blocks 65536] [--streams 256] [--runs 5] [--twice 20] [--tails]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool
from wire.block_keys import ROOT, block_key, prompt_keys
from engines.core.block_manager import BlockManager, halves
from engines.kv.publish import Publisher
from models.make_model import make_model
from engines.core.sampling import SamplingParams
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer

FP = b"f" * 32


def fill(index: BlockIndex, lay: KVLayout, streams: list[list[int]], rng: random.Random, twice: int = 0,
         tails: bool = False, free: int = 0) -> None:
    """Seal every full block of `streams`, then random keys in the blocks left, stamps shuffled;
    the last `twice` blocks hold keys of others (sealed twice: by the dead primary and the one
    before, as the H200's pools held 0-40 after each failover). `tails`: each stream's last partial
    block (at the pool's end) is OWNED and named as its tail; `free` blocks before them stay FREE (for
    the tails' copies: every claim quarantines the last one's)."""
    keys, blocks, bs = [], list(lay.shared_blocks), lay.block_size
    del blocks[len(blocks) - free:]
    for ids in streams:
        prev = None
        for i in range(len(ids) // bs):
            prev = block_key(prev, ids[i * bs:(i + 1) * bs])
            keys.append(halves(prev))
        if tails and len(ids) % bs:
            block, n = blocks.pop(), len(ids) % bs
            index.owned(block, 1)
            index.tails_completed(np.arange(block * bs, block * bs + n), np.array(ids[-n:]),
                                  [(block, *halves(prev or ROOT))], [block], np.array([n]))
    keys += [(rng.getrandbits(63) | 1, rng.getrandbits(64)) for _ in range(len(blocks) - len(keys) - twice)]
    keys += rng.sample(keys, twice)
    stamps = list(range(1, len(blocks) + 1))
    rng.shuffle(stamps)
    for block, (lo, hi), stamp in zip(blocks, keys, stamps):
        gen = 1000 + block % 3000  # (a pool in use for a while: blocks allocated many times over)
        index.owned(block, gen)
        index.sealed(block, gen, lo, hi, stamp)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=65536)
    p.add_argument("--streams", type=int, default=256, help="continued streams (prompt + answer 200-2048 tokens)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--twice", type=int, default=0, help="blocks whose key another block holds too")
    p.add_argument("--tails", action="store_true", help="each stream's last partial block named as its tail")
    a = p.parse_args()
    rng = random.Random(0)
    tokenizer = Tokenizer(make_model(Path(tempfile.mkdtemp()), "tiny", "llama", seed=0))
    vocab = tokenizer.vocab_size
    streams = [[rng.randrange(vocab) for _ in range(rng.randint(200, 2048))] for _ in range(a.streams)]
    lay = KVLayout(num_blocks=a.blocks, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, FP, torch.device("cpu"), 0)
    index = BlockIndex(pool.fds()[1], pool.index_bytes, pool.layout)
    index.claim(lay, FP)
    fill(index, lay, streams, rng, a.twice, a.tails, free=3 * a.runs * a.streams)  # (for the copies: none evicts)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    claims, adopts, admits, hinted, at_once, reused = [], [], [], [], [], 0
    keys = [prompt_keys(ids, ROOT, 16) for ids in streams]  # (as the front end hashes them)
    for _ in range(a.runs):
        t = time.perf_counter()
        adoption = index.claim(lay, FP)
        claims.append(time.perf_counter() - t)
        bm = BlockManager(lay.num_blocks, 16, scratch=lay.scratch(0), shared=lay.shared_blocks)
        t = time.perf_counter()
        bm.become_writer(adoption, index, Publisher(index, bm.gens, torch.device("cpu")))
        adopts.append(time.perf_counter() - t)
        t = time.perf_counter()
        seqs = [Sequence(ids, greedy, tokenizer, set(), 4096, lambda o: None, replayed=len(ids) // 2)
                for ids in streams]
        for seq in seqs:
            bm.match_prefix(seq)
        admits.append(time.perf_counter() - t)
        reused = sum(s.num_cached for s in seqs)
        bm = BlockManager(lay.num_blocks, 16, scratch=lay.scratch(0), shared=lay.shared_blocks)  # again, hinted
        bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu")))
        t = time.perf_counter()
        seqs = [Sequence(ids, greedy, tokenizer, set(), 4096, lambda o: None, replayed=len(ids) // 2, prefix_keys=k)
                for ids, k in zip(streams, keys)]
        for seq in seqs:
            bm.match_prefix(seq)
        hinted.append(time.perf_counter() - t)
        assert sum(s.num_cached for s in seqs) == reused
        bm = BlockManager(lay.num_blocks, 16, scratch=lay.scratch(0), shared=lay.shared_blocks)  # again, at once
        bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu")))
        seqs = [Sequence(ids, greedy, tokenizer, set(), 4096, lambda o: None, replayed=len(ids) // 2, prefix_keys=k)
                for ids, k in zip(streams, keys)]
        t = time.perf_counter()
        bm.match_many(seqs)
        at_once.append(time.perf_counter() - t)
        assert sum(s.num_cached for s in seqs) == reused
    ms = lambda xs: f"median {statistics.median(xs) * 1e3:.1f} ms (first {xs[0] * 1e3:.1f})"  # noqa: E731
    print(f"{a.blocks} blocks, {len(adoption.sealed)} keyed, {len(adoption.tails.blocks)} tails, runs {a.runs}: "
          f"claim {ms(claims)}, adopt {ms(adopts)}, "
          f"{a.streams} continuations admitted {ms(admits)}, with their keys hashed by the front end {ms(hinted)}, "
          f"their prefixes then matched at once (block_manager.match_many, Sequences apart) {ms(at_once)}, "
          f"{reused} of {sum(map(len, streams))} tokens reused")


if __name__ == "__main__":
    main()
