"""Cross-object checks, in one place: what no constructor sees alone (budget vs context vs the policy's
pins vs the model's positions, policy vs kernel, the tier stack vs the context), and sizes in bytes. The
run path (:mod:`kvtier.build`) and the Python API (``TieredKVCache``, the tasks) call them."""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "ki": 2**10, "mi": 2**20, "gi": 2**30,
          "ti": 2**40, "pi": 2**50}


def parse_bytes(value, field: str) -> int:
    """Bytes in ``value``: an integer, or a number and a unit (B, KB/MB/GB/TB/PB, KiB/MiB/GiB/TiB/PiB)."""
    m = None if isinstance(value, bool) else re.fullmatch(r"\s*(\d*\.?\d+)\s*([kmgtp]i?)?b?\s*", str(value), re.I)
    if m is None or int(float(m[1]) * _UNITS[(m[2] or "").lower()]) < 1:
        raise ConfigError(field, f"{value!r} is not a size; write e.g. 8GiB, 512MB or a number of bytes")
    return int(float(m[1]) * _UNITS[(m[2] or "").lower()])


def check_engine_args(model, layout, config, **flags) -> None:
    """What an :class:`~kvtier.engine.Engine` (and a ``TieredKVCache``, through it) is given, checked by kind before
    anything is allocated: ``model`` None or a Hugging Face model whose KV ``layout`` is (a
    :class:`~kvtier.layout.KVLayout`: layers, kv heads, head size as its config's), ``config`` an EngineConfig or
    None, each of ``flags`` (``exact_prefill=...``) true or false."""
    from kvtier.engine.config import EngineConfig
    from kvtier.layout import KVLayout

    if not isinstance(layout, KVLayout):
        raise ConfigError("layout", f"must be a kvtier.KVLayout (e.g. kvtier.kv_layout_for(model.config)), got "
                                    f"{type(layout).__name__}")
    if config is not None and not isinstance(config, EngineConfig):
        raise ConfigError("config", f"must be a kvtier.EngineConfig (e.g. EngineConfig(max_batch=4)), got "
                                    f"{type(config).__name__}")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"cache.{key}", f"must be True or False, got {type(value).__name__} {value!r}")
    if model is None:
        return
    config = getattr(model, "config", None)
    if not callable(getattr(model, "forward", None)) or not hasattr(config, "num_hidden_layers"):
        raise ConfigError("model", f"must be a Hugging Face causal LM (e.g. from kvtier.load_model()) or None, got "
                                   f"{type(model).__name__}")
    from kvtier.models import attention_dims

    _, kv_heads, head_dim = attention_dims(config)
    want = (config.num_hidden_layers, kv_heads, head_dim)
    have = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if have != want:
        field = next(f for f, a, b in zip(("num_layers", "num_kv_heads", "head_dim"), have, want) if a != b)
        raise ConfigError(f"layout.{field}", f"has {layout.num_layers} layers of {layout.num_kv_heads} kv heads x "
                                    f"{layout.head_dim}, the model {want[0]} of {want[1]} x {want[2]}: make it "
                                    f"with kvtier.kv_layout_for(model.config)")


