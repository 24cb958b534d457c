"""What a scope sees of a decode step (:class:`StepView`, built once a step), and the scope interface.

A scope picks, on the device with static shapes, the logical pages each row attends in a layer: ``pick(layer, q,
view)`` -> ``[B, K]`` or ``[B, N_kv, K]`` (-1: none), None (every page) or a :class:`KeyList` of single keys; a
``query_free`` scope instead plans a whole layer group's lists once a step, ``plan(layers, view) -> [L', B, K]``.
Under a token budget the scope chooses the whole pages between each row's spans (:func:`budget_pick`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.budget import TokenBudget
from kvtier.kernels.base import DROPPED

STATS = frozenset({"attention", "salience", "keys", "queries"})


@dataclass
class StepView:
    """One decode step as the scopes read it (device tensors are the engine's static buffers)."""

    table: torch.Tensor  # [L, R, M] int32 locations (device slot, host/staged slot, DROPPED)
    lens: torch.Tensor  # [R] int32 tokens, the one being written included
    spans: torch.Tensor  # [R, 2] int32 (sinks, win_start) of a token budget; (0, 0) where none applies
    pids: torch.Tensor  # [R, M] int32 pid of each logical page (-1 none)
    priority: torch.Tensor | None  # [L, pids] float64 the policy's priority of each pid, when a scope needs it
    batch: int  # rows of the bucket
    page_size: int
    budget: TokenBudget | None
    once: bool  # the budget compressed once: every kept page is a candidate
    dense_layers: int  # the first layers attend every page
    windows: tuple  # per layer: keys a query sees (0: global)

    def rows(self, layers: int | range):
        """``(table [(L',) B, M], lens [B] int64, n_pages [B])`` of a layer or a range of layers."""
        B = self.batch
        lens = self.lens[:B].long()
        at = slice(layers.start, layers.stop) if isinstance(layers, range) else layers
        return self.table[at, :B], lens, (lens + self.page_size - 1) // self.page_size

    def policy_scores(self, layers: int | range) -> torch.Tensor:
        """The policy's priority of each row's logical pages ``[(L',) B, M]`` float64 (higher first)."""
        at = slice(layers.start, layers.stop) if isinstance(layers, range) else layers
        return self.priority[at][..., self.pids[:self.batch].clamp(min=0).long()]

    def window(self, layers: int | range) -> int:
        """Keys a query of the layer(s) sees (0: global); a range's layers share it."""
        return self.windows[layers[0] if isinstance(layers, range) else layers] if self.windows else 0


@dataclass(frozen=True)
class KeyList:
    """A choice of single keys: each row's key positions ``[B, (N_kv,) W]`` int32 (each kv head its own with N_kv),
    in position order, -1 none; what the decode kernel attends in place of a page list (its ``key_list``)."""

    keys: torch.Tensor


def pages_of(choice, max_pages: int, page_size: int) -> torch.Tensor | None:
    """The logical pages a choice reads: a page list as it is, a :class:`KeyList`'s (``[..., B, N_kv, W]``) pages
    once each per row ``[..., B, max_pages]`` (page order, -1 none); None: every page."""
    if choice is None:
        return None
    if not isinstance(choice, KeyList):
        return choice
    keys = choice.keys.flatten(-2)  # [..., B, N_kv * W]
    read = torch.zeros(*keys.shape[:-1], max_pages + 1, dtype=torch.bool, device=keys.device)  # last: the -1s
    read.scatter_(-1, torch.where(keys >= 0, keys // page_size, max_pages).long(), True)
    return compact(read[..., :max_pages])


def compact(keep: torch.Tensor) -> torch.Tensor:
    """The logical pages where ``keep [..., M]`` ascending, then -1: ``[..., M]`` int32. A prefix sum and a scatter,
    no sort (a GPU sort of one row of pages is a ~25 us launch)."""
    M = keep.shape[-1]
    at = torch.where(keep, keep.cumsum(-1) - 1, M)  # [..., M] each kept page's place; the others: a dropped column
    logical = torch.arange(M, dtype=torch.int32, device=keep.device).expand_as(keep)
    out = torch.full((*keep.shape[:-1], M + 1), -1, dtype=torch.int32, device=keep.device)  # [..., M + 1]
    return out.scatter_(-1, at, logical)[..., :M]


def live_mask(table: torch.Tensor, lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages each row holds and has not dropped: ``[..., B, M]`` for ``table [..., B, M]``, ``lens [B]``."""
    logical = torch.arange(table.shape[-1], device=table.device)
    return (table != DROPPED) & (logical < ((lens.long() + page_size - 1) // page_size)[:, None])


def window_pages(lens: torch.Tensor, window: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, for the query at ``lens - 1``: ``(first, tail_from)`` logical pages (:func:`kvtier.window.attended_range`)."""
    s = lens - 1
    if not window:
        return torch.zeros_like(s), s // page_size
    first = (s - window + 1).clamp(min=0) // page_size
    whole = first * page_size >= s + 1 - window
    return first, torch.where(whole, s // page_size, first)


class Scope:
    """Chooses the pages a decode step attends. Subclasses (named by ``_target_``) implement :meth:`pick`.

    ``gives``: the statistics the scope's attention calls can hand the policy (checked against the
    policy's ``needs`` when the engine is built); ``needs_keys``: it reads the key bounds;
    ``needs_rank``: it reads the policy's page ranks; ``device_only``: a decode step attends only the device pages
    (and the page being written), and so does a prefill chunk (before the prompt is in, without an exact prefill)
    besides its own; ``query_free``: its
    choice reads no query, and it implements :meth:`plan` (the step plans every layer at once) instead of
    :meth:`pick`.
    """

    name = "scope"
    gives: frozenset = STATS
    needs_keys = False
    device_only = False

    def needs_rank(self, budget: TokenBudget | None) -> bool:
        return False

    def key_stats(self, layout) -> tuple[frozenset | None, int]:
        """A scope that ``needs_keys``: the key statistics it reads (None: every one,
        :class:`~kvtier.stats.KeyStats`) and the rank of the key sketch it keeps (0: none)."""
        return None, 0

    def bind(self, engine) -> None:
        """Allocate state once the engine exists (its layout, rows, key statistics)."""
        self.engine = engine

    def width(self, view_budget: TokenBudget | None, once: bool, max_pages: int) -> int | None:
        """Page-list width K of a decode step (None: every page)."""
        if view_budget is None:
            return None
        return max_pages if once else view_budget_width(view_budget)

    query_free = False

    def pick(self, layer: int, q: torch.Tensor, view: StepView):
        """Page list of ``layer`` for the queries ``q [B, H, D]``: ``[B, (N_kv,) K]`` or None (every page); a scope
        that chooses single keys returns a :class:`KeyList`."""
        if not self.query_free:
            raise NotImplementedError
        lists = self.plan(range(layer, layer + 1), view)
        return None if lists is None else lists[0]

    def plan(self, layers: range, view: StepView) -> torch.Tensor | None:
        """``query_free`` scopes: the lists of consecutive ``layers`` that share a window and are all dense or all
        budgeted, ``[L', B, (N_kv,) K]`` (None: every page), computed once when the step starts."""
        raise NotImplementedError

    def reset_row(self, row: int) -> None:
        """A new sequence takes ``row``."""

    def start_step(self) -> None:
        """A decode step starts (per-step state of the scope goes)."""

    def prepare(self) -> None:
        """Host work before a decode step is planned (eager, never captured): state the captured steps read."""


def view_budget_width(budget: TokenBudget) -> int:
    """List width of a continuous budget: sink pages, middle pages, the window's pages (one more where it
    straddles); a row the budget holds whole fits it too."""
    P = budget.page_size
    return -(-budget.sinks // P) + budget.middle_pages + -(-budget.window_tokens // P) + 1


def budget_pick(layers: int | range, view: StepView, candidate_score, device_only: bool):
    """A token budget's page lists ``[(L',) B, K]`` of a layer (or a range of layers sharing a window): the sink
    pages, the middle pages with the best ``candidate_score(cand [(L',) B, M] bool, k) -> picks [(L',) B, k]``
    (logical, -1 none), and the window's pages.

    Rows the budget holds whole (continuous budgets) list every live page. The layer's sliding window
    restricts the candidates to the pages every query sees whole, as :mod:`kvtier.window` does.
    """
    budget, P = view.budget, view.page_size
    table, lens, n_pages = view.rows(layers)  # [(L',) B, M]
    B, M = table.shape[-2:]
    lead = table.shape[:-2]
    logical = torch.arange(M, device=table.device)  # [M]
    live = live_mask(table, lens, P)  # [(L',) B, M]
    sinks, win_start = view.spans[:B].long().unbind(1)  # [B]
    first, layer_tail = window_pages(lens, view.window(layers), P)
    cand_lo = -(-budget.sinks // P)
    cand_hi = win_start // P
    tail_from = torch.maximum(first, torch.minimum(cand_hi, layer_tail))  # [B]
    cand = live & (logical >= cand_lo) & (logical < tail_from[:, None]) & (logical >= first[:, None])
    if device_only:
        cand &= table >= 0
    sink = (logical < torch.minimum(torch.full_like(tail_from, cand_lo), tail_from)[:, None]) & (first == 0)[:, None]
    window = (logical >= cand_hi[:, None]) & live
    whole = (win_start == 0)[:, None]  # [B, 1] the row fits the budget: every live page
    if view.once:  # every kept candidate, the window growing
        keep = sink | cand | window
        return compact(torch.where(whole, live, keep))
    k = budget.middle_pages
    n_win = view_budget_width(budget) - cand_lo - k  # the window's pages
    sink_part = torch.where(sink[:, :cand_lo], logical[:cand_lo], -1)  # [B, sink pages]
    win_part = cand_hi[:, None] + torch.arange(n_win, device=table.device)  # [B, n_win]
    win_part = torch.where(win_part < n_pages[:, None], win_part, -1)
    middle = candidate_score(cand, k) if k else torch.zeros(*lead, B, 0, dtype=torch.int32, device=table.device)
    listed = torch.cat([sink_part.to(torch.int32).expand(*lead, B, cand_lo), middle.to(torch.int32),
                        win_part.to(torch.int32).expand(*lead, B, n_win)], -1)  # [(L',) B, K]
    every = torch.where(live, logical, -1).to(torch.int32)  # a row the budget holds whole fits the list
    width = listed.shape[-1]
    every = every[..., :width] if M >= width else torch.cat([every, every.new_full((*lead, B, width - M), -1)], -1)
    return torch.where(whole, every, listed)


def best_of(score: torch.Tensor, cand: torch.Tensor, k: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` (per row at most ``count [...]``) candidates ``cand [..., M]`` with the highest ``score [..., M]``:
    logical pages ``[..., k]`` in page order, then -1. Equal scores: the lower page first; a candidate scored
    -inf or NaN is never taken (the rule of :mod:`kvtier.kernels.triton_page_choice`)."""
    M = score.shape[-1]
    ok = cand & (score > float("-inf"))  # [..., M]
    order = torch.where(ok, score, float("-inf")).argsort(dim=-1, descending=True, stable=True)  # [..., M] best first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(M, device=score.device).expand_as(order))
    keep = ok & (rank < (k if count is None else count.clamp(max=k)[..., None]))  # [..., M]
    out = compact(keep)[..., :k]
    if out.shape[-1] < k:
        out = torch.cat([out, out.new_full((*out.shape[:-1], k - out.shape[-1]), -1)], -1)
    return out
