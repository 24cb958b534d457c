"""Which key sketch? The attention a key choice keeps under each form of the sketch, on the ctx2k protocol of
``bench/policy_study.py`` (real SmolLM2-135M, fp32, 2,048 tokens of ``--text`` at ``--offsets``, then
``--continuation`` tokens; every ``--stride``-th of them is a decode query).

Each decode query's kv heads choose keys as the ``topk`` scope does (:mod:`kvtier.kernels.triton_key_choice`): the
sinks (4) and the window (64) shown, and the ``--fraction`` budget's middle by ``max_g (s_g - lse_g)`` over the
group's query heads, with ``lse_g`` over the shown keys; the figure is the true attention mass the chosen and shown
keys hold, per query head (``kept``: mean, ``kept_p10``: its 10th percentile; 1.0: nothing lost). Forms, each fitted
on the prefilled keys (and, where said, the prompt's queries), at rank ``r``:

- ``exact``: the keys themselves (the choice's ceiling);
- ``pca<r>_bf16``: the keys on their top principal directions in bf16 (Loki's basis; kvtier's sketch before);
- ``pca<r>_int8``: the same on :class:`~kvtier.stats.KeyStats`' 8-bit levels;
- ``fitted<r>_int8_s<x>``: :class:`~kvtier.stats.KeyStats` itself, as the engine keeps it: the rank-r form of q.k
  that loses the least over the prompt's queries and keys (:func:`~kvtier.stats.sketch_maps`), 8 bits, the query
  moment shrunk by ``x`` toward the identity (``--shrinks``; the engine's: :data:`~kvtier.stats.QUERY_SHRINK`).

    python -m bench.sketch_forms --offsets 0,30000,60000 --json sketch_forms-study.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.layout import KVLayout
from kvtier.models import load_model
from kvtier.stats import KeyStats, sketch_maps

SINKS, WINDOW, PAGE = 4, 64, 16


def captured_attention(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer -> (post-RoPE queries ``[H, T, D]``, keys ``[N_kv, T, D]``) of one forward over ``ids [1, T]``."""
    seen = {}

    def capture(module, q, k, v, mask, **kw):
        seen[module.layer_idx] = (q[0].detach(), k[0].detach())
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kvtier_capture", capture)
    before = model.config._attn_implementation
    model.config._attn_implementation = "kvtier_capture"
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.config._attn_implementation = before
    return seen


