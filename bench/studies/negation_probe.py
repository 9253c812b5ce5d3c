"""Question: could a learned probe on MiniLM's vectors catch the English negation traps the word-list
guards let through, at a price in should-hit pairs worth paying?

The probe: logistic regression (scikit-learn, which sentence-transformers brings) on the two
texts' normalised MiniLM vectors, symmetric in the pair: ``|a - b|`` and ``a * b`` (768 features).
Label 1 for a trap, 0 for a should-hit pair. Trained on the English pairs of the development sets
the guards' rules were written from (``tests/data/semantic/en/dev*.jsonl``, the fresh sets, the
first five negation sets); its threshold set on ``negation10.jsonl`` (the last round's development
set) so that it refuses at most ``cap`` (5 / 10 / 20 %) of the should-hit pairs the guards pass
there; reported on ``negation11.jsonl``, which neither the rules nor the probe saw.
Regularisation C 0.1 / 1 / 10.

What counts: among the pairs the shipped guards pass (``guards.check`` is None), how many traps the
probe refuses and how many should-hit pairs it refuses too; and the share of all traps the guards
and the probe together refuse (the guards' target is 95 %).

Run:   .venv/bin/python bench/studies/negation_probe.py          (~1 min: embeds ~2,000 texts)
       .venv/bin/python bench/studies/negation_probe.py --quick  (C = 1, cap 10 % only)
Output: bench/results/negation_probe.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # import bench

import numpy as np  # noqa: E402

from bench._common import bench_parser, finish, machine_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SETS = os.path.join(ROOT, "bench", "data", "semantic")
DEV_SETS = os.path.join(ROOT, "tests", "data", "semantic", "en")
TRAIN = ([os.path.join(DEV_SETS, f"dev{s}.jsonl") for s in ("", "2", "3")]
         + [os.path.join(BENCH_SETS, f"{n}.jsonl") for n in ("fresh", "fresh2", "fresh3", "fresh4",
                                                              "negation5", "negation6", "negation7", "negation8",
                                                              "negation9")])
VALIDATION = os.path.join(BENCH_SETS, "negation10.jsonl")
TEST = os.path.join(BENCH_SETS, "negation11.jsonl")


def english(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("lang", "en") == "en"]


def features(embedder, rows: list[dict]) -> np.ndarray:
    a = np.asarray(embedder.encode([r["a"] for r in rows]))
    b = np.asarray(embedder.encode([r["b"] for r in rows]))
    return np.hstack([np.abs(a - b), a * b])


def run(quick: bool) -> dict:
    from sklearn.linear_model import LogisticRegression

    from kvcached_router.semantic import guards
    from kvcached_router.semantic.embed import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    train = [r for p in TRAIN for r in english(p)]
    val, test = english(VALIDATION), english(TEST)
    x_train, x_val, x_test = features(embedder, train), features(embedder, val), features(embedder, test)
    y_train, y_val, y_test = (np.array([not r["same_answer"] for r in rows], dtype=int) for rows in (train, val, test))
    passes_val, passes_test = (np.array([guards.check(r["b"], r["a"]) is None for r in rows]) for rows in (val, test))
    traps_test = int(y_test.sum())
    refused_by_guards = int(((~passes_test) & (y_test == 1)).sum())
    rows = []
    for c in ((1.0,) if quick else (0.1, 1.0, 10.0)):
        probe = LogisticRegression(C=c, max_iter=5000).fit(x_train, y_train)
        s_val, s_test = probe.predict_proba(x_val)[:, 1], probe.predict_proba(x_test)[:, 1]
        hits_val = np.sort(s_val[passes_val & (y_val == 0)])
        for cap in ((0.10,) if quick else (0.05, 0.10, 0.20)):
            threshold = float(hits_val[int(len(hits_val) * (1 - cap))])
            row = {"C": c, "cap": cap, "threshold": round(threshold, 4)}
            for name, s, y, passes in (("validation", s_val, y_val, passes_val), ("test", s_test, y_test, passes_test)):
                traps, hits = passes & (y == 1), passes & (y == 0)
                row[name] = {"traps_passing_guards": int(traps.sum()), "caught": int((s[traps] >= threshold).sum()),
                             "should_hit_passing_guards": int(hits.sum()),
                             "should_hit_refused": int((s[hits] >= threshold).sum())}
            row["test_traps_refused_with_probe"] = round((refused_by_guards + row["test"]["caught"]) / traps_test, 4)
            rows.append(row)
    return {"benchmark": "negation_probe", "machine": machine_info(), "question": __doc__.split("\n\n")[0],
            "train_pairs": len(train), "train_traps": int(y_train.sum()), "validation": os.path.basename(VALIDATION),
            "test": os.path.basename(TEST), "test_traps": traps_test,
            "test_traps_refused_by_guards": round(refused_by_guards / traps_test, 4), "rows": rows}


def report(res: dict) -> None:
    print(f"trained on {res['train_pairs']} English pairs ({res['train_traps']} traps); threshold on "
          f"{res['validation']}; reported on {res['test']}: the guards alone refuse "
          f"{100 * res['test_traps_refused_by_guards']:.1f} % of its {res['test_traps']} traps")
    for r in res["rows"]:
        t = r["test"]
        print(f"  C={r['C']:<4} cap {100 * r['cap']:.0f} %: of the traps the guards pass {t['caught']} of "
              f"{t['traps_passing_guards']} caught, of the should-hit pairs {t['should_hit_refused']} of "
              f"{t['should_hit_passing_guards']} refused; guards + probe refuse "
              f"{100 * r['test_traps_refused_with_probe']:.1f} % of the traps")


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__, "one regularisation, one cap").parse_args(argv)
    finish("negation_probe", run(args.quick), args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
