"""Reduced (``--quick``) runs of the training examples: the precisions agree, loss scaling runs.

The examples' dependencies (scikit-learn, matplotlib) are part of the ``test`` extra.
"""
import importlib
import math
import os
import sys

import jax
import numpy as np
import pytest


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _example(name):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return importlib.import_module(name)


def _replay_dynamic_scale(history, skipped_at, period, factor=2.0, min_scale=1.0):
    """The scale each step should have used, replaying DynamicLossScale from the finite flags."""
    skipped = set(skipped_at)
    expected, scale, counter = [history[0]], history[0], 0
    for step in range(len(history) - 1):
        if step in skipped:
            scale, counter = max(min_scale, scale / factor), 0
        elif counter == period - 1:
            scale, counter = scale * factor, 0
        else:
            counter += 1
        expected.append(scale)
    return expected


def _check_loss_scale(run, period):
    ls = run["loss_scale"]
    # one scale per step plus the final one, starting at 2**15
    assert len(ls["history"]) == run["steps"] + 1
    assert ls["history"][0] == 2.0 ** 15
    # the history follows the dynamic state machine: growth after `period` finite steps,
    # halving on each skipped (non-finite) step
    assert ls["history"] == _replay_dynamic_scale(ls["history"], ls["skipped_at"], period)
    assert ls["max"] > 2.0 ** 15, "the scale never grew: the finite-step counter did not run"
    # optax.apply_if_finite skipped exactly the steps jamp flagged as non-finite
    assert ls["skipped_steps"] == len(ls["skipped_at"]) == ls["optax_notfinite"]
    assert ls["skipped_steps"] < run["steps"] // 10


