"""The sink and its datasets: finished requests' rows written to safetensors shards as they finish, read back with
CaptureDataset, whole after a crash, a full disk or a damaged manifest.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
import tl_vllm_hooks_tools as tools
from conftest import (  # the shared engines, oracles and helpers
    BATCH, MIXED_REQUESTS, NO_ENGINE, TOLERANCE, Model, check_sink_requests, engine, generate, manifest_lines,
    relative_error, shard_writer, write_request,
)


# --- the sink: rows on disk -------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, size: str, read_only=False):
    """A tmpfs of `size` mounted at `path`: a disk that fills up, or one that cannot be written. Mounting needs root
    (as CI has): without it, one that cannot be written is a directory without write permission, and one that fills
    up fails the test that needs it, saying so (never a skip that a green run hides)."""
    path.mkdir(parents=True, exist_ok=True)
    if read_only and os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(
            f"a disk that fills up (a {size} tmpfs) needs root to mount: {mounted.stderr.strip()}; run the tests as "
            "root (CI does), or leave these out: -k 'not TestSink'"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)



@contextlib.contextmanager
def sink_engine(model: Model, directory: Path, size: str):
    """A batched, eager, in-process engine of ``model`` writing 256 KiB shards to a sink on a filesystem of ``size``
    in ``directory`` (llm.model, llm.sink_dir)."""
    with small_filesystem(directory / "disk", size) as disk:
        sink_dir = disk / "dataset"
        with engine(model, in_process=True, eager=True, batching=True, sink_dir=str(sink_dir),
                    shard_bytes=256 << 10) as llm:
            llm.model, llm.sink_dir = model, sink_dir
            yield llm

class RecordingWriter:
    """A sink writer of the tests' own, through the interface the core declares for one (see its _sink_writer): it
    keeps each finished request's rows in memory, as the rows' copies stand once take_finished's event has passed.
    Loaded by its name, test_sink:RecordingWriter, so only where the worker is this process."""

    checked: list[str] = []
    written: dict[str, dict] = {}

    def __init__(self, state, worker):
        self.state, self.sources = state, state.sink_sources()

    @staticmethod
    def check(config):
        RecordingWriter.checked.append(config.sink_dir)

    @staticmethod
    def dataset(directory):
        return {"directory": directory, **RecordingWriter.written}

    def write(self, request_ids, at_shutdown=False):
        finished, copied = self.state.take_finished(request_ids)
        if copied is not None:
            copied.synchronize()
        for request in finished:
            if request.positions is not None:
                rows = {name: torch.cat(request.rows[name]).clone() for name in self.sources}
                kept = {"positions": request.positions.tolist(), **rows}
                RecordingWriter.written[tlh.user_request_id(request.request_id)] = kept
            self.state.release(request.files)

    def status(self):
        return {"directory": self.state.config.sink_dir, "error": None, "lost": 0}

    def flush(self):
        self.write(self.state.held_request_ids())
        return self.status()

    def close(self):
        pass


def test_a_sink_writer_of_ones_own_gets_each_finished_requests_rows_through_the_declared_interface(models, tmp_path):
    """configure's sink_writer names the class the core loads in the driver (check, dataset) and in each worker (the
    writer), through the batched flavour's declared interface: each request's rows, whole, are TransformerLens's; a
    name that is not 'module:Class', or cannot be imported, is refused before any engine starts."""
    spec = {"blocks.0.hook_resid_post": 128}
    with pytest.raises(ValueError, match="sink_writer: expected 'module:Class', got 'nope'"):
        tlh.configure(spec, enable_batching=True, sink_dir=str(tmp_path), sink_writer="nope")
    with pytest.raises(ValueError, match=r"sink_writer 'no_such_module:Writer' cannot be imported \(No module named"):
        tlh.configure(spec, enable_batching=True, sink_dir=str(tmp_path), sink_writer="no_such_module:Writer")
    RecordingWriter.checked.clear(), RecordingWriter.written.clear()
    model, prompts = models["llama"], [BATCH[0], BATCH[2]]
    with engine(model, sites=("resid_pre", "attn_out", "resid_post"), in_process=True, eager=True, batching=True,
                sink_dir=str(tmp_path / "sink"), sink_writer="test_sink:RecordingWriter") as llm:
        outputs = generate(llm, prompts, max_tokens=4)
        dataset = tlh.flush_sink(llm)
    assert RecordingWriter.checked == [str(tmp_path / "sink")] and dataset["directory"] == str(tmp_path / "sink")
    for output, prompt in zip(outputs, prompts):
        rows = dataset[output.request_id]
        tokens = prompt + list(output.outputs[0].token_ids[:-1])  # every token that ran, the last generated never
        assert rows.pop("positions") == list(range(len(tokens)))
        expected = model.reference(tokens, list(rows))
        assert all(relative_error(rows[name], expected[name]) <= TOLERANCE for name in rows), output.request_id



class TestSink:
    """Rows written to disk as requests finish: Llama, eager, in this process (the sink in
    separate processes: TestTensorParallel's and TestServe's), into a 24 MiB filesystem (one that fills:
    TestSinkFullDisk)."""

    @pytest.fixture(scope="class")
    def engine_and_written(self, models, tmp_path_factory):
        """The engine, and a copy of the dataset its first requests wrote, for the tests that damage it:
        written before any test runs a request of its own there, in whatever order they run."""
        with sink_engine(models["llama"], tmp_path_factory.mktemp("sink"), "24m") as llm:
            outputs, _dataset = check_sink_requests(llm, llm.model, MIXED_REQUESTS)
            copy_dir = tmp_path_factory.mktemp("written") / "dataset"
            shutil.copytree(llm.sink_dir, copy_dir)
            yield llm, (outputs, copy_dir)

    @pytest.fixture(scope="class")
    def llm(self, engine_and_written):
        return engine_and_written[0]

    @pytest.fixture(scope="class")
    def written(self, engine_and_written):
        return engine_and_written[1]

    def test_each_request_on_disk_matches_its_own_transformer_lens_run(self, llm, written):
        outputs, directory = written
        shards = [line["shard"] for line in manifest_lines(directory)[1:]]
        assert len(shards) > 1, "256 KiB shards: the requests must fill several"
        header = manifest_lines(directory)[0]
        assert header["model"] == str(llm.model.path) and header["dtype"] == "float32"
        assert set(header["versions"]) == {"vllm", "torch", "tl_vllm_hooks"}
        dataset = tools.CaptureDataset(directory)
        assert len(dataset) == len(outputs) - 1  # the "none" request wrote nothing
        assert all(rows.shape == (2, *dataset.hooks[name]) for name, rows in dataset[outputs[7].request_id].items())
        assert [list(r) for r in dataset.entry(outputs[7].request_id)["positions"]] == [[8, 9], [10, 11]]
        rows = dataset[outputs[0].request_id]  # TransformerLens's shorthand, layers from the end of the header's
        assert header["n_layers"] == 3 and rows["resid_post", -1] is rows["blocks.2.hook_resid_post"]

    def test_later_requests_go_on_in_new_shards(self, llm, written):
        before = tools.CaptureDataset(llm.sink_dir)
        shards = len(manifest_lines(llm.sink_dir)) - 1
        _outputs, dataset = check_sink_requests(llm, llm.model, [(BATCH[2], "prompt", None), (BATCH[1], None, None)])
        assert len(manifest_lines(llm.sink_dir)) - 1 > shards and len(dataset) == len(before) + 2

    def test_read_batched_is_refused_with_where_the_rows_went(self, llm):
        (output,) = generate(llm, [BATCH[0]])
        with pytest.raises(RuntimeError, match="writes captured rows to its sink_dir .*flush_sink"):
            tlh.read_batched(llm, [output.request_id])
        tlh.flush_sink(llm)

    def test_a_shard_cut_short_is_named_and_not_read(self, written, tmp_path):
        directory = tmp_path / "dataset"
        shutil.copytree(written[1], directory)
        shard = directory / manifest_lines(directory)[-1]["shard"]
        os.truncate(shard, shard.stat().st_size - 100)
        with pytest.raises(ValueError, match=f"{re.escape(str(shard))}: .* bytes, but .* lists it with .* cut short"):
            tools.CaptureDataset(directory)

    def test_a_manifest_that_does_not_match_its_shards_is_refused(self, written, tmp_path):
        directory = tmp_path / "dataset"
        shutil.copytree(written[1], directory)
        lines = manifest_lines(directory)
        request_id, entry = next(iter(lines[1]["requests"].items()))
        entry["positions"][0][1] += 1  # one row more than the shard holds
        (directory / "manifest-pp0-tp0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        with pytest.raises(ValueError, match="holds a different row count .* the manifest does not match its shards"):
            tools.CaptureDataset(directory)[request_id]

    def test_a_manifest_line_cut_short_claims_nothing(self, written, tmp_path):
        directory = tmp_path / "dataset"
        shutil.copytree(written[1], directory)
        manifest = directory / "manifest-pp0-tp0.jsonl"
        text = manifest.read_text()
        last = text.splitlines()[-1]
        manifest.write_text(text[: -len(last) - 1] + last[: len(last) // 2])  # a crash mid-append
        lost = set(json.loads(last)["requests"])
        dataset = tools.CaptureDataset(directory)
        assert lost and not lost & set(dataset) and len(dataset) == len(tools.CaptureDataset(written[1])) - len(lost)
        manifest.write_text(text.replace(last, last[: len(last) // 2], 1) + "\n")  # damaged, not cut short
        with pytest.raises(ValueError, match="line .* is not JSON: the manifest is damaged"):
            tools.CaptureDataset(directory)

    def test_a_directory_of_other_hooks_is_refused_before_an_engine_starts(self, written):
        with pytest.raises(ValueError, match="holds captures of other hooks or another dtype"):
            tlh.configure({"blocks.0.hook_resid_post": (128,)}, enable_batching=True, sink_dir=str(written[1]))


class TestSinkFullDisk:
    """A sink whose disk fills: Llama, eager, in this process, into an 8 MiB filesystem (an engine of its own: a
    writer that failed writes no more, which no other test should meet)."""

    @pytest.fixture(scope="class")
    def llm(self, models, tmp_path_factory):
        with sink_engine(models["llama"], tmp_path_factory.mktemp("full"), "8m") as llm:
            yield llm

    def test_a_full_disk_keeps_what_was_written_and_says_what_was_not(self, llm):
        generate(llm, [BATCH[0], BATCH[2]])
        before = tlh.flush_sink(llm)
        first = before[before.request_ids[0]]
        long_prompts = [[(7 * i + r) % 512 for i in range(300)] for r in range(8)]  # ~40 MiB of rows
        generate(llm, long_prompts)
        with pytest.raises(RuntimeError, match=r"flush_sink: writing .*\.partial failed \(\[Errno 28\] No space left"):
            tlh.flush_sink(llm)
        after = tools.CaptureDataset(llm.sink_dir)
        assert set(before) <= set(after) and len(after) < len(before) + len(long_prompts)
        assert all(torch.equal(first[name], after[before.request_ids[0]][name]) for name in first)
        assert not list(llm.sink_dir.glob("*.partial")), "the shard being written is removed"
        (status,) = tlh.status(llm)["sink"]
        assert status["lost"] > 0 and "No space left" in status["error"]


@NO_ENGINE
def test_a_writer_goes_on_after_the_whole_shards_and_drops_the_rest(tmp_path):
    """The shard writer alone, on CPU tensors: three shards, the second then cut short and
    a fourth left half-written; a new writer on the directory keeps shards 1 and 3, removes
    the rest, and numbers its next shard 4."""
    config = tlh.CaptureConfig({"blocks.0.hook_resid_post": (4,)}, enable_batching=True, sink_dir=str(tmp_path))
    header = {
        **tools.sink_header(config), "writer": "pp0-tp0", "model": "m", "versions": {"vllm": "v"},
        "writes": ["blocks.0.hook_resid_post"], "shards": {},
    }
    rows = {f"r{i}": torch.arange(12.0).reshape(3, 4) + i for i in range(4)}

    def write(writer, request_id):
        entry = {"prompt_token_ids": [1, 2, 3], "positions": [[0, 3]]}
        writer.write(request_id, entry, [("blocks.0.hook_resid_post", [3, 4], [rows[request_id][:1], rows[request_id][1:]])])

    writer = tools.ShardWriter(str(tmp_path), "pp0-tp0", header, shard_bytes=1)  # a shard per request
    for request_id in ("r0", "r1", "r2"):
        write(writer, request_id)
    writer.close()
    assert [line["shard"] for line in manifest_lines(tmp_path)[1:]] == [
        f"shard-pp0-tp0-00000{n}.safetensors" for n in (1, 2, 3)
    ]
    os.truncate(tmp_path / "shard-pp0-tp0-000002.safetensors", 100)
    (tmp_path / "shard-pp0-tp0-000004.safetensors.partial").write_bytes(b"rows of a killed engine")
    writer = tools.ShardWriter(str(tmp_path), "pp0-tp0", header, shard_bytes=1)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-pp0-tp0-000001.safetensors", "shard-pp0-tp0-000003.safetensors"
    ]
    write(writer, "r3")
    writer.close()
    dataset = tools.CaptureDataset(tmp_path)
    assert dataset.request_ids == ["r0", "r2", "r3"] and "r1" not in dataset
    assert manifest_lines(tmp_path)[-1]["shard"] == "shard-pp0-tp0-000004.safetensors"
    for request_id in dataset:
        assert torch.equal(dataset[request_id]["blocks.0.hook_resid_post"], rows[request_id])
    with pytest.raises(ValueError, match="was written with another model"):
        tools.ShardWriter(str(tmp_path), "pp0-tp0", {**header, "model": "other"}, shard_bytes=1)


@NO_ENGINE
def test_a_shard_open_shard_seconds_closes_without_a_flush(tmp_path):
    """A server's writer: its shard closes by age, and a reader waiting for the request gets it."""
    config = tlh.CaptureConfig({"blocks.0.hook_resid_post": (4,)}, enable_batching=True, sink_dir=str(tmp_path))
    header = {
        **tools.sink_header(config), "writer": "pp0-tp0", "model": "m", "versions": {"vllm": "v"},
        "writes": ["blocks.0.hook_resid_post"], "shards": {},
    }
    writer = tools.ShardWriter(str(tmp_path), "pp0-tp0", header, shard_bytes=1 << 30, shard_seconds=0.3)
    rows = torch.arange(8.0).reshape(2, 4)
    writer.write("cmpl-7-0-0123abcd", {"prompt_token_ids": [5, 6], "positions": [[0, 2]]}, [("blocks.0.hook_resid_post", [2, 4], [rows])])
    with pytest.raises(TimeoutError, match=r"no whole rows of \['cmpl-8-0'\]"):
        tools.CaptureDataset.wait(str(tmp_path), ["cmpl-8-0"], timeout=0.1)
    started = time.monotonic()
    dataset = tools.CaptureDataset.wait(str(tmp_path), ["cmpl-7-0"], timeout=10)
    assert 0.2 < time.monotonic() - started < 5, "closed by age, not at once and not never"
    assert torch.equal(dataset["cmpl-7-0"]["blocks.0.hook_resid_post"], rows)
    # A request the workers refused is on disk with the reason, raised when it is read.
    writer.write("cmpl-9-0-89abcdef", {"prompt_token_ids": [5], "positions": [], "error": "its options were refused: x"}, [])
    with pytest.raises(RuntimeError, match="'cmpl-9-0': its options were refused: x"):
        tools.CaptureDataset.wait(str(tmp_path), ["cmpl-9-0"], timeout=10)["cmpl-9-0"]
    writer.close()
    # Both shards are small: each takes about its rows' size (32 bytes, none), not the header's reserve (64 KiB).
    shards = sorted(glob.glob(str(tmp_path / "shard-*.safetensors")))
    assert len(shards) == 2 and all(os.path.getsize(shard) < 1024 for shard in shards), [os.path.getsize(s) for s in shards]
    from safetensors import safe_open

    with safe_open(shards[0], "pt") as opened:
        assert torch.equal(opened.get_tensor("cmpl-7-0-0123abcd/blocks.0.hook_resid_post"), rows), "readable by safetensors alone"


