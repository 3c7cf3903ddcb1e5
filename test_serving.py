"""Served and command-line use: vLLM's OpenAI server with the hooks (options in vllm_xargs, rows to the sink under the
response's id, HTTP 400 for bad options), the capture command, and the examples.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import tl_vllm_hooks as tlh
import tl_vllm_hooks_tools as tools
from conftest import (  # the shared engines, oracles and helpers
    BATCH, HERE, NO_ENGINE, assert_matches, free_port, manifest_lines, relative_error, run_command,
)


CAPTURE_PROMPTS = [[(13 * i + 7 * r) % 500 + 1 for i in range(5 + r % 60)] for r in range(300)]


@pytest.fixture(scope="module")
def capture_run(tmp_path_factory, models):
    """The capture command on Gemma 2's tiny model over a file of 300 prompts, killed (its
    engine too) once two shards are on disk, its last shard then cut short, and run again.
    Eager, which starts sooner (what --eager changes is test_capture_starts_a_compiled_engine_unless_eager's).
    Returns (the second run, the directory, what the first run had listed)."""
    directory = tmp_path_factory.mktemp("capture")
    (directory / "prompts.txt").write_text("".join(" ".join(map(str, p)) + "\n\n" for p in CAPTURE_PROMPTS))
    out = directory / "dataset"
    arguments = [
        "-m", "tl_vllm_hooks_tools", "capture", str(models["gemma2"].path), "--eager", "--token-ids-file", "prompts.txt",
        "--sites", "resid_mid,attn_z", "--layers", "0,2", "--max-in-flight", "4", "--shard-mb", "0.25",
        "--out", str(out),
    ]
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    first = subprocess.Popen(
        [sys.executable, *arguments], cwd=directory, env={**environment, "PYTHONPATH": str(HERE)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    manifest = out / "manifest-pp0-tp0.jsonl"
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline:
        if manifest.exists() and manifest.read_text().count("\n") >= 3:  # the header and two shards
            break
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    listed = manifest_lines(out)
    shard = out / listed[-1]["shard"]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ValueError, match="cut short"):
        tools.CaptureDataset(out)
    return run_command(arguments, directory), out, listed


class TestCaptureCommand:
    """The capture and compare commands on one capture run."""

    def test_an_interrupted_capture_goes_on_where_it_stopped(self, capture_run):
        done, out, listed = capture_run
        requests_before = [r for line in listed[1:] for r in line["requests"]]
        assert 0 < len(requests_before) < len(CAPTURE_PROMPTS), "the first run must be killed midway"
        whole_before = len(requests_before) - len(listed[-1]["requests"])  # the last shard was cut short
        assert done.returncode == 0 and done.stderr == "", done.stdout[-2000:] + done.stderr[-2000:]
        lines, count = done.stdout.splitlines(), len(CAPTURE_PROMPTS)
        assert lines[0].startswith(f"capture: {count} prompts of "), "what starts, said first"
        assert lines[1].startswith("engine ready in ") and f"; {whole_before} prompts done by an earlier run" in lines[1]
        assert lines[-2].startswith(f"capture: {count}/{count} prompts, "), "progress lines (stderr is no terminal)"
        assert lines[-1] == (
            f"wrote {out}: 300 requests ({whole_before} from an earlier run) x 4 hooks (float32); "
            "read them with tl_vllm_hooks_tools.CaptureDataset"
        )
        dataset = tools.CaptureDataset(out)
        lines = {f"line-{2 * r + 1}": prompt for r, prompt in enumerate(CAPTURE_PROMPTS)}
        user_ids = [re.sub(r"-[0-9a-f]{8}$", "", request_id) for request_id in dataset]
        assert sorted(user_ids) == sorted(lines), "each prompt once"
        assert all(dataset.entry(request_id)["prompt_token_ids"] == lines[request_id] for request_id in user_ids)
        assert not list(out.glob("*.partial")), "the killed run's open shard is removed"
        again = run_command(done.args[1:], out.parent)  # the same command once more
        assert again.returncode == 0 and again.stdout.startswith(f"capture: {out} holds all 300 prompts already ")
        assert again.stdout.endswith("; nothing to do, no engine started\n"), again.stdout + again.stderr[-2000:]

    @pytest.mark.parametrize(
        "name, stop", [("capture", signal.SIGINT), ("capture", signal.SIGTERM), ("serve", signal.SIGINT)]
    )
    def test_a_signal_to_the_command_alone_stops_it_and_its_engine_within_seconds(self, tmp_path, models, name, stop):
        """SIGINT or SIGTERM to the driver process alone (as a job runner sends it) while vLLM's engine starts: the
        capture command was deaf to it until vLLM's 600 s start-up timeout, its engine left running, and serve left
        its server running. Now each exits with 128 + the signal's number within seconds, says so in one line, and
        leaves no process of its session behind."""
        import psutil

        environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        arguments = {
            "capture": ["--token-ids", "1 2 3", "--eager", "--out", str(tmp_path / "dataset")],
            "serve": ["--port", str(free_port())],
        }[name]
        command = subprocess.Popen(
            [sys.executable, "-m", "tl_vllm_hooks_tools", name, str(models["llama"].path), *arguments],
            cwd=tmp_path, env={**environment, "PYTHONPATH": str(HERE)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        first_line = command.stdout.readline()
        assert "starting" in first_line, first_line
        time.sleep(3)  # (into vLLM's engine start)
        command.send_signal(stop)
        sent = time.monotonic()
        stdout, stderr = command.communicate(timeout=60)
        took = time.monotonic() - sent
        assert command.returncode == 128 + stop, stdout + stderr[-3000:]
        assert took < 20, f"{took:.0f} s to stop"
        assert stderr.strip().splitlines()[-1].startswith(f"{stop.name}: stopped"), stderr[-3000:]
        time.sleep(1)
        left = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):  # (gone meanwhile)
                if os.getsid(process.pid) == command.pid:
                    left.append(process.cmdline())
        assert not left, f"processes left behind: {left}"

    def test_capture_command_writes_what_compare_confirms(self, tmp_path, models, capture_run):
        _done, out, _listed = capture_run
        dataset = tools.CaptureDataset(out)
        rows = dataset["line-3"]
        assert set(rows) == {f"blocks.{i}.{h}" for i in (0, 2) for h in ("hook_resid_mid", "attn.hook_z")}
        assert rows["blocks.2.attn.hook_z"].shape == (len(CAPTURE_PROMPTS[1]), 2, 64)
        expected = models["gemma2"].reference(CAPTURE_PROMPTS[1], list(rows))
        assert_matches(rows, expected, "line-3")
        compared = run_command(["-m", "tl_vllm_hooks_tools", "compare", str(out), "--tolerance", "1e-5"], tmp_path)
        assert compared.returncode == 0, compared.stdout + compared.stderr[-2000:]
        assert "300 requests" in compared.stdout and "over tolerance" not in compared.stdout
        assert compared.stdout.strip().splitlines()[-1].startswith("verdict: all "), compared.stdout
        strict = run_command(["-m", "tl_vllm_hooks_tools", "compare", str(out), "--tolerance", "1e-12"], tmp_path)
        assert strict.returncode == 1 and "over tolerance" in strict.stdout
        assert "past the tolerance 1e-12 (exit code 1)" in strict.stdout.strip().splitlines()[-1], strict.stdout


@NO_ENGINE
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["capture", "MODEL", "--token-ids", "1 two 3", "--out", "x.safetensors"], "--token-ids: expected integers"),
        (["capture", "MODEL", "--out", "x"], "give one of --token-ids"),
        (["capture", "MODEL", "--token-ids", "1", "--sites", "resid", "--out", "x"], "unknown site 'resid'; did you"),
        (["capture", "MODEL", "--token-ids", "1", "--sites", "embed,resid_postt", "--out", "x"], "mean resid_post or"),
        (["capture", "MODEL", "--token-ids", "1", "--sites", "pos_embed", "--out", "x"], "LlamaForCausalLM has no"),
        (["capture", "MODEL", "--token-ids", "1", "--layers", "3", "--out", "x"], "layers [3]: expected ints in [-3, 3)"),
        (["capture", "tny", "--token-ids", "1", "--out", "x"], "model: no such directory: tny; give a model directory"),
        (["capture", "MODELl", "--token-ids", "1", "--out", "x"], "no such directory: MODELl; did you mean MODEL"),
        (["capture", "MODEL", "--token-ids-file", "nope.txt", "--out", "x"], "--token-ids-file nope.txt: no such file"),
        (["capture", "MODEL", "--prompts", "prompt.txt", "--out", "x"], "no such file; did you mean prompts.txt?"),
        (["compare", "missing"], "no such directory: missing; give a directory the capture command wrote"),
        (["compare", "act"], "compare: no such directory: act; did you mean acts?"),
        (["compare", "."], "no manifest-*.jsonl with a header: not a tl_vllm_hooks sink directory"),
        (["compare", "acts", "--model", "MODELl"], "no such directory: MODELl; did you mean MODEL"),
        (["compare", "missing", "--plot", "errors.png"], "--plot errors.png: needs matplotlib"),
        (["serve", "tny"], "model: no such directory: tny"),
        (["serve", "MODEL", "--sites", "resid_postt"], "unknown site 'resid_postt'; did you mean resid_post or"),
    ],
)
def test_command_line_errors_are_one_line(tmp_path, models, arguments, message, capfd, monkeypatch):
    """Each mistake is one line, said before vLLM is imported (seconds) and any engine starts, and leaves no output
    directory behind. A misspelt model, site, prompts file or capture directory comes with the close ones."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as the command can tell
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it fails: the checks come first
    (tmp_path / "prompts.txt").write_text("one prompt\n")
    (tmp_path / "acts").mkdir()
    (tmp_path / "acts" / "manifest-pp0-tp0.jsonl").write_text("")  # (a capture directory, to be near)
    model = str(models["llama"].path)
    capfd.readouterr()  # (what building the model printed)
    assert tools.main([a.replace("MODEL", model) for a in arguments]) == 2
    errors = capfd.readouterr().err
    assert message.replace("MODEL", model) in errors and len(errors.strip().splitlines()) == 1, errors[-2000:]
    assert not glob.glob(str(tmp_path / "x*")), "a failed command leaves no output directory"


@NO_ENGINE
@pytest.mark.parametrize("eager", [False, True])
def test_capture_starts_a_compiled_engine_unless_eager(tmp_path, models, stub_vllm, eager, capfd):
    """Compiled by default, as the README recommends; the first line says which, and that compiling takes long."""
    capfd.readouterr()
    out = tmp_path / "acts"
    flags = ["--eager"] if eager else []
    assert tools.main(["capture", str(models["llama"].path), *flags, "--token-ids", "1 2", "--out", str(out)]) == 2
    (call,) = stub_vllm
    assert call["enforce_eager"] is eager
    printed = capfd.readouterr()
    said = "eager vLLM engine" if eager else "compiled vLLM engine (compiling takes a minute or more; --eager skips it)"
    assert printed.out.splitlines()[0].endswith(f"starting a batched, {said}"), printed.out
    assert "the stub vLLM starts no engine" in printed.err
    assert not out.exists(), "the failed run removes the directory it made"


@NO_ENGINE
def test_demo_says_what_it_starts_and_removes_its_model_even_when_it_fails(tmp_path, stub_vllm, capfd, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    capfd.readouterr()
    assert tools.main(["demo"]) == 2
    (call,) = stub_vllm
    assert call["model_is_there"] and call["model"].startswith(str(tmp_path / "tl_vllm_hooks_demo_"))
    assert call["enforce_eager"] is False
    printed = capfd.readouterr()
    assert printed.out.splitlines()[0].endswith(
        "starting a compiled vLLM engine (compiling takes a minute or more; --eager skips it)"
    ), printed.out
    assert "the stub vLLM starts no engine" in printed.err
    assert not list(tmp_path.iterdir()), "the demo's model directory is gone"


class TestExamples:
    """The examples, each as a user runs it. On the CPU, vLLM's VLLM_CPU_CI_ENV=1 has Dynamo
    trace the compiled ones (the hooks in the traced graph, as compiled) and run the graph
    without inductor's C++ code generation, which costs ~100 s an example here; inductor's
    code runs in TestOnePrompt, TestBatched and TestFamilies (Qwen3)."""

    # The compiled ones first, the eager capture_batch.py last: pytest-xdist gives a worker
    # its next class when two tests of this one are left, and those should be the short ones.
    @pytest.mark.parametrize(
        "example, expected",
        [
            ("parity.py", "worst "),
            ("steer.py", "after reset:"),
            ("per_request.py", "last-token row matches the unedited request's row 29: True"),
            ("activation_patching.py", "(within 0.0001 of the largest effect)"),
            ("capture_batch.py", "blocks.1.hook_resid_post: (203, 128)"),
        ],
    )
    def test_example_runs_on_the_built_in_model(self, tmp_path, example, expected):
        done = run_command([str(HERE / "examples" / example)], tmp_path, VLLM_CPU_CI_ENV="1")
        assert done.returncode == 0 and expected in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_a_server_that_exits_is_reported_at_once_with_its_log(models, tmp_path):
    """serve() raises as soon as vLLM's server exits, with the end of its log, not after a client's retries."""
    config = tlh.configure(tlh.capture_specs(models["llama"].hf.config), enable_batching=True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)vLLM's server exited with code [1-9].*no-such-flag"):
        tools.serve(str(models["llama"].path), config, "--no-such-flag", port=free_port(), log=str(tmp_path / "log"))
    assert time.monotonic() - started < 120, "reported when it exits, not at the timeout"


class TestServe:
    """The OpenAI API of `vllm serve`: per-request options in vllm_xargs, rows in the sink."""

    def test_completion_rows_reach_the_sink_under_the_response_id(self, server):
        names = list(server.config.capture_specs)
        response = server.client.completions.create(
            model="tiny", prompt=BATCH[0], max_tokens=3, temperature=0.0,
            extra_body={"vllm_xargs": tlh.request_args(server.config, "prompt")},
        )
        assert response.usage.completion_tokens == 3
        request_id = f"{response.id}-0"  # the completion's first (only) prompt
        dataset = tools.CaptureDataset.wait(server.sink_dir, [request_id])
        assert dataset.entry(request_id)["prompt_token_ids"] == BATCH[0]
        assert_matches(dataset[request_id], server.model.reference(BATCH[0], names), "served completion")

    def test_streamed_chat_with_an_edit_matches_transformer_lens(self, server):
        names = list(server.config.capture_specs)
        edits = {"blocks.0.hook_resid_post": {"op": "add", "value": torch.linspace(-1.0, 1.0, 128), "positions": [1]}}
        stream = server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t5 t9 t33 t7 t42"}], max_tokens=3,
            temperature=0.0, stream=True, extra_body={"vllm_xargs": tlh.request_args(server.config, "prompt", edits)},
        )
        chunks = list(stream)
        dataset = tools.CaptureDataset.wait(server.sink_dir, [chunks[0].id])
        prompt = dataset.entry(chunks[0].id)["prompt_token_ids"]
        assert prompt == [5, 9, 33, 7, 42], "the chat template and the word-level tokenizer add nothing"
        expected = server.model.reference(prompt, names, edits)
        assert_matches(dataset[chunks[0].id], expected, "served chat, streamed, edited")
        assert relative_error(dataset[chunks[0].id]["blocks.0.hook_resid_post"], server.model.reference(prompt, names)["blocks.0.hook_resid_post"]) > 1e-3

    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
    def test_bad_options_get_http_400_and_the_next_request_is_served(self, server, stream):
        import openai

        bad_edits = {"blocks.0.hook_resid_pst": {"op": "suppress"}}
        with pytest.raises(ValueError) as expected:
            tlh.request_args(server.config, edits=bad_edits)
        bad = {"tl_vllm_hooks": json.dumps({"edits": bad_edits})}
        with pytest.raises(openai.BadRequestError) as refused:
            response = server.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "t5 t9"}], max_tokens=2, stream=stream,
                extra_body={"vllm_xargs": bad},
            )
            list(response) if stream else None
        assert str(expected.value) in refused.value.response.json()["error"]["message"]
        served = server.client.completions.create(
            model="tiny", prompt=[5, 9], max_tokens=2, extra_body={"vllm_xargs": tlh.request_args(server.config, "none")}
        )
        assert served.choices[0].finish_reason == "length"
