"""Cross-object checks, in one place: what no constructor can see alone (budget vs context vs the
policy's pins vs the model's positions, the tier stack vs the context). Constructors check their own
arguments; the run path (:mod:`kvtier.build`) and the Python API (``TieredKVCache``, the tasks) call these.
"""

from __future__ import annotations

import math

from kvtier.errors import ConfigError
from kvtier.sizes import parse_bytes


def device_pages_needed(policy, page_size: int, chunk_tokens: int, batch_size: int = 1) -> int:
    """Device pages a step needs per sequence: the policy's pins, the page being written, a chunk's new pages."""
    return batch_size * (policy.pinned_pages(page_size) + 1 + -(-chunk_tokens // page_size))


def check_device_room(capacity: int, policy, page_size: int, chunk_tokens: int, field: str,
                      batch_size: int = 1) -> None:
    need = device_pages_needed(policy, page_size, chunk_tokens, batch_size)
    if capacity < need:
        raise ConfigError(field, f"{capacity} device pages of {page_size} tokens cannot hold what policy "
                                 f"'{policy.name}' pins, the page being written and {chunk_tokens} more tokens "
                                 f"({need} pages); "
                                 f"give the device at least {need} pages ({need * page_size} tokens), or pin less, or "
                                 "prefill in smaller steps (scheduler.prefill.chunk_size)")


def check_positions(task, config) -> None:
    """The task's context plus what it generates fits the model's ``max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and task.context_tokens + task.new_tokens > limit:
        raise ConfigError(f"task.{task.context_key}",
                          f"{task.context_tokens} context tokens + {task.new_tokens} generated exceed the model's "
                          f"{limit} positions; use at most {limit - task.new_tokens}")


def budget_tokens(budget, context: int, token_bytes: int) -> int:
    """Device tokens per sequence from ``budget.tokens``, ``budget.size`` or ``budget.fraction``."""
    tokens, size, fraction = budget.tokens, budget.size, budget.fraction
    if tokens is not None:
        if tokens < 1 or tokens > context:
            raise ConfigError("budget.tokens", f"must be in [1, {context}] (the task's context), got {tokens}")
        return tokens
    if size is not None:
        tokens = parse_bytes(size, "budget.size") // token_bytes
        if not 1 <= tokens <= context:
            raise ConfigError("budget.size", f"{size} holds {tokens} tokens of KV ({token_bytes} B each); "
                                             f"the task's context is {context}: size it in between")
        return tokens
    if fraction is None or not 0 < fraction <= 1:
        raise ConfigError("budget.fraction", f"must be in (0, 1] (or set budget.tokens or budget.size), "
                                             f"got {fraction}")
    return max(1, int(fraction * context))


def tier_pages(spec, key: str, context_pages: int, stack_page_bytes: int) -> int:
    """Pages per layer of a lower tier: ``size`` (bytes over every layer) when set, else ``fraction`` of the
    context (default 1)."""
    if spec.get("size") is not None:
        pages = parse_bytes(spec.size, f"tiers.stack.{key}.size") // stack_page_bytes
        if pages < 1:
            raise ConfigError(f"tiers.stack.{key}.size", f"{spec.size} holds no page ({stack_page_bytes} B "
                                                         "over all layers); size it larger")
        return pages
    fraction = spec.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
        raise ConfigError(f"tiers.stack.{key}.fraction", f"must be a positive share of the context, got {fraction!r}")
    return max(1, math.ceil(fraction * context_pages))


def check_stack(capacities: dict, context_pages: int) -> None:
    """The tiers together hold the whole context (the device alone when it is the only tier)."""
    keys = list(capacities)
    held = sum(capacities[k] for k in keys[1:]) if len(keys) > 1 else capacities[keys[0]]
    if held < context_pages:
        where = f"tiers.stack.{keys[-1]}" if len(keys) > 1 else "tiers.stack"
        raise ConfigError(where, f"the tiers below the device hold {held} pages, the context needs "
                                 f"{context_pages}; raise a fraction or size, or add a tier")