@NO_ENGINE
def test_configure_on_a_sink_dir_holding_a_dataset_warns_that_it_adds_to_it(tmp_path):
    """A script run again into its sink_dir goes on with the dataset there, as a crashed run does, and says so once,
    when configured, with how many whole requests are there; an empty directory is configured without a word."""
    specs = {"blocks.0.hook_resid_post": (4,)}

    def configure():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = tlh.configure(specs, enable_batching=True, sink_dir=str(tmp_path))
        return config, [w for w in caught if str(tmp_path) in str(w.message)]

    config, said = configure()
    assert said == [], "an empty directory: nothing to say"
    writer = shard_writer(config)  # a shard per request
    for request_id in ("0-8e6792c5", "1-0123abcd", "2-89abcdef"):
        write_request(writer, config, request_id, torch.ones(3, 4))
    writer.close()
    os.truncate(tmp_path / "shard-pp0-tp0-000003.safetensors", 100)  # a crash's: not counted, the workers drop it
    _config, said = configure()
    assert len(said) == 1 and said[0].category is UserWarning, said
    assert said[0].filename == __file__, "pointing at the configure call"
    assert str(said[0].message).startswith(
        f"sink_dir: {tmp_path} already holds 2 requests an earlier engine wrote; this engine adds its requests to them"
    ), str(said[0].message)


