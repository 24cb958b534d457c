"""Staging: pinned copies of the disk and remote pages a step may read (the kernels address HBM and mapped host
memory only), each kept until its page moves or goes; the block table points at them as ``-(STAGED + slot)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.errors import KVTierError
from kvtier.kernels.base import STAGED

if TYPE_CHECKING:
    from kvtier.metrics import CacheStats
    from kvtier.table import BlockTable


class Staging:
    """Pinned copies of disk and remote pages that a step may read, kept until the page moves or goes:
    ``pool(layer)`` ``[slots, 2, P, N_kv, D]``, addressed in the block table as ``-(STAGED + slot)``."""

    def __init__(self, table: BlockTable, stats: CacheStats, has_host: bool, row_pages: int, pin: bool):
        """Staging for the tiers of ``table`` below the device (and below the host tier, ``has_host``: the kernels
        read that one in place), at most ``row_pages`` slots (the pages every row may hold); ``stats``: the ledger
        of the bytes read; ``pin``: pinned pools (a CUDA engine)."""
        layout, tiers = table.layout, table.tiers
        far = [t for i, t in enumerate(tiers) if i > 0 and not (i == 1 and has_host)]
        self.capacity = min(sum(t.capacity for t in far), row_pages)
        self.pools = torch.zeros((layout.num_layers, self.capacity, *layout.page_shape), dtype=layout.kv_dtype,
                                 pin_memory=pin)
        self.where = [dict() for _ in range(layout.num_layers)]  # pid -> (slot, tier, tier slot)
        self.free = [list(range(self.capacity - 1, -1, -1)) for _ in range(layout.num_layers)]
        self.table, self.stats = table, stats

    def pool(self, layer: int) -> torch.Tensor:
        return self.pools[layer]

    def encode(self, layers: np.ndarray, pids: np.ndarray) -> np.ndarray:
        """Staged slots of ``pids`` ``[n]`` in ``layers`` ``[n]`` (read from their tier now where not staged at their
        current place)."""
        tiers, slots = self.table.locate(layers, pids)
        out, todo = np.empty(pids.size, dtype=np.int64), []
        for i, (layer, pid, t, s) in enumerate(zip(layers.tolist(), pids.tolist(), tiers.tolist(), slots.tolist())):
            where, free = self.where[layer], self.free[layer]
            got = where.get(pid)
            if got is not None and got[1:] == (t, s):
                out[i] = got[0]
                continue
            if got is not None:
                free.append(got[0])
            if not free:
                raise KVTierError(f"layer {layer}: the staging pool holds {self.capacity} disk/remote pages; a step "
                                  "lists more: raise engine.max_batch's pages or keep fewer pages far away")
            slot = free.pop()
            where[pid] = (slot, t, s)
            out[i] = slot
            todo.append((layer, t, s, slot))
        reads: dict[tuple, list] = {}  # (layer, tier) -> its todo entries
        for x in todo:
            reads.setdefault(x[:2], []).append(x)
        for (layer, t), mine in reads.items():
            tier = self.table.tiers[t]
            pages = tier.read(layer, torch.tensor([x[2] for x in mine]))
            self.pools[layer][torch.tensor([x[3] for x in mine])] = pages.to(self.pools.device)
            self.stats.add_fetch(f"{tier.name}->staging", pages.numel() * pages.element_size())
        return -(STAGED + out)

    def forget(self, pids) -> None:
        for layer, where in enumerate(self.where):
            for pid in pids:
                got = where.pop(int(pid), None)
                if got is not None:
                    self.free[layer].append(got[0])
