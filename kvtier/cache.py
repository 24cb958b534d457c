"""TieredKVCache: a transformers ``Cache`` over an :class:`~kvtier.engine.Engine` session, for ``generate``
and any code that runs the model's own forward (``past_key_values=cache``).

The model's forward drives the engine's step: ``update()`` of layer 0 opens it (a prefill chunk while the
prompt comes in, then one decode token per sequence), every layer's ``update()`` writes its K/V and the
attention hook's ``attend()`` reads the pages the scope picks. Everything else (the token budget, the
policy's statistics, migrations, fidelity) is the engine's; this class only translates.
"""

from __future__ import annotations


import numpy as np
import torch

from kvtier.budget import TokenBudget
from kvtier.cache_base import ACTIVE_CACHE
from kvtier.compat import PagedCacheBase
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.hook import use_hook
from kvtier.layout import KVLayout
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import Scope, TopK
from kvtier.scopes.base import pages_of
from kvtier.scopes.topk import OPTIONS as TOPK_OPTIONS
from kvtier.tiers.base import Tier


def _of_engine(name: str) -> property:
    """A read-only attribute of the cache that is its engine's ``name``."""
    return property(lambda self: getattr(self.engine, name), doc=f"The engine's ``{name}``.")


class TieredKVCache(PagedCacheBase):
    """Paged, tiered KV cache for ``batch_size`` sequences of equal length (no padding).

    ``scope``: ``all`` | ``resident`` | ``topk`` or a :class:`~kvtier.scopes.Scope`; ``topk_pages`` and ``topk``
    (``rank``, ``unit``, ``sketch_rank``, ``per_head``, ...) are :class:`~kvtier.scopes.TopK`'s; ``budget`` (tokens
    attended per decode step), ``sinks``, ``window`` and ``mode`` make a :class:`~kvtier.budget.TokenBudget`.
    """

    def __init__(self, layout: KVLayout, tiers: list[Tier], policy: Policy, scheduler: Scheduler | None = None,
                 backend=None, scope: str | Scope = "all", topk_pages: int | None = None, sinks: int = 4,
                 batch_size: int = 1, fidelity: bool = False, budget: int | None = None, window: int = 64,
                 mode: str = "continuous", exact_prefill: bool = False, dense_layers: int = 0, **topk):
        tokens = None if budget is None else TokenBudget(budget, sinks, window, layout.page_size, mode)
        if scope == "topk":
            if unknown := sorted(set(topk) - TOPK_OPTIONS):
                raise ConfigError(f"scope.{unknown[0]}", f"is not an option of scope 'topk'; it takes "
                                                         f"{sorted(TOPK_OPTIONS)}")
            scope = TopK(topk_pages, sinks=sinks, **topk)
        elif topk:
            raise ConfigError(f"scope.{next(iter(topk))}", f"is an option of scope 'topk', not of {scope!r}")
        super().__init__(layout)
        self.layout = layout
        self.engine = Engine(None, layout, tiers, policy, scope, scheduler, backend, budget=tokens,
                             exact_prefill=exact_prefill, dense_layers=dense_layers, fidelity=fidelity,
                             config=EngineConfig(max_batch=batch_size, graphs=False, compile=False))
        self.sequences = batch_size  # sequences of equal length, one engine row each
        self.seqs: list[int] = []
        self.prefilled = False
        self._attended = -1

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
        return self.table.seq_len(self.seqs[0]) if self.seqs else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write K/V ``[B, N_kv, q, D]`` of ``layer_idx``; returns them unchanged (attention reads pages)."""
        B, _, q_len, _ = key_states.shape
        if B != self.sequences:
            raise ConfigError("batch_size", f"cache built for {self.sequences} sequences, got a batch of {B}")
        if layer_idx == 0:
            self._begin(q_len)
        elif self._attended != layer_idx - 1:  # the layer before wrote its K/V, then attended without kvtier
            raise ConfigError("attn_implementation", "the model's attention does not go through kvtier, so it "
                                                     "would read only the new tokens' K/V: call "
                                                     "kvtier.hook.use_hook(model) (kvtier.Engine does)")
        self.engine.store(layer_idx, key_states, value_states)
        ACTIVE_CACHE.set(self)
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Paged attention of ``query [B, H, q, D]`` for ``layer`` under the scope: ``[B, q, H, D]``. The hook's
        link is taken: each layer's ``update`` sets it again, and a forward with another cache (or none) finds no
        kvtier cache instead of this one."""
        self._attended = layer
        ACTIVE_CACHE.set(None)
        return self.engine.attend(layer, query, scaling)

    # -- running the model over it ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward of ``ids [B, q]`` over this cache (its attention routed through kvtier):
        logits ``[B, q, V]`` (float32). A step of ``q > 1`` tokens is prompt, of one token a decode step."""
        use_hook(model)
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
        picks = pages_of(e.scope.pick(layer, query[:, :, 0].contiguous(), e.view(B)), e.max_pages, e.layout.page_size)
        out = []
        for b, seq in enumerate(self.seqs):
            n = self.table.num_pages(seq)
            got = np.arange(n) if picks is None else np.unique(picks[b].reshape(-1).cpu().numpy())
            out.append(got[(got >= 0) & (got < n)])
        return out

    # -- steps -------------------------------------------------------------------------------------
    def _begin(self, q_len: int) -> None:
        self.finish_step()
        self._attended = -1
        if not self.seqs:
            self.seqs = [self.engine.open(q_len) for _ in range(self.sequences)]
        if q_len == 1 and not self.prefilled and self.engine.step_idx >= 0:
            self.end_prefill()
        if self.prefilled:
            if q_len != 1:
                raise KVTierError(f"after the prompt every step feeds one token per sequence, got {q_len}")
            self.engine.begin_decode()
        else:
            self.engine.begin_prefill(self.seqs, q_len)

    def receive_step(self, q_len: int) -> None:
        """Open a prefill step whose K/V another process computed (:mod:`kvtier.disagg`): every sequence grows
        by ``q_len`` tokens and the caller writes each layer's new pages into their tiers."""
        self._begin(q_len)
        self.engine._mode = "idle"

    def end_prefill(self) -> None:
        """The prompt is in: the sequences start decoding (with ``mode="once"``, compressed to the budget)."""
        self.finish_step()
        if self.prefilled or not self.seqs:
            return
        self.prefilled = True
        for seq in self.seqs:
            self.engine.start_decode(seq, 0)

    def finish_step(self) -> None:
        """Close the open step; the policy hears its statistics (idempotent)."""
        if self.engine._mode == "decode":
            self.engine.end_decode()
            if self.engine.recall is not None:  # a user's TopK(recall_slots=...): its stamps age by step
                self.engine.recall.next_step()
        self.engine._mode = "idle"
        self.engine.feedback.take(upto=self.engine.step_idx)

    def close(self) -> None:
        self.finish_step()
        self.engine.close()