@NO_ENGINE
def test_capture_into_a_directory_holding_every_prompt_starts_no_engine(tmp_path, models, capfd, monkeypatch):
    """The capture command run again on the directory it finished says there is nothing to do, without an engine;
    one more prompt starts one."""
    import vllm

    model = str(models["llama"].path)
    out = tmp_path / "acts"
    specs = tlh.capture_specs(models["llama"].hf.config, sites=("resid_post",))
    config = tlh.configure(specs, 2048, torch.float32, enable_batching=True, sink_dir=str(out))  # the command's
    writer = shard_writer(config, model=model, versions=tools.versions(), shard_bytes=1 << 20)
    for request_id in ("prompt-1-0123abcd", "prompt-2-89abcdef"):
        write_request(writer, config, request_id, torch.ones(3, 128))
    writer.close()

    def started(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(vllm, "LLM", started)
    arguments = ["capture", model, "--token-ids", "1 2 3", "--token-ids", "4 5 6", "--out", str(out)]
    capfd.readouterr()  # (what building the model printed)
    assert tools.main(arguments) == 0
    assert capfd.readouterr().out == (
        f"capture: {out} holds all 2 prompts already (2 requests of {model}); nothing to do, no engine started\n"
    )
    with pytest.raises(AssertionError, match="an engine was started"):
        tools.main([*arguments, "--token-ids", "7 8"])


@NO_ENGINE
def test_configure_refuses_a_sink_dir_it_cannot_write(tmp_path):
    with small_filesystem(tmp_path / "read-only", "1m", read_only=True) as directory:
        with pytest.raises(ValueError, match=f"sink_dir: cannot write to {directory}: Read-only file system"):
            tlh.configure({"blocks.0.hook_resid_post": (128,)}, enable_batching=True, sink_dir=str(directory))


def test_the_sinks_row_files_are_filled_again_once_written(models, tmp_path):
    """The writer thread gives a row file back once it has written the rows in it, so later steps fill it again
    rather than make (and on CUDA pin) a new one: three rounds of 20 MB of rows each, more than the first row file's
    16 MiB, where no step makes a file itself (each is made ahead, the first when the hooks go in). Llama eager in
    this process."""
    with engine(models["llama"], in_process=True, eager=True, batching=True, sink_dir=str(tmp_path / "acts")) as llm:
        made = []
        for _round in range(3):
            generate(llm, [BATCH[1]] * 5, 1)  # 1,500 prompt rows of the classic sites' 14 KiB
            tlh.flush_sink(llm)
            (files,) = tlh.status(llm)["row_files"]
            made.append(files["made_in_step"])
        dataset = tools.CaptureDataset(tmp_path / "acts")
        assert len(dataset) == 15 and all(dataset[r]["blocks.2.hook_resid_post"].shape == (300, 128) for r in dataset)
    assert made == [0, 0, 0], f"row files steps made themselves by the end of each round: {made}"
