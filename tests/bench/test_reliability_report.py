"""bench/reliability_report.py turns the committed scenario results into its report (no rerun)."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location("reliability_report", os.path.join(ROOT, "bench", "reliability_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sections_report_the_figures_of_the_committed_results():
    rr = _module()
    crash = "\n".join(rr.section_crash(rr.load("crash_loop")))
    d = json.load(open(os.path.join(ROOT, "bench", "results", "crash_loop.json")))
    assert f"| **durable chunks lost** | **{d['crash']['chunks_lost']}** |" in crash
    assert f"{d['crash']['kills_survived']} / {d['crash']['kills']}" in crash
    soak = "\n".join(rr.section_soak(rr.load("soak")))
    s = json.load(open(os.path.join(ROOT, "bench", "results", "soak.json")))
    assert f"| **failed RPCs** | **{s['failed_rpcs']}** |" in soak
    timing = "\n".join(rr.section_security(rr.load("timing_probe")))
    t = json.load(open(os.path.join(ROOT, "bench", "results", "timing_probe.json")))
    assert all(f"**{r['attack_auc']:.3f}**" in timing for r in t["results"])


def test_missing_inputs_are_named_not_invented():
    rr = _module()
    for section, name in ((rr.section_crash, "crash_loop"), (rr.section_soak, "soak"),
                          (rr.section_bad_input, "bad_input")):
        text = "\n".join(section(None))
        assert "missing" in text and name in text
