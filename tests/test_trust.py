"""Issue 26: no silent wrong result, no traceback, no lost run. Each case a user can meet: a run folder of
its own, partial results on SIGTERM / SIGINT / a tier's fault, atomic result files, one named line
(exit 2, before the model loads where the input is known) for bad inputs, and messages that name keys
that exist."""

import ast
import fnmatch
import inspect
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvtier.run
from kvtier.errors import ConfigError
from kvtier.run import RECIPES, execute, run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.length=128", "task.prefix=96", "scheduler.prefill.chunk_size=16", "progress=false", "logger=none",
        "budget.fraction=0.75"]


def composed(overrides=()):
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides], return_hydra_config=False)


def python(code: str, cwd: Path, *args) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout's kvtier, from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def one_line(proc) -> str:
    """The one line a failed kvtier-run prints (no traceback)."""
    lines = [l for l in proc.stderr.splitlines() if l.startswith("kvtier-run:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# -- lost runs ------------------------------------------------------------------------------------
def _claim(cfg, barrier, out):
    barrier.wait()
    out.put(run_dir(cfg))


def test_identical_runs_started_together_get_a_folder_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = composed()
    ctx = multiprocessing.get_context("fork")  # the children only make folders: no torch op runs
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(cfg, barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join()
    assert len(set(got)) == 4 and all((tmp_path / g).is_dir() for g in got), got
    assert [g[len(got[0]):] for g in got] == ["", "-2", "-3", "-4"]
    assert run_dir(cfg) == run_dir(cfg)  # one process asking twice keeps its folder


def test_a_failed_run_never_removes_a_folder_it_did_not_make(tmp_path, monkeypatch):
    other = tmp_path / "theirs"
    (other / ".hydra").mkdir(parents=True)  # another process's run, just started
    monkeypatch.setattr(kvtier.run, "build_model", lambda cfg: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        execute(composed(), other)
    assert (other / ".hydra").is_dir()
    with pytest.raises(RuntimeError, match="boom"):
        execute(composed(), tmp_path / "mine")
    assert not (tmp_path / "mine").exists()  # its own is removed


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_writes_the_finished_part(tmp_path, sig, code):
    proc = python(f"""
        import os, sys
        from kvtier.engine import Engine
        import kvtier.run
        real, calls = Engine.decode_step, []
        def step(self, cache, ids):
            calls.append(1)
            if len(calls) == 10:
                os.kill(os.getpid(), {int(sig)})  # as Slurm, Kubernetes or Ctrl-C send it
            return real(self, cache, ids)
        Engine.decode_step = step
        sys.argv = ["kvtier-run", *sys.argv[1:]]
        kvtier.run.main()
    """, tmp_path, *TINY)
    assert proc.returncode == code and "partial results in" in one_line(proc), proc.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/perplexity/*/metrics.json")
    m = json.loads(path.read_text())
    assert m["partial"] is True and m["fault"] is None and 9 <= m["task_result"]["scored_tokens"] <= 11


def test_a_tier_failing_mid_run_writes_the_finished_part_and_names_tier_and_fault(tmp_path):
    """Pages of the run's Redis expire (ttl) before they are read back: PageEvictedError mid-run."""
    proc = python("import sys, kvtier.run; sys.argv[0] = 'kvtier-run'; kvtier.run.main()", tmp_path, *TINY,
                  "tiers=device_host_remote", "budget.tokens=80", "tiers.stack.host.fraction=0.25",
                  "+tiers.stack.remote.ttl_s=0.05")
    line = one_line(proc)
    assert proc.returncode == kvtier.run.EXIT_TIER_FAULT
    assert "remote tier 'remote'" in line and "are gone" in line and "partial results in" in line
    (path,) = tmp_path.glob("outputs/perplexity/*/metrics.json")
    m = json.loads(path.read_text())
    assert m["partial"] is True and m["fault"].startswith("PageEvictedError: remote tier 'remote'")
    assert m["task_result"]["scored_tokens"] >= 1


def test_a_failed_result_write_leaves_no_truncated_file(tmp_path):
    """A file-size limit (as a full disk) stops the write of metrics.json halfway."""
    proc = python("""
        import resource, signal, sys
        from kvtier.report import write_json
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail with EFBIG instead of dying
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_json({"x": list(range(10000))}, sys.argv[1])
        except OSError as e:
            print("refused", e.errno)
    """, tmp_path, tmp_path / "metrics.json")
    assert proc.stdout.startswith("refused"), proc.stderr
    assert list(tmp_path.iterdir()) == []


# -- every key a message names exists -------------------------------------------------------------
# Keys that are Python-API argument names, not recipe keys (the object's own argument, documented in its
# docstring), and keys in files the engine rewrite (issue 22) replaces: those messages are rewritten there.
PYTHON_API = {"attention_mask", "attn_implementation", "batch_size", "capacity", "dropout", "dtype",
              "past_key_values", "sliding_windows", "spec.bandwidth_gbps", "spec.latency_s", "topk_pages",
              "transfer.method", "defaults"}
REWRITTEN = {"kvtier/cache.py": {"cache.budget", "cache.dense_layers"},
             "kvtier/fast/engine.py": {"margin", "prompt", "recall_slots", "scheduler.lookahead", "tiers.host"},
             "kvtier/serve/scheduler.py": {"request", "serve.max_batch", "serve.preempt", "serve.swap_tokens",
                                           "serve.token_budget"},
             "kvtier/kernels/base.py": {"model.num_attention_heads"},
             "kvtier/kernels/triton_prefill.py": {"layout.page_size"}}


def _literal_keys(node):
    """The key(s) a ConfigError's first argument names: a string, an f-string (``*`` for each value), or
    either branch of ``a if c else b``; nothing for a variable."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        yield "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    elif isinstance(node, ast.IfExp):
        yield from _literal_keys(node.body)
        yield from _literal_keys(node.orelse)


def raised_keys():
    """``(file, key)`` of every ``ConfigError(key, ...)`` in kvtier's source."""
    for path in sorted((ROOT / "kvtier").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "ConfigError":
                for key in _literal_keys(node.args[0]) if node.args else ():
                    yield path.relative_to(ROOT).as_posix(), key


def recipe_keys() -> set[str]:
    """Every key of every composed recipe option (``kvtier-run --cfg job``), with the parameters of each
    ``_target_`` node's target (what the node may set)."""
    from kvtier.build import target_of

    keys = set()

    def walk(node, prefix):
        for k, v in node.items():
            keys.add(f"{prefix}{k}")
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
        if "_target_" in node:
            target = target_of(OmegaConf.create({"_target_": node["_target_"]}), prefix)
            keys.update(f"{prefix}{p}" for p in inspect.signature(target).parameters)

    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        for group in (g for g in RECIPES.iterdir() if g.is_dir()):
            for option in group.rglob("*.yaml"):
                name = option.relative_to(group).with_suffix("").as_posix()
                cfg = compose("config", overrides=[f"{group.name}={name}"])
                walk(OmegaConf.to_container(cfg, resolve=False), "")
    return keys


def test_every_key_an_error_names_exists():
    keys = recipe_keys()
    raised = sorted(set(raised_keys()))
    assert len(raised) > 60  # the walk found the messages
    unknown = [(f, k) for f, k in raised if k not in PYTHON_API and k not in REWRITTEN.get(f, ())
               and not any(fnmatch.fnmatchcase(known, k) for known in keys)]
    assert unknown == [], unknown
    assert {k for ks in REWRITTEN.values() for k in ks} <= {k for _, k in raised}  # no stale exception
