"""Tests of tl_vllm_hooks_tools's commands and datasets beside the core's (whose helpers, in conftest.py, they use): which
model compare loads, the order of a dataset's requests, what a stopped command leaves behind, and the pictures.

One in-process engine (eager, batched, a sink) serves the dataset tests; the command tests start their own, each as a
user runs it. About three minutes on 2 CPU cores (two without circuitsvis, whose example test is skipped then).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
import tl_vllm_hooks_tools as tools
from conftest import HERE, NO_ENGINE, Model, engine, free_port, manifest_lines, run_command  # the shared helpers

SITES = ("resid_post", "attn_out")
# Request 0 generates longest, so it finishes last: the sink writes requests as they finish.
PROMPTS = [[(11 * i + 5 * r) % 500 + 1 for i in range(6 + 3 * r)] for r in range(4)]
MAX_TOKENS = [6, 1, 1, 1]
LATER_PROMPTS = [[7, 8, 9], [3, 1, 4, 1, 5]]  # a second generate of the same engine


def random_weights(model, directory: Path, seed: int) -> None:
    """Save ``model`` (a tiny model) to ``directory`` with weights moved by a draw of its own: the same config, other
    weights (tiny_model seeds its draw by family, so two calls give the same weights)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def two_tinies(tmp_path_factory):
    """Two random tiny Llamas of one config, each saved as ``tiny`` in a directory of its own: (a, b, a's
    transformers model)."""
    root = tmp_path_factory.mktemp("two_tinies")
    a, b = root / "a", root / "b"
    model = tools.tiny_model(str(a / "tiny"))
    random_weights(tools.tiny_model(str(b / "tiny")), b / "tiny", seed=1)
    return a, b, model


@pytest.fixture(scope="module")
def sink_run(two_tinies):
    """An engine started from directory a on the model "tiny" (a relative path, as a user gives it), writing to a/acts:
    PROMPTS in one generate (request 0 finishing last), then LATER_PROMPTS in another, each keeping its prompt's
    rows. Returns (the directory, the RequestOutputs' ids in the order given)."""
    a, _b, hf_model = two_tinies
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(a)
        model = Model("llama", Path("tiny"), hf_model=hf_model)
        with engine(model, sites=SITES, in_process=True, eager=True, batching=True, sink_dir=str(a / "acts")) as llm:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            given, keep = [], tlh.request_args(llm.config, "prompt")  # (compare checks prompt rows)
            for prompts, max_tokens in ((PROMPTS, MAX_TOKENS), (LATER_PROMPTS, [1, 1])):
                params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                                         extra_args=keep) for n in max_tokens]
                outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                given += [output.request_id for output in outputs]
            tlh.flush_sink(llm)
    return a / "acts", given


def compare(arguments: list[str], capfd) -> tuple[int, str, str]:
    """The compare command, run here as a user runs it: (exit code, stdout, stderr)."""
    capfd.readouterr()
    code = tools.main(["compare", *arguments])
    printed = capfd.readouterr()
    return code, printed.out, printed.err


# --- which model compare loads ------------------------------------------------------------


def test_the_manifest_names_the_model_by_absolute_path_and_fingerprint(two_tinies, sink_run):
    a, b, _model = two_tinies
    directory, _given = sink_run
    (header, *_shards) = manifest_lines(directory)
    assert header["model"] == str(a / "tiny"), "the engine was given 'tiny', from directory a"
    assert header["model_fingerprint"] == tools.model_fingerprint(str(a / "tiny"))
    dataset = tools.CaptureDataset(directory)
    assert (dataset.model, dataset.model_fingerprint) == (header["model"], header["model_fingerprint"])
    assert tools.model_fingerprint(str(b / "tiny")) != dataset.model_fingerprint, "same config, other weights"


