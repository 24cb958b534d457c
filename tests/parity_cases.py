"""The hook path's golden numbers (``tests/data/hook_path_golden.json``, made by the two data planes' hook path
before they became one engine) and the engine each case builds today: same model, text, budget, tiers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvtier.budget import TokenBudget
from kvtier.engine import Engine, EngineConfig
from kvtier.eval import Passkey, Perplexity
from kvtier.kernels.reference import TorchBackend
from kvtier.policies import POLICIES
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK, make_scope
from kvtier.tiers import DeviceTier, HostTier

GOLDEN = json.loads((Path(__file__).parent / "data" / "hook_path_golden.json").read_text())
SINKS, WINDOW = 4, 16


def engine_factory(model, layout_of, case, kernel=None, device="cpu", config=None):
    """``make_engine()`` for a golden ``case``."""
    total_tokens = case.get("S", case.get("context", 512)) + case.get("T", 16) + 64

    def make():
        layout = layout_of(case.get("kv_dtype"))
        total = layout.pages_for(total_tokens) + 8
        budget = case.get("budget")
        policy = POLICIES[case["policy"]](sinks=SINKS, window=WINDOW) if case["policy"] != "lru" else POLICIES["lru"]()
        dev = case["device"]
        if dev == "total":
            dev = total
        elif dev == "step":
            dev = TokenBudget(budget, SINKS, WINDOW, layout.page_size).step_pages
        tokens = None if budget is None else TokenBudget(budget, SINKS, WINDOW, layout.page_size,
                                                         case.get("mode", "continuous"))
        if case["scope"] == "topk":
            scope = TopK(case.get("topk_pages"), case.get("rank", "quest"), case.get("per_head", False),
                         case.get("query_rows", 1), case.get("policy_share", 0.0), sinks=SINKS,
                         unit=case.get("unit", "page"))
        else:
            scope = make_scope(case["scope"])
        tiers = [DeviceTier(layout, dev, device=device), HostTier(layout, total)]
        return Engine(model, layout, tiers, policy, scope, kernel=kernel or TorchBackend(),
                      prefill=ChunkedPrefill(case["chunk"]), budget=tokens,
                      exact_prefill=case.get("exact_prefill", True) and budget is not None,
                      dense_layers=case.get("dense_layers", 0), config=config or EngineConfig())
    return make


def run_case(model, tok, layout_of, case, **kw) -> dict:
    make = engine_factory(model, layout_of, case, **kw)
    if case["task"] == "ppl":
        task = Perplexity(text="opticks", length=case["S"] + case["T"], prefix=case["S"], offset=case["offset"],
                          block_tokens=1)
        res = task.run(make, tok)
        return dict(perplexity=res["perplexity"], nll=res["nll_blocks"], attended=res["attended_tokens"])
    task = Passkey(context_tokens=case["context"], depths=(0.5,), samples=2, question_at=case["question_at"],
                   max_new_tokens=8)
    res = task.run(make, tok)
    return dict(outputs=[r["output"] for r in res["records"]])


def layouts(model):
    from kvtier.models import kv_layout_for

    cache = {}

    def layout_of(kv_dtype):
        if kv_dtype not in cache:
            cache[kv_dtype] = kv_layout_for(model.config, page_size=16, dtype=torch.float32, kv_dtype=kv_dtype)
        return cache[kv_dtype]
    return layout_of
