"""The front end as a user meets it: own classes by _target_, mistakes refused before the model loads,
unique run folders, partial results on Ctrl-C, one-line CLI errors, the wheel, sweeps."""

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from kvtier.errors import ConfigError
from kvtier.models import cache_dir
from kvtier.run import RECIPES, execute, job_configs, main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_policy"
# 128 tokens of Opticks: 120 prefilled in 16-token chunks, 8 scored by decode steps (few: these tests check the front
# end around a run, not its numbers)
TINY = ["task.length=128", "task.prefix=120", "scheduler.prefill.chunk_size=16", "progress=false", "logger=none",
        "budget.fraction=0.75"]


def cli(args, cwd, env=None, exe=(sys.executable, "-m", "kvtier.run"), check=True):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.run([*exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_custom_policy_runs_from_its_recipe_folder_and_from_python(tmp_path):
    cli(["--config-dir", str(EXAMPLE), "policy=fifo", *TINY], tmp_path)
    (m,) = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/perplexity/*/metrics.json")]
    assert m["policy"] == "fifo" and m["perplexity"] > 1 and not m["partial"]
    proc = subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--tokens", "96"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0 and "device->host" in proc.stdout, proc.stderr


SILENT = [  # each ran with exit 0 before; now a named error before the model loads
    (["+bogus_key=1"], "bogus_key"),
    (["+budget.tokenz=80"], "budget"),
    (["+scheduler.lookahed=4"], "scheduler"),
    (["policy.theta_evict=2", "policy.theta_prefetch=3"], "policy.theta_evict"),
    (["policy.theta_prefetch=nan"], "policy.theta_prefetch"),
    (["task.length=20000"], "task.length"),
    (["tiers=device_host_remote", "tiers.stack.remote.url=nohost"], "tiers.stack.remote.url"),
]


@pytest.mark.parametrize("args,field", SILENT, ids=[" ".join(a) for a, _ in SILENT])
def test_silent_mistakes_are_named_before_the_model_loads(args, field, monkeypatch, tmp_path):
    import kvtier.build
    import kvtier.run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvtier.run, "build_model", lambda *a: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "argv", ["kvtier-run", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError) as err:
        list(map(kvtier.build.plan, job_configs(args)))
    assert err.value.field == field


def test_a_one_page_device_tier_is_refused_in_python():
    import torch

    from kvtier import DeviceTier, HostTier, SinkWindow, TieredKVCache
    from kvtier.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    with pytest.raises(ConfigError, match="1 device page of 4 tokens cannot hold"):
        TieredKVCache(layout, [DeviceTier(layout, 1, device="cpu"), HostTier(layout, 64)], SinkWindow(4, 8))


def test_a_disk_path_that_cannot_be_made_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as err:
        list(map(__import__("kvtier.build", fromlist=["plan"]).plan,
                 job_configs(["tiers=device_host_disk", f"tiers.stack.disk.path={tmp_path}/file/sub"])))
    assert err.value.field == "tiers.stack.disk.path"


def test_two_runs_differing_in_one_setting_write_two_folders_and_a_rerun_a_third(tmp_path):
    for extra in (["policy.theta_evict=0.001"], ["policy.theta_evict=0.002"], ["policy.theta_evict=0.002"]):
        cli([*TINY, *extra], tmp_path)
    runs = sorted(p.name for p in (tmp_path / "outputs" / "perplexity").iterdir())
    stems = sorted(r for r in runs if not r.endswith("-2"))  # the two configs' folders (hash order varies)
    assert len(runs) == 3 and len(stems) == 2 and stems[0][:-9] == stems[1][:-9]  # same readable name, two hashes
    assert sum(s + "-2" in runs for s in stems) == 1  # the rerun got its own folder beside its twin


def test_ctrl_c_writes_the_finished_part_marked_partial(tmp_path, monkeypatch):
    from kvtier.engine import Engine

    real, calls = Engine.step, []

    def interrupted(self, tokens=None):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(self, tokens)

    monkeypatch.setattr(Engine, "step", interrupted)
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "task.prefix=96"])  # 32 scored tokens: the 10th step is one
    with pytest.raises(KeyboardInterrupt):
        execute(cfg, tmp_path / "run")
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["partial"] is True and m["task_result"]["scored_tokens"] == 10 and m["perplexity"] > 1


def test_a_bad_override_prints_one_line_and_exits_2(tmp_path):
    proc = cli(["budget.fraction=1.5"], tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "budget.fraction" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_wheel_installs_and_runs_from_an_empty_folder(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True,
                          capture_output=True, check=True).stdout.strip()
    # this venv's packages (torch, hydra, ...) without its kvtier: a path in a .pth runs none of that dir's .pth
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": ""}  # (a kvtier on the path: pip installs none)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    *map(str, dist.glob("*.whl"))], check=True, timeout=300, capture_output=True, env=env)
    work = tmp_path / "empty"
    work.mkdir()
    proc = subprocess.run([str(env_dir / "bin" / "kvtier-run"), *TINY], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(env_dir) in subprocess.run([str(py), "-c", "import kvtier; print(kvtier.__file__)"], cwd=work,
                                          env=env, capture_output=True, text=True).stdout
    assert len(list(work.glob("outputs/perplexity/*/metrics.json"))) == 1


def test_joblib_launcher_runs_a_two_job_sweep(tmp_path):
    cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "policy=lru,sink_window", *TINY], tmp_path)
    assert len(list(tmp_path.glob("multirun/*/*/metrics.json"))) == 2


def test_wandb_agent_runs_two_sweep_jobs_offline(tmp_path):
    """The real ``wandb agent`` CLI runs the example sweep file's first two grid points, each one kvtier-run
    logging offline into its run folder. W&B's sweep service, which hands an agent its runs and which no
    offline mode replaces, is a loopback stand-in (wandb_sweep_service.py)."""
    from wandb_sweep_service import SweepService

    sweep = yaml.safe_load((ROOT / "examples" / "sweeps" / "wandb_sweep.yaml").read_text())
    sweep["command"][-1:-1] = [a for a in TINY if not a.startswith(("logger=", "budget."))]  # the grid sets these
    shim = tmp_path / "bin" / "kvtier-run"  # kvtier-run of this checkout, whatever the venv installed
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvtier.run \"$@\"\n")
    shim.chmod(0o755)
    with SweepService(sweep) as url:
        env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "HOME": str(tmp_path / "home"), "KVTIER_CACHE": str(cache_dir()),  # the converted model, not anew
               "WANDB_BASE_URL": url, "WANDB_API_KEY": "0" * 40}
        proc = subprocess.run([sys.executable, "-m", "wandb", "agent", "--count", "2", "local/kvtier/grid"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted(tmp_path.glob("outputs/perplexity/*/metrics.json"))
    metrics = [json.loads(p.read_text()) for p in runs]
    assert sorted((m["policy"], m["budget_fraction"]) for m in metrics) == [("lru", 0.25), ("lru", 0.5)]
    assert all(list(p.parent.glob("wandb/offline-run-*/run-*.wandb")) for p in runs)