def test_compare_loads_the_model_the_capture_ran_wherever_it_is_run(two_tinies, sink_run, capfd, monkeypatch,
                                                                     tmp_path):
    """Run from b, which holds another ./tiny of the same config: compare used to load b/tiny and blame the capture
    (every hook past the tolerance). It loads a/tiny, says so with its fingerprint, and draws the errors by layer;
    b/tiny given with --model is refused, as not the model the capture used."""
    a, b, _model = two_tinies
    directory, _given = sink_run
    monkeypatch.chdir(b)
    fingerprint = tools.model_fingerprint(str(a / "tiny"))
    plot = ["--plot", str(tmp_path / "errors.png")] if _has("matplotlib") else []
    code, out, err = compare([str(directory), *plot], capfd)
    assert code == 0, out + err[-3000:]
    lines = out.splitlines()
    assert lines[0] == (
        f"{directory} (float32, vLLM {tools.versions()['vllm']}) vs TransformerLens fp32 on {a / 'tiny'} "
        f"(fingerprint {fingerprint[:16]}, the capture's), {len(PROMPTS) + len(LATER_PROMPTS)} requests; "
        "tolerance 0.0001 (relative L2)"
    ), out
    assert lines[-1] == "verdict: all 6 hooks within the tolerance 0.0001 (exit code 0)", out
    if plot:
        assert (tmp_path / "errors.png").stat().st_size > 0 and f"wrote {tmp_path / 'errors.png'}" in out
    code, out, err = compare([str(directory), "--model", "tiny"], capfd)
    assert code == 2 and out == "", out
    assert err == (
        f"error: compare: {b / 'tiny'} is not the model the capture used: its fingerprint "
        f"{tools.model_fingerprint(str(b / 'tiny'))[:16]} is not the {fingerprint[:16]} the manifest records for "
        f"{a / 'tiny'} (its config.json or its weights' files differ); give the model the capture used instead of "
        "--model tiny\n"
    ), err


def test_compare_refuses_a_model_whose_weights_changed_or_that_is_gone(two_tinies, sink_run, capfd, tmp_path):
    """The dataset as if captured from a copy of a/tiny, whose weights are then b's, then which is removed; a dataset
    of a manifest without a fingerprint (written before manifests held one) is compared only with --model."""
    a, b, _model = two_tinies
    directory, _given = sink_run
    shutil.copytree(a / "tiny", tmp_path / "tiny")
    shutil.copytree(directory, tmp_path / "acts")
    (manifest,) = (tmp_path / "acts").glob("manifest-*.jsonl")
    header, *lines = manifest.read_text().splitlines(keepends=True)
    recorded = json.loads(header)
    manifest.write_text(json.dumps({**recorded, "model": str(tmp_path / "tiny")}) + "\n" + "".join(lines))
    shutil.copy(b / "tiny" / "model.safetensors", tmp_path / "tiny" / "model.safetensors")  # other weights
    code, out, err = compare([str(tmp_path / "acts")], capfd)
    assert code == 2 and out == "", out
    said = f"error: compare: {tmp_path / 'tiny'} is not the model the capture used: its fingerprint "
    assert err.startswith(said), err
    assert err.endswith("its weights' files differ); give the model the capture used with --model\n"), err
    shutil.rmtree(tmp_path / "tiny")
    code, out, err = compare([str(tmp_path / "acts")], capfd)
    assert (code, out) == (2, "")
    assert err == (
        f"error: compare: the model the capture used, {tmp_path / 'tiny'}, is gone (no such directory); give a copy "
        "of it with --model\n"
    ), err
    del recorded["model_fingerprint"]
    manifest.write_text(json.dumps(recorded) + "\n" + "".join(lines))
    code, out, err = compare([str(tmp_path / "acts")], capfd)
    assert (code, out) == (2, "")
    assert err == (
        f"error: compare: {tmp_path / 'acts'}'s manifest records no fingerprint of the model it was captured from "
        f"(written before manifests held one; it names {str(a / 'tiny')!r}), so compare cannot check which model "
        "to load: give the model the capture used with --model\n"
    ), err
    code, out, err = compare([str(tmp_path / "acts"), "--model", str(a / "tiny")], capfd)
    assert code == 0, out + err[-3000:]
    fingerprint = tools.model_fingerprint(str(a / "tiny"))
    assert (
        f"vs TransformerLens fp32 on {a / 'tiny'} (fingerprint {fingerprint[:16]}, not checked: the manifest records "
        "no fingerprint), 6 requests;"
    ) in out.splitlines()[0], out


