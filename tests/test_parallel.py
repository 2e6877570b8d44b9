"""Sharding and shard_map under autocast, on a 4x2 mesh of host devices (in a subprocess, since
the device count is fixed when JAX starts)."""
import os
import pathlib
import subprocess
import sys


def test_shardings_kept_and_shard_map_bodies_rewritten():
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "tests.sharding_checks"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sharding checks passed" in result.stdout
