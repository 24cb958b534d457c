"""How much of recall's loss is the selection unit? Oracle choices (by the true attention of the current query)
at the same attended-key budget, on the ctx2k protocol of ``bench/policy_study.py`` (real SmolLM2-135M, fp32,
2,048 tokens prefilled exactly, then ``--continuation`` teacher-forced tokens, slices at offsets 0, 30k, 60k).

Each decode step attends the sinks (4 tokens), the recent window (64 tokens) and a middle chosen by the oracle so
that ``--fraction`` of the context is attended, or a fixed ``--tokens`` keys as the engine's budget does (issue 24's
question: can recall get within 1% of the full cache?):
- ``mass<P>_all``: pages of P tokens by their true attention mass summed over every head, one set for all heads
  (what ``topk`` chooses with a perfect score); ``mass<P>_group``: the same per kv head (its query group's mass);
- ``quest<P>_all`` (Quest's bound, what ``topk`` chooses today), ``mean<P>_*`` (q·mean key), ``gauss<P>_*`` (the
  mass estimated from each page's channel means and variances, :func:`page_scores`): scorers, not oracles;
- ``sketch<P>_*``: the mass of each page under approximate logits from rank-``--sketch-rank`` keys (each kv head's
  keys projected on their top principal directions, ShadowKV's low-rank key cache, Sun et al., 2024,
  arXiv:2410.21465; here from the post-RoPE keys of the whole context at every step: an upper bound for the sketch);
  ``P=1``: single tokens;
- ``token_group``: single tokens per kv head (the max probability over its group);
- ``token_layer``: the same, but one budget for the layer's kv heads (Ada-KV, Feng et al., 2024,
  arXiv:2407.11550): the best ``middle * N_kv`` (kv head, key) pairs of the row;
- ``token_head``: single tokens per query head.
Scores here read every key (a page's statistics are computed on the fly): what a scorer could do
with per-page statistics, not its cost. It runs the model's own attention (HF, sdpa for the prefill) with a registered attention function that masks the
keys outside the choice before the softmax; no kvtier kernel is involved. An upper bound for a scorer, not a method.

    .venv/bin/python -m bench.selection_oracle --slices 3      # bench/results/selection_oracle.json
"""

from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.stats import quest_bound
from kvtier.models import load_model
from kvtier.scopes.topk import gauss_mass

SINKS, WINDOW, PREFIX = 4, 64, 2048
MODES = ["exact", "mass16_all", "mass16_group", "mass4_group", "token_group", "token_layer", "token_head", "quest16_all", "mean16_all",
         "gauss16_all", "gauss16_group", "gauss4_group"]
STATE = {"mode": "exact", "fraction": 0.2, "sketch_rank": 16, "tokens": None, "page_candidates": 0}


