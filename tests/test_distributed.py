"""jamp, its loss scales and tracing on many devices and hosts.

Under ``jax.distributed``, two processes on this machine (4 CPU devices each, JAX's gloo CPU
collectives, a coordinator on 127.0.0.1) train as one global 8-device mesh and end where one
process with 8 devices ends (tests/distributed_worker.py). The guide
docs/guides/many-devices.md, which test_docs_blocks.py runs on the suite's one device, runs
here on 8, where its collectives exist.
"""
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import chex
import numpy as np
import pytest

from tests.conftest import CACHE_VARIABLES

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 240  # all three processes: about 15 s on an idle machine; the rest for a busy one


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    # The workers set their own device counts; a count forced by the caller would fight them.
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", ""))
    # Processes started together compile the same programs at once, and JAX writes a persistent
    # compilation cache's entry in place, unlocked (tests/conftest.py): none for them.
    for name in CACHE_VARIABLES:
        env.pop(name, None)
    return env


def run_together(commands, directory):
    """Start every command at once; wait for all; fail with each one's stderr unless all pass."""
    logs = {name: directory / f"{name}.log" for name in commands}
    processes = {}
    for name, command in commands.items():
        with open(logs[name], "w") as log:  # files, not pipes: a full pipe cannot stall a child
            processes[name] = subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=log,
                                               stderr=subprocess.STDOUT)
    timed_out = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for name, process in processes.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.append(name)
                break
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = {name: p.returncode for name, p in processes.items() if p.returncode != 0}
    if failed or timed_out:
        report = [f"timed out after {TIMEOUT_S} s: {timed_out}"] if timed_out else []
        for name, code in failed.items():
            text = "\n".join(line for line in logs[name].read_text().splitlines()
                             if not line.startswith("[Gloo]"))  # gloo's connection chatter
            report.append(f"--- {name} exited with {code}:\n{text[-6000:]}")
        pytest.fail("\n".join(report), pytrace=False)


def load(path):
    with np.load(path) as data:
        return dict(data)


@pytest.mark.slow  # three processes, each compiling a training step
def test_two_processes_train_like_one_process_with_eight_devices(tmp_path):
    worker = [sys.executable, "-m", "tests.distributed_worker", str(tmp_path)]
    port = str(free_port())
    run_together({"process_0": worker + ["--port", port, "--process-id", "0"],
                  "process_1": worker + ["--port", port, "--process-id", "1"],
                  "one_process": worker}, tmp_path)
    first, second = load(tmp_path / "process_0.npz"), load(tmp_path / "process_1.npz")
    alone = load(tmp_path / "one_process.npz")

    # Both hosts hold the same parameters, loss scale and history, bit for bit.
    chex.assert_trees_all_equal(first, second)
    # The loss scale really moved: it backed off on overflow and grew after `period` steps.
    assert not first["finites"].all() and first["finites"][-8:].any()
    assert len(set(first["scales"].tolist())) > 2
    # The same decisions as one process with 8 devices, and the same numbers up to the order
    # in which the cross-device sums were added (they differ by about 3e-5 after 24 steps).
    for key in ("finites", "scales", "skipped_scale") + tuple(k for k in alone if "counter" in k):
        np.testing.assert_array_equal(first[key], alone[key], err_msg=key)
    chex.assert_trees_all_close(first, alone, rtol=2e-3, atol=2e-4)
    assert first["losses"][-1] < 0.85 * first["losses"][0]


# The page's blocks in order, as test_docs_blocks.py runs them, in a process with 8 devices.
RUN_PAGE = """
import json, pathlib, sys, warnings
import jax
jax.config.update("jax_num_cpu_devices", 8)
from tests.test_docs_blocks import LIBRARY_WARNINGS, python_blocks
page = pathlib.Path(sys.argv[1])
namespace = {"__name__": "__main__"}
with warnings.catch_warnings():
    for category in LIBRARY_WARNINGS:
        warnings.simplefilter("error", category)
    for line, code in python_blocks(page.read_text()):
        exec(compile("\\n" * (line - 1) + code, str(page), "exec"), namespace)
found = {name: namespace[name] for name in ("data_parallel", "fsdp_moved", "explicit_moved")}
print(json.dumps({"n": namespace["n"], **found}, default=sorted))
"""


@pytest.mark.slow  # the guide compiles a dozen steps for 8 devices
def test_many_devices_guide_on_eight_devices(tmp_path):
    page = ROOT / "docs" / "guides" / "many-devices.md"
    run_together({"guide": [sys.executable, "-c", RUN_PAGE, str(page)]}, tmp_path)
    lines = (tmp_path / "guide.log").read_text().splitlines()
    found = json.loads([line for line in lines if line.startswith("{")][-1])
    assert found["n"] == 8
    # What the page says crosses between devices, now that something does.
    assert found["data_parallel"] == {"all-reduce": ["f16"]}
    assert found["fsdp_moved"]["all-gather"] == ["f16"]
    assert found["explicit_moved"] == {"jax_gathers": ["f16"], "gather_then_cast": ["f32"],
                                       "cast_then_gather": ["f16"]}