def form_logits(q: torch.Tensor, k: torch.Tensor, prompt_q: torch.Tensor, rank: int,
                shrinks: tuple[float, ...]) -> dict[str, torch.Tensor]:
    """Each form's approximate logits (unscaled) ``[N_kv, G, T_q, S]`` of queries ``q [N_kv, G, T_q, D]`` with keys
    ``k [N_kv, S, D]``, every form fitted on the prompt's keys (and queries ``prompt_q [T, H, D]``; the prompt is its
    first ``T`` keys), the later keys sketched as they come."""
    context = prompt_q.shape[0]
    N, S, D = k.shape
    prompt_k = k[:, :context].double()
    key_second = torch.einsum("nsd,nse->nde", prompt_k, prompt_k)  # [N_kv, D, D]
    pca_w, pca_a = (m.float() for m in sketch_maps(key_second, torch.zeros_like(key_second), rank))
    out = {"exact": torch.einsum("ngtd,nsd->ngts", q, k)}
    y = torch.einsum("nsd,ndr->nsr", k, pca_w)
    qa = torch.einsum("ngtd,ndr->ngtr", q, pca_a)
    out[f"pca{rank}_bf16"] = torch.einsum("ngtr,nsr->ngts", qa, y.bfloat16().float())
    for name, use_queries, shrink in ((f"pca{rank}_int8", False, 1.0),
                                      *((f"fitted{rank}_int8_s{x:g}", True, x) for x in shrinks)):
        layout = KVLayout(num_layers=1, num_kv_heads=N, head_dim=D, page_size=PAGE, dtype="float32")
        stats = KeyStats(layout, -(-S // PAGE), "cpu", sketch_rank=rank, query_shrink=shrink)
        page = torch.arange(S) // PAGE  # [S] each key's page
        if use_queries:
            stats.add_queries(0, prompt_q)
        keys = k.transpose(0, 1).cpu()  # [S, N_kv, D]
        stats.add(0, page[:context], keys[:context])
        stats.fit_sketch([(np.arange(-(-context // PAGE)), [keys[:context]])])
        stats.add(0, page[context:], keys[context:])
        sketch = stats.sketch[0, page, torch.arange(S) % PAGE].float().to(k.device)  # [S, N_kv, r]
        out[name] = torch.einsum("ngtd,ndr,snr->ngts", q, stats.query_map[0].to(k.device), sketch)
    return out


def kept_mass(logits: dict[str, torch.Tensor], positions: torch.Tensor, fraction: float, scale: float) -> dict:
    """Per form, the true attention mass ``[N_kv, G, T_q]`` the choice keeps at each query's position."""
    exact = logits["exact"] * scale  # [N_kv, G, T_q, S]
    S = exact.shape[-1]
    t = torch.arange(S, device=exact.device)
    n_keys = positions[:, None] + 1  # [T_q, 1]
    visible = t[None] < n_keys  # [T_q, S]
    shown = visible & ((t[None] < SINKS) | (t[None] >= n_keys - WINDOW))
    middle = (fraction * n_keys).long() - shown.sum(-1, keepdim=True)  # [T_q, 1] keys to choose
    p = torch.softmax(exact.masked_fill(~visible, float("-inf")), -1)
    out = {}
    for name, s in logits.items():
        s = (s * scale).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s.masked_fill(~shown, float("-inf")), -1, keepdim=True)
        score = (s - lse).amax(1).masked_fill(shown | ~visible, float("-inf"))  # [N_kv, T_q, S]
        rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1, stable=True)  # [N_kv, T_q, S]
        chosen = (rank < middle) & (score > float("-inf"))
        out[name] = (p * (chosen | shown)[:, None]).sum(-1)  # [N_kv, G, T_q]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="opticks")
    ap.add_argument("--offsets", default="0,30000,60000")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--ranks", default="16,32")
    ap.add_argument("--shrinks", default="0,0.9", help="query-moment shrinks of the fitted forms, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="sketch_forms.json")
    args = ap.parse_args()
    model, tok = load_model(None, dtype="float32", device=args.device)
    stream = token_stream(tok, args.text)
    ranks = [int(r) for r in args.ranks.split(",")]
    shrinks = tuple(float(x) for x in args.shrinks.split(","))
    kept: dict[str, list[torch.Tensor]] = {}
    for off in (int(o) for o in args.offsets.split(",")):
        ids = stream[off:off + args.context + args.continuation][None].to(args.device)
        for q, k in captured_attention(model, ids).values():  # q [H, T, D], k [N_kv, T, D]
            H, T, D = q.shape
            N = k.shape[0]
            positions = torch.arange(args.context, T, args.stride, device=q.device)  # [T_q]
            prompt_q = q[:, :args.context].transpose(0, 1).cpu()  # [T, H, D]
            queries = q[:, positions].view(N, H // N, -1, D)  # [N_kv, G, T_q, D]
            for r in ranks:
                logits = form_logits(queries, k, prompt_q, r, shrinks)
                for name, mass in kept_mass(logits, positions, args.fraction, D ** -0.5).items():
                    if name != "exact" or r == ranks[0]:
                        kept.setdefault(name, []).append(mass.flatten().cpu())
    rows = []
    for name, parts in kept.items():
        x = torch.cat(parts)
        rows.append({"form": name, "kept": round(float(x.mean()), 4), "kept_p10": round(float(x.quantile(0.1)), 4),
                     "text": args.text, "offsets": args.offsets, "fraction": args.fraction})
        print(f"| {name} | {rows[-1]['kept']:.4f} | {rows[-1]['kept_p10']:.4f} |")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
