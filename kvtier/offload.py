"""Two lines around Hugging Face code: a kvtier cache for ``model.generate``, named as in the recipes.

    with kvtier.offload(model, policy="aspe", hbm=0.2, tiers="device_host"):
        out = model.generate(ids, max_new_tokens=32)          # a fresh kvtier cache for every call

    with kvtier.cache_for(model, ids.shape[1], new_tokens=32, policy="aspe", hbm=0.2) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

Names, defaults and what runs through it: the README's "Python API" section. ``hbm`` is the recipe's
``budget.fraction``: the device tier holds ``int(hbm * prompt tokens)`` tokens per sequence, rounded up to whole
pages, sized from each ``generate`` call's longest prompt; the tiers below take their ``fraction`` (or ``size``) of
the prompt plus the new tokens (the recipes' rule, :func:`kvtier.build.size_stack`). A disk tier writes to a fresh
folder under the temp folder, removed when the cache closes; a ``local`` remote tier starts a loopback redis-server
that stops with it. Other ``TieredKVCache`` arguments pass through; ``fidelity`` is off unless given.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import tempfile
import uuid
import weakref
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvtier.budget import token_budget
from kvtier.build import LOCAL_STORE, RECIPES, build, build_stack, size_stack
from kvtier.cache import TieredKVCache, cache_scope, check_renamed
from kvtier.errors import ConfigError
from kvtier.hook import route
from kvtier.models import kv_layout_for
from kvtier.policies import Policy
from kvtier.scopes.topk import OPTIONS as TOPK_OPTIONS
from kvtier.tiers.redis_server import LocalRedis


def recipe_node(group: str, name: str, device) -> DictConfig:
    """``recipes/<group>/<name>.yaml``, resolved with ``model.device`` = ``device``."""
    path = RECIPES / group / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (RECIPES / group).glob("*.yaml"))
        raise ConfigError(group, f"unknown {group} {name!r}; use one of {options}")
    root = OmegaConf.create({"model": {"device": str(device)}, group: OmegaConf.load(path)})
    return OmegaConf.create(OmegaConf.to_container(root[group], resolve=True))


def check_model(model, where: str) -> None:
    """ConfigError("model") unless ``model`` is a Hugging Face causal LM kvtier can route (a PreTrainedModel)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not hasattr(model, "generate"):
        raise ConfigError("model", f"{where} takes a Hugging Face causal LM (a transformers PreTrainedModel with "
                                   f"generate, e.g. from kvtier.load_model()), got {type(model).__name__}")


def check_options(options: dict, where: str) -> None:
    """ConfigError naming a keyword that neither :func:`cache_for` nor :class:`TieredKVCache` takes (a renamed one:
    its new spelling)."""
    check_renamed(options, where)
    known = set(inspect.signature(cache_for).parameters) | set(inspect.signature(TieredKVCache).parameters) | \
        TOPK_OPTIONS
    known -= {"model", "prompt_tokens", "new_tokens", "cache", "topk", "layout", "tiers", "scheduler"}
    for key in options:
        if key not in known:
            raise ConfigError(key, f"{where} takes no {key!r}; it takes {sorted(known)}")


