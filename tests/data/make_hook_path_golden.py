"""How tests/data/hook_path_golden.json was made: the hook path (TieredKVCache + the old Engine) at commit 50e7682,
before the two data planes became one. Run it in a worktree of that commit:

    git worktree add /tmp/golden 50e7682 && cd /tmp/golden
    PYTHONPATH=. <venv>/bin/python <this file> hook_path_golden.json

It imports modules that no longer exist at later commits; it is kept as the record of how the numbers were made.
"""
import json
import sys
import time

import torch

from kvtier.budget import TokenBudget
from kvtier.cache import TieredKVCache
from kvtier.engine import Engine
from kvtier.eval import Passkey, Perplexity
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import POLICIES
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier

S, T, BUDGET, SINKS, WINDOW = 384, 32, 96, 4, 16
POLICY_NAMES = ["lru", "sink_window", "h2o", "tova", "snapkv", "knorm", "quest", "expected_attention", "aspe"]


def cases():
    out = []
    ppl = dict(task="ppl", S=S, T=T, offset=30000, chunk=128)
    out.append(dict(name="exact", scope="all", policy="lru", device="total", **ppl))
    for p in POLICY_NAMES:
        out.append(dict(name=f"resident:{p}", scope="resident", policy=p, budget=BUDGET, device="step", **ppl))
    for p in ["snapkv", "h2o", "knorm", "aspe"]:
        out.append(dict(name=f"once:{p}", scope="resident", mode="once", policy=p, budget=BUDGET, device="total", **ppl))
    out.append(dict(name="topk", scope="topk", policy="sink_window", budget=BUDGET, device="total", **ppl))
    out.append(dict(name="topk:host", scope="topk", policy="sink_window", budget=BUDGET, device="step", **ppl))
    out.append(dict(name="topk:per_head", scope="topk", policy="sink_window", budget=BUDGET, device="total",
                    per_head=True, **ppl))
    out.append(dict(name="topk:query_rows", scope="topk", policy="sink_window", budget=BUDGET, device="total",
                    query_rows=4, **ppl))
    out.append(dict(name="topk:policy_share", scope="topk", policy="snapkv", budget=BUDGET, device="total",
                    policy_share=0.5, **ppl))
    out.append(dict(name="topk:quest_head", scope="topk", policy="sink_window", budget=BUDGET, device="total",
                    rank="quest_head", **ppl))
    out.append(dict(name="topk:dense2", scope="topk", policy="sink_window", budget=BUDGET, device="total",
                    dense_layers=2, **ppl))
    out.append(dict(name="resident:fp8", scope="resident", policy="sink_window", budget=BUDGET, device="step",
                    kv_dtype="fp8_e4m3", **ppl))
    # memory pressure, no attention budget: chunked prefill (not exact), pages migrate
    mp = dict(task="ppl", S=16, T=80, offset=0, chunk=32, exact_prefill=False)
    for p in ["lru", "sink_window", "aspe", "h2o"]:
        out.append(dict(name=f"pressure:resident:{p}", scope="resident", policy=p, device=4, **mp))
    out.append(dict(name="pressure:all", scope="all", policy="lru", device=4, **mp))
    out.append(dict(name="pressure:topk", scope="topk", policy="lru", device=4, topk_pages=3, **mp))
    out.append(dict(name="pressure:resident:chunked", scope="resident", policy="sink_window", device=6,
                    task="ppl", S=96, T=16, offset=0, chunk=32, exact_prefill=False))
    pk = dict(task="passkey", context=512, question_at="after", chunk=128)
    out.append(dict(name="passkey:topk", scope="topk", policy="sink_window", budget=128, device="total", **pk))
    out.append(dict(name="passkey:resident:snapkv", scope="resident", policy="snapkv", budget=128, device="step", **pk))
    out.append(dict(name="passkey:inside:topk", scope="topk", policy="sink_window", budget=64, device="total",
                    task="passkey", context=512, question_at="inside", chunk=128))
    return out


def make_factory(layout_of, case):
    total_tokens = case.get("S", case.get("context", 512)) + case.get("T", 16) + 64
    def make():
        layout = layout_of(case.get("kv_dtype"))
        total = layout.pages_for(total_tokens) + 8
        budget = case.get("budget")
        pk = dict(sinks=SINKS, window=WINDOW)
        policy = POLICIES[case["policy"]](**pk) if case["policy"] != "lru" else POLICIES["lru"]()
        dev = case["device"]
        if dev == "total":
            dev = total
        elif dev == "step":
            dev = TokenBudget(budget, SINKS, WINDOW, layout.page_size).step_pages
        kw = dict(scope=case["scope"], **({"sinks": SINKS} if case["scope"] == "topk" else {}))
        if budget is not None:
            kw.update(budget=TokenBudget(budget, SINKS, WINDOW, mode=case.get("mode", "continuous")),
                      exact_prefill=case.get("exact_prefill", True))
        for k in ("per_head", "query_rows", "policy_share", "rank", "dense_layers", "topk_pages"):
            if k in case:
                kw[k] = case[k]
        return TieredKVCache(layout, [DeviceTier(layout, dev, device="cpu"), HostTier(layout, total)], policy, **kw)
    return make


def main(out_path):
    torch.set_num_threads(1)
    model, tok = load_model(None, dtype="float32", device="cpu", attn_implementation=install())
    model.eval()
    layouts = {}
    def layout_of(kv):
        if kv not in layouts:
            layouts[kv] = kv_layout_for(model.config, page_size=16, dtype=torch.float32, kv_dtype=kv)
        return layouts[kv]
    rows = []
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for case in cases():
        if only and case["name"] not in only:
            continue
        t0 = time.time()
        engine = Engine(model, ChunkedPrefill(case["chunk"]))
        make = make_factory(layout_of, case)
        caches = []
        def made():
            c = make()
            caches.append(c)
            return c
        if case["task"] == "ppl":
            task = Perplexity(text="opticks", length=case["S"] + case["T"], prefix=case["S"], offset=case["offset"], block_tokens=1)
            res = task.run(engine, made, tok)
            nll = res["nll_blocks"]
            row = dict(case=case, perplexity=res["perplexity"], nll_mean=res["nll_mean"], nll=nll,
                       attended=res["attended_tokens"], hit=res["tier1_hit_rate"])
        else:
            task = Passkey(context_tokens=case["context"], depths=(0.5,), samples=2, question_at=case["question_at"],
                           max_new_tokens=8)
            res = task.run(engine, made, tok)
            row = dict(case=case, accuracy=res["accuracy"], outputs=[r["output"] for r in res["records"]])
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(rows, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
