"""The identity-policy experiment: JAX's own tests with every ``jax.jit`` wrapped in
``jamp.autocast_transform(f, Policy(jnp.float32))``, or (``--form region``) with every jitted
function's body run inside a ``with jamp.autocast(Policy(jnp.float32)):`` region.

A float32 policy changes no dtype in a float32 program, so every test that passes without the
patch and fails with it points at something jamp's rewrite breaks (or at a test that inspects the
program or JAX's caches, which a rewrite legitimately changes: those are bucketed separately).

JAX's test files are not fetched here (CI has no network): put the files of the installed JAX
version in a directory first, e.g. from a clone of github.com/jax-ml/jax::

    mkdir -p /tmp/jax-tests/tests
    for f in lax_control_flow_test api_test custom_api_test lax_autodiff_test \\
             lax_numpy_reducers_test; do
      git -C jax show jax-v0.10.2:tests/$f.py > /tmp/jax-tests/tests/$f.py; done
    git -C jax show jax-v0.10.2:conftest.py > /tmp/jax-tests/conftest.py

then, from the repository root::

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu .venv/bin/python benchmarks/identity_policy.py \\
        /tmp/jax-tests --out /tmp/identity-0.10

``--form`` picks the front end under test (``JAMP_IDENTITY_FORM`` for the plugin):
``transform`` (the default) patches ``jax.jit(f)`` to ``jax.jit(autocast_transform(f, policy))``;
``region`` patches it to ``jax.jit(g)``, where ``g`` calls ``f`` inside
``jamp.autocast(policy)`` (the region trace, front end 2); ``eager-region`` patches nothing and
runs every test's body inside ``jamp.autocast(policy)`` (its eager operations, and its jits met
inside the region). Use a separate ``--out`` per form.

``--helpers`` patches the jit of JAX's test helpers too (``jtu._CompileAndCheck``, which calls
``jax._src.api.jit``): most of ``lax_test``, the ``lax_numpy_*_test`` files and
``lax_autodiff_test`` compile only through it. ``--vmap`` patches ``jax.vmap`` too (its function
wrapped as a jit's is): ``lax_vmap_test``, ``lax_vmap_op_test`` and ``ann_test`` batch without
compiling, against their own unbatched reference. ``--cast-back`` casts every patched
function's outputs back to the dtypes it returns without jamp, so that a 16-bit program the
float32 policy computes in float32 (by design) is checked on its values, with the test's own
tolerances, rather than failing on its dtype.

It runs each file with ``benchmarks/identity_jit_plugin.py`` patched, then without the patch the
tests that failed patched (``--full-baseline``: all of them), writes ``patched.json`` and
``baseline.json`` per file under ``--out`` and prints a markdown summary of the tests the patch
breaks, bucketed by cause (``--report-only`` re-prints it from the JSON files;
``--rerun-failures`` runs the patched failures again after a fix).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

FILES = ("lax_control_flow_test", "api_test", "custom_api_test", "lax_autodiff_test",
         "lax_numpy_reducers_test")

# (bucket, whose, pattern over the test id, the failure message and the traceback's tail). First
# match wins. whose: "jamp" = a jamp bug to fix; "by design" = jamp's documented behaviour
# differs from plain JAX's; "rewrite" = the test inspects what a rewrite
# legitimately changes (the jaxpr's text, JAX's trace/compile caches, which error a misuse raises);
# "harness" = an artefact of patching jax.jit from outside (see identity_jit_plugin.py).
BUCKETS = (
    ("a jitted callee is traced again inside a region (its jit key holds the policy)",
     "by design", r"::APITest::test_inner_jit_function_retracing\b"),
    ("the jitted object is the plugin's wrapper (repr, name, its trace-cache entry, a reference "
     "cycle through the function's __dict__)", "harness",
     r"::(JitTest::test_jit_repr(_errors)?|JitTest::test_fun_name|JitTest::test_jit_reference_"
     r"dropping|APITest::test_eval_shape_trace_cache_share)\b"),
    ("the plugin's wrapper adds Python frames under the jit (or, with --vmap, the vmap) call",
     "harness",  # the region form's wrapper one; the transform form's more
     r"::TracebackTest::test_(jit_traceback\n\w+: \d+ != 6|vmap_traceback\n\w+: \d+ != 7)\b"),
    ("RewriteError wraps the user's exception", "jamp", r"RewriteError"),
    ("custom_vjp symbolic_zeros: every input looks perturbed", "jamp (rules/custom_ad.py)",
     r"\.perturbed"),
    ("custom_vjp `defvjp_with_logs`: logs lost under jit", "jamp (rules/custom_ad.py)",
     r"defvjp_with_logs"),
    ("platform_dependent lowers every platform's branch", "jamp",
     r"platform_dependent|branches_platforms|not found for platform"),
    ("token arguments rejected", "jamp (transform.py)", r"(?is)token.*neither an array"),
    ("strict dtype promotion", "jamp", r"TypePromotionError"),
    ("while with a batched predicate", "jamp", r"cond_fun must return a boolean scalar"),
    ("a custom_vjp's float32 cotangent for a bfloat16 primal comes back bfloat16", "by design",
     r"CotangentDtype|excess_precision_hell"),  # README: custom_vjp cotangents are cast to
    # the primal input dtypes (JAX lets a bwd return float32 for a bfloat16 input)
    # JAX's tests run float16/bfloat16 programs too, which a float32 policy does change
    # (docs/reference/dtypes.md, the tables and "Regions"); each test listed was read through.
    ("16-bit computations under the float32 policy: matmuls, convolutions and fp32-table ops "
     "(in a region also jnp's reductions and squares) run and return float32 where the test "
     "asserts the 16-bit dtype", "by design",
     r"dtype\('float32'\) != (dtype\((bfloat16|'float16')\)|<class 'numpy\.float16'>)|"
     r"got (bfloat16|float16)\[[^\]]*\], but expected float32\["),
    # jax.nn.dot_product_attention asks its float16 einsum for the F16_F16_F32 algorithm and
    # falls back where that raises, which only an eager (vmap) run does: under jax.jit (or a
    # rewrite, which traces) the CPU's lowering refuses it, in plain JAX too.
    ("an eager-only fallback (JAX's float16 attention, F16_F16_F32 on CPU): jax.jit fails alike",
     "JAX", r"The precision 'F16_F16_F32' is not supported by dot_general on CPU"),
    ("the test expects another error for a misuse", "rewrite",
     r"not raised|does not match|DID NOT RAISE"),
    # jax 0.12: under jax.debug_infs, JAX's op-by-op re-run of a jitted function that evaluates a
    # jaxpr binds its nested jits directly, which raise JAX's internal error type:
    # jax.jit(jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(ndtri)(.5)))(1.) fails alike.
    ("debug_infs re-run of an evaluated jaxpr raises JAX's internal error (jit of "
     "jaxpr_as_fun fails alike)", "JAX", r"InternalFloatingPointError"),
    ("the test checks that an output is its input object (a rewrite returns an equal array)",
     "rewrite", r"assert Array\(.*\) is Array\("),
    ("the test reads the jaxpr's text", "rewrite", r"\{ lambda ;|pretty_print|jaxpr_text"),
    ("the test counts traces/compiles or cache entries", "rewrite",
     r"_cache_size|cache_miss|count_(jit|pjit|primitive|subjaxpr)|tracing_cache|"
     r"compile(s|d)? (count|cache)"),
)


def bucket_of(nodeid: str, entry: dict) -> tuple[str, str]:
    if entry.get("jamp_warnings"):
        prim = re.search(r"primitive `(\w+)`", entry["jamp_warnings"][0])
        return f"UnsupportedPrimitiveWarning: no rule for `{prim[1] if prim else '?'}`", "jamp"
    message = nodeid + "\n" + entry.get("message", "")
    text = message + "\n" + entry.get("tail", "")
    for name, whose, pattern in BUCKETS:  # what a test asserts is read from its message only
        if re.search(pattern, message if whose == "rewrite" else text):
            return name, whose
    first = entry.get("message", "").split(":")[0].strip() or "?"
    return f"other: {first[:60]}", "?"


def run_file(args: argparse.Namespace, name: str, patched: bool,
             only: list[str] | None = None, rerun: bool = False) -> dict:
    out_dir = Path(args.out) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / (("patched" if patched else "baseline") + ("-rerun" if rerun else "") + ".json")
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(here), args.jamp_root or str(here.parent),
                                         env.get("PYTHONPATH", "")])
    env.update(JAX_PLATFORMS="cpu", JAMP_IDENTITY_OUT=str(out),
               JAMP_IDENTITY_PATCH="1" if patched else "0", JAMP_IDENTITY_FORM=args.form,
               JAMP_IDENTITY_HELPERS="1" if args.helpers else "0",
               JAMP_IDENTITY_VMAP="1" if args.vmap else "0",
               JAMP_IDENTITY_CAST_BACK="1" if args.cast_back else "0",
               JAX_NUM_GENERATED_CASES=str(args.generated_cases))
    cmd = [args.python, "-m", "pytest", "-p", "identity_jit_plugin", "-p", "no:cacheprovider",
           "-q", "--no-header", "-rN", "--tb=short", f"tests/{name}.py"]
    if only == []:
        result = {"patched": patched, "counts": {}, "outcomes": {}, "seconds": 0}
        out.write_text(json.dumps(result))
        return result
    if only is not None:  # node ids, through an argument file (pytest's @file)
        ids = out_dir / ("patched-ids.txt" if patched else "baseline-ids.txt")
        ids.write_text("\n".join(only) + "\n")
        cmd = cmd[:-1] + [f"@{ids}"]
    elif name in args.select:
        cmd += ["-k", args.select[name]]
    if args.workers:  # (after the file: the ids replace it as the last argument)
        cmd += ["-n", str(args.workers)]
    for stale in out_dir.glob(f"{out.name}.counts-*"):
        stale.unlink()
    start = time.time()
    log = out_dir / ("patched.log" if patched else "baseline.log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=args.tests_dir, env=env, stdout=f, stderr=subprocess.STDOUT)
    if not out.exists():
        raise SystemExit(f"{name}: pytest wrote no results (exit {proc.returncode}), see {log}")
    result = json.loads(out.read_text())
    for part in sorted(out_dir.glob(f"{out.name}.counts-*")):  # xdist workers' patched jits
        for key, value in json.loads(part.read_text())["counts"].items():
            result["counts"][key] = result["counts"].get(key, 0) + value
        part.unlink()
    result["seconds"] = round(time.time() - start, 1)
    out.write_text(json.dumps(result, indent=1))
    return result


def _first_line(entry: dict) -> str:
    text = entry.get("message") or "; ".join(entry.get("jamp_warnings", [])) or "?"
    return text.strip().splitlines()[0] if text.strip() else "?"


def summarize(out_root: Path, names: list[str]) -> str:
    lines = ["| file | tests | patched failures | of which fail without the patch too | "
             "broken by the patch | jits patched (with static args) |", "|---|---|---|---|---|---|"]
    broken: dict[str, list[tuple[str, str, dict]]] = {}
    for name in names:
        base = json.loads((out_root / name / "baseline.json").read_text())
        pat = json.loads((out_root / name / "patched.json").read_text())
        b, p = base["outcomes"], pat["outcomes"]
        failed = lambda o: {k for k, v in o.items() if v["outcome"] == "failed"}
        passed = lambda o: {k for k, v in o.items() if v["outcome"] == "passed"}
        newly = sorted((failed(p) | {k for k, v in p.items() if v.get("jamp_warnings")})
                       & passed(b))
        both = sorted(failed(p) & failed(b))
        for k in newly:
            bucket, whose = bucket_of(k, p[k])
            broken.setdefault(bucket, []).append((whose, k, p[k]))
        c = {"jit_calls": "?", "with_static_args": "?", **pat["counts"]}
        vmaps = f", {c['vmap_calls']} vmaps" if c.get("vmap_calls") else ""
        vmaps += f", {c['cast_back']} outputs cast back" if c.get("cast_back") else ""
        lines.append(f"| {name} | {len(p)} | {len(failed(p))} | {len(both)} | {len(newly)} | "
                     f"{c['jit_calls']} ({c['with_static_args']}){vmaps} |")
    lines += ["", "| cause | whose | tests | example |", "|---|---|---|---|"]
    for bucket, items in sorted(broken.items(), key=lambda kv: -len(kv[1])):
        whose, k, entry = items[0]
        msg = _first_line(entry)[:120].replace("|", "\\|")
        lines.append(f"| {bucket} | {whose} | {len(items)} | `{k.split('::', 1)[-1]}`: {msg} |")
    lines += ["", "Tests broken by the patch:", ""]
    for bucket, items in sorted(broken.items()):
        for whose, k, entry in items:
            msg = _first_line(entry)[:160]
            lines.append(f"- [{bucket}] `{k}`: {msg}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", help="directory holding conftest.py and tests/<file>.py")
    parser.add_argument("--out", required=True, help="directory for the JSON results")
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--select", nargs="*", default=[], metavar="FILE=EXPR",
                        help="a pytest -k expression for one file, e.g. lax_autodiff_test=Grad")
    parser.add_argument("--generated-cases", type=int, default=2,
                        help="JAX_NUM_GENERATED_CASES (JAX's default is 10)")
    parser.add_argument("--form", choices=("transform", "region", "eager-region"),
                        default="transform",
                        help="transform: jit(autocast_transform(f)); region: jit of f's body "
                             "inside a jamp.autocast region; eager-region: each test's body "
                             "inside one")
    parser.add_argument("--helpers", action="store_true",
                        help="also patch the jit of JAX's test helpers (jtu._CompileAndCheck), "
                             "which most lax and jnp test files compile through")
    parser.add_argument("--vmap", action="store_true",
                        help="also patch jax.vmap (its function in the same form as a jit's), "
                             "for the tests that batch without compiling")
    parser.add_argument("--cast-back", action="store_true",
                        help="cast every patched function's outputs back to the dtypes it "
                             "returns without jamp: 16-bit programs are then checked on their "
                             "values instead of failing on the float32 the policy returns")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--full-baseline", action="store_true",
                        help="run every test without the patch too (default: only those the "
                             "patched run fails)")
    parser.add_argument("--rerun-failures", action="store_true",
                        help="run the previous patched run's failures again (after a fix) and "
                             "update its results")
    parser.add_argument("--jamp-root", help="import jamp from this checkout (e.g. an older "
                        "commit's `git archive`) instead of this one")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.select = dict(s.split("=", 1) for s in args.select)
    if not args.report_only:
        for name in args.files:
            # Patched first; the baseline then runs the tests the patch broke (or all of them
            # with --full-baseline): a test that fails either way is not jamp's.
            rerun = None
            if args.rerun_failures:  # after a fix: the patched run again, its failures only
                old = json.loads((Path(args.out) / name / "patched.json").read_text())
                rerun = [k for k, v in old["outcomes"].items()
                         if v["outcome"] == "failed" or v.get("jamp_warnings")]
                prior = {k: v for k, v in old["outcomes"].items() if k not in rerun}
            r = run_file(args, name, True, rerun, rerun=rerun is not None)
            if rerun is not None:
                r["outcomes"] = {**prior, **r["outcomes"]}
                r["rerun_of_failures"] = len(rerun)
                (Path(args.out) / name / "patched.json").write_text(json.dumps(r, indent=1))
            print(f"{name} patched: {len(r['outcomes'])} tests in {r['seconds']} s",
                  file=sys.stderr)
            if args.rerun_failures:
                continue
            broken = [k for k, v in r["outcomes"].items()
                      if v["outcome"] == "failed" or v.get("jamp_warnings")]
            b = run_file(args, name, False, None if args.full_baseline else broken)
            print(f"{name} baseline: {len(b['outcomes'])} tests in {b['seconds']} s",
                  file=sys.stderr)
    print(summarize(Path(args.out), args.files))


if __name__ == "__main__":
    main()
