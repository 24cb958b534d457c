"""``topk``: recall, each decode step attends the keys that matter wherever they live (docs/architecture.md,
"Scopes, budgets and statistics in the step", lists every option).

``unit="token"``, ``rank="sketch"`` (the default): each kv head of each row chooses single keys by their share of
its query group's attention under an 8-bit low-rank sketch of every key kept on the device (:class:`~kvtier.stats.
KeyStats`; Loki, arXiv:2406.02542; ShadowKV, arXiv:2410.21465): two Triton launches a layer inside the captured
step (:mod:`kvtier.kernels.triton_key_choice`), read in place as a :class:`~kvtier.scopes.base.KeyList`.
``unit="page"``: whole pages, by Quest's bound (Tang et al., 2024, arXiv:2406.10774; :mod:`kvtier.kernels.
triton_page_choice`) or, under a token budget, ``quest_head``, ``gauss`` (:func:`gauss_mass`) or ``sketch``
(:func:`sketch_mass`). Equal scores: the lower page (key) first; picks are listed in page (position) order.
``recall_slots``, ``landing_slots`` and ``predictor``: :mod:`kvtier.scopes.recall`, :mod:`kvtier.scopes.predict`.
"""

from __future__ import annotations

import inspect

import torch

from kvtier.budget import TokenBudget
from kvtier.compiling import compile_step
from kvtier.stats import over_heads, page_bounds
from kvtier.errors import ConfigError
from kvtier.kernels.reference import key_choice_reference, page_choice_reference
from kvtier.scopes.predict import make_predictor
from kvtier.scopes.base import KeyList, Scope, StepView, best_of, budget_pick, compact, live_mask, window_pages
from kvtier.scopes.simple import live_pages

RANKS = ("quest", "quest_head", "gauss", "sketch")
UNITS = ("page", "token")  # what the choice picks: whole pages, or single keys
QUEST_FIELDS = frozenset({"key_min", "key_max", "count"})  # the key statistics each rank reads
FIELDS = {"quest": QUEST_FIELDS, "quest_head": QUEST_FIELDS, "gauss": frozenset({"key_sum", "key_sq", "count"}),
          "sketch": frozenset({"count"})}


def check_topk_options(rank: str, unit: str, query_rows, policy_share) -> None:
    """The topk scope's ``rank`` (one of :data:`RANKS`), ``unit``, ``query_rows`` and ``policy_share``."""
    if rank not in RANKS:
        raise ConfigError("scope.rank", f"unknown rank {rank!r}; use one of {list(RANKS)}")
    if unit not in UNITS:
        raise ConfigError("scope.unit", f"unknown unit {unit!r}; use one of {list(UNITS)}")
    if not isinstance(query_rows, int) or isinstance(query_rows, bool) or query_rows < 1:
        raise ConfigError("scope.query_rows", f"must be an integer >= 1, got {query_rows!r}")
    if isinstance(policy_share, bool) or not isinstance(policy_share, (int, float)) or \
            not 0.0 <= policy_share <= 1.0:  # nan too
        raise ConfigError("scope.policy_share", f"must be in [0, 1], got {policy_share!r}")


