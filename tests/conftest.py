import os
import subprocess

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on a CPU; it must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each pytest-xdist worker
if _workers > 1:  # the cores are shared between the workers: one's threads would wait on the other's
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # for the processes the tests start
    torch.set_num_threads(_threads)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32, CPU, sdpa attention) and its tokenizer."""
    from kvtier.models import load_model

    model, tokenizer = load_model(None, dtype="float32", device="cpu", attn_implementation="sdpa")
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def smollm2_engines():
    """``(make, tokenizer)``: SmolLM2 (fp32, one CPU thread) through kvtier's hook, ``make()`` a fresh engine of
    scope ``all`` whose 8-page device tier sends the rest of a long prompt to the host (the benchmark tasks' tests)."""
    from kvtier.engine import Engine
    from kvtier.hook import install
    from kvtier.models import kv_layout_for, load_model
    from kvtier.policies import LRU
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill
    from kvtier.tiers import DeviceTier, HostTier

    torch.set_num_threads(1)
    model, tok = load_model(None, dtype="float32")
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)

    def make():
        return Engine(model, layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 64)], LRU(), "all",
                      prefill=ChunkedPrefill(128))
    return make, tok


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB tmpfs mounted under tmp_path (needs root)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill up (needs root): {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture(scope="module")
def login_node(tmp_path_factory):
    """A folder of stand-ins for a Slurm login node's srun and sbatch (a Slurm sweep is planned, never
    submitted)."""
    slurm = tmp_path_factory.mktemp("slurm")
    for tool in ("srun", "sbatch"):
        (slurm / tool).write_text("#!/bin/sh\n")
        (slurm / tool).chmod(0o755)
    return slurm