def cache_for(model, prompt_tokens: int, new_tokens: int = 0, *, policy: str | Policy = "aspe", hbm: float = 0.25,
              tiers: str = "device_host", scope: str = "resident", page_size: int = 16, kernel: str = "auto",
              batch_size: int = 1, expand: int = 1, **cache) -> TieredKVCache:
    """A TieredKVCache for ``batch_size`` prompts of up to ``prompt_tokens`` tokens (padding aside) that
    ``generate`` continues by ``new_tokens`` on ``expand`` rows each (``max(num_beams, num_return_sequences)``);
    routes ``model``'s attention through the kvtier hook until the cache closes. See the module docstring."""
    check_model(model, "kvtier.cache_for")
    check_options(cache, "kvtier.cache_for")
    for key, value, least in (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 0),
                              ("batch_size", batch_size, 1), ("expand", expand, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            empty = "; the prompt is empty: give it at least one token" if key == "prompt_tokens" else ""
            raise ConfigError(key, f"must be an integer >= {least}, got {value!r}{empty}")
    if isinstance(hbm, bool) or not isinstance(hbm, (int, float)) or not 0 < hbm <= 1:
        raise ConfigError("hbm", f"the device tier's share of the prompt must be in (0, 1], got {hbm!r}")
    if (budget := int(hbm * prompt_tokens)) < 1:
        raise ConfigError("hbm", f"hbm={hbm} of a {prompt_tokens}-token prompt is no token; raise hbm to at least "
                                 f"{1 / prompt_tokens:.3g}")
    attended = token_budget(cache.get("budget"), page_size)
    topk = {k: cache.pop(k) for k in list(cache) if k in TOPK_OPTIONS | {"topk_pages", "sinks"}}
    pages, sinks = topk.pop("topk_pages", None), topk.pop("sinks", None)

    def scope_for(device_pages: int):
        """The cache's scope (topk's pages: ``topk_pages``, else the device tier's pages of a row)."""
        return cache_scope(scope, pages, sinks, attended, topk, device_pages)
    scope_for(1)  # a scope or option it does not know is said before any size is
    device = next(model.parameters()).device
    layout = kv_layout_for(model.config, page_size=page_size, dtype=model.dtype)
    if not isinstance(policy, Policy):
        policy = build(recipe_node("policy", policy, device), "policy")
    stack, rows = recipe_node("tiers", tiers, device).stack, batch_size * expand
    capacities = size_stack(stack, layout, policy, scope_for, budget, prompt_tokens + new_tokens, "hbm", copies=rows,
                            rows=rows, give=lambda pages: hbm_for(-(-pages // rows), page_size, prompt_tokens, hbm))
    servers, made = [], []

    def place(key: str, node: DictConfig) -> None:
        """A disk tier's fresh folder in the temp folder (removed when it closes); a local redis-server per cache."""
        if "path" in node:
            node.path = str(Path(tempfile.gettempdir()) / f"kvtier-{key}-{uuid.uuid4().hex}")
        if node.get("url") == LOCAL_STORE:
            servers.append(LocalRedis())
            node.url = servers[-1].url
    try:
        made = build_stack(stack, layout, capacities, place)
        scheduler = build(recipe_node("scheduler", "lookahead", device).placement, "scheduler.placement")
        result = TieredKVCache(layout, made, policy, scheduler, build(recipe_node("kernel", kernel, device), "kernel"),
                               scope=scope_for(next(iter(capacities.values())) // rows), batch_size=rows,
                               expand=expand, **cache)
        result.route(model)
    except BaseException:
        for tier in made:
            tier.close()
        for server in servers:
            server.stop()
        raise
    for server in servers:
        weakref.finalize(result, server.stop)
    return result


def hbm_for(pages: int, page_size: int, prompt_tokens: int, hbm: float) -> str:
    """The ``hbm`` that gives each row ``pages`` device pages of a ``prompt_tokens``-token prompt (or why none can)."""
    tokens = (pages - 1) * page_size + 1
    if tokens > prompt_tokens:
        return f"the {prompt_tokens}-token prompt is shorter than that: pick a policy that pins less, or a longer prompt"
    return f"raise hbm to at least {math.ceil(tokens / prompt_tokens * 1000) / 1000:g} ({tokens} tokens; {hbm:g} " \
           f"gives {int(hbm * prompt_tokens)})"


def generation_sizes(model, args: tuple, kwargs: dict) -> dict:
    """What :func:`cache_for` needs of a ``generate(*args, **kwargs)`` call: the prompts, the longest one's tokens
    (padding aside), the new tokens and the rows per prompt, as ``generate`` will read them."""
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(getattr(ids, "shape", ()))
        raise ConfigError("input_ids", "kvtier.offload sizes the cache from the prompt: pass input_ids, a tensor "
                                       f"[prompts, tokens], got {type(ids).__name__} {shape}")
    mask = kwargs.get("attention_mask")
    prompt = int(mask.sum(-1).max()) if isinstance(mask, torch.Tensor) and mask.numel() else ids.shape[1]
    if prompt < 1:
        raise ConfigError("input_ids", f"the prompt is empty (input_ids of shape {tuple(ids.shape)}"
                                       f"{', every token masked' if ids.shape[1] else ''}); give it at least one token")
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})  # generate's own checks
    if config.use_cache is False:
        raise ConfigError("use_cache", "generate with use_cache=False keeps no cache, so kvtier would hold nothing: "
                                       "leave use_cache on inside kvtier.offload, or call generate outside the block")
    for key in ("num_beams", "num_return_sequences"):
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
    return {"prompt_tokens": prompt, "new_tokens": max(int(new), 0), "batch_size": ids.shape[0],
            "expand": max(config.num_beams or 1, config.num_return_sequences or 1)}


@contextlib.contextmanager
def offload(model, policy: str | Policy = "aspe", hbm: float = 0.25, tiers: str = "device_host", **options):
    """Inside the block, ``model.generate(...)`` runs over a fresh :func:`cache_for` cache per call, sized
    from that call's prompt and ``max_new_tokens``, closed when it returns. Yields the list of caches
    made (their ``stats`` stay readable); on exit ``generate`` and the attention implementation are
    the model's own again."""
    check_model(model, "kvtier.offload")
    check_options(options, "kvtier.offload")
    if "generate" in vars(model):
        raise ConfigError("model", "model.generate is already wrapped (a kvtier.offload block inside another?)")
    generate, caches = model.generate, []

    @functools.wraps(generate)
    def generate_offloaded(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            raise ConfigError("past_key_values", "kvtier.offload gives each generate call its own cache; pass "
                                                 "none, or use kvtier.cache_for outside an offload block")
        cache = cache_for(model, **generation_sizes(model, args, kwargs), policy=policy, hbm=hbm, tiers=tiers,
                          **options)
        caches.append(cache)
        try:
            return generate(*args, past_key_values=cache, **kwargs)
        finally:
            cache.close()

    model.generate = generate_offloaded
    release = route(model)
    try:
        yield caches
    finally:
        del model.generate
        release()
