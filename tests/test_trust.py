"""Issue 26: no silent wrong result, no traceback, no lost run. Each case a user can meet: a run folder of
its own, partial results on SIGTERM / SIGINT / a tier's fault, atomic result files, one named line
(exit 2, before the model loads where the input is known) for bad inputs, and messages that name keys
that exist."""

import ast
import fnmatch
import http.server
import inspect
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvtier.run
from kvtier.errors import ConfigError, KVTierError, MissingDependencyError
from kvtier.run import RECIPES, execute, job_configs, main, run_dir

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
        import os, signal, sys
        from kvtier.engine import Engine
        import kvtier.run
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (the suite's worker may ignore it)
        real, calls = Engine.step, []
        def step(self, tokens=None):
            calls.append(1)
            if len(calls) == 10:
                os.kill(os.getpid(), {int(sig)})  # as Slurm, Kubernetes or Ctrl-C send it
            return real(self, tokens)
        Engine.step = step
        sys.argv = ["kvtier-run", *sys.argv[1:]]
        kvtier.run.main()
    """, tmp_path, *TINY)
    assert proc.returncode == code and "partial results in" in one_line(proc), proc.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/perplexity/*/metrics.json")
    m = json.loads(path.read_text())
    assert m["partial"] is True and m["fault"] is None and 9 <= m["task_result"]["scored_tokens"] <= 11


def test_a_tier_failing_mid_run_writes_the_finished_part_and_names_tier_and_fault(tmp_path):
    """Pages of the run's Redis expire (ttl) before they are read back: PageEvictedError mid-run."""
    proc = python("import sys, kvtier.run; sys.argv[0] = 'kvtier-run'; kvtier.run.main()", tmp_path, *TINY[:-1],
                  "tiers=device_host_remote", "budget.tokens=80", "tiers.stack.host.fraction=0.25",
                  "+tiers.stack.remote.ttl_s=0.05")
    line = one_line(proc)
    assert proc.returncode == kvtier.run.EXIT_TIER_FAULT
    assert "remote tier 'remote'" in line and "are gone" in line and "partial results in" in line
    (path,) = tmp_path.glob("outputs/perplexity/*/metrics.json")
    m = json.loads(path.read_text())
    assert m["partial"] is True and m["fault"].startswith("PageEvictedError: remote tier 'remote'")
    assert m["task_result"]["scored_tokens"] >= 1


def test_a_server_gone_mid_task_is_a_tier_fault_carrying_the_finished_part():
    import torch

    from kvtier.errors import TierFailed, partial_on_stop
    from kvtier.layout import KVLayout
    from kvtier.tiers import RedisTier
    from kvtier.tiers.redis_server import LocalRedis

    layout = KVLayout(1, 2, 8, 4, torch.float32)
    server = LocalRedis()
    tier = RedisTier(layout, 4, server.url, timeout_s=2.0)
    tier.write(0, torch.arange(2), torch.zeros(2, *layout.page_shape))
    server.stop()
    done = []
    with pytest.raises(TierFailed, match="remote tier 'remote'.*unreachable") as err:
        with partial_on_stop(lambda: {"scored": len(done)}):
            done.append(tier.read(0, torch.arange(1)))
    assert err.value.result["partial"] and err.value.result["scored"] == 0
    assert err.value.result["fault"].startswith("TierIOError: remote tier 'remote'")
    tier.close()


def test_a_failed_result_write_leaves_no_truncated_file(tmp_path):
    """A file-size limit (as a full disk) stops the write of metrics.json halfway."""
    proc = python("""
        import resource, signal, sys
        from kvtier.report import write_json
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail with EFBIG instead of dying
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_json({"x": list(range(10000))}, sys.argv[1])
        except Exception as e:
            print(f"{type(e).__name__}: {e}")
    """, tmp_path, tmp_path / "metrics.json")
    assert proc.stdout.startswith(f"KVTierError: cannot write {tmp_path / 'metrics.json'} (File too large)"), \
        proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as f:  # someone else takes the disk
        with pytest.raises(OSError, match="No space"):
            while True:
                f.write(b"\0" * 65536)
                f.flush()


@pytest.mark.parametrize("fault", ["disk full", "folder removed"])
def test_a_failed_metrics_write_keeps_the_runs_data_and_leaves_no_half_folder(fault, tiny_fs, tmp_path, monkeypatch):
    """The run's disk fills up (a real 1 MiB tmpfs), or its folder is removed, while the task runs: metrics.json
    cannot be written, so the metrics go to a file of their own that the error names, and no run folder is left."""
    import kvtier.build

    run_dir = (tiny_fs if fault == "disk full" else tmp_path) / "run"
    real_close = kvtier.build.EngineFactory.close

    def close(self):  # the task is done; its result not written yet
        real_close(self)
        _fill(tiny_fs) if fault == "disk full" else shutil.rmtree(run_dir)

    monkeypatch.setattr(kvtier.build.EngineFactory, "close", close)
    with pytest.raises(KVTierError) as err:
        execute(composed(), run_dir)
    message = str(err.value)
    assert f"cannot write {run_dir / 'metrics.json'}" in message and "the run's metrics are kept in" in message
    kept = Path(message.rsplit(" kept in ", 1)[1])
    metrics = json.loads(kept.read_text())
    assert metrics["partial"] is False and metrics["task_result"]["scored_tokens"] == 128 - 96
    assert not run_dir.exists()
    kept.unlink()


# -- every key a message names exists -------------------------------------------------------------
# Keys that are Python-API argument names, not recipe keys (the object's own argument, documented in its
# docstring), and keys in files the engine rewrite (issue 22) replaces: those messages are rewritten there.
PYTHON_API = {"attention_mask", "attn_implementation", "batch_size", "capacity", "dropout", "dtype",
              "past_key_values", "sliding_windows",
              "transfer.method", "defaults", "layout.head_dim", "prompt", "request", "hbm", "input_ids", "keep_room",
              "expand", "prompt_tokens", "new_tokens", "topk_pages", "config", "layout", "layout.*",
              "use_cache", "device", "pin_memory"}
HYDRA = {"hydra/launcher"}  # Hydra's own group, named on the command line
OWN_FILES = ("kvtier/sim/",)  # the simulator's messages name keys of its calibration file and cluster setups
REWRITTEN = {"kvtier/kernels/base.py": {"model.num_attention_heads"},
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
    unknown = [(f, k) for f, k in raised if k not in PYTHON_API | HYDRA and k not in REWRITTEN.get(f, ())
               and not f.startswith(OWN_FILES) and not any(fnmatch.fnmatchcase(known, k) for known in keys)]
    assert unknown == [], unknown
    assert {k for ks in REWRITTEN.values() for k in ks} <= {k for _, k in raised}  # no stale exception


# -- one named line before the model loads ---------------------------------------------------------
@pytest.fixture
def inputs(tmp_path):
    """Bad inputs a user hands kvtier-run: ``{name: path}``, and a folder of their own recipes."""
    mine = tmp_path / "mine"
    (mine / "policy").mkdir(parents=True)
    (mine / "tiers").mkdir()
    (mine / "policy" / "bad_yaml.yaml").write_text("_target_: kvtier.policies.LRU\n  name: : x\n")
    (mine / "policy" / "not_a_policy.yaml").write_text("_target_: kvtier.tiers.HostTier\n")
    (mine / "policy" / "raises.yaml").write_text("_target_: strict.Strict\nlevel: 7\n")
    (mine / "strict.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from kvtier.policies import LRU

        @dataclass
        class Strict(LRU):
            level: int = 1

            def __post_init__(self):
                if self.level > 3:
                    raise ValueError(f"level must be <= 3, got {self.level}")
    '''))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    array = tmp_path / "array"
    array.mkdir()
    (array / "config.json").write_text('[{"model_type": "llama"}]')
    traces = {"malformed": b'{"timestamp": 0, "input_length": 4\n', "binary": b"\xff\xfe\x00 trace\n",
              "keyless": b'{"timestamp": 0}\n', "empty": b""}
    for name, data in traces.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
    return {"mine": mine, "model": model, "array": array, **{k: tmp_path / f"{k}.jsonl" for k in traces}}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server():
    """A loopback server that speaks HTTP, not Redis: ``redis://`` URL of it."""
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    server.shutdown()


NAMED = [  # (args, key): each was a traceback or a silent run before; now one line naming the key, exit 2
    (lambda i: ["--config-dir", i["mine"], "policy=bad_yaml"], "policy"),
    (lambda i: ["--config-dir", i["mine"], "policy=not_a_policy"], "policy._target_"),
    (lambda i: ["--config-dir", i["mine"], "policy=raises"], "policy"),
    (lambda i: ["--config-dir", ROOT / "examples" / "custom_policy", "policy=fifo", "policy.sinks=-1"],
     "policy.sinks"),
    (lambda i: ["tiers.stack.host._target_=kvtier.policies.LRU"], "tiers.stack.host._target_"),
    (lambda i: ["model=local", f"model.path={i['model']}"], "model"),
    (lambda i: ["tiers=device_host_remote", f"tiers.stack.remote.url=redis://127.0.0.1:{_closed_port()}/0"],
     "tiers.stack.remote.url"),
    (lambda i: ["tiers=device_host_remote", f"tiers.stack.remote.url={i['http']}"], "tiers.stack.remote.url"),
    (lambda i: ["task=serve_trace", f"task.trace={i['malformed']}"], "task.trace"),
    (lambda i: ["task=serve_trace", f"task.trace={i['binary']}"], "task.trace"),
    (lambda i: ["task=serve_trace", f"task.trace={i['keyless']}"], "task.trace"),
    (lambda i: ["task=serve_trace", f"task.trace={i['empty']}"], "task.trace"),
    (lambda i: ["task=serve_trace", "task.start=1000000"], "task.start"),
    (lambda i: ["tiers.stack.host.size=1000TB"], "tiers.stack.host.size"),
    (lambda i: ["budget.fraction=1.0"], "budget.fraction"),
    (lambda i: ["budget.tokens=320", "scope=topk"], "budget.tokens"),
    (lambda i: ["cache.mode=sometimes"], "cache.mode"),
    (lambda i: ["scope=topk", "scope.policy_share=7"], "scope.policy_share"),
    (lambda i: ["scope=topk", "scope.query_rows=-3"], "scope.query_rows"),
    (lambda i: ["scope=topk", "scope.rank=best"], "scope.rank"),
    (lambda i: ["cache.topk_pages=4"], "cache.topk_pages"),
    (lambda i: ["scope._target_=kvtier.policies.LRU"], "scope._target_"),
    # issue 60: checks that ran after the model loaded, and tracebacks
    (lambda i: ["tiers=device_host_remote", "tiers.stack.remote.timeout_s=0"], "tiers.stack.remote.timeout_s"),
    (lambda i: ["tiers=device_host_disk", "tiers.stack.disk.path=/proc/kvtier"], "tiers.stack.disk.path"),
    (lambda i: ["tiers=device_host_disk", "tiers.stack.disk.size=100TB"], "tiers.stack.disk.path"),
    (lambda i: ["engine.max_context=64"], "engine.max_context"),
    (lambda i: ["engine.graphs=true", "model.device=cpu"], "engine.graphs"),
    (lambda i: ["cache.dense_layers=99"], "cache.dense_layers"),
    (lambda i: ["hydra.run.dir=/proc/kvtier-run"], "hydra.run.dir"),
    (lambda i: ["-m", "hydra.sweep.dir=/proc/kvtier-sweep", "policy=lru,aspe"], "hydra.sweep.dir"),
    (lambda i: ["model=local", f"model.path={i['array']}"], "model"),
    (lambda i: ["scope=topk", "scope.recall_slots=100", "budget.fraction=0.5"], "scope.recall_slots"),
]
NAMED_IDS = ["user yaml", "not a policy", "plugin ValueError", "fifo sinks", "not a tier", "config.json",
             "closed redis port", "not redis", "trace malformed", "trace not utf-8", "trace key-less", "trace empty",
             "trace start past end", "host 1000TB", "fraction 1.0", "whole budget topk", "cache.mode",
             "scope.policy_share", "scope.query_rows", "scope.rank", "old topk key", "not a scope", "redis timeout 0",
             "disk under /proc", "disk reservation", "max_context", "graphs on a CPU", "dense_layers", "run dir",
             "sweep dir", "config.json array", "recall slots"]


@pytest.mark.parametrize("case", range(len(NAMED)), ids=NAMED_IDS)
def test_a_bad_input_is_one_named_line_before_the_model_loads(case, inputs, http_server, tmp_path, monkeypatch,
                                                             capsys):
    import kvtier.build

    make, key = NAMED[case]
    args = [str(a) for a in make({**inputs, "http": http_server})]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts --config-dir on it
    monkeypatch.setattr(kvtier.run, "build_model", lambda *a: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "argv", ["kvtier-run", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.count("\n") == 0 and f"error: {key}: " in err, err
    assert list(work.iterdir()) == []
    with pytest.raises(ConfigError) as raised:
        list(map(kvtier.build.plan, job_configs(args)))
    assert raised.value.field == key


MESSAGES = [  # (args, key, what the message says): the key and value at fault, and how to fix it
    (["task.length=2"], "task.length", "task.length=2 leaves no token to score after the task.prefix=16"),
    (["task.length=128"], "budget.fraction", "set budget.fraction >= 0.383 (49 of the 128 tokens of task.length; "
                                             "0.25 gives 32)"),
    (["task.length=128", "budget.tokens=20"], "budget.tokens", "set budget.tokens >= 49"),
    (["scope=topk", "scope.recall_slots=100", "budget.fraction=0.5"], "scope.recall_slots",
     "the recall cache's 100 slots take 100 of the 8 device pages of 16 tokens, leaving none"),
    (["+tiers.stack.host.capacity=3"], "tiers.stack.host.capacity", "size it with tiers.stack.host.fraction"),
    (["engine.graphs=true", "model.device=cpu"], "engine.graphs", "the model runs on cpu"),
    (["engine.max_context=64"], "engine.max_context", "task.length=320 tokens + 0 generated; give it at least 320"),
]


@pytest.mark.parametrize("args,key,says", MESSAGES, ids=[" ".join(a) for a, _, _ in MESSAGES])
def test_a_message_names_the_key_and_value_at_fault(args, key, says):
    from kvtier.build import plan

    with pytest.raises(ConfigError) as err:
        list(map(plan, job_configs(args)))
    assert err.value.field == key and says in str(err.value), str(err.value)
    assert not re.search(r"-\d+ device page", str(err.value))


def test_what_a_message_suggests_plans():
    """The budget a refusal names is accepted; a lower tier's fraction is a key; a .gguf file is a model path."""
    from kvtier.build import plan
    from kvtier.models import gguf_parts

    (cfg,) = job_configs(["task.length=128", "budget.fraction=0.383"])
    assert plan(cfg).budget_tokens == 49
    (cfg,) = job_configs(["tiers=device_host_disk", "tiers.stack.disk.fraction=0.5"])
    assert plan(cfg).capacities["disk"] == 10  # half of the 20 pages of 320 tokens
    (cfg,) = job_configs(["model=local", f"model.path={gguf_parts('smollm2')[0]}"])  # the GGUF kvtier ships
    assert plan(cfg).labels["model"] == gguf_parts("smollm2")[0].name


def test_a_slurm_launcher_without_slurm_is_one_named_line(tmp_path, monkeypatch, capsys):
    import shutil as sh

    if sh.which("srun") and sh.which("sbatch"):
        pytest.skip("Slurm is installed here")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kvtier-run", "-m", "hydra/launcher=submitit_slurm", "policy=lru,aspe"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.count("\n") == 0 and "error: hydra/launcher: " in err and "srun" in err
    assert list(tmp_path.iterdir()) == []


def test_the_python_api_example_names_a_stream_too_short_for_its_budget(tmp_path):
    """``examples/python_api.py --tokens 128``: one line naming --tokens and the least that works, before the
    model loads (exit 2)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), "--tokens", "128"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("python_api.py: error: --tokens: ") and "use --tokens >= 196" in line


def test_the_exact_baseline_is_scope_all_at_the_whole_budget():
    from kvtier.build import plan

    (cfg,) = job_configs(["scope=all", "budget.fraction=1.0"])
    assert plan(cfg).budget_tokens == plan(cfg).context_tokens == 320


def test_a_text_that_is_not_utf8_is_named(monkeypatch):
    import kvtier.data

    from kvtier.models import PACKAGED_MODELS

    smollm2 = PACKAGED_MODELS["smollm2"]
    (dist, gguf), version = smollm2.parts[0], smollm2.requirement.split("==")[1]
    monkeypatch.setitem(kvtier.data.PACKAGED, "gguf", (dist, version, gguf))  # a binary file in a package
    with pytest.raises(ConfigError, match="not UTF-8") as err:
        kvtier.data.text("gguf")
    assert err.value.field == "task.text"


def test_the_joblib_launcher_without_its_extra_names_it(tmp_path):
    proc = python("""
        import sys
        import hydra_plugins
        hydra_plugins.__path__ = []  # as if kvtier[sweep] were not installed
        import kvtier.run
        sys.argv = ["kvtier-run", *sys.argv[1:]]
        kvtier.run.main()
    """, tmp_path, "-m", "hydra/launcher=joblib", "policy=lru,aspe")
    assert proc.returncode == 2 and "pip install 'kvtier[sweep]'" in one_line(proc)
    assert list(tmp_path.iterdir()) == []


def test_a_layout_in_another_dtype_than_the_model_is_refused():
    import torch

    from kvtier import DeviceTier, TieredKVCache, install, kv_layout_for
    from kvtier.models import tiny_llama
    from kvtier.policies import LRU

    model = tiny_llama()
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=8)  # bfloat16 (the default) under a float32 model
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu")], LRU(), scope="all")
    with pytest.raises(ConfigError, match="dtype=torch.float32") as err:
        model(torch.zeros(1, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert err.value.field == "dtype"


# -- documented commands work as written -----------------------------------------------------------
DOCS = ["README.md", "kvtier/recipes/README.md", "docs/policies.md", "examples/sweeps/README.md"]
OPTION_FLAGS = ("--config-dir", "-cd", "--config-name", "-cn")


def documented_commands():
    """``(file, args)`` of every ``kvtier-run`` command in the READMEs, docs/policies.md and the recipes'
    comments (continued lines joined; a trailing comment, ``&& ...`` or two spaces end one). Prose that
    merely names kvtier-run (a word that is neither a flag, a flag's value nor ``key=value``) is skipped."""
    texts = [(d, (ROOT / d).read_text()) for d in DOCS]
    for y in sorted([*ROOT.glob("kvtier/recipes/**/*.yaml"), *ROOT.glob("examples/**/*.yaml")]):
        comments = "\n".join(line.split("#", 1)[1] if "#" in line else "" for line in y.read_text().splitlines())
        texts.append((y.relative_to(ROOT).as_posix(), comments))
    for name, text in texts:
        text = re.sub(r"\s*\\\n[#\s]*", " ", text)
        for m in re.finditer(r"kvtier-run(?=[\s`]|$)([^`#\n]*)", text):
            args = [a.strip("'\"") for a in re.split(r"&&|;|\s{2,}", m.group(1).strip())[0].split()]  # sh -c '...'
            if all(a.startswith("-") or "=" in a or i and args[i - 1] in OPTION_FLAGS for i, a in enumerate(args)):
                yield name, args


COMMANDS = sorted({tuple(args): name for name, args in documented_commands()}.items())  # [(args, file)]


def test_the_documented_commands_are_found():
    assert len(COMMANDS) >= 20 and any(name == "kvtier/recipes/model/local.yaml" for _, name in COMMANDS)


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory):
    """What the documented commands' placeholders stand for here: a local Llama config, a Redis server started
    for the module, the custom-policy example, a scope in tests/user_scope.py."""
    from transformers import LlamaConfig

    from kvtier.tiers.redis_server import LocalRedis

    llama = tmp_path_factory.mktemp("model") / "llama"
    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                intermediate_size=96, vocab_size=256).save_pretrained(llama)
    with LocalRedis() as server:
        yield {"DIR": "examples/custom_policy", "policy=mine": "policy=fifo",
               "mine.MyScope": "user_scope.Recent",  # tests/user_scope.py
               "/models/Llama-3.1-8B": str(llama), "redis://127.0.0.1:6379/0": server.url}



@pytest.mark.parametrize("args,name", COMMANDS, ids=[f"{i}-{name}" for i, (_, name) in enumerate(COMMANDS)])
def test_every_documented_command_composes_and_plans(args, name, placeholders, login_node, monkeypatch):
    """Each job of each command is composed and checked (``plan``: everything but the weights); the runs
    themselves are exercised by test_run / test_frontend (default recipe, sweeps, joblib, custom policy)."""
    from kvtier.build import plan

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom_policy"))
    monkeypatch.setenv("PATH", f"{login_node}:{os.environ['PATH']}")
    for old, new in placeholders.items():
        args = [a.replace(old, new) for a in args]
    try:
        configs = list(job_configs(args))  # composed first: Hydra's global state is released
        assert sum(1 for _ in map(plan, configs)) >= 1
    except MissingDependencyError as e:  # an extra this install does not have (the message names it)
        assert "pip install 'kvtier[" in str(e), e
    except ConfigError as e:
        if not (e.field in ("model.id", "task") and "hf download" in str(e)):  # a Hub model or dataset needs the
            # user's HF cache
            pytest.fail(f"{name}: kvtier-run {' '.join(args)}: {e}")
