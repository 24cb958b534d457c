"""Sliding windows over pages: which logical pages a step attends, and which are gone for good.

A layer with window W lets the query at position i see keys j with ``i - W < j <= i`` (HF's
``sliding_window``). The kernels apply the window by the keys' order in a batch
(``window_left = W - 1``, FlashInfer's convention), so the cache lists, in the call that holds a
sequence's newest pages, every page from the first one any query sees only in part up to the
newest, contiguously; every other attended page is seen whole by every query of the step.
"""

from __future__ import annotations

import numpy as np


def first_page(start, window, page_size: int):
    """The first logical page a query at ``start`` sees through a window of ``window`` keys (0: a global layer,
    page 0): ints or numpy arrays, broadcast against each other."""
    return np.where(np.asarray(window) > 0, np.maximum(np.asarray(start) - window + 1, 0) // page_size, 0)


def attended_range(start: int, q_len: int, page_size: int, window: int) -> tuple[int, int]:
    """``(first, tail_from)`` logical pages for the queries at positions ``[start, start + q_len)``.

    Pages before ``first`` lie left of every query's window. Pages from ``tail_from`` on are
    attended whole, in one causal call, positions contiguous (so the window's mask is exact);
    the pages in between are seen whole by every query, so any subset of them is exact too.
    A global layer (``window`` 0) has ``first = 0`` and ``tail_from`` the page of ``start``.
    """
    tail = start // page_size
    if not window:
        return 0, tail
    first = int(first_page(start, window, page_size))
    seen_whole = first * page_size >= start + q_len - window  # the last query sees all of page `first`
    return first, tail if seen_whole else first


def out_of_window(seqs: dict, page_size: int, window: int) -> np.ndarray:
    """pids that no sequence's next query can see ``[n]``: left of the window of every holder.

    ``seqs``: sequence -> state with ``pids`` (logical order) and ``length`` (the next query's
    position), as :class:`~kvtier.table.BlockTable` keeps them.
    """
    old, needed = [], []
    for s in seqs.values():
        first = attended_range(s.length, 1, page_size, window)[0]
        old.append(np.asarray(s.pids[:first], dtype=np.int64))
        needed.append(np.asarray(s.pids[first:], dtype=np.int64))
    if not old:
        return np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.concatenate(old), np.concatenate(needed))
