"""Lazy package exports (kvtier.lazy): the simulator runs without torch or transformers, and every exported name of
kvtier and its lazy subpackages still resolves, each in a fresh interpreter (this process has imported them)."""

import subprocess
import sys
import textwrap

import pytest

import kvtier

HEAVY = ("torch", "transformers")
PUBLIC_API = ["ASPE", "BlockTable", "ChunkedPrefill", "Compose", "ConfigError", "DeviceTier", "DiskTier", "Engine",
              "EngineConfig", "HostTier", "KVLayout", "KVTierError", "LRU", "LookaheadScheduler",
              "MissingDependencyError", "MooncakeTier", "Policy", "RedisTier", "SinkWindow", "Tier", "TieredKVCache",
              "TokenBudget", "bytes_moved", "cache_for", "install", "kv_layout_for", "load_model", "make_backend",
              "offload", "tiny_llama"]


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (a failure shows its stderr)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_simulator_and_its_commands_import_neither_torch_nor_transformers(tmp_path):
    out = run_fresh(f"""
        import runpy, sys
        import kvtier.sim, kvtier.sim.kv_pool_cluster, kvtier.sim.validate, kvtier.sim.calibrate
        for module, args in [("kvtier.sim.kv_pool_cluster", ["--requests", "200", "--gpus", "16"]),
                             ("kvtier.sim.validate", []),
                             ("kvtier.sim.calibrate", ["--out", {str(tmp_path / "h100.json")!r}])]:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__")
        print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
    """)
    assert out.splitlines()[-1] == "LOADED []"
    assert (tmp_path / "h100.json").is_file()


def test_every_exported_name_resolves_to_its_module_s_object():
    assert kvtier.__all__ == PUBLIC_API
    out = run_fresh(f"""
        import importlib, sys
        import kvtier, kvtier.policies, kvtier.serve
        print("AT IMPORT", sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
        for package in (kvtier, kvtier.policies, kvtier.serve):
            assert set(package.__all__) <= set(dir(package)), package.__name__
            for name in package.__all__:
                value = getattr(package, name)
                source = importlib.import_module(package._exports[name])
                assert value is getattr(source, name), (package.__name__, name)
            namespace = {{}}
            exec(f"from {{package.__name__}} import *", namespace)
            assert set(package.__all__) <= set(namespace), package.__name__
        assert callable(kvtier.offload) and kvtier.offload is sys.modules["kvtier.offload"].offload
        print("POLICIES", sorted(kvtier.policies.POLICIES))
    """)
    lines = out.splitlines()
    assert lines[0] == "AT IMPORT []"
    assert lines[1] == ("POLICIES ['aspe', 'compose', 'expected_attention', 'h2o', 'knorm', 'lru', 'quest', 'scored', "
                        "'sink_window', 'snapkv', 'tova']")


def test_an_export_named_like_its_submodule_stays_the_export_when_the_submodule_loads_later():
    out = run_fresh("""
        import kvtier
        from kvtier.offload import recipe_node  # the first load of kvtier/offload.py, after the package
        import kvtier.offload
        print(kvtier.offload.__module__, kvtier.offload.__name__, callable(recipe_node))
    """)
    assert out.split() == ["kvtier.offload", "offload", "True"]


def test_an_unknown_name_is_an_attribute_error_naming_the_package():
    with pytest.raises(AttributeError, match="module 'kvtier' has no attribute 'no_such_name'"):
        kvtier.no_such_name  # noqa: B018