@NO_ENGINE
def test_a_fingerprint_reads_config_and_sampled_weights(tmp_path):
    """Two tiny models of one config differ; one file's name, size or sampled bytes change it; a large file is read in
    16 blocks of 64 KiB, not whole."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"a": 1}')
    weights = tmp_path / "m" / "model-00001.safetensors"
    weights.write_bytes(bytes(range(256)) * (1 << 14))  # 4 MiB
    first = tools.model_fingerprint(str(tmp_path / "m"))
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    with open(weights, "r+b") as file:  # a byte inside the last sampled block
        file.seek(-5, os.SEEK_END)
        file.write(b"\xff")
    assert tools.model_fingerprint(str(tmp_path / "m")) != first
    (tmp_path / "m" / "notes.txt").write_text("not a weights file")
    changed = tools.model_fingerprint(str(tmp_path / "m"))
    assert tools.model_fingerprint(str(tmp_path / "m")) == changed
    (tmp_path / "m" / "config.json").write_text('{"a": 2}')
    assert tools.model_fingerprint(str(tmp_path / "m")) != changed
    reads, pread = [], os.pread
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "pread", lambda fd, size, offset: reads.append((size, offset)) or pread(fd, size, offset))
        tools.model_fingerprint(str(tmp_path / "m"))
    assert len(reads) == 16 and reads[0] == (1 << 16, 0) and reads[-1] == (1 << 16, (4 << 20) - (1 << 16))


# --- the order of a dataset's requests ----------------------------------------------------


def test_request_ids_are_the_users_ids_in_the_order_given(sink_run):
    """The sink writes requests as they finish, with vLLM's suffix (request 0 last here, as '0-1a2b3c4d'); the dataset
    lists them as the RequestOutputs name them, in the order given, and opens them by either id."""
    directory, given = sink_run
    written = [request_id for line in manifest_lines(directory)[1:] for request_id in line["requests"]]
    assert [tlh.user_request_id(r) for r in written] != given, "finished in another order than given"
    assert all(re.fullmatch(r"\d+-[0-9a-f]{8}", r) for r in written), written
    dataset = tools.CaptureDataset(directory)
    assert dataset.request_ids == given == [str(i) for i in range(6)]
    assert list(dataset) == given
    prompts = PROMPTS + LATER_PROMPTS
    for request_id, prompt in zip(given, prompts):
        assert dataset.entry(request_id)["prompt_token_ids"] == prompt
        assert dataset[request_id]["blocks.2.hook_resid_post"].shape[0] == len(prompt)
    for full in written:
        assert dataset.entry(full) == dataset.entry(tlh.user_request_id(full))
    assert [dataset.entry(r)["order"] for r in given] == [[0, n] for n in range(6)]


@NO_ENGINE
def test_engines_run_into_one_directory_come_in_the_order_run(tmp_path):
    """Two engines one after another into one directory, each finishing its requests in reverse: the second
    engine's entries come after the first's, and an id both gave keeps its full ids."""
    config = tlh.CaptureConfig({"blocks.0.hook_resid_post": (4,)}, enable_batching=True, sink_dir=str(tmp_path))
    header = {**tools.sink_header(config), "writer": "pp0-tp0", "model": "m", "model_fingerprint": "f",
              "versions": {"vllm": "v"}, "writes": ["blocks.0.hook_resid_post"], "shards": {}}
    engines = [["0-aaaaaaaa", "1-bbbbbbbb", "2-cccccccc"], ["0-dddddddd", "1-eeeeeeee"]]
    for number, ids in enumerate(engines):
        writer = tools.ShardWriter(str(tmp_path), "pp0-tp0", header, shard_bytes=1)
        assert writer.engine == number
        for arrival, request_id in reversed(list(enumerate(ids))):  # (finished last to first)
            entry = {"prompt_token_ids": [arrival], "positions": [[0, 1]], "order": [writer.engine, arrival]}
            writer.write(request_id, entry, [("blocks.0.hook_resid_post", [1, 4], [torch.full((1, 4), arrival)])])
        writer.close()
    dataset = tools.CaptureDataset(tmp_path)
    assert dataset.request_ids == ["0-aaaaaaaa", "1-bbbbbbbb", "2", "0-dddddddd", "1-eeeeeeee"]
    assert dataset.entry("2")["order"] == [0, 2] and dataset.entry("1-eeeeeeee")["order"] == [1, 1]
    with pytest.raises(KeyError, match=r"'0' matches 2 requests: \['0-aaaaaaaa', '0-dddddddd'\]"):
        dataset["0"]


# --- no leftovers ---------------------------------------------------------------------------


def _stop_command(command: subprocess.Popen, stop: signal.Signals | None) -> tuple[str, str, float]:
    """The command's output and how long it took to end after ``stop`` was sent to it (None: sent already)."""
    if stop is not None:
        command.send_signal(stop)
    sent = time.monotonic()
    stdout, stderr = command.communicate(timeout=60)
    return stdout, stderr, time.monotonic() - sent


