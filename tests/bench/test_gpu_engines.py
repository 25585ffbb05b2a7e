"""bench.gpu_engines' pure parts: when it refuses to run, how it deploys, the agreement and
summary tables. Nothing here needs a GPU, vLLM or a fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_engines as g


def completion(tokens: list[str], ttft: float | None, seconds: float) -> g.Completion:
    return g.Completion(tokens=tokens, completion_tokens=len(tokens), ttft_s=ttft, seconds=seconds)


def test_refuses_clearly_without_a_gpu_or_vllm() -> None:
    assert "GPU" in (g.unavailable([], True) or "")
    assert "vLLM is not installed" in (g.unavailable([("H100", 80.0)], False) or "")
    assert g.unavailable([("H100", 80.0)], True) is None


def test_main_without_a_gpu_exits_2_with_a_message(monkeypatch, capsys) -> None:
    import agent.inventory

    monkeypatch.setattr(agent.inventory, "detect_gpus", lambda: [])
    assert g.run_main(g.main, ["--model", "Qwen/Qwen2.5-0.5B-Instruct"]) == 2
    out = capsys.readouterr().out
    assert "no NVIDIA GPU" in out and "Traceback" not in out


def test_model_as_fleetctl_takes_it(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert g.fleet_model(str(tmp_path / "m")) == str((tmp_path / "m").resolve())
    assert g.fleet_model("Qwen/Qwen2.5-0.5B-Instruct") == "hf://Qwen/Qwen2.5-0.5B-Instruct"
    assert g.fleet_model("hf://org/m@abc") == "hf://org/m@abc"
    assert g.fleet_model("smollm2-135m") == "smollm2-135m"


def test_deploy_argv_names_the_engine_and_passes_engine_args() -> None:
    argv = g.deploy_argv("vllm", "gpu-vllm", "hf://org/m", 2, ["max_model_len=4096", "max_num_seqs=64"])
    assert argv[:2] == ["deploy", "gpu-vllm"]
    assert argv[argv.index("--engine") + 1] == "vllm" and argv[argv.index("--gpus") + 1] == "2"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-e"] == ["max_model_len=4096", "max_num_seqs=64"]
    assert argv[-2:] == ["--output", "json"]
    # parallel sizes give the GPU count: a --gpus beside them would be refused
    tp = g.deploy_argv("vllm", "gpu-vllm", "hf://org/m", 1, ["tensor_parallel_size=2"])
    assert "--gpus" not in tp and tp[tp.index("-e") + 1] == "tensor_parallel_size=2"


def test_last_json_skips_progress_lines() -> None:
    assert g.last_json('waiting for clusters...\n{"key": "k", "clusters": [{"gateway": "g"}]}\n') == {
        "key": "k",
        "clusters": [{"gateway": "g"}],
    }
    with pytest.raises(RuntimeError, match="no JSON"):
        g.last_json("nothing\n")


def test_token_agreement_per_prompt() -> None:
    ref = [["a", "b", "c", "d"], ["a", "b", "c", "d"], ["x", "y"], []]
    got = [["a", "b", "c", "d"], ["a", "b", "z", "d"], ["x", "y", "z"], []]
    rows = g.token_agreement(ref, got)
    assert [(r.first_divergence, r.matched) for r in rows] == [(None, 1.0), (2, 0.5), (2, 1.0), (None, 1.0)]
    assert rows[2].other_tokens == 3  # vLLM went on where Fleet stopped: not identical
    last = g.agreement_rows(rows)[-1]
    assert last[0] == "all (2/4 identical)" and last[-1] == pytest.approx(0.875)
    with pytest.raises(ValueError):
        g.token_agreement(ref, got[:2])


def test_summary_percentiles_throughput_and_ratio_row() -> None:
    fleet = g.EngineRun(
        engine="fleet",
        sequential=[completion(["t"] * 10, 0.1 * (i + 1), 1.0) for i in range(10)]
        + [completion([], None, 0.5)],
        batched_tokens=400,
        batched_seconds=2.0,
        concurrency=8,
    )
    vllm = fleet.model_copy(update={"engine": "vllm", "batched_tokens": 800})
    fs, vs = g.summarize(fleet), g.summarize(vllm)
    assert fs.ttft_p50_ms == pytest.approx(550.0) and fs.ttft_p90_ms == pytest.approx(910.0)
    assert fs.tokens_per_s_single == pytest.approx(100 / 10.5) and fs.tokens_per_s_batched == 200.0
    rows = g.summary_rows([fs, vs])
    assert (
        rows[-1][0] == "vllm / fleet"
        and rows[-1][4] == pytest.approx(2.0)
        and rows[-1][1] == pytest.approx(1.0)
    )
    assert len(g.summary_rows([fs])) == 1  # no ratio without both


def test_report_prints(capsys) -> None:
    run = g.EngineRun(
        engine="fleet",
        sequential=[completion(["a"], 0.05, 0.2)],
        batched_tokens=1,
        batched_seconds=0.1,
        concurrency=1,
    )
    report = g.Report(
        model="m",
        max_tokens=8,
        gpus=["H100 80 GiB"],
        summaries=[g.summarize(run)],
        agreement=g.token_agreement([["a"]], [["a"]]),
    )
    g.print_report(report)
    out = capsys.readouterr().out
    assert "Fleet vs vLLM" in out and "Greedy agreement" in out


def test_prompts_for_any_count() -> None:
    prompts = g.prompts_for(20)
    assert len(prompts) == 20 == len(set(prompts))
