"""TieredKVCache: a transformers ``Cache`` over an :class:`~kvtier.engine.Engine` session, for ``generate``
and any code that runs the model's own forward (``past_key_values=cache``).

The model's forward drives the engine's step: ``update()`` of layer 0 opens it (a prefill chunk while the
prompt comes in, then one decode token per sequence), every layer's ``update()`` writes its K/V and the
attention hook's ``attend()`` reads the pages the scope picks. Everything else (the token budget, the
policy's statistics, migrations, fidelity) is the engine's; this class only translates.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kvtier.budget import TokenBudget, token_budget
from kvtier.cache_base import ACTIVE_CACHE, STEP_MASK
from kvtier.checks import check_engine_args
from kvtier.compat import PagedCacheBase
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.hook import route, use_hook
from kvtier.layout import KVLayout
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import Scope, TopK, make_scope
from kvtier.scopes.base import pages_of
from kvtier.scopes.topk import OPTIONS as TOPK_OPTIONS
from kvtier.tiers.base import Tier


# keywords the Python door renamed -> what to pass instead (one spelling on every door, the recipes')
RENAMED = {"backend": "kernel=... (a backend or its name, as in the recipes and on kvtier.Engine)",
           "window": "budget=kvtier.TokenBudget(tokens, window=...)",
           "mode": "budget=kvtier.TokenBudget(tokens, mode=...)"}


def check_renamed(options, where: str) -> None:
    """ConfigError naming the new spelling of a keyword in ``options`` that the Python door renamed."""
    for old, new in RENAMED.items():
        if old in options:
            raise ConfigError(old, f"{where} takes no {old}= any more: pass {new}")


def cache_scope(scope, pages: int | None, sinks: int | None, budget: TokenBudget | None, options: dict,
                device_pages: int | None = None) -> Scope:
    """The cache's scope: a :class:`~kvtier.scopes.Scope` as given, or the one named ``scope``; ``topk`` takes TopK's
    ``options`` (its ``pages``: ``pages``, else ``device_pages``; its ``sinks``: ``sinks``, else the token budget's,
    else 4), no other scope takes any."""
    if unknown := sorted(set(options) - TOPK_OPTIONS):
        raise ConfigError(unknown[0], f"is no keyword of the cache nor an option of scope 'topk' (which takes "
                                      f"{sorted(TOPK_OPTIONS | {'topk_pages', 'sinks'})})")
    if scope == "topk":
        try:
            return TopK(device_pages if pages is None else pages,
                        sinks=sinks if sinks is not None else budget.sinks if budget is not None else 4, **options)
        except ConfigError as e:  # TopK names its recipe key; this door's keyword for it is topk_pages
            if e.field != "scope.pages" or pages is None:
                raise
            raise ConfigError("topk_pages", str(e).split(": ", 1)[1]) from None
    given = [k for k, v in (("topk_pages", pages), ("sinks", sinks)) if v is not None] + list(options)
    if given:
        sinks_hint = " (a token budget's sinks: budget=kvtier.TokenBudget(tokens, sinks=...))" \
            if given[0] == "sinks" else ""
        raise ConfigError(f"scope.{given[0]}", f"is an option of scope 'topk', not of {scope!r}{sinks_hint}")
    return make_scope(scope)


def _of_engine(name: str) -> property:
    """A read-only attribute of the cache that is its engine's ``name``."""
    return property(lambda self: getattr(self.engine, name), doc=f"The engine's ``{name}``.")