def test_a_capture_stopped_while_its_engine_starts_leaves_no_directory(two_tinies, tmp_path):
    """SIGINT to the command once its workers wrote the manifest's header: it left the directory it made, with that
    manifest in it, as _stop_on_signals ended the process without the command's clean-up. (Enough prompts that no
    shard closes before the signal: the first closes at the end, 1 GiB being far off.)"""
    a, _b, _model = two_tinies
    out = tmp_path / "acts"
    (tmp_path / "prompts.txt").write_text("".join(f"{r} 7 8 9 10 11 12 13\n" for r in range(1, 401)))
    command = subprocess.Popen(
        [sys.executable, "-m", "tl_vllm_hooks_tools", "capture", str(a / "tiny"), "--token-ids-file", "prompts.txt",
         "--eager", "--out", str(out)],
        cwd=tmp_path, env={**_environment(), "PYTHONPATH": str(HERE)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("manifest-*.jsonl")) and command.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(out.glob("manifest-*.jsonl")), "the workers write the manifest's header when their hooks go in"
    stdout, stderr, took = _stop_command(command, signal.SIGINT)
    assert command.returncode == 130 and took < 20, stdout + stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("SIGINT: stopped"), stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}


def test_serve_stopped_by_sigint_says_so_exits_130_and_removes_its_log(two_tinies, tmp_path, request):
    """The serve command stopped by a terminal's Ctrl-C (SIGINT to its process group, vLLM's processes included) as
    soon as a request is answered: it says so, exits 130 and removes its temporary log, and the request's rows are
    in its sink, whose open shard would otherwise close only after --shard-seconds."""
    a, _b, _model = two_tinies
    # A temporary directory of its own, short: vLLM makes its engine's sockets there, and a socket path past 107
    # characters (pytest's tmp_path under xdist) stops its start.
    temporary = Path(tempfile.mkdtemp(prefix="tlh-serve-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(temporary, ignore_errors=True))
    port = free_port()
    command = subprocess.Popen(
        [sys.executable, "-m", "tl_vllm_hooks_tools", "serve", str(a / "tiny"), "--port", str(port), "--sites", "resid_post",
         "--sink-dir", "acts", "--shard-seconds", "600", "--enforce-eager", "--max-model-len", "256",
         "--gpu-memory-utilization", "0.05"],
        cwd=tmp_path, env={**_environment(), "PYTHONPATH": str(HERE), "TMPDIR": str(temporary)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    said = [command.stdout.readline(), command.stdout.readline()]
    if not said[1].startswith(f"serving http://127.0.0.1:{port}/v1 "):
        command.kill()
        pytest.fail(f"the serve command did not come up: {said!r}\n{command.communicate()[1][-4000:]}")
    log = Path(re.search(r"; log (\S+)\)", said[1]).group(1))
    assert log.parent == temporary and log.exists()
    body = json.dumps({"model": str(a / "tiny"), "prompt": [5, 9, 33], "max_tokens": 2, "temperature": 0.0}).encode()
    post = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=120) as answer:
        request_id = json.load(answer)["id"] + "-0"  # (the server's id of a completion's first prompt)
    os.killpg(command.pid, signal.SIGINT)  # a terminal's Ctrl-C
    stdout, stderr, took = _stop_command(command, None)
    assert command.returncode == 130 and took < 20, stdout + stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "SIGINT: stopped the server", stderr[-3000:]
    assert not list(temporary.glob("tl_vllm_hooks-serve-*.log")), "the temporary log is removed"
    rows = tools.CaptureDataset(str(tmp_path / "acts"))[request_id]
    assert {name: tuple(tensor.shape) for name, tensor in rows.items()} == {
        f"blocks.{layer}.hook_resid_post": (4, 128) for layer in range(3)
    }, "its 3 prompt tokens' rows and its first generated token's"


@NO_ENGINE
def test_serve_writes_its_log_where_told_and_says_which_signal_stopped_it(tmp_path, stub_vllm, monkeypatch, capfd):
    """--log reaches serve(); SIGTERM while serving: 'SIGTERM: stopped the server', exit code 143."""
    started = []

    class Server:
        log = str(tmp_path / "vllm.log")

        def wait(self):
            if not started[-1]["stopped"]:
                raise KeyboardInterrupt("SIGTERM")
            return -15

        def terminate(self):
            started[-1]["stopped"] = True

        def _remove_log(self):
            pass

    def serve(model, config, *vllm_args, **options):
        started.append({"options": options, "stopped": False})
        return Server()

    monkeypatch.setattr(tools, "serve", serve)
    model = tmp_path / "tiny"
    tools.tiny_model(str(model))
    capfd.readouterr()
    assert tools.main(["serve", str(model), "--log", str(tmp_path / "vllm.log"), "--port", "8123"]) == 143
    (call,) = started
    assert call["options"] == {"host": "127.0.0.1", "port": 8123, "log": str(tmp_path / "vllm.log")}
    assert call["stopped"]
    printed = capfd.readouterr()
    assert printed.err == "SIGTERM: stopped the server\n", printed


@NO_ENGINE
def test_a_servers_temporary_log_goes_when_it_is_stopped_and_stays_otherwise(tmp_path):
    """serve's process: terminate() or the end of a with block removes the log serve made; a log given, or one whose
    server stopped by itself, stays."""
    logs = [tmp_path / f"{name}.log" for name in ("made", "given", "exited", "with")]
    for log in logs:
        log.write_text("vLLM's output")

    def started(log: Path, temporary: bool, *command: str) -> tools._Server:
        process = tools._Server(list(command) or ["sleep", "30"])
        process.log, process.temporary_log = str(log), temporary
        return process

    made, given, exited = started(logs[0], True), started(logs[1], False), started(logs[2], True, "true")
    for process in (made, given):
        process.terminate()
        process.wait()
    exited.wait()
    with started(logs[3], True):
        pass
    assert [log.exists() for log in logs] == [False, True, True, False]


# --- pictures -------------------------------------------------------------------------------


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _drawn(monkeypatch) -> list:
    """The figures matplotlib saves from now on (each still saved)."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or save(self, *a, **k))
    return figures


@NO_ENGINE
def test_compares_picture_draws_each_hooks_error_by_layer(tmp_path, monkeypatch, capsys):
    """A line per site over the layers (hooks outside them before or after), on a log scale, with the tolerance; it
    was a bar per hook."""
    pytest.importorskip("matplotlib")
    figures = _drawn(monkeypatch)
    worst = {"hook_embed": (0.0, 0.0), "ln_final.hook_normalized": (1e-6, 3e-7)}
    worst.update({f"blocks.{i}.hook_resid_post": (1e-6, 10.0 ** (-7 + i)) for i in range(3)})
    worst.update({f"blocks.{i}.attn.hook_z": (1e-6, 2e-7) for i in (0, 2)})
    tools._plot_errors(worst, str(tmp_path / "errors.png"), 1e-4, "acts vs TransformerLens")
    assert (tmp_path / "errors.png").read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out == f"wrote {tmp_path / 'errors.png'}\n"
    (axes,) = figures[0].axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()}
    assert lines["resid_post"] == ([0, 1, 2], pytest.approx([1e-7, 1e-6, 1e-5]))
    assert lines["attn_z"] == ([0, 2], [2e-7, 2e-7])
    assert lines["embed"] == ([-1], [pytest.approx(1e-8)]), "an error of 0 drawn at a tenth of the smallest other"
    assert lines["final_norm"] == ([3], [3e-7])
    assert lines["tolerance 0.0001"][1] == [1e-4, 1e-4]
    assert axes.get_yscale() == "log" and not axes.patches, "no bars"
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["before", "0", "1", "2", "after"]


@NO_ENGINE
def test_the_benchmark_draws_its_ratio_table(tmp_path, monkeypatch, capsys):
    """bench_tl_vllm_hooks.py --plot PNG: per case, a bar per ratio of its table (n/a left out), plain's 1.0 dashed;
    without matplotlib the flag is refused before any engine starts."""
    import bench_tl_vllm_hooks as bench

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as the benchmark can tell
        patch.setattr(sys, "argv", ["bench_tl_vllm_hooks.py", "--tiny", "--cases", "plain,b", "--plot", "r.png"])
        with pytest.raises(SystemExit) as stopped:
            bench.main()
    assert stopped.value.code == 2
    assert "--plot r.png: needs matplotlib, which is not installed here" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    figures = _drawn(monkeypatch)
    results = {
        "plain": {"tokens_per_s_ratio": 1.0, "fastest_ratio": 1.0, "paired_ratio": None, "peak_ratio": 1.0},
        "b": {"tokens_per_s_ratio": 0.9, "fastest_ratio": 0.95, "paired_ratio": None, "peak_ratio": 1.1},
        "f": {"tokens_per_s_ratio": 0.8, "fastest_ratio": 0.85, "paired_ratio": None, "peak_ratio": None},
        "s": {"error": "engine failed"},
    }
    bench._plot_ratios(results, str(tmp_path / "ratios.png"), "CPU, vLLM 0.32.0")
    assert (tmp_path / "ratios.png").read_bytes().startswith(b"\x89PNG")
    (axes,) = figures[0].axes
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["b", "f"]
    heights = sorted(round(bar.get_height(), 3) for bar in axes.patches)
    assert heights == [0.8, 0.85, 0.9, 0.95, 1.1]
    assert [line.get_ydata()[0] for line in axes.get_lines()] == [1.0]


def test_the_attention_patterns_example_writes_circuitsvis_page(tmp_path):
    """examples/attention_patterns.py, as TestExamples runs the others: circuitsvis's attention view of a layer's
    rows["pattern", layer], a self-contained HTML page."""
    pytest.importorskip("circuitsvis")
    done = run_command([str(HERE / "examples" / "attention_patterns.py"), "--out", "heads.html"], tmp_path,
                       VLLM_CPU_CI_ENV="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "blocks.1.attn.hook_pattern: [2, 24, 24] (heads, queries, keys); rows sum to 1.000" in done.stdout
    page = (tmp_path / "heads.html").read_text()
    assert "AttentionPatterns" in page and "unpkg.com" not in page, page[:500]


@NO_ENGINE
def test_the_attention_patterns_example_without_circuitsvis_says_how_to_install_it(tmp_path):
    (tmp_path / "circuitsvis.py").write_text("raise ImportError('No module named circuitsvis')\n")  # (as if missing)
    done = subprocess.run(
        [sys.executable, str(HERE / "examples" / "attention_patterns.py")], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE)])},
    )
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr == (
        "attention_patterns.py draws with circuitsvis, which is not installed here: pip install circuitsvis\n"
    ), done.stderr[-2000:]
