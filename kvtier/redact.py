"""Secrets out of every message, log line and result file: the password of a URL (``redis://user:pw@host``),
secret query parameters (``?password=``, ``token=``, ``api_key=`` ...), Hugging Face tokens and bearer tokens become
``***``. kvtier's errors redact their own message (:class:`~kvtier.errors.KVTierError`); ``kvtier-run`` redacts its
log records, what it prints (``--cfg job`` among it), its tracebacks, the config it writes (``metrics.json``,
``.hydra/``) and the command line a W&B run records."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from pathlib import Path

HIDDEN = "***"
_RULES = [
    # a URL's password: up to the authority's last "@" (a password may hold an unescaped one)
    (re.compile(r"(?P<keep>\b[a-z][a-z0-9+.-]*://[^/\s:@'\"]*:)[^/\s'\"]*(?=@[^/\s@'\"]*(?:[/\s'\"?#]|$))", re.I),
     rf"\g<keep>{HIDDEN}"),
    (re.compile(r"(?P<keep>[?&;](?:password|passwd|pwd|pass|secret|token|access_token|auth|api_?key|access_key|"
                r"secret_key|key)=)[^&;\s'\"]+", re.I), rf"\g<keep>{HIDDEN}"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), f"hf_{HIDDEN}"),
    (re.compile(r"(?P<keep>\bBearer\s+)[A-Za-z0-9._~+/=-]{8,}", re.I), rf"\g<keep>{HIDDEN}"),
]


def redact(text: str) -> str:
    """``text`` with every secret it holds replaced by ``***``."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def redacted(value):
    """A config value (dicts, lists, strings) with the secrets of its strings replaced."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value


def redact_file(path: Path) -> None:
    """Rewrite a text file (a config Hydra saved) without its secrets, atomically (a sweep's jobs may rewrite one
    file together); nothing happens to a file that holds none."""
    text = path.read_text()
    if (clean := redact(text)) != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(clean)
        os.replace(tmp, path)


def redact_logs() -> None:
    """Every log record made from now on, by any logger, carries its message with the secrets replaced."""
    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def record(*args, **kwargs):
        rec = make(*args, **kwargs)
        rec.msg, rec.args = redact(rec.getMessage()), ()
        return rec

    record.redacts = True
    logging.setLogRecordFactory(record)


@contextlib.contextmanager
def argv_redacted():
    """``sys.argv`` without its secrets while the block runs (for a library that records the command line: a W&B
    run keeps it in its metadata, which ``wandb sync`` uploads)."""
    argv = sys.argv[:]
    sys.argv[:] = [redact(a) for a in argv]
    try:
        yield
    finally:
        sys.argv[:] = argv


def redact_tracebacks() -> None:
    """An error nothing catches prints its traceback with the secrets replaced."""
    if getattr(sys.excepthook, "redacts", False):
        return

    def hook(kind, error, tb):
        sys.stderr.write(redact("".join(traceback.format_exception(kind, error, tb))))

    hook.redacts = True
    sys.excepthook = hook


class RedactedStream:
    """A text stream that passes on what is written to it without its secrets; anything else is the stream's."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def prints_redacted():
    """``sys.stdout`` and ``sys.stderr`` without secrets while the block runs (what Hydra prints itself: ``--cfg``)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactedStream(out), RedactedStream(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
