"""No secret in any message, log or result file: a Redis URL's password (a real redis-server that wants one), tokens."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, KVTierError, TierIOError
from kvtier.layout import KVLayout
from kvtier.models import cache_dir
from kvtier.redact import redact
from kvtier.tiers.redis import RedisTier, probe_url
from kvtier.tiers.redis_server import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret-Pa55"
TINY = ["task.length=128", "task.prefix=120", "scheduler.prefill.chunk_size=16", "progress=false", "logger=none",
        "budget.tokens=80", "tiers.stack.host.fraction=0.25", "tiers=device_host_remote"]


@pytest.mark.parametrize("text, clean", [
    ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("at rediss://default:p@ss@host:1/0 now", "at rediss://default:***@host:1/0 now"),  # an unescaped @ in it
    ("redis://127.0.0.1:6379/0 and 12:30@noon", "redis://127.0.0.1:6379/0 and 12:30@noon"),  # nothing secret
    ("https://h/x?token=abc&page=2", "https://h/x?token=***&page=2"),
    ("unix:///tmp/r.sock?password=zz", "unix:///tmp/r.sock?password=***"),
    ("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123", "HF_TOKEN=hf_***"),
    ("Authorization: Bearer eyJhbGciOi.x.y", "Authorization: Bearer ***"),
])
def test_redact(text, clean):
    assert redact(text) == clean
    assert str(KVTierError(f"failed: {text}")) == f"failed: {clean}"  # every kvtier error redacts its message


@pytest.fixture(scope="module")
def server():
    with LocalRedis(password=SECRET) as server:
        yield server


def test_a_wrong_password_says_authentication_failed_and_never_prints_it(server):
    layout = KVLayout(1, 2, 8, 4, torch.float32)
    for url in (server.url.replace(SECRET, "wrong-Pa55"), server.url.replace(f":{SECRET}@", "")):
        with pytest.raises(ConfigError) as err:
            probe_url(url, "tiers.stack.remote.url", 2.0)
        assert err.value.field == "tiers.stack.remote.url" and "authentication failed" in str(err.value)
        assert "start the server" not in str(err.value)
        with pytest.raises(TierIOError, match="remote tier 'remote': authentication failed") as err:
            RedisTier(layout, 4, url, name="remote")
        for message in (str(err.value), repr(err.value)):
            assert "Pa55" not in message
    tier = RedisTier(layout, 4, server.url, name="remote")  # the right one works
    tier.write(0, torch.arange(2), torch.ones(2, *layout.page_shape))
    assert tier.read(0, torch.arange(2)).eq(1).all()
    tier.close()


def kvtier_run(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "HOME": str(cwd / "home"),
           "KVTIER_CACHE": str(cache_dir())}  # the model converted once, outside the folder searched for the secret
    return subprocess.run([sys.executable, "-m", "kvtier.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_run_with_a_password_leaves_it_nowhere(server, tmp_path):
    """kvtier-run on a server that wants a password: the wrong one is one line (exit 2) naming the key, without
    it; the right one runs, and neither its output, its log, metrics.json, Hydra's saved config nor its W&B run (the
    command line in its metadata), nor a file it writes into kvtier's model cache, holds it."""
    wrong = kvtier_run([*TINY, f"tiers.stack.remote.url={server.url.replace(SECRET, 'wrong-Pa55')}"], tmp_path)
    assert wrong.returncode == 2 and "Pa55" not in wrong.stdout + wrong.stderr
    assert "error: tiers.stack.remote.url: authentication failed" in wrong.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "outputs").exists()
    wandb = [a.replace("logger=none", "logger=wandb") for a in TINY]  # offline: a run folder of its own
    started = time.time()
    right = kvtier_run([*wandb, f"tiers.stack.remote.url={server.url}", "hydra.verbose=true"], tmp_path)
    assert right.returncode == 0, right.stderr[-3000:]
    assert SECRET not in right.stdout + right.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    cached = [p for p in cache_dir().rglob("*") if p.is_file() and p.stat().st_mtime >= started - 1]
    assert [p for p in cached if SECRET.encode() in p.read_bytes()] == []  # kvtier's cache (outside HOME) too
    assert {"metrics.json", "config.yaml", "overrides.yaml", "kvtier-run.log"} <= {p.name for p in files}
    assert any(p.suffix == ".wandb" for p in files)
    leaks = [p for p in files if SECRET.encode() in p.read_bytes()]
    assert leaks == []
    assert "redis://:***@127.0.0.1" in (next(p for p in files if p.name == "metrics.json")).read_text()


def test_what_kvtier_run_prints_itself_holds_no_password(server, tmp_path):
    """Hydra's own printout of the config (``--cfg all``: the job's and Hydra's, the overrides among them) and a
    traceback no handler takes show the password as ``***``."""
    shown = kvtier_run([*TINY, f"tiers.stack.remote.url={server.url}", "--cfg", "all"], tmp_path)
    assert shown.returncode == 0 and "url: redis://:***@127.0.0.1" in shown.stdout, shown.stderr[-2000:]
    assert SECRET not in shown.stdout + shown.stderr
    crash = subprocess.run([sys.executable, "-c", "from kvtier.redact import redact_tracebacks; redact_tracebacks(); "
                            f"raise RuntimeError('no answer from {server.url}')"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert "RuntimeError: no answer from redis://:***@127.0.0.1" in crash.stderr and SECRET not in crash.stderr