def device_pages_needed(policy, page_size: int, chunk_tokens: int, batch_size: int = 1) -> int:
    """Device pages a step needs: per sequence, the policy's pins, the page being written and a chunk's new pages."""
    return batch_size * (policy.pinned_pages(page_size) + 1 + -(-chunk_tokens // page_size))


def pay_for_key_stats(device_pages: int, scope, layout, tokens: int, field: str) -> int:
    """The device tier's pages once its budget paid for the key statistics ``scope`` keeps on the device to choose
    (Quest's bounds, the key sketch: :meth:`kvtier.stats.KeyStats.bytes_per_token_for`) for ``tokens`` stored
    tokens; a policy's own statistics are not counted."""
    from kvtier.stats import KeyStats

    if not scope.needs_keys:
        return device_pages
    per_token = KeyStats.bytes_per_token_for(layout, *KeyStats.needed(scope, None, layout))
    taken = math.ceil(tokens * per_token / (layout.num_layers * layout.page_bytes))
    if device_pages - taken < 1:
        raise ConfigError(field, f"gives the device {device_pages} pages; scope '{scope.name}' keeps key statistics "
                                 f"of {per_token:.0f} B a token there, {taken} pages' worth for {tokens} tokens: "
                                 "raise it")
    return device_pages - taken


def check_device_room(capacity: int, policy, page_size: int, chunk_tokens: int, field: str,
                      batch_size: int = 1, taken: int = 0, by: str = "", give=None, settable: bool = True) -> None:
    """What the ``capacity`` device pages leave once ``taken`` of them went elsewhere (``by``: to what, said; a
    setting unless not ``settable``) holds :func:`device_pages_needed`. ``give(pages)``: the setting of ``field`` that
    gives the device that many pages (for the message; default: the pages and tokens)."""
    need = device_pages_needed(policy, page_size, chunk_tokens, batch_size)
    if capacity - taken >= need:
        return

    def pages(n: int, of: str = "") -> str:
        return f"{n} device page{'s' if n != 1 else ''}{of} of {page_size} tokens"

    if not taken:
        have = f"{pages(capacity)} cannot hold"
    elif taken < capacity:
        have = f"{pages(capacity - taken, f' (of {capacity}, less {by})')} cannot hold"
    else:
        have = f"{by} take {taken} of the {pages(capacity)}, leaving none for"
    fix = give(need + taken) if give is not None else \
        f"give the device at least {need + taken} pages ({(need + taken) * page_size} tokens)"
    rows = f" for each of {batch_size} rows" if batch_size > 1 else ""
    less = f", or give less to {by}" if taken and settable else ""
    smaller = ", or prefill in smaller steps (scheduler.prefill.chunk_size)" if chunk_tokens else ""
    raise ConfigError(field, f"{have} what policy '{policy.name}' pins ({policy.pinned_pages(page_size)} pages), the "
                             f"page being written and {chunk_tokens} more tokens{rows}; {fix}, or pin less{smaller}{less}")


def check_recall_room(capacity: int, policy, page_size: int, scope, rows: int) -> int:
    """The device slots a scope's recall cache takes (its slots, and each row's landing slots per layer) leave the
    device room for what the policy pins and the pages being written (:func:`check_device_room`); those slots."""
    n_land = getattr(scope, "landing_slots", 0)
    taken = getattr(scope, "recall_slots", 0) + rows * n_land
    if taken:
        landing = f" and {rows} x {n_land} landing slots" if n_land else ""
        check_device_room(capacity, policy, page_size, 0, "scope.recall_slots", rows, taken,
                          f"the recall cache's {scope.recall_slots} slots{landing}")
    return taken


def check_partial_budget(budget: int, context: int, scope: str, key: str) -> None:
    """A budget of the whole context is refused unless ``scope`` is ``all``: under ``resident`` or ``topk``
    the scheduler keeps room for the next chunk and the policy still places and picks pages, so it is not
    exact attention, yet it would be read as the exact end of a quality-vs-budget curve."""
    if budget >= context and scope != "all":
        raise ConfigError(key, f"gives the whole context ({context} tokens) to the device, which under "
                               f"scope={scope} is still not exact attention; for the exact baseline use scope=all, "
                               "else a budget below the context")


def check_kernel(backend, policy, scope, layout, lower_tiers: bool, budget: bool, fidelity: bool,
                 dense_layers: int) -> None:
    """What a step asks of the kernel backend against what it declares it can do (``backend.can``,
    :class:`~kvtier.kernels.base.Capabilities`): ``scope`` (an instance or its class), ``lower_tiers`` (pages may live
    below the device tier), ``budget`` (a token budget's spans). A ConfigError names the option at fault and what to
    set instead."""
    can, name = backend.can, f"kernel={backend.name}"
    other = "use kernel=triton (or kernel=torch)"
    if not can.decode:
        raise ConfigError("kernel", f"{name} has no decode step over kvtier's block table; {other}")
    page_stats = set(policy.needs) & {"attention", "salience"}
    if page_stats and not can.page_stats:
        raise ConfigError("kernel", f"policy '{policy.name}' needs {sorted(page_stats)} per page, which {name} does "
                                    f"not give; {other}, or a policy that needs neither")
    if getattr(scope, "unit", "page") == "token" and not can.key_lists:
        raise ConfigError("scope.unit", f"{name} attends pages, not single keys (key lists): set scope.unit=page, or "
                                        f"{other}")
    if getattr(scope, "per_head", False) and not can.head_lists:
        raise ConfigError("scope.per_head", f"{name} takes one page list per row: set scope.per_head=false, or {other}")
    if not scope.query_free and not can.query_picks:
        raise ConfigError("scope", f"scope '{scope.name}' picks each layer's pages from its query during the step, and "
                                   f"{name} plans its page lists on the host before it: use scope=all or scope=resident, "
                                   f"or {other}")
    if budget and not can.spans:
        raise ConfigError("cache.attend_budget", f"a token budget attends part of some pages (its sinks and window), "
                                                 f"and {name} whole pages only: attend without a budget, or {other}")
    if layout.scaled and not can.scaled_pages:
        raise ConfigError("kv_dtype", f"{name} cannot read kvtier's 8-bit pages (their scales per page): set kv_dtype "
                                      f"to the model's dtype, or {other}")
    if fidelity and can.host_plan:
        raise ConfigError("cache.fidelity", f"the uncounted exact pass is planned on the device per call, and "
                                            f"{name} plans each step's lists on the host: set cache.fidelity=false, "
                                            f"or {other}")
    if lower_tiers and not can.far_pages:
        if not scope.device_only:
            raise ConfigError("scope", f"scope '{scope.name}' attends pages wherever they live, and {name} reads HBM "
                                       f"only: use scope=resident, a device tier that holds every page (no tier "
                                       f"below it), or {other}")
        if dense_layers:
            raise ConfigError("cache.dense_layers", f"dense layers attend every page wherever it lives, and {name} "
                                                    f"reads HBM only: set cache.dense_layers=0, or {other}")
        if any(layout.sliding_windows) and not can.window_by_position:
            raise ConfigError("kernel", f"{name} masks a sliding window by the keys' order in the list, and "
                                        f"scope '{scope.name}' lists skip the pages below the device: {other}")


def check_scheduler(scheduler) -> None:
    """The engine hands a placement scheduler the step's :class:`~kvtier.scheduler.base.Ranking` (the policy is
    asked once per step): ``plan`` must take it."""
    import inspect

    from kvtier.scheduler.base import Scheduler

    if not isinstance(scheduler, Scheduler) or "ranking" not in inspect.signature(scheduler.plan).parameters:
        raise ConfigError("scheduler.placement", f"must be a kvtier.scheduler.Scheduler whose plan(table, policy, "
                                                 f"step, reserve=0, ranking=None) takes the step's Ranking, got "
                                                 f"{type(scheduler).__name__}")


def graphs_for(graphs, device, host_kernel: bool, fidelity: bool, forward: bool = True) -> bool:
    """Whether steps replay as CUDA graphs, the one rule of every door (recipes, ``Engine``, ``TieredKVCache``):
    ``graphs`` None: where a step can be captured; true: that, or a ConfigError saying why not; false: never. A step
    can be captured when it is GPU work (a model on a GPU) whose forward the engine runs itself (``forward``; under
    ``generate`` HF's loop runs it, through ``TieredKVCache``), with a kernel that reads the lengths on the device
    (``host_kernel``: one that does not, the torch reference, or FlashInfer, planned on the host each step) and no
    uncounted fidelity pass timed per call."""
    import torch

    why = None
    if torch.device(device).type != "cuda":
        why = f"CUDA graphs replay GPU work, and the model runs on {device}: set engine.graphs=false (or null: on a " \
              "GPU only)"
    elif not forward:
        why = "this engine runs no forward of its own (generate runs the model's, through TieredKVCache), so it has no " \
              "step to capture: drive a kvtier.Engine with the model, or leave graphs null"
    elif host_kernel:
        why = "the kernel backend reads the step's lengths on the host (torch's reference) or plans its lists there " \
              "(FlashInfer), which a captured step cannot: use kernel=triton, or engine.graphs=false"
    elif fidelity:
        why = "cache.fidelity times an uncounted exact pass per call, which a captured step cannot leave out of TPOT: " \
              "set engine.graphs=false"
    if graphs and why:
        raise ConfigError("engine.graphs", why)
    return why is None if graphs is None else bool(graphs)


def check_dense_layers(dense_layers, num_layers: int) -> None:
    """``cache.dense_layers``: how many first layers attend every page, an integer in ``[0, num_layers]``."""
    if not isinstance(dense_layers, int) or isinstance(dense_layers, bool) or not 0 <= dense_layers <= num_layers:
        raise ConfigError("cache.dense_layers", f"must be an integer in [0, {num_layers}] (the model's layers), got "
                                                f"{dense_layers!r}")


def check_max_context(max_context, task, page_size: int) -> None:
    """``engine.max_context`` (None: what the tiers hold; whole pages of ``page_size``) holds the task's context and
    the tokens it generates."""
    need = task.context_tokens + task.new_tokens
    if max_context is not None and -(-max_context // page_size) * page_size < need:
        raise ConfigError("engine.max_context", f"{max_context} tokens per sequence cannot hold the task's "
                                                f"task.{task.context_key}={task.context_tokens} tokens + "
                                                f"{task.new_tokens} generated; give it at least {need}, or null "
                                                "(what the tiers hold)")


def check_positions(task, config) -> None:
    """The task's context plus what it generates fits the model's ``max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and task.context_tokens + task.new_tokens > limit:
        raise ConfigError(f"task.{task.context_key}",
                          f"{task.context_tokens} context tokens + {task.new_tokens} generated exceed the model's "
                          f"{limit} positions; use at most {limit - task.new_tokens}")


def tier_pages(spec, field: str, context_pages: int, stack_page_bytes: int) -> int:
    """Pages per layer of a lower tier: ``size`` (bytes over all layers), else ``fraction`` (default 1) of
    the context."""
    if spec.get("size") is not None:
        if (pages := parse_bytes(spec.size, f"{field}.size") // stack_page_bytes) < 1:
            raise ConfigError(f"{field}.size", f"{spec.size} holds no page ({stack_page_bytes} B over all layers)")
        return pages
    fraction = spec.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
        raise ConfigError(f"{field}.fraction", f"must be a positive share of the context, got {fraction!r}")
    return math.ceil(fraction * context_pages)


def check_stack(capacities: dict, context_pages: int) -> None:
    """The tiers below the device (the device, when alone) hold the whole context."""
    keys = list(capacities)
    held = sum(capacities[k] for k in keys[1:]) if len(keys) > 1 else capacities[keys[0]]
    if held < context_pages:
        raise ConfigError(f"tiers.stack.{keys[-1]}" if len(keys) > 1 else "tiers.stack", f"the tiers below the "
                          f"device hold {held} pages, the context needs {context_pages}; raise a fraction or size")


def check_memory(in_memory: dict) -> None:
    """The tiers held in memory fit what is free there now: ``in_memory`` maps the key that sizes each
    such tier (the budget's for the device) to ``(bytes, device)``; host DRAM and a CPU device share the RAM."""
    import psutil
    import torch

    need: dict = {}
    for key, (nbytes, device) in in_memory.items():
        device = torch.device(device)
        need.setdefault(device if device.type == "cuda" else torch.device("cpu"), []).append((nbytes, key))
    for device, tiers in need.items():
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        if (total := sum(n for n, _ in tiers)) > free:
            nbytes, key = max(tiers)
            raise ConfigError(key, f"gives a tier {nbytes / 2**30:.1f} GiB; the tiers in {device.type} memory need "
                                   f"{total / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB is free: make it smaller")
