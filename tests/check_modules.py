"""Run a check module of this directory in a subprocess: its JAX starts with the host device
count the module sets (fixed once JAX starts), apart from the test process's."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_check_module(module: str, passed: str) -> None:
    """``python -m tests.<module>`` exits 0 and prints ``passed``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", f"tests.{module}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert passed in result.stdout
