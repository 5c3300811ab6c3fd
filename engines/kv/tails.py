"""The tails a dead writer named in the shared KV pool's index, as the new writer finds them
(engines/core/tail_publisher.py names them; why, and what a continuation does with one, is said there)."""
from __future__ import annotations

from collections.abc import Sequence as Ids

from daemon.kv_index import Tails


class AdoptedTails:
    """The new writer's side: the tails the pool named when it took the writer role."""

    def __init__(self, tails: Tails) -> None:
        self._blocks = tails.blocks.tolist()
        self._gens = tails.gens.tolist()
        self._hi = tails.parent_hi.tolist()
        self._fill = tails.fill.tolist()
        self._tokens = tails.tokens
        self._by_parent: dict[int, list[int]] = {}
        for i, lo in enumerate(tails.parent_lo.tolist()):
            self._by_parent.setdefault(lo, []).append(i)

    def __len__(self) -> int:
        return len(self._blocks)

    def find(self, parent: tuple[int, int], ids: Ids[int], gens: list[int]) -> int | None:
        """A block whose tail follows `parent` with at least these token `ids` complete, still as the
        pool named it (not allocated since), if there is one."""
        n = len(ids)
        for i in self._by_parent.get(parent[0], ()):
            block = self._blocks[i]
            if self._hi[i] == parent[1] and self._fill[i] >= n and gens[block] == self._gens[i] \
                    and self._tokens[i, :n].tolist() == ids:
                return block
        return None
