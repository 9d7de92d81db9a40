"""jaxspec-bench on CPU: the default run, the --json schema, a batch sweep on a tiny random
model (with a random draft head), results written run by run, the serving run, and the pieces
the modes compute with."""
from __future__ import annotations

import json
import math
from unittest import mock

import pytest

from jaxspec import bench_cli
from jaxspec.benchmark import adaptive, large, prompts, runner, serving
from jaxspec.benchmark.runner import divergence, first_difference, parse_specs
from jaxspec.spec import SpecConfig

ROW_KEYS = {"mode", "batch", "spec", "requests", "tokens", "seconds", "tokens_per_s",
            "accept_len", "accept_hist", "speedup", "mean_ttft_s", "mean_latency_s",
            "compiled_in_timed_pass", "capped", "accept_len_capped", "accept_len_ended",
            "looping", "warmup_s"}


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_gguf):
    """A 2-layer random Llama with SmolLM2's tokenizer (so chat prompts encode in range)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from jaxspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_ids[0])
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("bench") / "tiny-chat"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    tok.hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def sweep(tiny_chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    argv = ["--model", str(tiny_chat_model), "--draft", "random", "--num-prompts", "3",
            "--max-tokens", "12", "--batch-sizes", "1,2", "--spec", "chain",
            "--max-model-len", "128", "--adaptive", "--no-peers", "--quiet", "--dtype", "float32",
            "--repeats", "2", "--json", str(out / "r.json"), "--plot", str(out / "r.png")]
    assert bench_cli.main(argv) == 0
    return json.loads((out / "r.json").read_text()), out


def test_no_arguments_mean_default_model_head_mt_bench_batch_1():
    args = bench_cli._defaults(bench_cli.build_parser().parse_args([]))
    assert args.model is None and args.draft is None and args.dataset == "mt-bench"
    assert args.mode == "sweep" and args.batch_list == [1] and args.temperature == 0.0
    assert args.spec == "chain" and args.num_prompts == 4   # CPU defaults


@pytest.mark.real_weights
def test_default_run(smollm2_gguf, capsys):
    """The default model and shipped head, cut to one question and a few tokens (the real
    SmolLM2 weights: it runs with the other real_weights tests, at XLA's full CPU optimization)."""
    assert bench_cli.main(["--num-prompts", "1", "--max-tokens", "8", "--no-peers",
                           "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (default)" in out and "shipped head" in out
    lines = [ln.split() for ln in out.splitlines()]
    header = next(ln for ln in lines if ln[:2] == ["batch", "mode"])
    chain = dict(zip(header, next(ln for ln in lines if ln[:2] == ["1", "chain"])))
    assert chain["=plain"] == "100%" and chain["prefix"] == "100%"   # greedy spec == plain
    assert chain["mean/med"] == f"{chain['tokens']}/{chain['tokens']}"   # one request
    assert "| float32 |" in out      # the dtype, in the header line


def test_json_schema(sweep):
    res, _ = sweep
    assert res["schema"] == bench_cli.SCHEMA and res["mode"] == "sweep"
    assert res["partial"] is False and res["runs_done"] == res["runs_total"] == 4
    assert res["dtype"] == "float32" and res["matmul_precision"] == "highest"
    assert res["backend"] == "cpu" and res["dataset"] == "mt-bench"
    assert "RANDOM" in res["draft_label"] and any("RANDOM" in n for n in res["notes"])
    assert [(r["batch"], r["mode"]) for r in res["rows"]] == [
        (1, "plain"), (1, "chain"), (2, "plain"), (2, "chain")]
    for r in res["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["requests"] == 3 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        # the warm-up compiled every shape the timed pass used: nothing compiles while timed
        assert r["compiled_in_timed_pass"] == 0, r
        assert r["admit_interval"] == 1      # the engine's default on a CPU, as run
        assert r["engine"]["max_batch"] == r["batch"] and r["engine"]["max_model_len"] == 128
        assert r["engine"]["prefill_chunk"] == 128   # the CPU's 512, capped by max_model_len
        assert r["warmup_s"] > 0             # the warm-up's wall time, compilations included
        # two timed passes; the row is the median one (the slower of two)
        assert len(r["tokens_per_s_runs"]) == 2
        assert r["tokens_per_s"] == pytest.approx(min(r["tokens_per_s_runs"]))
        # each pass's record: garbage collection, and the engine's work in that pass alone
        assert len(r["gc_runs"]) == 2
        for g in r["gc_runs"]:
            assert set(g) == {"gc_s", "full", "device_calls", "admit_calls", "host_s",
                              "dispatch_s", "admit_dispatch_s", "wait_s", "steps",
                              "max_step_ms", "slowest_steps", "pass_s", "before_steps_s",
                              "between_steps_s", "after_steps_s"}
            # the pass is its steps (host + wait) and what lies before, between and after them
            outside = [g[k] for k in ("before_steps_s", "between_steps_s", "after_steps_s")]
            assert all(x >= 0 for x in outside) and outside[0] > 0, g
            assert sum(outside) + g["host_s"] + g["wait_s"] == pytest.approx(g["pass_s"],
                                                                             abs=2e-3)
            assert 0 < g["dispatch_s"] <= g["host_s"]
            assert 0 < g["admit_dispatch_s"] < g["dispatch_s"]
            assert g["device_calls"] > 0 and g["admit_calls"] >= 1 and g["steps"] > 0
            assert g["max_step_ms"] > 0
            # the pass's slowest steps, slowest first, each with what it dispatched
            slow = g["slowest_steps"]
            assert 1 <= len(slow) <= min(5, g["steps"])
            assert slow[0]["ms"] == g["max_step_ms"]
            assert [x["ms"] for x in slow] == sorted((x["ms"] for x in slow), reverse=True)
            assert slow[0]["ms"] >= slow[0]["median_ms"] > 0
            assert len({x["median_ms"] for x in slow}) == 1
            assert len({x["step"] for x in slow}) == len(slow)
            assert all(0 <= x["step"] < g["steps"] and x["admits"] >= 0 and x["call_size"] >= 0
                       for x in slow)
            assert sum(x["admits"] for x in slow) <= g["admit_calls"]
            # where each slow step's time went: its parts add up to the step
            for x in slow:
                parts = [x[k] for k in ("admit_ms", "cycle_ms", "wait_ms", "other_ms")]
                assert all(p >= 0 for p in parts[:3]) and parts[3] > -0.05, x
                assert sum(parts) == pytest.approx(x["ms"], abs=0.05)
                assert (x["admit_ms"] > 0) == (x["admits"] > 0)
                assert (x["cycle_ms"] > 0) == (x["call_size"] > 0)
        # the engine schedules by steps, not by the clock: both passes did the same calls
        first, second = r["gc_runs"]
        assert (first["device_calls"], first["admit_calls"]) == \
            (second["device_calls"], second["admit_calls"])
    plain, chain = res["rows"][0], res["rows"][1]
    assert plain["speedup"] == 1.0 and plain["accept_len"] is None
    assert chain["spec"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4,
                             "cycles_per_call": 1, "draft_vocab": 0,   # as run: all tokens
                             "context_vocab": 0}
    assert sum(chain["accept_hist"]) == chain["cycles"] and len(chain["accept_hist"]) == 4
    assert 1.0 <= chain["accept_len"] <= 4.0
    assert set(res["requests"]) == {"b1/plain", "b1/chain", "b2/plain", "b2/chain"}
    assert res["categories"] and {"category", "requests", "plain", "chain"} <= set(res["categories"][0])


def test_sweep_greedy_spec_equals_plain_at_every_batch_size(sweep):
    res, _ = sweep
    for r in res["rows"]:
        if r["mode"] == "chain":
            assert r["equals_plain"] == 1.0 and r["prefix_token_frac"] == 1.0
            assert r["prefix_mean"] == pytest.approx(r["tokens"] / r["requests"])
    for key in ("b1/chain", "b2/chain"):
        assert [q["first_diff"] for q in res["requests"][key]] == ["equal"] * 3
    assert not any("bf16" in n for n in res["notes"])


def test_adaptive_choice_per_batch_size(sweep):
    res, _ = sweep
    ad = res["adaptive"]
    assert [a["batch"] for a in ad] == [1, 2]
    for a in ad:
        assert a["choice"] in ("plain", "chain") and a["expected_speedup"] >= 1.0
        assert set(a["probes"]) == {"plain", "chain"}
        assert a["measured_tokens_per_s"] > 0


def test_plot_is_a_png(sweep):
    _, out = sweep
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_sweeps_joins_two_calls_of_one_set(sweep, tmp_path):
    """bench.merge_sweeps: a sweep run as two calls (small and large batches) gives one plot and
    one JSON holding every row; files of different sets are refused."""
    from bench import merge_sweeps
    result, _ = sweep
    parts = []
    for b in (1, 2):
        part = dict(result, rows=[r for r in result["rows"] if r["batch"] == b])
        parts.append(tmp_path / f"b{b}.json")
        parts[-1].write_text(json.dumps(part))
    merge_sweeps.main([str(tmp_path / "m.png")] + [str(p) for p in parts])
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["rows"] == [r for b in (1, 2) for r in result["rows"] if r["batch"] == b]
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(result, dataset="gsm8k")))
    with pytest.raises(SystemExit, match="different sets"):
        merge_sweeps.main([str(tmp_path / "x.png"), str(parts[0]), str(other)])


def test_results_are_written_after_every_run(tiny_chat_model, tmp_path, monkeypatch, capsys):
    """A run cut off during its second (batch size x mode) run keeps the first on disk."""
    path = tmp_path / "r.json"
    seen, build = {}, runner.Target.llm

    def llm(self, batch, mode):
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] == 2:     # the chain run: what a time limit would find on disk
            seen["on_disk"] = json.loads(path.read_text())
            raise RuntimeError("cut off")
        return build(self, batch, mode)

    monkeypatch.setattr(runner.Target, "llm", llm)
    with pytest.raises(RuntimeError, match="cut off"):
        bench_cli.main(["--model", str(tiny_chat_model), "--draft", "random", "--spec", "chain",
                        "--num-prompts", "2", "--max-tokens", "6", "--max-model-len", "128",
                        "--no-peers", "--quiet", "--json", str(path)])
    mid = seen["on_disk"]
    assert mid["partial"] is True and "error" not in mid
    assert [(r["batch"], r["mode"]) for r in mid["rows"]] == [(1, "plain")]
    assert (mid["runs_done"], mid["runs_total"]) == (1, 2) and set(mid["requests"]) == {"b1/plain"}
    end = json.loads(path.read_text())
    assert end["partial"] is True and end["error"] == "RuntimeError: cut off"
    assert [r["mode"] for r in end["rows"]] == ["plain"]
    assert any(ln.split()[:2] == ["1", "plain"] for ln in capsys.readouterr().out.splitlines())


def test_default_spec_runs_the_llm_default_at_each_batch_size(tiny_chat_model, tmp_path):
    """--spec default builds each batch size's LLM with the shape LLM() would pick there (here,
    a GPU's rule: the 4x8x32 tree at batch 1, the chain at 2), and the row reports that shape.
    (The rule's 3x2x4 from 16 slots: test_parse_specs and test_engine_warmup's defaults test;
    batches 1 and 2 here run the sweep fixture's plain and chain programs again.)"""
    from jaxspec import defaults
    path = tmp_path / "r.json"
    seen, build, rule = [], runner.Target.llm, defaults.spec

    def llm(self, batch, mode):
        out = build(self, batch, mode)
        seen.append((batch, mode.label, getattr(out, "spec", None)))
        return out

    def gpu_rule(slots):            # the GPU's choice; everything else runs as on this CPU
        with mock.patch.object(defaults.jax, "default_backend", lambda: "gpu"):
            return rule(slots)

    with mock.patch.object(runner.Target, "llm", llm), \
            mock.patch.object(defaults, "spec", gpu_rule):
        assert bench_cli.main(["--model", str(tiny_chat_model), "--draft", "random", "--spec",
                               "default:1", "--batch-sizes", "1,2", "--num-prompts", "2",
                               "--max-tokens", "6", "--max-model-len", "128", "--no-peers",
                               "--quiet", "--dtype", "float32", "--json", str(path)]) == 0
    assert [(b, label, spec) for b, label, spec in seen if label != "plain"] == [
        (1, "default:1", SpecConfig(4, 8, 32)), (2, "default:1", SpecConfig(3, 1, 4))]
    rows = [r for r in json.loads(path.read_text())["rows"] if r["mode"] == "default:1"]
    assert [(r["spec"]["num_steps"], r["spec"]["topk"], r["spec"]["num_draft_tokens"])
            for r in rows] == [(4, 8, 32), (3, 1, 4)]
    assert [len(r["accept_hist"]) for r in rows] == [5, 4]


def test_time_budget_starts_no_run_after_it_is_spent(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert bench_cli.main(["--no-spec", "--time-budget", "0", "--no-peers", "--quiet",
                           "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["partial"] is True and res["rows"] == [] and res["runs_total"] == 1
    assert any("--time-budget 0 s: stopped after 0 of 1 runs" in n for n in res["notes"])


def test_serving_run(tiny_chat_model, capsys):
    assert bench_cli.main(["--model", str(tiny_chat_model), "--no-spec", "--num-prompts", "2",
                           "--num-requests", "4", "--request-rate", "inf", "--batch-sizes", "2",
                           "--max-tokens", "6", "--max-model-len", "128", "--json", "-",
                           "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    s = res["serving"][0]
    assert res["mode"] == "serve" and s["completed"] == 4 and s["output_tokens"] > 0
    assert 0 < s["p50_ttft_s"] <= s["p99_ttft_s"] and s["p50_e2e_s"] >= s["p50_ttft_s"]


def test_profile_pass(tiny_chat_model, tmp_path, capsys):
    """--profile traces one more pass per run and files its per-program summary (the CPU has no
    device kernels: zeros, but the trace is written and read back); other modes refuse it."""
    prof = tmp_path / "prof"
    assert bench_cli.main(["--model", str(tiny_chat_model), "--no-spec", "--num-prompts", "1",
                           "--max-tokens", "4", "--max-model-len", "128", "--no-peers", "--quiet",
                           "--profile", str(prof), "--json", "-"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out[out.index("\n{") + 1:])
    row = res["rows"][0]
    assert row["profile"]["wall_ms"] > 0 and row["profile"]["kernels"] == 0
    assert "profile, batch 1, plain" in out
    assert list(prof.glob("b1_plain/**/*.json.gz"))
    with pytest.raises(SystemExit) as e:
        bench_cli.main(["--mode", "accuracy", "--profile", str(prof)])
    assert e.value.code == 2 and "--profile traces a sweep" in capsys.readouterr().err


# ---------------------------------------------------------------- pieces, no model
def test_divergence_from_plain():
    plain = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9], [1, 2, 3]]
    spec = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9], [1, 2, 3, 4]]
    d = divergence(plain, spec)
    # equal; differs at 2; at 0; plain stops (EOS) where spec goes on: differs at 3
    assert d["first_diff"] == ["equal", 2, 0, 3]
    assert d["equals_plain"] == 0.25
    assert d["prefix_mean"] == 2.25 and d["prefix_median"] == 2.5     # prefixes 4, 2, 0, 3
    assert d["prefix_token_frac"] == 9 / 14                           # of 4 + 4 + 2 + 4 emitted
    assert first_difference((), ()) == "equal" and first_difference([7], []) == 0
    assert divergence([], [])["equals_plain"] is None


def test_dtype_option(capsys):
    parse = bench_cli.build_parser().parse_args
    assert parse(["--dtype", "float32"]).dtype == "float32"
    args = bench_cli._defaults(parse([]))
    assert args.dtype == "auto" and bench_cli._dtype(args) == "float32"   # CPU default
    with pytest.raises(SystemExit):
        parse(["--dtype", "fp16"])
    err = capsys.readouterr().err
    assert "--dtype: invalid choice: 'fp16'" in err and "bfloat16" in err and "float32" in err


def _refused(capsys, argv, *words):
    """argv is an argparse error (exit code 2) before anything loads: one line naming words."""
    with pytest.raises(SystemExit) as e:
        bench_cli.parse_args(argv + ["--model", "/nonexistent.gguf"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("jaxspec-bench: error:"), err
    assert all(w in err for w in words), err


def test_admission_options(capsys):
    from jaxspec import defaults
    parse = bench_cli.build_parser().parse_args
    a = bench_cli._defaults(parse([]))
    assert a.admit_interval is None and a.prefill_chunk == 512    # the CPU's default chunk
    with mock.patch.object(defaults.jax, "default_backend", lambda: "gpu"):
        assert bench_cli._defaults(parse([])).prefill_chunk == defaults.GPU_PREFILL_CHUNK
    a = bench_cli._defaults(parse(["--admit-interval", "2", "--prefill-chunk", "2048"]))
    assert a.admit_interval == 2 and a.prefill_chunk == 2048
    _refused(capsys, ["--admit-interval", "0"], "--admit-interval", "must be an int >= 1")
    _refused(capsys, ["--prefill-chunk", "8"], "--prefill-chunk", "must be an int >= 16")
    assert bench_cli._defaults(parse(["--submit-slice", "32"])).submit_slice == 32
    assert parse([]).pack_rows is None          # EngineConfig's own default: pow2
    assert parse(["--pack-rows", "fine"]).pack_rows == "fine"
    _refused(capsys, ["--submit-slice", "0"], "--submit-slice", "must be an int >= 1")
    # checks across options name both flags
    _refused(capsys, ["--pack-tokens", "100"], "--pack-tokens (100) must be >= --prefill-chunk")


def test_invalid_values_fail_before_the_model_loads(capsys):
    """Every value is checked as the options are read: nothing is replaced silently."""
    _refused(capsys, ["--max-tokens", "0"], "--max-tokens", "0")
    _refused(capsys, ["--num-prompts", "0"], "--num-prompts")
    _refused(capsys, ["--batch-sizes", "1,0"], "--batch-sizes")
    _refused(capsys, ["--temperature", "-1"], "--temperature")
    _refused(capsys, ["--spec", "bushy"], "--spec", "STEPSxTOPKxTOKENS")
    _refused(capsys, ["--dataset", "no-such-set"], "--dataset", "mt-bench, gsm8k, sharegpt")
    _refused(capsys, ["--draft-vocab", "-1"], "--draft-vocab", ">= 0")
    _refused(capsys, ["--layer-layout", "diagonal"], "--layer-layout")
    _refused(capsys, ["--max-tokens", "64", "--max-model-len", "64"], "--max-tokens 64",
             "--max-model-len 64")
    _refused(capsys, ["--data-parallel", "2", "--tensor-parallel", "2"], "--data-parallel",
             "--tensor-parallel")


def test_engine_options_are_the_config_fields():
    """One option per EngineConfig field (max_batch: --batch-sizes) and per DraftConfig field,
    named after it, its help from the dataclass's docstring; given values reach the configs,
    the others keep the configs' defaults."""
    import dataclasses
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import DraftConfig
    ap = bench_cli.build_parser()
    flags = {o: a for a in ap._actions for o in a.option_strings}
    for cls, skip in ((EngineConfig, {"max_batch"}), (DraftConfig, set())):
        docs = bench_cli._field_help(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert (flag in flags) != (f.name in skip), flag
            if flag in flags:
                assert flags[flag].dest == f.name and docs[f.name][:20] in flags[flag].help
    args = ap.parse_args(["--prefill-chunk", "64", "--min-chunk", "32", "--slot-growth", "2",
                          "--width-growth", "2", "--no-packing", "--pack-tokens", "128",
                          "--pack-max-tokens", "512", "--pack-rows", "fine",
                          "--admit-interval", "3", "--cycles-per-call", "2",
                          "--decode-steps", "8", "--short-rows", "0", "--cycle-copies", "2",
                          "--layer-layout", "unrolled", "--compile-workers", "1",
                          "--submit-slice", "7", "--seed", "5", "--max-model-len", "256",
                          "--kv-budget", "4096", "--draft-vocab", "0",
                          "--draft-context-vocab", "0", "--draft-vocab-ranking", "r.st"])
    assert bench_cli._config(EngineConfig, args, bench_cli.SWEPT) == EngineConfig(
        max_model_len=256, kv_budget=4096, prefill_chunk=64, min_chunk=32, slot_growth=2,
        width_growth=2, packing=False, pack_tokens=128, pack_max_tokens=512, pack_rows="fine",
        admit_interval=3, cycles_per_call=2, decode_steps=8, short_rows=0, cycle_copies=2,
        layer_layout="unrolled", compile_workers=1, submit_slice=7, seed=5)
    assert bench_cli._config(DraftConfig, args) == DraftConfig(0, "r.st", 0)
    assert bench_cli._config(EngineConfig, ap.parse_args([]), bench_cli.SWEPT) == EngineConfig()
    assert bench_cli._config(DraftConfig, ap.parse_args([])) == DraftConfig()


def test_engine_options_reach_the_engine_and_keep_outputs(tiny_chat_model):
    """The options as jaxspec-bench builds its LLM (`runner.Target`): a prompt of several
    16-token chunks gives the output of one wide chunk."""
    from jaxspec import SamplingParams
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import DraftConfig
    prompt = [[{"role": "user", "content": "Count: " + " ".join(str(i) for i in range(20))}]]
    sp = SamplingParams(max_tokens=6)
    outs = []
    for chunk, interval, growth, pack in ((16, 2, 2, "--packing"), (512, None, 4, "--no-packing")):
        argv = ["--prefill-chunk", str(chunk), "--slot-growth", str(growth), pack,
                "--max-model-len", "128"] + (["--admit-interval", str(interval)] if interval
                                             else [])
        args = bench_cli.parse_args(argv)
        target = runner.Target(str(tiny_chat_model), None,
                               bench_cli._config(EngineConfig, args, bench_cli.SWEPT),
                               bench_cli._config(DraftConfig, args))
        llm = target.llm(4, runner.PLAIN)
        conf = llm.engine_config
        assert (conf.prefill_chunk, conf.admit_interval) == (min(chunk, 128),
                                                             interval or 1)   # CPU: 1
        assert llm.engine.planner.slot_buckets == ([1, 2, 4] if growth == 2 else [1, 4])
        assert conf.packing == (pack == "--packing") and conf.max_batch == 4
        outs.append(llm.generate(prompt * 3, sp))
        assert llm.engine.stats.prefill_chunks >= (3 if chunk == 16 else 1)
        # packed first chunks, later chunks a whole chunk wide; without packing, chunks only
        assert {s[3] for s in llm.engine.stats.admit_shapes} == \
            ({"packed", "chunk"} if pack == "--packing" else {"chunk"})
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_packing_option(capsys):
    parse = bench_cli.build_parser().parse_args
    assert parse([]).packing is None                   # EngineConfig's default: on
    assert parse(["--no-packing"]).packing is False
    assert parse(["--packing"]).packing is True
    with pytest.raises(SystemExit):
        parse(["--packing", "maybe"])


@pytest.mark.parametrize("flag", ["width", "slot"])
def test_growth_options(flag, capsys):
    from jaxspec.engine import EngineConfig
    parse = bench_cli.build_parser().parse_args
    attr = f"{flag}_growth"
    assert getattr(bench_cli._config(EngineConfig, parse([]), bench_cli.SWEPT), attr) == 4
    assert getattr(bench_cli._defaults(parse([f"--{flag}-growth", "2"])), attr) == 2
    _refused(capsys, [f"--{flag}-growth", "1"], f"--{flag}-growth", "must be an int >= 2")


def test_repeat_share_tells_loops_from_text():
    assert runner.repeat_share(list(range(100))) == 0.0
    assert runner.repeat_share([7, 8, 9] * 30) == 1.0        # a loop: every window comes again
    # 40 distinct tokens, then a 4-token phrase 15 times: only windows inside the loop repeat
    ids = list(range(100, 140)) + [1, 2, 3, 4] * 15
    share = runner.repeat_share(ids)
    assert share == pytest.approx(45 / 85)   # the windows inside the loop (starts 40..84)
    assert runner.repeat_share([1, 2, 3]) == 0.0               # shorter than a window
    from types import SimpleNamespace as NS
    outs = [NS(token_ids=[7, 8, 9] * 30, accept_lens=None, finish_reason="length",
               metrics={"ttft_s": 0.0, "latency_s": 1.0}),
            NS(token_ids=list(range(100)), accept_lens=None, finish_reason="stop",
               metrics={"ttft_s": 0.0, "latency_s": 1.0})]
    assert runner.summarize(runner.PLAIN, 1, outs, 1.0, "-")["looping"] == 0.5
    reqs = runner.per_request([{"id": 1}, {"id": 2}], outs)
    assert [r["repeat_share"] for r in reqs] == [1.0, 0.0]


def test_repeats_keep_the_median_pass(capsys):
    """Three passes of 1, 3 and 2 seconds: the row is the 2-second pass, its outputs included."""
    from types import SimpleNamespace as NS

    class Clocked:
        def __init__(self):
            self.t, self.calls = 0.0, 0

        def generate(self, chats, sp):
            self.calls += 1
            self.t += {1: 1.0, 2: 3.0, 3: 2.0}[self.calls]
            return [NS(token_ids=[self.calls] * 6)]

    llm = Clocked()
    clock = runner.time.perf_counter
    runner.time.perf_counter = lambda: llm.t
    try:
        outs, secs, compiled, rates = runner.timed_generate(llm, ["q"], None, repeats=3)
    finally:
        runner.time.perf_counter = clock
    assert rates == [6.0, 2.0, 3.0] and secs == 2.0 and outs[0].token_ids[0] == 3
    assert compiled == 0
    _refused(capsys, ["--repeats", "0"], "--repeats", "must be >= 1")


def test_gc_clock_counts_the_collections_in_its_block():
    import gc

    with runner.GcClock() as clock:
        gc.collect()
        gc.collect(1)
    assert clock.collections == [0, 1, 1] and clock.seconds > 0
    gc.collect()
    assert clock.collections == [0, 1, 1]        # nothing counted after the block


def test_bf16_differences_are_explained():
    res = {"dtype": "bfloat16", "notes": []}
    bench_cli._exactness_note(res, {"equals_plain": 1.0})
    assert res["notes"] == []
    bench_cli._exactness_note(res, {"equals_plain": 0.06})
    bench_cli._exactness_note(res, {"equals_plain": 0.19})
    assert len(res["notes"]) == 1 and "--dtype float32" in res["notes"][0]


def test_capped_requests_are_told_apart():
    """Accept lengths of requests cut at max_tokens and of those that ended by themselves."""
    from types import SimpleNamespace as NS

    def out(n, accepts, reason):
        return NS(token_ids=[0] * n, accept_lens=accepts, finish_reason=reason,
                  metrics={"ttft_s": 0.0, "latency_s": 1.0})

    chain = parse_specs("chain")[0]
    outs = [out(8, [3, 3], "length"), out(4, [1, 0, 0], "stop"), out(2, [1], "stop")]
    row = runner.summarize(chain, 1, outs, 1.0, "head")
    assert row["capped"] == pytest.approx(1 / 3)
    assert row["accept_len_capped"] == 4.0                  # (4 + 4) / 2
    assert row["accept_len_ended"] == 1.5                   # (2 + 1 + 1 + 2) / 4
    assert row["accept_len"] == pytest.approx(14 / 6)
    assert row["looping"] == 0.0                            # too short to hold a window
    res = {"notes": []}
    bench_cli._capped_note(res, row)
    assert len(res["notes"]) == 1 and "33% of requests hit max_tokens" in res["notes"][0]
    plain = runner.summarize(runner.PLAIN, 1, [out(8, None, "length")], 1.0, "head")
    assert plain["capped"] == 1.0 and plain["accept_len_capped"] is None
    bench_cli._capped_note(res, plain)
    assert len(res["notes"]) == 1


def test_gsm8k_answers():
    qs = prompts.gsm8k(3)
    assert len(qs) == 3 and qs[0]["answer"] == "18"
    assert prompts.gsm8k_reference("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert prompts.last_number("She makes $18.00 a day, then 20 more: 38.") == "38"
    assert prompts.last_number("no digits") is None


def test_mt_bench_goes_round_again_past_80_questions():
    qs = prompts.load_prompts("mt-bench", 200)
    assert len(qs) == 200 and len({q["id"] for q in qs}) == 200
    assert qs[80]["chat"] == qs[0]["chat"] and qs[199]["chat"] == qs[39]["chat"]
    assert qs[199]["round"] == 2 and len(prompts.load_prompts("mt-bench", 5)) == 5


class _LengthTokenizer:
    """A chat's token count = its number of words."""
    def apply_chat_template(self, chat):
        return chat[0]["content"].split()


def test_fit_prompts_keeps_a_length_window_up_to_the_limit():
    from jaxspec.benchmark.runner import fit_prompts
    rows = [{"chat": [{"role": "user", "content": "w " * n}]} for n in (3, 9, 5, 12, 7, 6, 8)]
    kept, dropped = fit_prompts(_LengthTokenizer(), rows, max_tokens=4, max_model_len=16,
                                min_prompt_tokens=6, limit=3)
    # 3 < 6 dropped, 9 kept, 5 dropped, 12 + 4 = 16 kept, 7 kept; then the limit stops it
    assert [len(r["chat"][0]["content"].split()) for r in kept] == [9, 12, 7] and dropped == 2
    kept, dropped = fit_prompts(_LengthTokenizer(), rows, 4, 12)
    assert len(kept) == 5 and dropped == 2


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(SystemExit, match="not one of mt-bench, gsm8k, sharegpt"):
        prompts.load_prompts("no-such-set")


def test_parse_specs():
    ms = parse_specs("chain,2x2x4,chain:4,chain:4@8192")
    assert [m.label for m in ms] == ["chain", "2x2x4", "chain:4", "chain:4@8192"]
    assert ms[1].describe() == {"num_steps": 2, "topk": 2, "num_draft_tokens": 4,
                                "cycles_per_call": None,          # the LLM's default
                                "draft_vocab": None, "context_vocab": None}
    assert ms[3].draft_vocab == 8192 and ms[3].cycles_per_call == 4 and ms[3].spec == ms[0].spec
    assert ms[1].describe(1)["cycles_per_call"] == 1
    assert ms[2].spec == ms[0].spec and ms[2].describe(64)["cycles_per_call"] == 4
    with pytest.raises(Exception, match="STEPSxTOPKxTOKENS"):
        parse_specs("bushy")
    # 'default': LLM()'s own shape, resolved at each batch size (on a GPU: 4x8x32, chain, 3x2x4)
    d, = parse_specs("default:2")
    assert d.label == "default:2" and d.cycles_per_call == 2
    assert d.describe()["num_steps"] is None
    assert d.spec_at(1) == d.spec_at(64) == SpecConfig(3, 1, 4)                 # a CPU: the chain
    with mock.patch("jax.default_backend", lambda: "gpu"):
        assert [d.spec_at(b) for b in (1, 4, 16)] == [SpecConfig(4, 8, 32), SpecConfig(3, 1, 4),
                                                      SpecConfig(3, 2, 4)]
        assert d.describe(16) == {"num_steps": 3, "topk": 2, "num_draft_tokens": 4,
                                  "cycles_per_call": 2, "draft_vocab": None,
                                  "context_vocab": None}
    for bad in ("chain:0", "chain:x"):
        with pytest.raises(Exception, match="cycles per call"):
            parse_specs(bad)
    for bad in ("chain@-1", "chain:4@x"):
        with pytest.raises(Exception, match="draft vocabulary"):
            parse_specs(bad)
    e, = parse_specs("4x8x32:2@16384+0")
    assert (e.draft_vocab, e.context_vocab, e.cycles_per_call) == (16384, 0, 2)
    for bad in ("chain@16384+-1", "chain@16384+x"):
        with pytest.raises(Exception, match="context vocabulary"):
            parse_specs(bad)


def test_poisson_arrivals_and_percentiles():
    a = serving.poisson_arrivals(2000, rate=10.0, seed=1)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:]))
    assert abs(a[-1] / 1999 - 0.1) < 0.01            # mean gap 1/rate
    assert serving.poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    recs = [{"arrival": 0.0, "first": 0.1 * (i + 1), "finish": 1.0 + i, "tokens": 11,
             "reason": "length"} for i in range(10)]
    m = serving.metrics(recs, 5.0, "waves")
    assert m["completed"] == 10 and m["duration_s"] == pytest.approx(10.0)
    assert m["output_throughput"] == pytest.approx(11.0)
    assert m["p50_ttft_s"] == pytest.approx(0.55) and m["p99_ttft_s"] <= 1.0


def test_adaptive_never_picks_a_config_slower_than_plain():
    probes = {"plain": {"tokens_per_s": 100.0}, "chain": {"tokens_per_s": 90.0}}
    assert adaptive.choose(probes)["choice"] == "plain"
    probes["tree"] = {"tokens_per_s": 150.0}
    d = adaptive.choose(probes)
    assert d["choice"] == "tree" and d["expected_speedup"] == pytest.approx(1.5)


def test_adaptive_probe_runs_the_workload_prompts_once_each():
    prompts_ = [{"chat": [{"role": "user", "content": f"q{i}"}]} for i in range(40)]
    chats = adaptive.probe_chats(prompts_, 4)
    assert len(chats) == 12 and len({c[0]["content"] for c in chats}) == 12
    assert len(adaptive.probe_chats(prompts_, 1)) == adaptive.MIN_PROBE_REQUESTS
    # fewer prompts than the probe wants: each once, repeated only to fill one batch
    assert len(adaptive.probe_chats(prompts_[:5], 4)) == 5
    assert len(adaptive.probe_chats(prompts_[:3], 4)) == 4


def test_adaptive_probe_times_the_whole_run_at_the_run_s_length():
    """Tokens/s over everything generate did (prefill included), at the run's max_tokens and
    EOS; the decode-only cost per cycle and the accept length come along."""
    from types import SimpleNamespace
    from jaxspec.sampling import SamplingParams

    class FakeLLM:
        def generate(self, chats, sp):
            self.sp = sp
            return [SimpleNamespace(token_ids=[1] * 9, accept_lens=[3, 3, 0],
                                    metrics={"latency_s": 0.5, "ttft_s": 0.2}) for _ in chats]
    llm = FakeLLM()
    p = adaptive.probe(llm, [[{"role": "user", "content": "x"}]] * 4,
                       SamplingParams(max_tokens=77), spec=True)
    assert llm.sp.max_tokens == 77 and not llm.sp.ignore_eos
    assert p["tokens"] == 36 and p["requests"] == 4
    assert p["tokens_per_s"] == pytest.approx(36 / p["seconds"])
    assert p["decode_cost_s"] == pytest.approx(0.1) and p["accept_len"] == pytest.approx(3.0)
    adaptive.probe(llm, [[]], SamplingParams(max_tokens=77), spec=False, tokens=5)
    assert llm.sp.max_tokens == 5


def test_cycle_mode_replays_accept_lengths_labelled_as_replayed(sweep):
    """Large-model mode never measures acceptance: it replays an earlier run's, by mode."""
    _, out = sweep
    acc = large.replayed_accept(str(out / "r.json"))
    assert set(acc) == {"chain"} and 1.0 <= acc["chain"] <= 4.0
