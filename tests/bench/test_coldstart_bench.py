"""Keeps bench/coldstart.py from rotting: one scenario (the in-process part each child
runs) on a tiny random Llama, and the measured fields it reports."""

from __future__ import annotations

import argparse
import json

from bench import coldstart
from tests.agent.conftest import make_tiny_model_dir


def test_one_scenario_reports_every_part(tmp_path, capsys) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    ns = argparse.Namespace(target=str(model), cache=str(tmp_path / "cache"), device="cpu", threads=1)
    assert coldstart.child(ns) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[7:])
    assert result["pull_s"] is None  # a local path: nothing to pull
    assert result["load_s"] > 0 and result["warmup_s"] > 0 and result["first_token_s"] > 0
    assert result["weights_in_memory"] > 0 and result["peak_rss"] >= result["peak_anon"] >= 0
