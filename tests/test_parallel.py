"""Sharding and shard_map under autocast, on a 4x2 mesh of host devices (in a subprocess, since
the device count is fixed when JAX starts)."""
from tests.check_modules import run_check_module


def test_shardings_kept_and_shard_map_bodies_rewritten():
    run_check_module("sharding_checks", "sharding checks passed")