# The quick runs train for minutes of CPU time; what they rely on has fast tests: the loss-scale
# state machine (test_loss_scale.py), optax.apply_if_finite with jamp's flags
# (test_loss_scale_flax_port.py), linen training with batch stats (test_flax.py), and the
# examples' own tables, plots and notes below.
@pytest.mark.slow  # fast twins: the test_digits_* below, test_flax.py, test_loss_scale*.py
def test_digits_quick_run_agrees_across_precisions(tmp_path, capsys):
    digits = _example("digits")
    plot = tmp_path / "losses.png"
    results = digits.main(["--quick", "--no-progress", "--plot", str(plot)])
    printed = " ".join(capsys.readouterr().out.split())
    # the settings it used, and why its period is not the default
    assert "DynamicLossScale(loss_scale=32768, period=25," in printed
    assert "the default is 2000" in printed
    runs = results["runs"]
    assert list(runs) == ["float32", "bfloat16", "float16"]
    accuracies = {mode: run["accuracy"] for mode, run in runs.items()}
    # The quick run (5 epochs) already converges: over seeds 0-5 on jax 0.10 and 0.12 the three
    # accuracies were 97.8-99.6% and agreed within 0.67 points, so the full run's bound holds.
    gap = max(accuracies.values()) - min(accuracies.values())
    assert gap <= digits.MAX_ACCURACY_GAP, accuracies
    assert results["agree"] and results["accuracy_gap"] <= 1.5
    assert min(accuracies.values()) >= 95.0, accuracies
    for mode, run in runs.items():
        assert len(run["losses"]) == run["steps"] and all(map(math.isfinite, run["losses"])), mode
        assert run["losses"][-1] < run["losses"][0] / 5, mode
        assert run["param_dtypes"] == ["float32"], mode       # optimizer and params in float32
        assert run["batch_stats_dtypes"] == ["float32"], mode  # BatchNorm statistics too
        assert run["median_step_ms"] > 0
        assert run["temp_bytes"] is None or run["temp_bytes"] > 0
    _check_loss_scale(runs["float16"], digits.LOSS_SCALE_PERIOD)
    assert runs["float16"]["loss_scale"]["period"] == digits.LOSS_SCALE_PERIOD
    if jax.default_backend() == "cpu":  # emulated 16-bit arithmetic: the printed note says why
        assert "computes 16-bit matmuls and convolutions in float32" in printed
    assert "loss_scale" not in runs["float32"] and "loss_scale" not in runs["bfloat16"]
    assert results["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_digits_table_lists_every_mode():
    digits = _example("digits")
    run = {"accuracy": 98.0, "final_loss": 0.01, "median_step_ms": 5.0, "compile_seconds": 4.0,
           "temp_bytes": None}
    table = digits.format_table({
        "float32": run, "float16": dict(run, temp_bytes=3 * 2 ** 20, loss_scale={
            "min": 32768.0, "max": 131072.0, "final": 65536.0, "skipped_steps": 2})})
    lines = table.splitlines()
    assert len(lines) == 4 and "test acc %" in lines[0]
    assert "n/a" in lines[2] and "3.00 MiB" in lines[3]
    assert "32768 / 131072 / 65536, 2 skipped" in lines[3]


@pytest.mark.slow  # fast twin: test_flax.py::test_linen_training_steps_with_batch_stats
def test_tiny_gpt_quick_run_bfloat16_learns_like_float32(tmp_path):
    tiny_gpt = _example("tiny_gpt")
    plot = tmp_path / "gpt.png"
    # float16 + loss scaling is covered by the digits test; two modes keep this test under a minute
    results = tiny_gpt.main(["--quick", "--no-progress", "--modes", "float32,bfloat16",
                             "--plot", str(plot)])
    runs = results["runs"]
    assert list(runs) == ["float32", "bfloat16"]
    reference = runs["float32"]["accuracy"]
    assert reference >= 95.0, "float32 did not learn to sort"
    for mode, run in runs.items():
        # held-out token accuracy (teacher-forced, the sorted half of the sequence)
        gap = abs(run["accuracy"] - reference)
        assert gap <= tiny_gpt.MAX_ACCURACY_GAP, (mode, run["accuracy"])
        assert all(map(math.isfinite, run["losses"])), mode
        assert np.mean(run["losses"][-10:]) < np.mean(run["losses"][:10]) / 5, mode
        assert run["param_dtypes"] == ["float32"], mode
    assert results["agree"]
    assert plot.read_bytes()[:8] == PNG_MAGIC


def _eqns(jaxpr, inside=None):
    """(equation, name of the innermost enclosing higher-order primitive) over all sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _eqns(sub, eqn.primitive.name)


@pytest.mark.slow  # fast twin: test_properties.py::test_pinned_program[pinned4-*] (remat)
def test_tiny_gpt_remat_blocks_recompute_in_bfloat16():
    import jax

    tiny_gpt = _example("tiny_gpt")
    model = tiny_gpt.TinyGPT()
    seqs = jax.numpy.asarray(tiny_gpt.make_sequences(np.random.default_rng(0), 4))
    params = model.init(jax.random.key(0), seqs[:, :-1])["params"]
    grad_jaxpr = jax.make_jaxpr(jax.grad(tiny_gpt.make_loss_fn(model, "bfloat16")))(params, seqs)
    in_remat = [eqn for eqn, inside in _eqns(grad_jaxpr)
                if inside in ("checkpoint", "remat", "remat2")
                and eqn.primitive.name == "dot_general"]
    assert in_remat, "no matmuls inside a rematerialized block"
    assert {str(e.outvars[0].aval.dtype) for e in in_remat} == {"bfloat16"}
    assert {str(aval.dtype) for aval in grad_jaxpr.out_avals} == {"float32"}  # float32 grads


def _fake_run(mode, losses, accuracy=99.0, **extra):
    return {"mode": mode, "losses": list(losses), "accuracy": accuracy, **extra}


def test_digits_plot_keeps_coinciding_curves_apart_and_shows_the_loss_scale():
    import matplotlib.pyplot as plt
    digits = _example("digits")
    losses = np.geomspace(2.0, 0.01, 40)
    history = [2.0 ** 15] * 20 + [2.0 ** 16] * 5 + [2.0 ** 15] * 16
    runs = {"float32": _fake_run("float32", losses),
            "bfloat16": _fake_run("bfloat16", losses),   # identical curves: the case
            "float16": _fake_run("float16", losses * 1.1, loss_scale={
                "history": history, "skipped_at": [24], "period": 20})}
    fig = digits.loss_figure(runs)
    try:
        loss_ax, diff_ax, scale_ax = fig.axes[:3]
        styles = {(line.get_linestyle(), line.get_marker(), line.get_color())
                  for line in loss_ax.get_lines() if line.get_label().split()[0] in runs}
        assert len(styles) == 3, styles  # one look per mode, even where the curves coincide
        # the relative panel shows float16's 10% above float32 and bfloat16 on the zero line
        rel = {line.get_label(): line.get_ydata() for line in diff_ax.get_lines()}
        np.testing.assert_allclose(rel["float16"], 10.0, rtol=1e-6)
        np.testing.assert_allclose(rel["bfloat16"], 0.0, atol=1e-9)
        scale_line = next(l for l in scale_ax.get_lines() if "loss scale" in l.get_label())
        assert list(scale_line.get_ydata()) == history
        assert "20 finite steps" in scale_ax.get_title() and "default 2000" in scale_ax.get_title()
    finally:
        plt.close(fig)
    two = digits.loss_figure({k: runs[k] for k in ("float32", "bfloat16")})
    try:
        assert len(two.axes) == 2  # no loss-scale panel without a loss-scaled run
    finally:
        plt.close(two)


def test_digits_memory_note_explains_emulated_16_bit_arithmetic():
    digits = _example("digits")
    runs = {"float32": _fake_run("float32", [1.0], temp_bytes=5 * 2 ** 20,
                                 matmul_dtypes={"f32": 11, "convert": 2}),
            "bfloat16": _fake_run("bfloat16", [1.0], temp_bytes=6 * 2 ** 20,
                                  matmul_dtypes={"f32": 11, "convert": 89})}
    note = digits.memory_note(runs)
    assert note is not None
    assert "bfloat16: 6.00 MiB" in note and "11 dot/convolution ops all float32" in note
    assert "89 converts" in note and "float32: 5.00 MiB" in note
    # Where the backend computes in 16 bits there is nothing to explain.
    runs["bfloat16"]["matmul_dtypes"] = {"bf16": 10, "f32": 1, "convert": 40}
    assert digits.memory_note(runs) is None


def test_digits_matmul_dtypes_reads_the_compiled_program():
    import jax
    import jax.numpy as jnp
    digits = _example("digits")
    a = jnp.ones((8, 8), jnp.float32)
    compiled = jax.jit(lambda x, y: (x @ y).astype(jnp.bfloat16)).lower(a, a).compile()
    counts = digits.matmul_dtypes(compiled)
    assert counts["f32"] == 1 and counts["convert"] >= 1, counts


def test_digits_says_which_loss_scale_settings_it_uses_and_why():
    digits = _example("digits")
    text = digits.describe_loss_scale(25, 252)
    assert "period=25" in text and "loss_scale=32768" in text
    assert "the default is 2000" in text and "252 steps" in text
    assert "Keep 2000 for real training" in text
    assert "default is" not in digits.describe_loss_scale(2000, 252)  # nothing to excuse
    assert digits.make_loss_scale("float16", 7).period == 7
    assert digits.parse_args([]).loss_scale_period == digits.LOSS_SCALE_PERIOD == 25
