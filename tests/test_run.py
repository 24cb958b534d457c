"""kvtier-run end to end on the real SmolLM2 (tiny streams), its outputs, and config validation."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir

from kvtier.build import plan as validate
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.models import cache_dir
from kvtier.report import WandbLogger
from kvtier.run import RECIPES, execute, job_configs, main

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"kvtier-run": "kvtier.run", "kvtier-plot": "kvtier.plot"}  # this checkout's, whatever the venv installed
# 128 tokens of Opticks: 96 prefilled in 16-token chunks, 32 scored by decode steps
TINY = ["task.length=128", "task.prefix=96", "scheduler.prefill.chunk_size=16", "progress=false"]
# the same 128 tokens, 120 prefilled and 8 scored: for the sweep, whose checks read labels and the end of each run
SHORT = [o.replace("task.prefix=96", "task.prefix=120") for o in TINY]
REQUIRED = ("task", "policy", "scope", "budget_tokens", "perplexity", "tier1_hit_rate", "bytes_moved",
            "offloaded_fraction", "ttft_s", "tpot_p50_s", "tpot_p99_s", "stall_s", "occupancy", "config")
PNG = b"\x89PNG\r\n\x1a\n"


def kvtier(cmd: str, args: list[str], cwd: Path, prefix=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(cwd / "home"), "KVTIER_CACHE": str(cache_dir()), "WANDB_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*prefix, sys.executable, "-m", MODULES[cmd], *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def strace_connects(trace: Path):
    """A prefix tracing every connect() of the run and its children, when strace works here."""
    cmd = ("strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect", "-o")
    if shutil.which("strace") is None or subprocess.run([*cmd, os.devnull, "true"]).returncode:
        return ()
    return (*cmd, str(trace))


def network_connects(trace: Path) -> list[str]:
    """connect() calls to an IP address other than loopback."""
    if not trace.exists():
        return []
    lines = [l for l in trace.read_text().splitlines() if "AF_INET" in l]
    loopback = re.compile(r'inet_addr\("127\.|inet_pton\(AF_INET6, "::1"|"::ffff:127\.')
    return [l for l in lines if not loopback.search(l)]


def test_cli_run_writes_metrics_disk_and_offline_wandb_inside_its_folder(tmp_path):
    trace = tmp_path / "connect.trace"
    args = [*TINY, "tiers=device_host_disk", "budget.tokens=80", "tiers.stack.host.fraction=0.25", "logger=wandb"]
    proc = kvtier("kvtier-run", args, tmp_path, prefix=strace_connects(trace))
    (run_dir,) = (tmp_path / "outputs" / "perplexity").glob("aspe-resident-device_host_disk-tok80-*")
    m = json.loads((run_dir / "metrics.json").read_text())
    assert all(k in m for k in REQUIRED), [k for k in REQUIRED if k not in m]
    assert m["task"] == "perplexity" and m["policy"] == "aspe" and m["budget_tokens"] == 80
    assert m["perplexity"] > 1 and 0 < m["tier1_hit_rate"] <= 1 and 0 < m["offloaded_fraction"] < 1
    assert any("disk" in link for link in m["bytes_moved"])  # pages spilled past the small host tier
    assert m["bytes_moved_total"] == sum(m["bytes_moved"].values())
    assert m["peak_pages"]["device"] <= m["capacity_pages"]["device"] == 5
    assert len(m["occupancy"]["step"]) == len(m["occupancy"]["pages"]["device"]) > 32
    assert m["config"]["task"]["length"] == 128
    assert "tier-1 hit rate" in proc.stdout and "attention-mass recall" in proc.stdout  # the rich table
    assert 0 < m["attention_mass_recall_min"] <= m["attention_mass_recall"] <= 1 + 1e-6 and m["attention_rel_err"] > 0
    assert m["fidelity_calls"] == m["decode_steps"] * 30 and len(m["attention_mass_recall_per_layer"]) == 30
    assert (run_dir / "disk").is_dir() and not any((run_dir / "disk").rglob("*.kv"))  # scratch removed
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not list(tmp_path.glob("home/**/*wandb*"))
    assert {p.name for p in tmp_path.iterdir()} - {"home", "connect.trace"} == {"outputs"}
    assert network_connects(trace) == [] and (not trace.exists() or "connect(" in trace.read_text())


def test_multirun_three_policies_two_budgets_then_plot(tmp_path):
    kvtier("kvtier-run", ["-m", "policy=lru,sink_window,aspe", "budget.fraction=0.5,0.75", "logger=none", *SHORT],
           tmp_path)
    (sweep,) = (tmp_path / "multirun").iterdir()
    runs = sorted(sweep.glob("*/metrics.json"))
    assert len(runs) == 6
    metrics = [json.loads(p.read_text()) for p in runs]
    assert {(m["policy"], m["budget_fraction"]) for m in metrics} == \
        {(p, f) for p in ("lru", "sink_window", "aspe") for f in (0.5, 0.75)}
    off = {(m["policy"], m["budget_fraction"]): m["offloaded_fraction"] for m in metrics}
    assert all(off[p, 0.5] > off[p, 0.75] for p in ("lru", "sink_window", "aspe"))  # less room, more offloaded
    proc = kvtier("kvtier-plot", [str(sweep)], tmp_path)
    pngs = sorted((sweep / "plots").glob("*.png"))
    assert [p.name for p in pngs if p.name.startswith("quality")] == ["quality_vs_budget-perplexity-opticks.png"]  # the task and its text
    assert len([p for p in pngs if p.name.startswith("occupancy")]) == 6
    assert all(p.read_bytes().startswith(PNG) and str(p) in proc.stdout for p in pngs)


def test_needle_sweep_runs_a_job_per_length_and_plots_depth_by_length(tmp_path):
    """experiment=needle_sweep at two tiny lengths and two depths on SmolLM2: a job per length, each budget half of
    its own length, each metrics.json scoring every depth; kvtier-plot's heatmap grid is those scores. StreamingLLM
    (sinks + a 32-token window) with the question fed after the context loses the needle at depth 0 and keeps it at
    the end, at both lengths (measured)."""
    from kvtier.plot import main as plot

    kvtier("kvtier-run", ["experiment=needle_sweep", "task.context_tokens=160,224", "task.depths=[0,1]",
                          "task.max_new_tokens=4", "scope=resident", "policy=sink_window", "cache.attend_budget=true",
                          "budget.fraction=0.5", "cache.window=32", "logger=none"], tmp_path)
    (sweep,) = (tmp_path / "multirun").iterdir()
    metrics = sorted((json.loads(p.read_text()) for p in sweep.glob("*/metrics.json")),
                     key=lambda m: m["context_tokens"])
    assert [(m["config"]["task"]["context_tokens"], m["budget_tokens"]) for m in metrics] == [(160, 80), (224, 112)]
    for m in metrics:
        assert m["task_result"]["per_depth"] == {"0": 0.0, "1": 1.0}, m["task_result"]["records"]
        assert m["config"]["task"]["question_at"] == "after" and m["samples"] == 2
    assert plot([str(sweep)]) == 0
    heatmap = sweep / "plots" / "depth_heatmap-needle-lady_susan-question_after-sink_window-resident-fraction0.5.png"
    assert heatmap.read_bytes().startswith(PNG)
    grid = (sweep / "plots" / "depth_grid.csv").read_text().splitlines()
    assert [line.split(",")[4:] for line in grid[1:]] == [["160", "0.0", "1", "0.0"], ["160", "1.0", "1", "1.0"],
                                                          ["224", "0.0", "1", "0.0"], ["224", "1.0", "1", "1.0"]]


def test_python_api_run_with_a_local_remote_store(tmp_path):
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "tiers=device_host_remote", "policy=sink_window",
                                           "budget.tokens=80", "tiers.stack.host.fraction=0.25", "logger=none"])
    m = execute(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["perplexity"] == pytest.approx(m["perplexity"])
    assert m["bytes_moved"].get("host->remote", 0) > 0 and m["capacity_pages"] == {"device": 5, "host": 2, "remote": 8}
    left = [p for p in psutil.Process().children(recursive=True) if p.name() == "redis-server"]
    assert not left, left  # the run's loopback redis-server was stopped with the run


def test_wandb_offline_opens_no_network_socket_and_keeps_its_files_in_the_run_folder(tmp_path, monkeypatch):
    refused = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guard(real):
        def connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not str(address[0]).startswith(("127.", "::1")):
                refused.append(address)
                raise OSError(f"test: network connect to {address} refused")
            return real(self, address)
        return connect

    monkeypatch.setattr(socket.socket, "connect", guard(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guard(real_connect_ex))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = {"task": "perplexity", "policy": "lru", "scope": "resident", "tiers": "device_host", "kernel": "torch",
               "run_name": "lru-resident", "score_name": "perplexity", "perplexity": 12.5, "budget_tokens": 64,
               "budget_fraction": 0.5, "context_tokens": 128, "tier1_hit_rate": 0.9, "offloaded_fraction": 0.5,
               "bytes_moved": {"device->host": 4096}, "bytes_moved_total": 4096, "stall_s": 0.0, "ttft_s": 0.1,
               "tpot_p50_s": 0.05, "tpot_p99_s": 0.06, "peak_pages": {"device": 4}, "wall_s": 1.0,
               "occupancy": {"step": [0, 1], "pages": {"device": [2.0, 4.0]}}, "config": {"policy": {"name": "lru"}}}
    WandbLogger(mode="offline").log(metrics, run_dir)
    assert refused == []
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not (tmp_path / "home").exists() and "WANDB_DIR" not in os.environ


BAD = [
    (["policy=nope"], "policy", "sink_window"),
    (["policy.name=nope"], "policy", "aspe"),
    (["budget.tokens=5000"], "budget.tokens", "320"),
    (["budget.fraction=0"], "budget.fraction", "(0, 1]"),
    (["budget.fraction=1.5"], "budget.fraction", "(0, 1]"),
    (["-m", "budget.fraction=0.5,0"], "budget.fraction", "(0, 1]"),
    (["kernel=nope"], "kernel", "torch"),
    (["kernel.name=nope"], "kernel", "flashinfer"),
    (["task=nope"], "task", "passkey"),
    (["scope=nope"], "scope", "resident"),
    (["tiers=nope"], "tiers", "device_host_disk"),
    (["tiers.stack.host._target_=kvtier.tiers.NoSuchTier"], "tiers.stack.host._target_", "HostTier"),
    (["policy=sink_window", "policy.window=-1"], "policy.window", ">= 0"),
    (["budget.fraction=0.05"], "budget.fraction", "chunk_size"),
    (["page_size=12"], "page_size", "power of two"),
    (["logger=wandb", "logger.mode=online"], "logger.mode", "offline"),
    (["cache.fidelity=maybe"], "cache.fidelity", "true or false"),
    (["budget.fraction=nan"], "budget.fraction", "(0, 1]"),
    (["budget.size=lots"], "budget.size", "GiB"),
    (["+tiers.stack.host.bogus=3"], "tiers.stack.host.bogus", "bogus"),
    (["+tiers.stack.host.capacity=3"], "tiers.stack.host.capacity", "tiers.stack.host.fraction"),
    (["+model.foo=2"], "model.foo", "foo"),
    (["cpu_threads=0"], "cpu_threads", ">= 1"),
    # a setting that a key read before it shadows (an experiment's budget.tokens): a sweep of identical runs
    (["experiment=serve_trace", "budget.fraction=0.3"], "budget.fraction", "add budget.tokens=null"),
    (["-m", "experiment=streaming_llm", "budget.fraction=0.25,0.5"], "budget.fraction", "add budget.tokens=null"),
    (["budget.tokens=64", "budget.size=1MiB"], "budget.size", "budget.tokens=64 is read first"),
    (["tiers.stack.host.size=1GiB", "tiers.stack.host.fraction=2"], "tiers.stack.host.fraction",
     "add tiers.stack.host.size=null"),
    # the token budget's keys without the token budget (resident reads no sinks of its own)
    (["cache.mode=once"], "cache.mode", "cache.attend_budget=true"),
    (["-m", "cache.window=16,32"], "cache.window", "cache.attend_budget=true"),
    (["cache.sinks=8"], "cache.sinks", "cache.attend_budget=true"),
    # exact prefill where every prefill is exact already
    (["scope=topk", "cache.exact_prefill=true"], "cache.exact_prefill", "resident"),
    (["-m", "scope=all,topk", "cache.exact_prefill=true"], "cache.exact_prefill", "prefills over every page"),
    # the needle sweep: every length (a job each) and the depths checked before any job runs
    (["experiment=needle_sweep", "task.context_tokens=1024,9000"], "task.context_tokens", "use at most 8180"),
    (["experiment=needle_sweep", "task.context_tokens=100,1024"], "task.context_tokens", ">= 128"),
    (["experiment=needle_sweep", "task.depths=[0,1.5]"], "task.depths", "fractions in [0, 1]"),
    # kvpress's presses (method=kvpress:<press>): a press it has, and only the settings it reads
    (["method=kvpress:h2o"], "method", "unknown press 'kvpress:h2o'"),
    (["method=kvtier"], "method", "use kvpress:<press>"),
    (["method=kvpress:knorm", "policy=tova"], "policy", "reads none of kvtier's tiers, policy"),
    (["-m", "method=kvpress:knorm,kvpress:tova", "cache.window=32"], "cache.window", "of cache.* only nothing"),
    (["method=kvpress:snapkv", "cache.window=null"], "cache.window", "takes its window from cache.window"),
]


@pytest.mark.parametrize("args,field,hint", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_config_raises_config_error_naming_the_field_and_writes_nothing(tmp_path, monkeypatch, args, field, hint):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["kvtier-run", *args])
    with pytest.raises(ConfigError) as err:
        list(map(validate, job_configs(args)))
    assert err.value.field == field and hint in str(err.value)
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and list(tmp_path.iterdir()) == []


def test_a_press_without_kvpress_is_one_line_naming_its_environment(tmp_path, monkeypatch, capsys):
    """``method=kvpress:<press>`` where kvpress cannot be imported (.venv): exit 2 before anything loads, one line
    naming the extra and ``make compare-env``; its window is a setting it reads (snapkv's), not refused as unread."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    args = ["-m", "task=ruler", "method=kvpress:snapkv,kvpress:knorm", "cache.window=32", "budget.fraction=0.1,0.2"]
    assert len(list(job_configs(args))) == 4
    monkeypatch.setattr(sys, "argv", ["kvtier-run", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and list(tmp_path.iterdir()) == []
    assert "kvtier[compare]" in err[0] and "make compare-env" in err[0]


def test_a_setting_refused_as_unread_goes_through_where_it_is_read():
    """The fix the shadowed-setting error names works: with the experiment's budget.tokens cleared, the budget is
    the fraction given (a sweep over it differs); the token budget's keys under the token budget, or interpolated."""
    jobs = list(job_configs(["-m", "experiment=streaming_llm", "budget.tokens=null", "budget.fraction=0.25,0.5"]))
    assert [validate(cfg).budget_tokens for cfg in jobs] == [1024, 2048]
    # read: under the token budget, and topk's own sinks interpolate cache.sinks
    for args in (["cache.attend_budget=true", "cache.mode=once", "cache.window=32"], ["scope=topk", "cache.sinks=8"]):
        assert len(list(job_configs(args))) == 1
    # a sweep where some jobs read it (the budget's window beside the run without a budget)
    assert len(list(job_configs(["-m", "cache.attend_budget=true,false", "cache.window=32"]))) == 2
    assert len(list(job_configs(["-m", "scope=resident,topk", "cache.exact_prefill=true"]))) == 2


def recipe_options():
    return [(g.name, f.relative_to(g).with_suffix("").as_posix()) for g in sorted(RECIPES.iterdir()) if g.is_dir()
            for f in sorted(g.rglob("*.yaml"))]  # nested options too: task=study/opticks


@pytest.mark.parametrize("group,option", recipe_options(), ids=[f"{g}={o}" for g, o in recipe_options()])
def test_every_recipe_option_validates(group, option):
    # the key sketch recall keeps in HBM takes an eighth of the context's KV bytes from the device budget: 25% of the
    # default 320 tokens then cannot hold the pins and the prefill chunk beside it
    extra = ["budget.fraction=0.5"] if (group, option) == ("scope", "topk") else []
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={option}", *extra])
    if (group, option) == ("kernel", "triton") and not _cuda() and os.environ.get("TRITON_INTERPRET") != "1" or \
            (group, option) == ("kernel", "flashinfer") and not _cuda():  # a GPU's kernels
        with pytest.raises(ConfigError, match="kernel"):
            validate(cfg)
    elif (group, option) == ("kernel", "flashinfer") and importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(MissingDependencyError, match=r"kvtier\[gpu\]"):
            validate(cfg)
    elif (group, option) in (("model", "local"), ("model", "hf")):  # model.path / model.id: ??? (the user's)
        with pytest.raises(ConfigError, match="model.path" if option == "local" else "model.id"):
            validate(cfg)
    elif (group, option) in (("task", "longbench"), ("task", "infinitebench")):  # data from the user's HF cache
        try:
            validate(cfg)
        except ConfigError as e:  # not fetched here: one line naming the command that fetches it
            assert e.field == "task" and "hf download --repo-type dataset" in str(e)
    else:
        plan = validate(cfg)
        if plan.needs_model:
            assert 0 < plan.budget_tokens <= plan.context_tokens
        else:  # a simulator task (kvtier.sim): nothing of the model is planned
            assert plan.labels == {"task": "sim_seed"} and plan.layout is None


def test_the_default_kernel_is_the_devices():
    """``kernel: auto`` (the default) is the torch reference for a model on the CPU, and the run says which."""
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=["model.device=cpu"])
    assert cfg.kernel.name == "auto" and validate(cfg).labels["kernel"] == "torch"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