class TieredKVCache(PagedCacheBase):
    """Paged, tiered KV cache for a batch of ``batch_size`` rows (``generate``'s rows: prompts x ``expand``).

    ``kernel``, ``budget``, ``exact_prefill``, ``dense_layers``, ``fidelity``: as on :class:`~kvtier.engine.Engine`;
    ``scope``: a name or a :class:`~kvtier.scopes.Scope`, ``topk_pages``, ``sinks`` and ``topk`` (``rank``,
    ``unit``, ...) :class:`~kvtier.scopes.TopK`'s.

    ``cache.close()`` (or leaving ``with cache:``) closes the tiers and gives each model whose forward ran over it
    (:meth:`forward`, ``kvtier.cache_for``) its own attention back (:func:`kvtier.hook.route`).

    A left-padded batch (``attention_mask`` of zeros before each row's first token) stores and attends only its
    rows' tokens: padding is never in a page, so never attended nor counted in a budget. ``expand``: the rows come
    in runs of ``expand`` identical prompts (``generate``'s ``max(num_beams, num_return_sequences)``): each run's
    prompt is prefilled once and its rows decode copy-on-write forks of it; beam search's ``reorder_cache`` forks
    the chosen beams the same way (:meth:`~kvtier.engine.Engine.reorder`).
    """

    def __init__(self, layout: KVLayout, tiers: list[Tier], policy: Policy, scheduler: Scheduler | None = None,
                 kernel=None, scope: str | Scope = "all", topk_pages: int | None = None, sinks: int | None = None,
                 batch_size: int = 1, fidelity: bool = False, budget: TokenBudget | None = None,
                 exact_prefill: bool = False, dense_layers: int = 0, expand: int = 1, **topk):
        check_renamed(topk, "TieredKVCache")
        for key, value in (("batch_size", batch_size), ("expand", expand)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
        if batch_size % expand:
            raise ConfigError("expand", f"the batch's {batch_size} rows are not runs of {expand} rows of one prompt")
        check_engine_args(None, layout, None, exact_prefill=exact_prefill, fidelity=fidelity)
        budget = token_budget(budget, layout.page_size)
        scope = cache_scope(scope, topk_pages, sinks, budget, topk)
        super().__init__(layout)
        self.layout = layout
        self.engine = Engine(None, layout, tiers, policy, scope, scheduler, kernel, budget=budget,
                             exact_prefill=exact_prefill, dense_layers=dense_layers, fidelity=fidelity,
                             config=EngineConfig(max_batch=batch_size, compile=False))
        self._routed: dict = {}  # model -> release() of its routing through kvtier (kvtier.hook.route)
        weakref.finalize(self, _release_routes, self._routed)  # a cache gone unclosed gives the models back too
        self.sequences, self.expand = batch_size, expand  # rows of the batch; rows per prompt
        self.seqs: list[int] = []  # the engine sequence of each row (while prefilling: of each run's first row)
        self.prefilled = False
        self.seen = 0  # tokens each row has fed, padding included (HF's positions in the batch)
        self._attended = -1
        self._gather = None  # the prefill step's rows and tokens that are stored: ([T], [T]), None: all of them
        self._scatter = None  # and where each row's kept tokens take their output from: ([n], [n], [n])
        self._empty = False  # a prefill step that brings no stored token (padding only)

    # -- what the engine keeps --------------------------------------------------------------------
    stats = _of_engine("stats")
    table = _of_engine("table")
    transfer = _of_engine("transfer")
    policy = _of_engine("policy")
    fidelity = _of_engine("fidelity")
    device = _of_engine("device")
    kv_bytes_per_token = _of_engine("kv_bytes_per_token")
    stats_bytes_per_token = _of_engine("stats_bytes_per_token")
    hit_rate = _of_engine("hit_rate")  # cache.hit_rate(): attended pages read from the device tier, every step

    @property
    def scope(self) -> str:
        return self.engine.scope.name

    # -- transformers Cache interface ---------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write K/V ``[B, N_kv, q, D]`` of ``layer_idx``; returns them unchanged (attention reads pages)."""
        B, _, q_len, _ = key_states.shape
        if B != self.sequences:
            raise ConfigError("batch_size", f"the cache was built for {self.sequences} rows, the model runs {B}: "
                                            "generate runs prompts x max(num_beams, num_return_sequences) rows; build "
                                            "it with that batch_size (kvtier.cache_for(..., batch_size=prompts, "
                                            "expand=rows per prompt); kvtier.offload sizes it itself)")
        if layer_idx == 0:
            self._begin(q_len, key_states)
        elif self._attended != layer_idx - 1:  # the layer before wrote its K/V, then attended without kvtier
            raise ConfigError("attn_implementation", "the model's attention does not go through kvtier, so it "
                                                     "would read only the new tokens' K/V: call "
                                                     "kvtier.hook.use_hook(model) (kvtier.Engine does)")
        if not self._empty:
            self.engine.store(layer_idx, self._gathered(key_states), self._gathered(value_states))
        ACTIVE_CACHE.set(self)
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Paged attention of ``query [B, H, q, D]`` for ``layer`` under the scope: ``[B, q, H, D]`` (zeros at
        padding). The hook's link is taken: each layer's ``update`` sets it again, and a forward with another cache
        (or none) finds no kvtier cache instead of this one."""
        self._attended = layer
        ACTIVE_CACHE.set(None)
        if self._empty:
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        out = self.engine.attend(layer, self._gathered(query), scaling)  # [B or 1, q or T, H, D]
        if self._scatter is None:
            return out
        rows, tokens, source = self._scatter
        full = out.new_zeros(query.shape[0], query.shape[2], *out.shape[2:])  # [B, q, H, D]
        full[rows, tokens] = out[0, source]
        return full

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``r`` goes on with a copy-on-write fork of the sequence of row ``beam_idx[r]``."""
        order = [int(r) for r in beam_idx.reshape(-1).tolist()]
        if not self.prefilled:  # the prompt's forward came last: each row's sequence first
            self.end_prefill()
        if order != list(range(len(self.seqs))):
            self.finish_step()
            self.seqs = self.engine.reorder(order)

    # -- padding and prompts prefilled once ---------------------------------------------------------------
    def _kept(self, q_len: int, B: int) -> np.ndarray | None:
        """The tokens of the step's ``q_len`` per row that are stored ``[B, q]`` (bool), from the forward's padding
        mask (:data:`~kvtier.cache_base.STEP_MASK`); None: every one. Only left padding is kept out."""
        mask = STEP_MASK.get()
        STEP_MASK.set(None)
        if mask is None:
            return None
        if tuple(mask.shape) != (B, self.seen + q_len):
            raise ConfigError("attention_mask", f"has shape {tuple(mask.shape)}; this step's is [{B}, "
                                                f"{self.seen + q_len}] (the tokens seen and the new ones)")
        mask = mask.bool().cpu().numpy()
        if mask.all():
            return None
        new = mask[:, -q_len:]
        count = new.sum(1)  # [B]
        started = mask[:, :self.seen].any(1)  # rows with a token before this step
        left = new == (np.arange(q_len) >= q_len - count[:, None])  # zeros only before the row's first token
        if not left.all() or (started & (count < q_len)).any():
            row = int(np.flatnonzero(~left.all(1) | (started & (count < q_len)))[0])
            raise ConfigError("attention_mask", f"row {row} masks a token after its first one; kvtier keeps out left "
                                                "padding only (tokenizer padding_side='left'), never a token between "
                                                "two it stores")
        return new

    def _plan_prefill(self, kept: np.ndarray | None, q_len: int, B: int) -> list[int]:
        """Each run's tokens stored this step (its first row's), and the gather/scatter of the step's rows."""
        first = np.arange(0, B, self.expand)  # [G] the first row of each run of one prompt
        counts = np.full(B, q_len) if kept is None else kept.sum(1)  # [B]
        if kept is not None and self.expand > 1 and \
                (kept.reshape(-1, self.expand, q_len) != kept[first][:, None]).any():
            raise ConfigError("expand", f"the rows of a run of {self.expand} (one prompt's) differ in their padding")
        self._gather = self._scatter = None
        if kept is not None or self.expand > 1:
            kept = np.ones((B, q_len), dtype=bool) if kept is None else kept
            grows = first[counts[first] > 0]  # [G'] runs with tokens this step, in sequence order
            rows, tokens = np.nonzero(kept[grows])
            start = np.zeros(B, dtype=np.int64)
            start[grows] = np.cumsum(counts[grows]) - counts[grows]  # where each run's tokens begin in the gather
            to_rows, to_tokens = np.nonzero(kept)  # [n] every row's stored tokens
            source = start[to_rows - to_rows % self.expand] + np.cumsum(kept, 1)[to_rows, to_tokens] - 1
            dev = self.device
            self._gather = tuple(torch.from_numpy(x).to(dev) for x in (grows[rows], tokens))
            self._scatter = tuple(torch.from_numpy(x).to(dev) for x in (to_rows, to_tokens, source))
        return counts[first].tolist()

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """The stored tokens of a step's attention input ``x [B, N, q, D]``: ``[1, N, T, D]`` (all: ``x``)."""
        if self._gather is None:
            return x
        rows, tokens = self._gather
        return x[rows, :, tokens].transpose(0, 1)[None]  # [T, N, D] -> [1, N, T, D]

    def _check_runs(self, key: torch.Tensor) -> None:
        """The rows of each run of ``expand`` hold one prompt: layer 0's keys ``[B, N_kv, q, D]`` agree."""
        first = key[::self.expand].repeat_interleave(self.expand, 0)
        if not torch.equal(key, first):
            raise ConfigError("expand", f"rows in runs of {self.expand} must repeat one prompt each (as generate "
                                        "expands them), but a run's rows differ; pass expand=1 for distinct rows")

    # -- running the model over it ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward of ``ids [B, q]`` over this cache (its attention routed through kvtier):
        logits ``[B, q, V]`` (float32). A step of ``q > 1`` tokens is prompt, of one token a decode step."""
        self.route(model)
        return model(input_ids=ids.to(self.device), past_key_values=self, use_cache=True).logits.float()

    def prefill(self, model, ids: torch.Tensor, chunk_size: int = 512) -> torch.Tensor:
        """The prompt ``ids [B, S]`` in chunks, then :meth:`end_prefill`: logits ``[B, S, V]``."""
        out = [self.forward(model, ids[:, a:b]) for a, b in ChunkedPrefill(chunk_size).chunks(ids.shape[1])]
        self.end_prefill()
        return torch.cat(out, 1)

    def choose(self, layer: int, query: torch.Tensor) -> list:
        """The logical pages each sequence attends in ``layer`` this decode step for ``query [B, H, 1, D]``
        (sorted; the union over kv heads of a per-head choice): what the scope picks, for inspection."""
        e = self.engine
        B = len(self.seqs)
        e.scope.start_step()  # chosen from the lengths and table of now
        picks = pages_of(e.scope.pick(layer, query[:, :, 0].contiguous(), e.callbacks.view(B)), e.max_pages, e.layout.page_size)
        out = []
        for b, seq in enumerate(self.seqs):
            n = self.table.num_pages(seq)
            got = np.arange(n) if picks is None else np.unique(picks[b].reshape(-1).cpu().numpy())
            out.append(got[(got >= 0) & (got < n)])
        return out

    # -- steps -------------------------------------------------------------------------------------
    def _begin(self, q_len: int, key: torch.Tensor | None = None) -> None:
        """Open the step of a forward of ``q_len`` tokens per row (``key``: layer 0's keys ``[B, N_kv, q, D]``)."""
        self.finish_step()
        self._attended = -1
        B = self.sequences
        kept = self._kept(q_len, B)
        if q_len == 1 and not self.prefilled and self.engine.step_idx >= 0:
            self.end_prefill()
        if self.prefilled:
            if q_len != 1:
                raise KVTierError(f"after the prompt every step feeds one token per sequence, got {q_len}")
            if kept is not None and not kept.all():
                raise ConfigError("attention_mask", "masks a decode step's token; kvtier keeps out left padding only")
            self._gather = self._scatter = None
            self._empty = False
            self.engine.begin_decode()
        else:
            if self.expand > 1 and key is not None:
                self._check_runs(key)
            counts = self._plan_prefill(kept, q_len, B)
            if not self.seqs:
                self.seqs = [self.engine.open(max(q_len, 1)) for _ in counts]
            grows = [(seq, n) for seq, n in zip(self.seqs, counts) if n]
            self._empty = not grows
            if grows:
                self.engine.begin_prefill([s for s, _ in grows], [n for _, n in grows])
        self.seen += q_len

    def receive_step(self, q_len: int) -> None:
        """Open a prefill step whose K/V another process computed (:mod:`kvtier.disagg`): every sequence grows
        by ``q_len`` tokens and the caller writes each layer's new pages into their tiers."""
        self._begin(q_len)
        self.engine.plan.mode = "idle"

    def end_prefill(self) -> None:
        """The prompt is in: the sequences start decoding (with ``mode="once"``, compressed to the budget); each run
        of ``expand`` rows decodes copy-on-write forks of its prompt's sequence."""
        self.finish_step()
        if self.prefilled or not self.seqs:
            return
        empty = [i * self.expand for i, seq in enumerate(self.seqs) if self.table.seq_len(seq) == 0]
        if empty:
            raise ConfigError("attention_mask", f"rows {empty} are padding only; give each row a token")
        self.prefilled = True
        self._gather = self._scatter = None
        for seq in self.seqs:
            self.engine.start_decode(seq, 0)
        if len(self.seqs) < self.sequences:
            self.seqs = self.engine.reorder([self.engine.row_seq.index(self.seqs[r // self.expand])
                                             for r in range(self.sequences)])

    def finish_step(self) -> None:
        """Close the open step; the policy hears its statistics (idempotent)."""
        if self.engine.plan.mode == "decode":
            self.engine.end_decode()
            if self.engine.recall is not None:  # a user's TopK(recall_slots=...): its stamps age by step
                self.engine.recall.next_step()
        self.engine.plan.mode = "idle"
        self.engine.feedback.take(upto=self.engine.step_idx)

    def route(self, model) -> None:
        """Route ``model``'s attention through kvtier until this cache closes (then the model's own is back)."""
        if model not in self._routed:
            self._routed[model] = route(model)
        use_hook(model)  # another user may have switched it

    def close(self) -> None:
        """Close the step and the tiers; each model routed through kvtier for this cache gets its attention back."""
        self.finish_step()
        self.engine.close()
        _release_routes(self._routed)

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release_routes(routed: dict) -> None:
    """Give each model routed for a cache its attention back (``routed``: model -> its route's release)."""
    for release in routed.values():
        release()
    routed.clear()