class TopK(Scope):
    name = "topk"
    needs_keys = True

    def __init__(self, pages: int | None = None, rank: str = "sketch", per_head: bool | None = None,
                 query_rows: int = 1, policy_share: float = 0.0, recall_slots: int = 0, sinks: int = 4,
                 sketch_rank: int | None = None, unit: str = "token", predictor=None, landing_slots: int = 0):
        for key, v, low in (("scope.pages", pages, 1), ("scope.recall_slots", recall_slots, 0),
                            ("scope.landing_slots", landing_slots, 0),
                            ("scope.sinks", sinks, 0), ("scope.sketch_rank", sketch_rank, 1)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise ConfigError(key, f"must be an integer >= {low}, got {v!r}")
        check_topk_options(rank, unit, query_rows, policy_share)
        if sketch_rank is not None and rank != "sketch":
            raise ConfigError("scope.sketch_rank", f"only rank 'sketch' keeps a key sketch (rank is {rank!r}): set "
                                                   "scope.rank=sketch or leave sketch_rank null")
        if unit == "token":
            chosen = {"rank": rank != "sketch", "per_head": per_head is False, "query_rows": query_rows > 1,
                      "policy_share": bool(policy_share), "landing_slots": bool(landing_slots)}
            if any(chosen.values()):
                key = next(k for k, v in chosen.items() if v)
                raise ConfigError(f"scope.{key}", "a choice of single keys scores each key from its sketch (rank "
                                                  "'sketch'), for each kv head its own keys, by the newest query, and "
                                                  "reads them in place (no landing slots): leave it unset, or set "
                                                  "scope.unit=page")
        self.pages, self.rank, self.unit, self.query_rows = pages, rank, unit, query_rows
        self.per_head = unit == "token" or bool(per_head)
        self.policy_share, self.recall_slots, self.sinks = float(policy_share), recall_slots, sinks
        self.sketch_rank = sketch_rank  # rank 'sketch': None is head_dim / 2 (8 bits: a quarter of the 16-bit keys)
        if self.per_head and recall_slots and unit == "page":
            raise ConfigError("scope.recall_slots", "the recall cache admits one page list per row; per_head gives "
                                                    "each kv head its own: set scope.per_head=false or recall_slots=0")
        if landing_slots and not recall_slots:
            raise ConfigError("scope.landing_slots", "pages land to be admitted into the recall cache: set "
                                                     "scope.recall_slots (and a host tier)")
        self.landing_slots = landing_slots
        self.predictor = make_predictor(predictor)
        if self.predictor is not None and not recall_slots:
            raise ConfigError("scope.predictor", "a prediction is fetched into the recall cache: set "
                                                 "scope.recall_slots (and a host tier)")
        if self.predictor is not None and query_rows > 1:
            raise ConfigError("scope.predictor", "a choice over the last query_rows queries would remember the "
                                                 "estimates: set scope.query_rows=1 with a predictor")

    def key_stats(self, layout) -> tuple[frozenset, int]:
        """The key statistics the choice reads and the rank of the key sketch it keeps (0: none)."""
        if self.rank != "sketch":
            return FIELDS[self.rank], 0
        rank = self.sketch_rank or max(layout.head_dim // 2, 1)
        if rank > layout.head_dim:
            raise ConfigError("scope.sketch_rank", f"must be at most the head dim {layout.head_dim}, got {rank}")
        return FIELDS[self.rank], rank

    def needs_rank(self, budget: TokenBudget | None) -> bool:
        return budget is not None and budget.mode == "continuous" and self.policy_share > 0

    def bind(self, engine) -> None:
        super().bind(engine)
        budget_only = [n for n, v in (("per_head", self.per_head and self.unit == "page"),
                                      ("query_rows", self.query_rows > 1), ("policy_share", self.policy_share > 0),
                                      ("rank", self.rank not in ("quest", "sketch") or
                                       (self.rank == "sketch" and self.unit == "page"))) if v]
        if engine.budget is None and budget_only:
            raise ConfigError(f"scope.{budget_only[0]}", "this option chooses a token budget's middle pages: set "
                                                         "cache.attend_budget=true (Python: budget=)")
        if engine.budget is None and self.pages is None:
            raise ConfigError("scope.pages", "scope 'topk' without a token budget needs pages >= 1 (the keys it "
                                             "chooses are that many pages' worth); or set cache.attend_budget=true")
        if engine.budget is None and self.unit == "page" and self.rank != "quest":
            raise ConfigError("scope.rank", "without a token budget the page choice is Quest's: set scope.rank=quest")
        self.recent = None  # [L, R, query_rows, H, D] the last decode queries of each (layer, row), made at the first
        layout = engine.layout
        L, R, M = layout.num_layers, engine.config.max_batch, engine.max_pages
        self.seen = torch.zeros(L, R, dtype=torch.int64, device=engine.device)
        self._forced = compile_step(forced_pages, dynamic=False) if engine.compiled else forced_pages
        self.start_step()
        self.fused = engine.kernel.name == "triton"  # the choice as Triton launches (scores, selection)
        self.key_lists = None
        if self.unit == "token":  # each layer's lists, static: the captured step writes them in place
            width = self.width(engine.budget, False, M)
            self.key_lists = torch.full((L, R, layout.num_kv_heads, width), -1, dtype=torch.int32,
                                        device=engine.device)
        if self.fused:  # imported here: triton.jit picks compiled or interpreted kernels (TRITON_INTERPRET) at import
            from kvtier.kernels.triton_key_choice import KeyChoiceWork, key_choice
            from kvtier.kernels.triton_page_choice import ChoiceWork, page_choice

            self._fused_choice, self._fused_keys, self._key_work = page_choice, key_choice, KeyChoiceWork.make
            self.work = ChoiceWork.make(R, M, engine.device)
            self.key_work = None  # the key choice's scratch, made at its first call (it needs the query heads)

    def reset_row(self, row: int) -> None:
        self.seen[:, row] = 0

    def start_step(self) -> None:
        self._lists = {}  # a layer group's first index -> its lists, candidates and room (or spans) this step

    def prepare(self) -> None:
        """Before a step that chooses keys from the sketch: its maps, fitted once from every stored key."""
        e = self.engine
        if self.rank != "sketch" or e.keys.fitted or not any(
                s is not None and e.table.seq_len(s) + 1 > self._choosing_from(e.budget) for s in e.row_seq):
            return
        seqs = list(e.table.seqs)
        e.keys.fit_sketch([(e.table.pages(s), [kv[0] for kv in e.read_sequence(s, e.table.seq_len(s), e.device)])
                           for s in seqs])

    def _choosing_from(self, budget: TokenBudget | None) -> int:
        """The keys past which a row has a choice to make."""
        return budget.tokens if budget is not None else self.width(None, False, self.engine.max_pages) * \
            (1 if self.unit == "token" else self.engine.layout.page_size)

    def width(self, budget, once, max_pages):
        P = self.engine.layout.page_size
        if self.unit == "token" and not once:  # keys: the budget's, or the sinks, the chosen and the page written
            return budget.tokens if budget is not None else self.sinks + self.pages * P + P
        if budget is None:
            tail = max([-(-w // P) + 1 for w in self.engine.layout.sliding_windows if w] + [1])
            return min(-(-self.sinks // P) + tail + self.pages, max_pages)  # max_pages: every page, exact
        return super().width(budget, once, max_pages)

    def pick(self, layer: int, q: torch.Tensor, view: StepView):
        if layer < view.dense_layers:
            return live_pages(layer, view)
        if self.unit == "token" and not view.once:
            return self._pick_keys(layer, q, view)
        q = self._remember(layer, q, view.batch) if view.budget is not None else q[:, None]  # [B, r, H, D]
        if view.budget is None:
            return self._pick_pages(layer, q[:, 0], view)
        if self.per_head:  # an estimated mass is computed once for every kv head's choice
            mass = self._mass(layer, q, view) if self.rank in ("gauss", "sketch") else None
            per_head = [budget_pick(layer, view, lambda c, k, h=h: self._choose(layer, q, view, c, k, kv_head=h,
                                                                                 mass=mass),
                                    device_only=False) for h in range(self.engine.layout.num_kv_heads)]
            return torch.stack(per_head, 1)  # [B, N_kv, K]
        return budget_pick(layer, view, lambda c, k: self._middle(layer, q, view, c, k), device_only=False)

    def _pick_keys(self, layer: int, q: torch.Tensor, view: StepView) -> KeyList:
        """Each kv head's keys of ``layer`` for the queries ``q [B, H, D]``: the spans' keys and the middle's best
        by their sketched share (:mod:`kvtier.kernels.triton_key_choice`)."""
        B, keys = view.batch, self.engine.keys
        spans, n = self._key_spans(layer, view)
        out = self.key_lists[layer, :B]  # [B, N_kv, W]
        args = (q, keys.query_map[layer], keys.sketch[layer], view.pids[:B], view.table[layer, :B], view.lens[:B], spans,
                n, out, view.window(layer))
        if self.fused:
            if self.key_work is None:  # once, before any capture: every later call writes the same scratch
                e = self.engine
                self.key_work = self._key_work(e.config.max_batch, e.layout.num_kv_heads,
                                               e.max_pages * view.page_size, q.device)
            self._fused_keys(*args, work=self.key_work)
        else:
            key_choice_reference(*args)
        return KeyList(out)

    def _key_spans(self, layer: int, view: StepView) -> tuple[torch.Tensor, int]:
        """``(spans [B, 2], n)``: the keys each row shows (``(sinks, win_start)``, win_start 0: every key) and how
        many it chooses: the budget's, or without one ``scope.sinks``, the page being written and ``pages`` pages'
        worth of chosen keys (once a step for a layer group)."""
        P = view.page_size
        if view.budget is not None:
            return view.spans[:view.batch], view.budget.middle_pages * P
        group = next(g for g in self.engine.groups if layer in g)
        if group.start not in self._lists:
            lens = view.lens[:view.batch].long()
            tail = (lens - 1).clamp(min=0) // P * P  # the page being written
            whole = lens <= self.width(None, False, self.engine.max_pages)
            self._lists[group.start] = torch.stack([torch.full_like(lens, self.sinks),
                                                    torch.where(whole, 0, tail)], 1).to(torch.int32)
        return self._lists[group.start], self.pages * P

    def _middle(self, layer, q, view, cand, k):
        k_policy = int(round(self.policy_share * k))
        if not k_policy:
            return self._choose(layer, q, view, cand, k)
        by_policy = best_of(view.policy_scores(layer), cand, k_policy)  # [B, k_policy]
        taken = torch.zeros_like(cand).scatter_(1, by_policy.clamp(min=0).long(), by_policy >= 0)
        rest = self._choose(layer, q, view, cand & ~taken, k - k_policy)
        return torch.cat([by_policy, rest], 1)

    def _choose(self, layer: int, q: torch.Tensor, view: StepView, cand: torch.Tensor, k: int,
                count: torch.Tensor | None = None, kv_head: int | None = None,
                mass: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The best ``k`` (at most ``count [B]``) candidates ``cand [B, M]`` for the row queries ``q [B, r, H, D]``:
        ``[B, k]`` logical pages in page order, -1 none. Scores over the query heads (per kv head: its group's):
        the max of Quest's bounds, the sum of ``gauss``'s and ``sketch``'s estimated shares (``mass [B, M, H]``
        when the caller has them: :meth:`_shares`). ``out [B, k]``: where Quest's choice is written."""
        keys, pids = self.engine.keys, view.pids[:view.batch]  # [B, M]
        n_kv = self.engine.layout.num_kv_heads
        if self.rank in ("gauss", "sketch"):  # estimated attention mass per head: summed over the heads sharing
            ub = self._mass(layer, q, view) if mass is None else mass  # [B, M, H]
            return best_of(over_heads(ub, n_kv, kv_head, torch.sum), cand & (pids >= 0), k, count)
        if self.rank == "quest_head":  # each head's bounds as a softmax over the candidates
            ub = page_bounds(q, keys.key_min[layer], keys.key_max[layer], pids)  # [B, M, H]
            ub = torch.softmax(ub.masked_fill(~cand[..., None], float("-inf")) * q.shape[-1] ** -0.5, dim=1)
            return best_of(over_heads(ub, n_kv, kv_head), cand & (pids >= 0), k, count)
        if self.fused:
            return self._fused_choice(q, keys.key_min[layer], keys.key_max[layer], pids, cand, k, count, kv_head,
                                      self.work, out)
        picked = page_choice_reference(q, keys.key_min[layer], keys.key_max[layer], pids, cand, k, count, kv_head)
        return picked if out is None else out.copy_(picked)

    def _mass(self, layer: int, q: torch.Tensor, view: StepView) -> torch.Tensor:
        """Each live page's estimated share of each head's attention for the row queries ``q [B, r, H, D]``, max
        over the rows: ``[B, M, H]`` (:func:`gauss_mass`, :func:`sketch_mass`)."""
        keys, pids = self.engine.keys, view.pids[:view.batch]  # [B, M]
        ids, live = pids.long().clamp(min=0), pids >= 0
        mass = gauss_mass if self.rank == "gauss" else sketch_mass
        return torch.stack([mass(q[:, i], keys, layer, ids, live, live) for i in range(q.shape[1])]).amax(0)

    def _remember(self, layer: int, q: torch.Tensor, B: int) -> torch.Tensor:
        """Add the decode query ``q [B, H, D]``; the last ``query_rows`` queries of each row ``[B, r, H, D]``."""
        if self.query_rows == 1:
            return q[:, None]
        if self.recent is None:
            L, R = self.seen.shape
            self.recent = torch.zeros(L, R, self.query_rows, *q.shape[1:], device=q.device)
        seen = self.seen[layer, :B]
        rows = torch.arange(B, device=q.device)
        self.recent[layer, rows, seen % self.query_rows] = q.float()
        self.seen[layer, :B] += 1
        order = (seen[:, None] + 1 + torch.arange(self.query_rows, device=q.device)) % self.query_rows  # oldest first
        got = self.recent[layer, rows[:, None], order]  # [B, r, H, D]
        filled = torch.arange(self.query_rows, device=q.device)[None, :] >= self.query_rows - (seen[:, None] + 1)
        return torch.where(filled[..., None, None], got, got[:, -1:])  # missing rows repeat the newest

    def _pick_pages(self, layer: int, q: torch.Tensor, view: StepView) -> torch.Tensor:
        """No budget: the sink pages and the tail (forced), and the ``pages`` best of the rest."""
        M = view.table.shape[-1]
        width = self.width(None, False, M)
        if width >= M:  # every page fits the list: exact
            return live_pages(layer, view)
        group = next(g for g in self.engine.groups if layer in g)
        if group.start not in self._lists:  # once a step for the group: its layers share the window
            P = view.page_size
            self._lists[group.start] = self._forced(view.table[group.start:group.stop, :view.batch],
                                                    view.lens[:view.batch], view.window(layer), P,
                                                    -(-self.sinks // P), self.pages, width)
        lists, free, room = (x[layer - group.start] for x in self._lists[group.start])
        self._choose(layer, q[:, None], view, free, self.pages, count=room, out=lists[:, width - self.pages:])
        return lists  # [B, width] int32


OPTIONS = frozenset(inspect.signature(TopK).parameters) - {"pages", "sinks"}  # what a caller may set beside those


def forced_pages(table: torch.Tensor, lens: torch.Tensor, window: int, page_size: int, sink_pages: int, pages: int,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The choice without a budget before the bound, for the layers ``table [L', B, M]`` of one window and ``lens
    [B]``: ``(lists [L', B, width], free [L', B, M], room [L', B])``, the lists with the sink pages and the tail first
    (logical, page order, -1 none) and ``pages`` places for the bound's picks (-1), the other live pages seen (the
    candidates) and the picks left to each row. Pure tensor work: compiled, one or two launches a step."""
    M = table.shape[-1]
    lens = lens.long()
    logical = torch.arange(M, device=table.device)  # [M]
    live = live_mask(table, lens, page_size)  # [L', B, M]
    first, tail_from = window_pages(lens, window, page_size)  # [B]
    seen = live & (logical >= first[:, None])
    forced = ((logical >= tail_from[:, None]) | (logical < sink_pages)) & seen
    room = (pages - forced.sum(-1)).clamp(min=0)  # [L', B]
    picks = torch.full((*table.shape[:-1], pages), -1, dtype=torch.int32, device=table.device)
    return torch.cat([compact(forced)[..., :width - pages], picks], -1), seen & ~forced, room


def gauss_mass(q: torch.Tensor, keys, layer: int, pids: torch.Tensor, live: torch.Tensor,
               cand: torch.Tensor) -> torch.Tensor:
    """Each candidate page's share of a head's attention ``[B, M, H]`` (0 for the others) for the query ``q [B, H,
    D]``, with q·k taken as Gaussian over the page's keys (channel means mu, variances var from ``keys``' sums;
    pids ``[B, M]``, the row's pages ``live [B, M]``, ``cand [B, M]``): log sum_t exp(s q·k_t) ~ log n + s q·mu +
    s^2 / 2 sum_d q_d^2 var_d, ``s = D^-1/2``, normalised over every live page (the Gaussian moment-generating
    function, as Expected Attention, arXiv:2510.00636, applies it to a distribution of queries)."""
    B, H, D = q.shape
    n = keys.count[layer][pids]  # [B, M]
    mu = keys.key_sum[layer][pids] / n.clamp(min=1)[..., None, None]  # [B, M, N_kv, D]
    var = (keys.key_sq[layer][pids] / n.clamp(min=1)[..., None, None] - mu.square()).clamp(min=0)
    n_kv, s = mu.shape[2], D ** -0.5
    qg = q.float().view(B, 1, n_kv, H // n_kv, D)  # [B, 1, N_kv, G, D]
    log_z = (n.clamp(min=1).log()[..., None, None] + s * (qg * mu[:, :, :, None]).sum(-1)
             + 0.5 * s * s * (qg.square() * var[:, :, :, None]).sum(-1)).flatten(2)  # [B, M, H]
    return shares(log_z, live & (n > 0), cand)


def sketch_logits(q: torch.Tensor, keys, layer: int, pids: torch.Tensor) -> torch.Tensor:
    """Approximate scaled logits ``[B, M, P, H]`` of the query ``q [B, H, D]`` with every key of the pages ``pids
    [B, M]`` (-inf past a page's stored keys) from the keys' low-rank sketch (``keys.sketch``/``keys.query_map``:
    :class:`~kvtier.stats.KeyStats`; ShadowKV's low-rank key cache, Sun et al., 2024, arXiv:2410.21465). Reads r/(2D)
    of the 16-bit keys' bytes."""
    B, H, D = q.shape
    y = keys.sketch[layer][pids].float()  # [B, M, P, N_kv, r]
    n_kv, P = y.shape[3], y.shape[2]
    qr = torch.einsum("bkgd,kdr->bkgr", q.float().view(B, n_kv, H // n_kv, D), keys.query_map[layer])  # [B, N_kv, G, r]
    logits = torch.einsum("bmpkr,bkgr->bmpkg", y, qr).flatten(3) * D ** -0.5  # [B, M, P, H]
    stored = torch.arange(P, device=q.device) < keys.count[layer][pids][..., None]  # [B, M, P]
    return logits.masked_fill(~stored[..., None], float("-inf"))


def sketch_mass(q: torch.Tensor, keys, layer: int, pids: torch.Tensor, live: torch.Tensor,
                cand: torch.Tensor) -> torch.Tensor:
    """Each candidate page's share of a head's attention ``[B, M, H]`` (0 for the others) for the query ``q [B, H,
    D]``: the log-sum-exp of each page's approximate logits (:func:`sketch_logits`), normalised over every live
    page as :func:`gauss_mass`."""
    n = keys.count[layer][pids]  # [B, M]
    return shares(sketch_logits(q, keys, layer, pids).logsumexp(2), live & (n > 0), cand)


def shares(log_z: torch.Tensor, live: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Each head's softmax over the ``live [B, M]`` pages of their log masses ``log_z [B, M, H]``, 0 outside
    ``cand [B, M]``."""
    share = torch.softmax(log_z.masked_fill(~live[..., None], float("-inf")), dim=1).nan_to_num(0.0)
    return share.masked_fill(~cand[..., None], 0.0)
