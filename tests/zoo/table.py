"""Print the zoo's (model x policy x check) table, one process, with each run's stage timings.

    KERAS_BACKEND=jax python -m tests.zoo.table [model-name-substring ...] > table.md

A development and reporting aid; the test suite is tests/zoo/test_zoo.py.
"""
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

from .harness import CHECKS, POLICIES, ZooRun, checks_for, policies_for  # noqa: E402
from .models import MODELS  # noqa: E402


def main(patterns):
    import jax
    print(f"jax {jax.__version__}\n")
    print("| model | policy | " + " | ".join(CHECKS) + " | seconds |")
    print("|---" * (len(CHECKS) + 3) + "|")
    failures = []
    for model in MODELS:
        if patterns and not any(p in model.name for p in patterns):
            continue
        for policy in POLICIES:
            run, cells, start = ZooRun(model, policy), [], time.perf_counter()
            for name, check in CHECKS.items():
                if name not in checks_for(model) or policy not in policies_for(name):
                    cells.append("-")
                    continue
                try:
                    check(run)
                    cells.append("pass")
                except Exception as e:  # noqa: BLE001 - a report of every failure
                    cells.append("FAIL")
                    failures.append(f"{model.name}[{policy}] {name}: {type(e).__name__}: "
                                    f"{str(e)[:1500]}")
                    print(f"FAIL {failures[-1]}", file=sys.stderr, flush=True)
            print(f"| {model.name} | {policy} | " + " | ".join(cells) +
                  f" | {time.perf_counter() - start:.0f} |", flush=True)
            print("    stages: " + ", ".join(f"{k} {v:.1f}s" for k, v in run.seconds.items()),
                  file=sys.stderr, flush=True)
            if run.relative_errors:
                print(f"    max relative error {max(run.relative_errors.values()):.3g}",
                      file=sys.stderr, flush=True)
    print("\n## Failures\n")
    for f in failures:
        print(f"- {f}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