def page_scores(scorer: str, prob: torch.Tensor, q: torch.Tensor, key: torch.Tensor, P: int) -> torch.Tensor:
    """Per (query head, page) scores ``[B, H, pages]`` of one decode query ``q [B, H, 1, D]`` (attention ``prob [B,
    H, S]``) over ``key [B, N_kv, S, D]``: ``mass`` the true attention mass (the oracle); ``quest`` Quest's bound
    (:func:`kvtier.stats.quest_bound`, Tang et al., 2024); ``mean`` q·(mean key); ``gauss`` the estimated
    share of the head's attention that ``topk rank=gauss`` uses (:func:`kvtier.scopes.topk.gauss_mass`), from
    each page's key statistics as :class:`~kvtier.stats.KeyStats` keeps them."""
    B, H, S = prob.shape
    pages = -(-S // P)
    pad = pages * P - S
    if scorer == "sketch":  # the true softmax, of approximate logits from rank-r keys
        kf = key.float()  # [B, N_kv, S, D]
        n_kv, D = kf.shape[1], kf.shape[-1]
        basis = torch.linalg.eigh(kf.transpose(-1, -2) @ kf).eigenvectors[..., -STATE["sketch_rank"]:]  # [B, N_kv, D, r]
        qg = q[:, :, 0].float().view(B, n_kv, H // n_kv, D) @ basis  # [B, N_kv, G, r]
        approx = (qg @ (kf @ basis).transpose(-1, -2)).flatten(1, 2) * D ** -0.5  # [B, H, S]
        prob = torch.softmax(approx, -1)
        scorer = "mass"
    if scorer == "mass":
        return torch.nn.functional.pad(prob, (0, pad)).view(B, H, pages, P).sum(-1)
    kp = torch.nn.functional.pad(key.float(), (0, 0, 0, pad)).view(B, -1, pages, P, key.shape[-1])  # [B, N_kv, pages, P, D]
    kp = kp.permute(0, 2, 3, 1, 4)  # [B, pages, P, N_kv, D]
    valid = (torch.arange(pages * P, device=key.device) < S).view(1, pages, P, 1, 1)
    qf = q[:, :, 0].float()  # [B, H, D]
    if scorer == "quest":
        kmin = torch.where(valid, kp, float("inf")).amin(2)  # [B, pages, N_kv, D]
        kmax = torch.where(valid, kp, float("-inf")).amax(2)
        return quest_bound(qf, kmin, kmax).transpose(1, 2)  # [B, H, pages]
    pids = torch.arange(B * pages, device=key.device).view(B, pages)  # each row its own pages
    stats = SimpleNamespace(count=valid.sum(2).float().view(1, pages).expand(B, pages).reshape(1, -1),  # layer 0
                            key_sum=kp.sum(2).flatten(0, 1)[None], key_sq=kp.square().sum(2).flatten(0, 1)[None])
    if scorer == "mean":
        mu = stats.key_sum[0][pids] / stats.count[0][pids][..., None, None]  # [B, pages, N_kv, D]
        qg = qf.view(B, 1, mu.shape[2], -1, mu.shape[-1])  # [B, 1, N_kv, G, D]
        return (qg * mu[:, :, :, None]).sum(-1).flatten(2).transpose(1, 2)  # [B, H, pages]
    every = torch.ones(B, pages, dtype=torch.bool, device=key.device)
    return gauss_mass(qf, stats, 0, pids, every, every).transpose(1, 2)  # [B, H, pages]


def keep_mask(logits: torch.Tensor, q: torch.Tensor, key: torch.Tensor, mode: str, fraction: float) -> torch.Tensor:
    """Keys kept ``[B, H, 1, S]`` (bool) for one decode query ``q [B, H, 1, D]`` over ``key [B, N_kv, S, D]`` (its
    scaled ``logits [B, H, 1, S]``)."""
    B, H, _, S = logits.shape
    n_kv = key.shape[1]
    G = H // n_kv
    budget = max(STATE["tokens"] or int(fraction * S), SINKS + WINDOW)
    pos = torch.arange(S, device=logits.device)
    forced = (pos < SINKS) | (pos >= S - WINDOW)  # [S]
    middle = budget - int(forced.sum())
    blocked = forced  # never a middle candidate
    if STATE["page_candidates"]:  # the engine's candidates: keys of the pages between the sink page and the window's
        page = STATE["page_candidates"]
        blocked = forced | (pos < page) | (pos >= (S - WINDOW) // page * page)
    if middle <= 0:
        return forced.expand(B, H, 1, S)
    prob = torch.softmax(logits.float(), -1)[:, :, 0]  # [B, H, S]
    if mode == "token_layer":  # one budget for the layer's kv heads (Ada-KV): the best middle * N_kv (head, key)
        score = prob.view(B, n_kv, G, S).amax(2).masked_fill(blocked, float("-inf")).flatten(1)  # [B, N_kv S]
        picked = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(middle * n_kv, -1).indices, True)
        return (picked.view(B, n_kv, 1, S).expand(B, n_kv, G, S).reshape(B, H, S) | forced)[:, :, None]
    if mode == "token_head":
        score = prob  # [B, H, S]
    elif mode == "token_group":
        score = prob.view(B, n_kv, G, S).amax(2).repeat_interleave(G, 1)  # [B, H, S]
    else:
        scorer, rest = mode.split("_")[0].rstrip("0123456789"), mode.split("_")
        P, share = int(rest[0][len(scorer):]), rest[1]
        ps = page_scores(scorer, prob, q, key, P)  # [B, H, pages]
        if share == "group":
            ps = ps.view(B, n_kv, G, -1)
            ps = (ps.sum(2) if scorer in ("mass", "gauss", "sketch") else ps.amax(2)).repeat_interleave(G, 1)
        else:
            ps = (ps.sum(1) if scorer in ("mass", "gauss", "sketch") else ps.amax(1))[:, None].expand(B, H, -1)
        score = ps.repeat_interleave(P, -1)[..., :S]  # every token of a page takes its page's score
        middle = (middle // P) * P
    score = score.masked_fill(blocked, float("-inf"))
    picked = torch.zeros(B, H, S, dtype=torch.bool, device=logits.device)
    picked.scatter_(-1, score.topk(middle, -1).indices, True)
    return (picked | forced)[:, :, None]


def oracle_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa for the prefill; a decode query attends the oracle's choice (``STATE``)."""
    if query.shape[2] > 1 or STATE["mode"] == "exact":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    n_kv, H = key.shape[1], query.shape[1]
    k = key.repeat_interleave(H // n_kv, 1)  # [B, H, S, D]
    v = value.repeat_interleave(H // n_kv, 1)
    logits = (query.float() @ k.float().transpose(-1, -2)) * scaling  # [B, H, 1, S]
    mode, rest = STATE["mode"].split("+")[0], "+mv" in STATE["mode"]
    keep = keep_mask(logits, query, key, mode, STATE["fraction"])
    out = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ v.float()  # [B, H, 1, D]
    if rest:  # SparQ's mean-value reallocation: the mass left out goes to the mean value of the keys left out
        prob = torch.softmax(logits.float(), -1)  # [B, H, 1, S]
        alpha = (prob * keep).sum(-1, keepdim=True)  # [B, H, 1, 1] true mass of the kept keys
        n_out = (~keep).sum(-1, keepdim=True).clamp(min=1)
        v_out = ((~keep).float() @ v.float()) / n_out  # [B, H, 1, D]
        out = alpha * out + (1 - alpha) * v_out
    return out.to(query.dtype).transpose(1, 2), None


@torch.no_grad()
def slice_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """NLL ``[len(ids) - PREFIX]`` of the continuation: an exact prefill of ``ids[:PREFIX]``, then one token a step."""
    out = model(ids[None, :PREFIX], use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    nll = []
    for i in range(PREFIX, ids.numel()):
        nll.append(-torch.log_softmax(logits.double(), -1)[ids[i]])
        if i + 1 < ids.numel():
            out = model(ids[None, i:i + 1], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
    return torch.stack(nll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--slices", type=int, default=3)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--smollm2", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sketch-rank", type=int, default=16, help="sketch<P>_* modes: the keys' rank")
    ap.add_argument("--page-candidates", type=int, default=0,
                    help="P > 0: the middle's candidates are only the keys of the P-token pages between the sink page "
                         "and the window's first page, as the engine's token budget lists them")
    ap.add_argument("--tokens", type=int, default=None,
                    help="a fixed budget of keys per step (the engine's protocol: fraction x the prefix), not "
                         "--fraction of each step's length")
    ap.add_argument("--text", default="opticks", help="the text of the slices (opticks, lady_susan)")
    ap.add_argument("--offsets", default=None, help="token offsets of the slices (default: 0, 30000, ... --slices)")
    ap.add_argument("--json", default="selection_oracle.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    AttentionInterface.register("oracle", oracle_attention)
    AttentionMaskInterface.register("oracle", AttentionMaskInterface._global_mapping["sdpa"])
    model, tok = load_model(args.smollm2, dtype="float32")
    model.set_attn_implementation("oracle")
    STATE["fraction"], STATE["sketch_rank"], STATE["tokens"] = args.fraction, args.sketch_rank, args.tokens
    STATE["page_candidates"] = args.page_candidates
    offsets = [int(x) for x in args.offsets.split(",")] if args.offsets else [30000 * s for s in range(args.slices)]
    texts = [token_stream(tok, args.text, o + PREFIX + args.continuation)[o:] for o in offsets]
    rows = []
    for mode in args.modes.split(","):
        STATE["mode"] = mode
        t0 = time.perf_counter()
        nll = [slice_nll(model, ids) for ids in texts]
        row = {"mode": mode, "ppl": math.exp(float(torch.cat(nll).mean())),
               "slices": [math.exp(float(x.mean())) for x in nll], "seconds": time.perf_counter() - t0}
        rows.append(row)
        base = rows[0]["ppl"]
        print(f"| {mode} | {row['ppl']:.4f} | {100 * (row['ppl'] / base - 1):+.2f}% | "
              f"{' / '.join(f'{x:.3f}' for x in row['slices'])} |", flush=True)
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
