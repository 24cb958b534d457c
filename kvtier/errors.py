"""Named errors. Each message says what to change."""

import contextlib


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose; its message never holds a secret (a URL's password, a
    token: :func:`kvtier.redact.redact`)."""

    def __init__(self, *args):
        from kvtier.redact import redact

        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid. ``field`` names the offending key."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class TierFullError(KVTierError):
    """A tier has no free slot; raise its capacity or demote pages first."""


class PageCorruptedError(KVTierError):
    """A stored page failed its integrity check; its bytes are never returned."""


class PageEvictedError(PageCorruptedError):
    """A stored page is gone from its store (evicted, expired, or the server restarted empty); never
    replaced by other bytes."""


class TierIOError(KVTierError):
    """A tier's backing store failed (disk full, server gone, truncated file)."""


class MissingDependencyError(KVTierError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, package: str, extra: str, feature: str):
        super().__init__(f"{feature} needs the '{package}' package: pip install 'kvtier[{extra}]'")


class UnsupportedAttentionError(ConfigError):
    """The model asks for an attention feature kvtier does not compute (soft-capping, sinks, ALiBi, a
    non-causal mask, ...): refused rather than silently attended differently. ``feature`` names it."""

    def __init__(self, feature: str, model: str, message: str):
        self.feature = feature
        super().__init__("model", f"{model} uses {feature}, which kvtier does not honour: {message}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a task; ``result`` is the task's result over what finished, marked ``partial``."""

    def __init__(self, result: dict):
        super().__init__("interrupted")
        self.result = {**result, "partial": True}


class TierFailed(KVTierError):
    """A tier failed under a running task (its store gone, a page lost or damaged): ``result`` is the
    task's result over what finished, marked ``partial``, with the fault; ``fault`` is the tier's error."""

    def __init__(self, result: dict, fault: Exception, where: str = ""):
        super().__init__(f"{fault}{'; ' + where if where else ''}")
        self.fault = fault
        self.result = {**result, "partial": True, "fault": f"{type(fault).__name__}: {fault}"}


@contextlib.contextmanager
def partial_on_stop(result):
    """Ctrl-C (SIGINT, or SIGTERM turned into it) becomes :class:`Interrupted` and a tier's fault
    :class:`TierFailed`, each carrying ``result()``: the task's result over what finished so far."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(result()) from None
    except (TierIOError, PageCorruptedError) as fault:
        raise TierFailed(result(), fault) from None
