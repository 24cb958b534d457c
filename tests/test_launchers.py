"""Cluster launchers for kvtier-run sweeps: Ray (a 2-job sweep on a local cluster started by the test, in a
private network namespace since Ray listens on every address) and submitit's Slurm launcher (composed and
checked by kvtier-run's own pre-check; no Slurm here)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.build import plan
from kvtier.errors import MissingDependencyError
from kvtier.loopback import private_network_command, private_network_unavailable
from kvtier.models import cache_dir
from kvtier.run import LAUNCHERS, job_configs

ROOT = Path(__file__).resolve().parents[1]
TINY = ["budget.fraction=0.5", "task.length=128", "task.prefix=96", "scheduler.prefill.chunk_size=16",
        "progress=false", "logger=none", "cache.fidelity=false"]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not installed("hydra_plugins.hydra_ray_launcher"), reason="the [ray] extra is not installed")
def test_ray_runs_a_two_job_sweep_on_a_local_cluster(tmp_path):
    if reason := private_network_unavailable():
        pytest.skip(reason)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "KVTIER_CACHE": str(cache_dir()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = ["-m", "hydra/launcher=ray", "+hydra.launcher.ray.init.include_dashboard=false",
            "+hydra.launcher.ray.init.num_cpus=2", "policy=lru,aspe", *TINY]
    proc = subprocess.run(private_network_command([sys.executable, "-m", "kvtier.run", *args]), cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray Launcher is launching 2 jobs" in proc.stdout + proc.stderr
    runs = [json.loads(p.read_text()) for p in sorted((tmp_path / "multirun").rglob("metrics.json"))]
    assert sorted(r["policy"] for r in runs) == ["aspe", "lru"] and all(r["perplexity"] > 1 for r in runs)


@pytest.mark.skipif(not installed("hydra_plugins.hydra_submitit_launcher"), reason="the [submitit] extra is not installed")
def test_submitit_slurm_sweep_passes_the_pre_check(login_node, monkeypatch):
    """On a Slurm login node (srun and sbatch on PATH; here two stand-ins, since nothing is submitted) every job is
    checked; without Slurm the sweep is one named line (tests/test_trust.py)."""
    monkeypatch.setenv("PATH", f"{login_node}:{os.environ['PATH']}")
    jobs = list(job_configs(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                             "policy=lru,aspe", *TINY]))
    assert [str(cfg.policy._target_).rsplit(".", 1)[-1] for cfg in jobs] == ["LRU", "ASPE"]
    for cfg in jobs:
        assert plan(cfg).labels["policy"] in ("lru", "aspe")


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_launcher_without_its_extra_names_the_extra(launcher):
    package, extra = LAUNCHERS[launcher]
    if installed(f"hydra_plugins.{package.replace('-', '_')}"):
        pytest.skip(f"{package} is installed here")
    with pytest.raises(MissingDependencyError, match=fr"pip install 'kvtier\[{extra}\]'"):
        list(job_configs(["-m", f"hydra/launcher={launcher}", "policy=lru"]))
