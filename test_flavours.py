"""Both flavours in both engine layouts: the one-prompt flavour's capture and edits, the batched flavour's requests
(rows kept whole across chunked prefill, preemption and decode; their ids; the row files they travel in), AsyncLLM,
and tensor and pipeline parallelism, against TransformerLens 4.3's bridge.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import logging
import os
import re
import socket
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools
from conftest import (  # the shared engines, oracles and helpers
    BATCH, BF16_TOLERANCE, EDIT, MAX_TOKENS_PER_FORWARD, MIXED_REQUESTS, NO_ENGINE, PROMPT, SAE_PROMPTS, SAE_TOP_K,
    TOLERANCE, TWO_GPUS, assert_features, assert_matches, bf16_reference, capture, check_batched,
    check_every_site_edit, check_every_site_edit_per_request, check_logit_lens, check_mixed_requests, engine,
    engine_arguments, features, fired, generate, kept_rows, relative_error, shard_writer, take_rows, write_request,
)


def dead_workers_row_file() -> Path:
    """A row file in /dev/shm as a worker killed before its driver mapped it leaves it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = Path(f"/dev/shm/tl_vllm_hooks-{int(dead.stdout)}-0")
    path.write_bytes(b"rows")
    return path


@pytest.fixture(scope="module")
def async_engine(models):
    """An AsyncLLM (separate processes, eager) with the batched hooks on every Llama site and
    vLLM's prefix caching on, 32-token blocks (the CPU's smallest); `engine.run(coroutine)` runs on its event loop."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = models["llama"]
    config = tlh.configure(
        tlh.capture_specs(model.hf.config, sites=model.classic_sites), MAX_TOKENS_PER_FORWARD, enable_batching=True
    )
    loop = asyncio.new_event_loop()
    arguments = {**engine_arguments(), "enforce_eager": True, **config.llm_kwargs}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(str(model.path), **{**arguments, "enable_prefix_caching": True, "block_size": 32}))
    engine.config, engine.model, engine.run = config, model, loop.run_until_complete
    try:
        yield engine
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))  # the output handler's cancellation
        loop.close()
        del engine
        gc.collect()


async def run_request(engine, prompt, request_id, options=None, max_tokens=3):
    """The final RequestOutput of one greedy request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=2, extra_args=options)
    async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        final = output
    return final


@NO_ENGINE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensor_wire_format_is_exact(dtype):
    tensor = (torch.randn(5, 3) * 1000).to(dtype)
    decoded = tlh.decode_tensor(tlh.encode_tensor(tensor))
    assert decoded.dtype == dtype and torch.equal(decoded, tensor)


@NO_ENGINE
def test_tensor_wire_format_rejects_truncated_data():
    message = tlh.encode_tensor(torch.ones(4))
    message["data"] = message["data"][:-1]
    with pytest.raises(ValueError, match="15 bytes"):
        tlh.decode_tensor(message)


@NO_ENGINE
def test_rows_without_n_layers_refuse_what_needs_it_by_name():
    rows = tlh.ActivationRows({f"blocks.{i}.hook_resid_pre": torch.full((2, 4), float(i)) for i in range(2)})
    assert rows["resid_pre", 1] is rows["blocks.1.hook_resid_pre"]
    assert rows.accumulated_resid(layer=1).shape == (2, 2, 4)
    with pytest.raises(KeyError, match="a layer from the end needs n_layers"):
        rows["resid_pre", -1]
    for method in (rows.accumulated_resid, rows.decompose_resid):
        with pytest.raises(ValueError, match="every layer needs n_layers"):
            method()


@NO_ENGINE
def test_request_ids_join_exactly():
    match = tlh._match_request_ids
    assert match(["1", "11"], ["11-0123abcd", "1-89abcdef"], {}) == {"1": "1-89abcdef", "11": "11-0123abcd"}
    assert match(["a-b"], ["a-b"], {}) == {"a-b": "a-b"}
    with pytest.raises(KeyError, match="no captured request"):
        match(["2"], ["1-0123abcd"], {})
    with pytest.raises(KeyError, match="several"):
        match(["1"], ["1-0123abcd", "1-89abcdef"], {})


@NO_ENGINE
def test_read_batched_errors_name_the_users_ids_and_a_second_read():
    """The ids in a refused read's message are those the user passes (vLLM's suffix dropped), and a request whose
    rows were read is said to be, rather than unknown."""
    match = tlh._match_request_ids
    with pytest.raises(KeyError, match=re.escape("no captured request; unread: ['1', '5']")):
        match(["2"], ["5-0123abcd", "1-89abcdef"], {})
    with pytest.raises(KeyError, match=re.escape("id '1': already read: a request's rows are handed over once")):
        match(["1"], ["5-0123abcd"], {"1-89abcdef": None, "1": None})
    assert match(["1"], ["1-0123abcd"], {"1-89abcdef": None, "1": None}) == {"1": "1-0123abcd"}, "a new request, '1' again"


@NO_ENGINE
def test_step_collection_keeps_each_requests_rows():
    """The batched flavour's per-step bookkeeping on hand-made steps, no engine: which rows each
    request keeps, across chunks, decode steps, a preemption and prefix-cache gaps."""
    
    buffer = torch.zeros(32, 2)
    config = tlh.CaptureConfig({"h": ("model.layers.0", 2)}, 32, enable_batching=True)
    text_config = types.SimpleNamespace(get_text_config=lambda: None)
    engine = tlh._EngineFacts(torch.nn.Linear(1, 1), text_config, 32, 8, False, torch.device("cpu"), torch.float32,
                              None, False, False)
    hook = types.SimpleNamespace(buffer=buffer, width=2, row_shape=(2,), keeps_rows=True, sae=None)
    state = tlh._Batched(config, engine, {"h": hook}, [])
    def plan(prompt_len, capture):
        return tlh._RunningRequest(tlh._RequestOptions(capture), prompt_len, None, 0)

    state.running.update({
        "A": plan(6, "prompt"),
        "B": plan(4, "last_prompt_token"),
        "C": plan(3, np.array([1, 5])),
        "G": plan(3, "last_prompt_token"),
        "N": plan(2, "none"),
        "H": plan(6, "last_prompt_token"),
    })  # D, E and F have no options: every row
    for request, running in state.running.items():
        state.request_table.add(request, running.options.kept_range(running.prompt_len), False)

    def step(number, layout):
        """layout: (request id, first position, rows) in row order."""
        counts = np.array([rows for _, _, rows in layout])
        starts = np.concatenate([[0], np.cumsum(counts)])
        first = np.array([position for _, position, _ in layout])
        request_ids = [request for request, _, _ in layout]
        requests = state.request_table.of_step(request_ids, tlh._RequestOptions("all").kept_range(0))
        state.step = tlh._StepLayout(starts, first, requests)
        owners = np.repeat(np.arange(len(layout)), counts)
        buffer.zero_()
        buffer[: starts[-1], 0] = torch.from_numpy(state.step.row_positions).float()  # what the row is ...
        buffer[: starts[-1], 1] = torch.from_numpy(1000 * number + owners).float()  # ... and when, whose
        state.executed()
        return state.step.requests

    step(1, [("A", 0, 4), ("B", 0, 4), ("C", 0, 3), ("D", 0, 2), ("F", 2, 2), ("N", 0, 2), ("H", 4, 2)])
    step(2, [("A", 4, 2), ("B", 4, 1), ("E", 0, 0), ("C", 3, 1), ("D", 2, 1), ("G", 4, 1)])
    step(3, [("A", 6, 1), ("C", 4, 1), ("D", 3, 1)])
    step(4, [("C", 5, 1), ("D", 1, 4)])  # D preempted after position 3, recomputed from 1
    # Decode steps of the same requests reuse what the table gave the last one, and still see a recomputation.
    decoding = step(5, [("C", 6, 1), ("D", 5, 1)])
    assert step(6, [("C", 7, 1), ("D", 6, 1)]) is decoding
    assert step(7, [("C", 8, 1), ("D", 2, 1)]) is decoding  # D preempted after position 6, recomputed from 2
    state.request_table.remove("N")
    assert step(8, [("C", 9, 1), ("D", 3, 1)]) is not decoding, "a request removed: its entry may be reused"

    def kept(request):
        rows = torch.cat(state.records[request].rows("h"))
        return rows[:, 0].int().tolist(), (rows[:, 1] // 1000).int().tolist()

    assert kept("A") == ([0, 1, 2, 3, 4, 5], [1, 1, 1, 1, 2, 2])
    assert kept("B") == ([3], [1])
    assert kept("C") == ([1, 5], [1, 4])
    assert kept("D") == ([0, 1, 2, 3], [1, 4, 7, 8])  # each position once, the recomputed rows
    assert kept("H") == ([5], [1]), "a cached prefix before the one row it keeps takes nothing from it"
    assert set(state.records) == {"A", "B", "C", "D", "F", "H"}
    assert set(state.incomplete) == {"F", "G"} and "prefix caching" in state.incomplete["G"]
    next_positions = {r: int(state.request_table.next_position[e]) for r, e in state.request_table.index.items()}
    assert next_positions == {"A": 7, "B": 5, "C": 10, "D": 4, "E": 0, "F": 4, "G": 5, "H": 6}
    files = list(state.shared.files)
    assert files and all(os.path.exists(path) for path in files), "the rows sit in the worker's row files"
    state.close()
    assert not any(os.path.exists(path) for path in files), "and go with the hooks"


@NO_ENGINE
def test_row_files_are_made_ahead_of_the_steps_that_fill_them():
    """The first file is made ahead when the hooks go in, for the largest step the engine can run, and the next, on a
    thread of its own, as soon as the file being filled has less room left than that: no step makes one itself, even
    while every file is held (rows not yet read), and after the idle files are removed one is made ahead again. Only
    a step larger than that (one past a quarter of /dev/shm's free room) makes a file itself, and the idle files too
    small for it, the one made ahead among them, are removed."""
    others = set(glob.glob(f"/dev/shm/tl_vllm_hooks-{os.getpid()}-*"))  # an in-process engine's, alive in this worker
    shared = tlh._SharedRows(pin=False, wait=None)
    mb = 1 << 20
    try:
        shared.begin(12 * mb)  # each step at most 12 MiB: the 16 MiB file made ahead
        assert len(shared.next_file) == 1 and shared.status() == {"files": 1, "bytes": 16 * mb, "created": 1,
                                                                  "made_in_step": 0}
        first, pages = shared.region(10 * mb)  # 6 MiB left, less than a step: the next is begun
        assert pages.numel() == 10 * mb and shared.status()["made_in_step"] == 0 and len(shared.next_file) == 1
        held = [first]
        shared.hold(first)
        for nbytes in [12 * mb, 9 * mb, 12 * mb, 11 * mb, 1 * mb] * 4:
            file, pages = shared.region(nbytes)
            shared.hold(file)  # rows of this step, until read
            held.append(file)
            assert pages.numel() == nbytes and pages.data_ptr() % 64 == 0
        status = shared.status()
        assert status["made_in_step"] == 0 and len(set(held)) >= 4, (status, len(set(held)))
        assert status["created"] == len(set(held)) + len(shared.next_file), "the files filled, and any made ahead"
        for file in held:
            shared.drop(file)  # read
        shared.trim()
        assert not shared.files and len(shared.next_file) == 1, "the idle files removed, one made ahead again"
        again, _pages = shared.region(12 * mb)
        assert shared.status()["made_in_step"] == 0 and again.pages.numel() >= 12 * mb
        shared.hold(again)
        shared.drop(again)
        big, _pages = shared.region(300 * mb)  # past begin's bound (a bound /dev/shm's room capped)
        assert shared.status()["made_in_step"] == 1 and big.pages.numel() == 300 * mb
        assert list(shared.files.values()) == [big], "the idle files too small for it are removed"
    finally:
        shared.close()
    assert shared.status()["files"] == 0 and set(glob.glob(f"/dev/shm/tl_vllm_hooks-{os.getpid()}-*")) <= others


@NO_ENGINE
def test_request_table_reuses_entries_and_keeps_values_as_it_grows():
    table = tlh._RequestTable()
    ids = [f"r{i}" for i in range(150)]  # past the first 64 entries and the next 64
    for i, request in enumerate(ids):
        table.add(request, (i, i + 1), i % 2 == 0)
    entries = table.entries(ids, tlh._RequestOptions("all").kept_range(0))
    assert sorted(entries.tolist()) == list(range(150))
    assert table.kept_first[entries].tolist() == list(range(150))
    assert table.has_edits[entries].tolist() == [1 - i % 2 for i in range(150)]
    table.next_position[entries] = 7
    for request in ids[:10]:
        table.remove(request)
    (reused,) = table.entries(["new"], tlh._RequestOptions("all").kept_range(0))  # not added: keeps the default
    assert reused in entries[:10] and table.next_position[reused] == 0
    assert (table.kept_first[reused], table.kept_last[reused]) == tlh._RequestOptions("all").kept_range(0)
    again = table.add(ids[20], (3, 4), False)  # added again: its position carries on
    assert again == entries[20] and table.next_position[again] == 7 and table.kept_first[again] == 3


# --- one-prompt flavour --------------------------------------------------------


def capture_under_edits(llm, edits: dict) -> dict:
    """PROMPT's rows with these engine-wide edits set, reset afterwards whatever happens."""
    tlh.set_edits(llm, edits)
    try:
        return capture(llm, PROMPT)
    finally:
        tlh.reset_edits(llm)


class TestOnePrompt:
    """The one-prompt flavour: Llama torch.compiled (inductor) with the engine core in this
    process, Qwen2 eager in vLLM's default separate processes (a compile in a spawned
    worker costs ~60 s; the one-prompt flavour is compiled in spawned workers by
    test_parallel_layout_matches_one_device[tp2-one-prompt] and examples/steer.py and parity.py)."""

    @pytest.fixture(scope="class", params=[("llama", True, False), ("qwen2", False, True)],
                    ids=lambda p: f"{p[0]}-{'in-process' if p[1] else 'separate'}")
    def llm(self, request, models):
        family, in_process, eager = request.param
        with engine(models[family], in_process=in_process, eager=eager) as llm:
            llm.model = models[family]
            yield llm

    @pytest.fixture(scope="class")
    def baseline(self, llm):
        tlh.reset_edits(llm)
        return capture(llm, PROMPT)

    def test_every_hook_matches_transformer_lens(self, llm, baseline, request):
        worst = assert_matches(baseline, llm.model.reference(PROMPT, llm.hook_names), request.node.name)
        print(f"\n{request.node.name}: worst relative error {worst:.2e}")

    def test_an_edit_at_each_site_matches_transformer_lens(self, llm, baseline):
        check_every_site_edit(llm, llm.model, baseline)

    def test_no_hook_is_absent(self, llm):
        assert tlh.status(llm)["absent"] == []

    @pytest.mark.parametrize(
        "hook, edit",
        [
            ("blocks.0.hook_resid_post", {"op": "scale", "value": 0.5}),
            ("blocks.1.hook_attn_out", {"op": "suppress"}),
            ("blocks.0.hook_mlp_out", {"op": "add", "value": "vector"}),
            ("hook_embed", {"op": "set", "value": 0.25}),
            ("blocks.1.hook_resid_post", {"op": "set", "value": "vector"}),
        ],
    )
    def test_edit_matches_transformer_lens_with_the_same_edit(self, llm, baseline, hook, edit):
        if edit.get("value") == "vector":
            edit = {**edit, "value": torch.linspace(-1.0, 1.0, 128)}
        edited = capture_under_edits(llm, {hook: edit})
        expected = llm.model.reference(PROMPT, llm.hook_names, {hook: edit})
        assert_matches(edited, expected, f"edit {edit['op']} at {hook}")
        final = "ln_final.hook_normalized"
        assert relative_error(edited[final], baseline[final]) > 1e-3, "the edit changed nothing downstream"

    def test_reset_restores_unedited_values_bit_for_bit(self, llm, baseline):
        tlh.set_edits(llm, {"blocks.0.hook_attn_out": {"op": "scale", "value": 3.0}})
        capture(llm, PROMPT)
        tlh.reset_edits(llm)
        after = capture(llm, PROMPT)
        for name in baseline:
            assert torch.equal(after[name], baseline[name]), f"{name} differs after reset"

    def test_position_edit_touches_only_its_rows(self, llm, baseline):
        hook, positions = "blocks.0.hook_resid_post", [3, 17]
        edit = {"op": "add", "value": torch.full((128,), 0.5), "positions": positions}
        edited = capture_under_edits(llm, {hook: edit})
        expected = llm.model.reference(PROMPT, llm.hook_names, {hook: edit})
        assert_matches(edited, expected, "position edit")
        for name in baseline:
            assert torch.equal(edited[name][:3], baseline[name][:3]), f"{name}: rows before 3 changed"
        changed = (edited[hook] != baseline[hook]).any(dim=1).nonzero().flatten().tolist()
        assert changed == positions, f"{hook}: rows {changed} changed, expected {positions}"

    def test_multi_token_generate_keeps_prompt_rows_and_fires_once_per_forward(self, llm, baseline):
        tlh.reset_fire_counts(llm)
        kept = capture(llm, PROMPT, max_tokens=5)
        counts = tlh.read_fire_counts(llm)
        for name in baseline:
            assert torch.equal(kept[name], baseline[name]), f"{name}: decode steps overwrote rows"
        assert set(counts.values()) == {5}, f"one prefill + 4 decode forwards, got {counts}"

    def test_position_edit_reaches_generated_tokens(self, llm):
        # The first generated token sits at position len(PROMPT): suppressing the
        # final norm there makes every logit 0, so greedy sampling picks token 0.
        (plain,) = generate(llm, [PROMPT], max_tokens=3)
        tokens = list(plain.outputs[0].token_ids)
        edit = {"op": "suppress", "positions": [len(PROMPT) + 1]}
        tlh.set_edits(llm, {"ln_final.hook_normalized": edit})
        try:
            (edited,) = generate(llm, [PROMPT], max_tokens=3)
        finally:
            tlh.reset_edits(llm)
        assert tokens[:2] == list(edited.outputs[0].token_ids)[:2]
        assert list(edited.outputs[0].token_ids)[2] == 0 != tokens[2], (tokens, edited.outputs[0].token_ids)

    @pytest.mark.parametrize(
        "edits, message",
        [
            ({"blocks.0.hook_resid_pst": {"op": "suppress"}}, "close matches"),
            ({"blocks.0.hook_resid_post": {"op": "zero"}}, "not one of"),
            ({"blocks.0.hook_resid_post": {"value": 1.0}}, "'op'"),
            ({"blocks.0.hook_resid_post": {"op": "add"}}, "needs a 'value'"),
            ({"blocks.0.hook_resid_post": {"op": "suppress", "value": 1.0}}, "takes no 'value'"),
            ({"blocks.0.hook_resid_post": {"op": "add", "value": 1.0, "pos": [1]}}, "keys must be"),
            ({"blocks.0.hook_resid_post": {"op": "add", "value": torch.ones(127)}}, r"shape \[128\], got shape \[127\]"),
            ({"blocks.0.hook_resid_post": {"op": "scale", "value": float("inf")}}, "NaN or infinite"),
            ({"blocks.0.hook_resid_post": {"op": "scale", "value": False}}, "finite number"),
            ({"blocks.0.hook_resid_post": {"op": "suppress", "positions": [-1]}}, "ints >= 0"),
            ({"blocks.0.hook_resid_post": {"op": "suppress", "positions": [128]}}, "must be < 128"),
        ],
    )
    def test_bad_edit_is_refused_and_engine_still_serves(self, llm, baseline, edits, message):
        with pytest.raises(ValueError, match=message):
            tlh.set_edits(llm, edits)
        after = capture(llm, PROMPT)
        assert torch.equal(after["ln_final.hook_normalized"], baseline["ln_final.hook_normalized"])

    def test_logits_of_the_rows_read_match_transformer_lens(self, llm, baseline):
        """unembed on the one-prompt flavour's rows: hook_unembed from the last layer's hook_resid_post, and from
        the final norm's input normalized with the norm's weight applied here (apply_ln=False), top 3 of each."""
        last = llm.model.bridge.cfg.n_layers - 1
        with torch.no_grad():
            logits = llm.model.bridge.run_with_cache(torch.tensor([PROMPT]), names_filter=[])[0][0]
        normalized = baseline["ln_final.hook_normalized"] * llm.model.hf.model.norm.weight.detach()
        for rows, apply_ln in ((baseline[f"blocks.{last}.hook_resid_post"], True), (normalized, False)):
            assert_matches({"unembed": tlh.unembed(llm, rows, apply_ln=apply_ln)}, {"unembed": logits})
            best = tlh.unembed(llm, rows[None, :5], top_k=3, apply_ln=apply_ln)
            assert best.values.shape == best.indices.shape == (1, 5, 3) and best.indices.dtype == torch.int64
            assert torch.equal(best.indices[0], logits[:5].topk(3).indices)

    @pytest.mark.parametrize(
        "rows, options, message",
        [
            ([0.0] * 128, {}, "float tensor"),
            (torch.ones(3, 128, dtype=torch.int64), {}, "float tensor"),
            (torch.ones(3, 127), {}, "rows of 127, but this model's residual stream is 128 wide"),
            (torch.tensor([[float("nan")] * 128]), {}, "NaN or infinite"),
            (torch.ones(3, 128), {"top_k": True}, "top_k must be an int from 0"),
            (torch.ones(3, 128), {"top_k": 10**6}, "top_k must be an int from 0"),
            (torch.ones(3, 128), {"apply_ln": 1}, "apply_ln must be True or False"),
        ],
    )
    def test_bad_rows_to_unembed_are_refused_before_any_worker_runs(self, llm, rows, options, message):
        with pytest.raises(ValueError, match=message):
            tlh.unembed(llm, rows, **options)

    def test_logit_lens_needs_residual_stream_rows(self, llm, baseline):
        with pytest.raises(ValueError, match="rows hold no residual-stream hook"):
            tlh.logit_lens(llm, {"ln_final.hook_normalized": baseline["ln_final.hook_normalized"]})

    def test_reading_more_rows_than_the_buffer_is_refused(self, llm):
        with pytest.raises(ValueError, match="num_rows must be an int in"):
            tlh.read_captures(llm, MAX_TOKENS_PER_FORWARD + 1)

    def test_reading_past_the_rows_the_forward_wrote_is_refused(self, llm):
        """Reading 6 rows after a 5-token prompt returned a sixth row that forward never wrote (stale or zero)."""
        first = capture(llm, PROMPT[:5])["blocks.0.hook_resid_post"]
        with pytest.raises(ValueError, match="wrote 5 rows .* read at most 5"):
            tlh.read_captures(llm, 6)
        assert torch.equal(tlh.read_captures(llm, 3)["blocks.0.hook_resid_post"], first[:3])

    def test_reading_before_any_forward_is_refused(self, llm):
        tlh.open_capture(llm)
        with pytest.raises(RuntimeError, match="no forward ran since open_capture"):
            tlh.read_captures(llm, len(PROMPT))
        generate(llm, [PROMPT])

    def test_two_prompts_in_one_generate_are_refused_when_read(self, llm):
        """Two prompts after one open_capture ran in one forward, and a read returned both prompts' rows joined as
        one sequence. (An engine in separate processes may schedule the second prompt a step later: then the read
        says a request started after the armed forward.)"""
        tlh.open_capture(llm)
        generate(llm, [PROMPT[:5], PROMPT[5:7]])
        with pytest.raises(RuntimeError, match="(ran 2 requests at once.*one prompt after each open_capture|1 requests "
                           "started after it .*or another prompt of the same one.*one prompt each).*enable_batching"):
            tlh.read_captures(llm, 7)
        capture(llm, PROMPT[:5])  # one prompt again: read as before

    def test_a_read_after_a_generate_that_no_open_capture_armed_is_refused(self, llm):
        """A generate with no open_capture before it left the armed forward's rows, which a read returned as if
        they were its own."""
        first = capture(llm, PROMPT[:5])["blocks.0.hook_resid_post"]
        assert torch.equal(tlh.read_captures(llm, 5)["blocks.0.hook_resid_post"], first), "a second read of it"
        generate(llm, [PROMPT[10:15]])
        with pytest.raises(RuntimeError, match="1 requests started after it.*call open_capture right before the "
                           "generate whose rows you want"):
            tlh.read_captures(llm, 5)
        other = capture(llm, PROMPT[10:15])["blocks.0.hook_resid_post"]
        assert not torch.equal(other, first)


class TestBatched:
    """The batched flavour: Llama eager in separate processes and compiled in this process,
    Qwen2 eager in this process."""

    @pytest.fixture(
        scope="class",
        params=[("llama", False, True), ("llama", True, False), ("qwen2", True, True)],
        ids=lambda p: f"{p[0]}-{'in-process' if p[1] else 'separate'}-{'eager' if p[2] else 'compiled'}",
    )
    def llm(self, request, models):
        family, in_process, eager = request.param
        stale_file = dead_workers_row_file()
        with engine(models[family], in_process=in_process, eager=eager, batching=True) as llm:
            llm.model = models[family]
            llm.stale_file = stale_file
            llm.in_process = in_process
            yield llm

    def test_each_request_matches_its_own_transformer_lens_run(self, llm, request):
        worst = check_batched(llm, llm.model, max_tokens=5)
        print(f"\n{request.node.name}: worst relative error {worst:.2e}")

    def test_an_edit_at_each_site_per_request_matches_transformer_lens(self, llm):
        check_every_site_edit_per_request(llm, llm.model)

    def test_edit_applies_to_every_request(self, llm):
        check_batched(llm, llm.model, {"blocks.0.hook_mlp_out": {"op": "scale", "value": -2.0}})

    def test_many_requests_each_add_their_own_vector_in_their_own_slot(self, llm):
        """20 requests, each adding a vector of its own at blocks.1.hook_resid_post (at every position, or at its
        listed positions for every third), through 8 slots (max_num_seqs) that finished requests give back: each
        request's rows there are the unedited rows plus its own vector, and the edit outlives no request."""
        name = "blocks.1.hook_resid_post"
        prompts = [[(7 * i + 3 * n + 1) % 512 for i in range(5 + n % 7)] for n in range(20)]
        vectors = torch.randn(20, 128, generator=torch.Generator().manual_seed(0))
        edits = [{name: {"op": "add", "value": vectors[n], **({"positions": [1, 3]} if n % 3 == 0 else {})}}
                 for n in range(20)]
        plain = generate(llm, prompts, 3)
        edited = generate(llm, prompts, 3, [tlh.request_args(llm.config, "prompt", edit) for edit in edits])
        rows = tlh.read_batched(llm, [output.request_id for output in plain + edited])
        for n, (before, after) in enumerate(zip(plain, edited)):
            added = rows[after.request_id][name] - rows[before.request_id][name][: len(prompts[n])]
            at = [1, 3] if n % 3 == 0 else list(range(len(prompts[n])))
            expected = torch.zeros_like(added)
            expected[at] = vectors[n]
            assert torch.allclose(added, expected, atol=1e-5), f"request {n}: another request's vector, or none"
        again = generate(llm, prompts[:1], 3)
        assert again[0].outputs[0].token_ids == plain[0].outputs[0].token_ids, "an edit outlived its request"
        tlh.reset_batched(llm)

    def test_position_edit_in_batch(self, llm):
        edits = {"blocks.1.hook_attn_out": {"op": "add", "value": torch.linspace(-1, 1, 128), "positions": [0, 60]}}
        check_batched(llm, llm.model, edits)

    def test_per_request_options_match_transformer_lens_beside_engine_wide_edits(self, llm):
        engine_edits = {
            "blocks.0.hook_mlp_out": {"op": "scale", "value": -2.0},  # request 2 replaces it
            "blocks.1.hook_attn_out": {"op": "add", "value": 0.1, "positions": [3]},
        }
        check_mixed_requests(llm, llm.model, engine_edits)

    def test_rows_are_freed_once_read_and_a_refused_read_names_the_users_ids(self, llm):
        tlh.reset_batched(llm)  # (rows other tests left unread)
        read, unread = generate(llm, [BATCH[0], BATCH[2]])
        tlh.read_batched(llm, [read.request_id])
        assert tlh.status(llm)["unread_requests"] == 1, "the read request's rows are freed"
        with pytest.raises(KeyError, match=re.escape(f"id {read.request_id!r}: already read")):
            tlh.read_batched(llm, [read.request_id])
        with pytest.raises(KeyError, match=re.escape(f"id 'unknown' matches no captured request; unread: {[unread.request_id]}")):
            tlh.read_batched(llm, ["unknown"])
        assert list(tlh.read_batched(llm, [unread.request_id])) == [unread.request_id]

    def test_positions_past_a_requests_end_are_refused_before_it_runs(self, llm):
        """capture=[10] on a 5-token prompt was accepted, and its read gave [0, width] rows per hook, with no word."""
        past, unread = tlh.request_args(llm.config, [2, 10]), tlh.status(llm)["unread_requests"]
        with pytest.raises(ValueError, match=r"capture positions \[10\] are past the request's last position, 4: "
                           r"its 5 prompt tokens run positions 0-4.*give positions below 5 \(the request's length\)"):
            generate(llm, [BATCH[0][:5]], 1, [past])
        edit = {"blocks.0.hook_mlp_out": {"op": "suppress", "positions": [6]}}
        with pytest.raises(ValueError, match=r"edits\['blocks.0.hook_mlp_out'\] positions \[6\] are past the "
                           "request's last position, 5"):
            generate(llm, [BATCH[0][:5]], 2, [tlh.request_args(llm.config, edits=edit)])
        assert tlh.status(llm)["unread_requests"] == unread, "the refused requests never ran"
        (reached,) = generate(llm, [BATCH[0][:5]], 7, [past])  # reached: its sixth generated token's row
        assert tlh.read_batched(llm, [reached.request_id])[reached.request_id]["resid_post", 0].shape[0] == 2

    def test_a_request_that_stops_before_a_listed_position_is_read_with_a_warning(self, llm):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = BATCH[0][:5]
        (plain,) = generate(llm, [prompt], 2)
        stop = plain.outputs[0].token_ids[0]  # its first generated token, made a stop token: it ends there
        params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop],
                                extra_args=tlh.request_args(llm.config, [1, 6]))
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        assert list(output.outputs[0].token_ids) == [stop]
        with pytest.warns(UserWarning, match=rf"1 requests hold no rows of positions their capture listed.*"
                          rf"{output.request_id!r}: \[6\]; list positions below each request's length"):
            rows = tlh.read_batched(llm, [output.request_id])[output.request_id]
        assert rows["resid_post", 0].shape[0] == 1, "position 1 alone"

    def test_requests_started_while_earlier_rows_wait_unread_are_warned_of(self, llm, caplog):
        """Requests without options keep every row; after 15 of them status said unread_requests: 15, and nothing
        warned. The warning comes from the workers' log (this process's, for an in-process engine)."""
        if not llm.in_process:
            pytest.skip("the workers' log is this process's only where the engine runs in it")
        tlh.reset_batched(llm)
        caplog.set_level(logging.WARNING, logger="tl_vllm_hooks")

        def said():
            return [r.getMessage() for r in caplog.records if "finished earlier hold" in r.getMessage()]

        generate(llm, [BATCH[0]] * 3)
        assert not said(), "nothing unread when the first generate starts"
        generate(llm, [BATCH[0]])
        assert len(said()) == 1 and re.match(
            r"tl_vllm_hooks: 3 requests that finished earlier hold [0-9.]+ MiB of rows that no read took \(status"
            r"\(llm\)'s unread_requests\): read them with read_batched\(llm, ids\), or free them with "
            r"reset_batched\(llm\); a request without options keeps every row", said()[0]), said()
        generate(llm, [BATCH[0]])  # 4 unread: fewer than twice 3, no second warning
        generate(llm, [BATCH[0]])  # 5
        generate(llm, [BATCH[0]])  # 6: twice 3
        assert len(said()) == 2 and said()[1].startswith("tl_vllm_hooks: 6 requests"), said()
        tlh.reset_batched(llm)
        generate(llm, [BATCH[0]])
        assert len(said()) == 2, "none unread after reset_batched"
        tlh.reset_batched(llm)

    def test_hand_written_options_are_refused_where_vllm_takes_the_request(self, llm):
        unread = tlh.status(llm)["unread_requests"]
        with pytest.raises(ValueError, match=r"capture: expected one of \['all'"):
            generate(llm, [BATCH[0]], 2, [{"tl_vllm_hooks": {"capture": "most"}}])
        assert tlh.status(llm)["unread_requests"] == unread, "the refused request never ran"
        check_batched(llm, llm.model, prompts=BATCH[:1])

    def test_rows_reach_the_driver_as_places_in_shared_memory(self, llm):
        (output,) = generate(llm, [BATCH[0]], 3)  # rows of three steps: its prompt, then two generated tokens
        (reply,) = llm.collective_rpc("tl_call", args=("read_batched", [output.request_id], socket.gethostname()))
        reply = reply["result"]
        assert reply["files"] and all(t.startswith("/dev/shm/tl_vllm_hooks-") for t in reply["files"]), reply["files"]
        message = reply["rows"][output.request_id]
        pieces = message["pieces"]
        assert set(message) == {"pieces"} and len(pieces) == 3, f"places of each step's rows, not bytes: {message!r:.200}"
        assert all(len(piece) == 3 for piece in pieces), "region, first row, rows"
        assert all(len(region) == 1 + len(llm.hook_names) for region in reply["regions"]), "file, each hook's row 0"
        mapped = {torch.float32: [tlh._map_row_file(token).view(torch.float32) for token in reply["files"]]}
        layouts = tlh._row_layouts(reply["hooks"])
        rows = tlh._rows_in(mapped, layouts, reply["regions"], {output.request_id: message}, reply["attention"])[output.request_id]
        tokens = BATCH[0] + list(output.outputs[0].token_ids[:2])
        assert_matches(rows, llm.model.reference(tokens, llm.hook_names), "through /dev/shm")
        del mapped, rows
        gc.collect()  # the mappings go, and with them the driver's hold on the files
        assert all(os.path.exists(token) for token in reply["files"]), "the driver says so, one file a token"

    def test_rows_for_a_driver_on_another_host_come_through_the_rpc(self, llm):
        (output,) = generate(llm, [BATCH[0]])
        (reply,) = llm.collective_rpc("tl_call", args=("read_batched", [output.request_id], "another-host"))
        reply = reply["result"]
        assert reply["files"] == []
        encoded = reply["rows"][output.request_id]["encoded"]
        rows = {name: tlh.decode_tensor(message) for name, message in encoded.items()}
        assert_matches(rows, llm.model.reference(BATCH[0], llm.hook_names), "through the RPC")

    def test_read_batched_says_when_rows_come_through_the_rpc(self, llm, monkeypatch):
        """A driver on another host than the engine's is warned that its rows come through the RPC; an engine in
        the driver's process has the driver's host name whatever it is, and its rows come through /dev/shm."""
        (output,) = generate(llm, [BATCH[0]])
        monkeypatch.setattr(socket, "gethostname", lambda: "another-host")  # the driver's, here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = tlh.read_batched(llm, [output.request_id])[output.request_id]
        said = [w for w in caught if "rows come through vLLM's RPC, which is slow" in str(w.message)]
        assert len(said) == (0 if llm.in_process else 1), [str(w.message) for w in caught]
        assert_matches(rows, llm.model.reference(BATCH[0], llm.hook_names), "through the RPC")

    def test_row_files_are_filled_again_once_the_driver_lets_go_and_removed_on_reset(self, llm):
        (output,) = generate(llm, [BATCH[0]])
        (reply,) = llm.collective_rpc("tl_call", args=("read_batched", [output.request_id], socket.gethostname()))
        tokens = reply["result"]["files"]
        for token in tokens:  # as a driver that mapped them and let go
            tlh._give_back_row_file(token.rpartition("#")[0], token)
        (before,) = tlh.status(llm)["row_files"]
        for _round in range(3):  # each round's rows dropped before the next read: no step makes a file
            outputs = generate(llm, BATCH)
            rows = tlh.read_batched(llm, [output.request_id for output in outputs])
            (now,) = tlh.status(llm)["row_files"]
            assert len(rows) == len(BATCH) and now["made_in_step"] == 0, (before, now)
            assert now["created"] - before["created"] == now["files"] - before["files"] in (0, 1), (
                "the same files, none removed, and at most one made ahead", before, now)
            del rows
            gc.collect()
        tlh.reset_batched(llm)
        (after,) = tlh.status(llm)["row_files"]
        # (one made ahead now, or the one begun before the reset kept: an earlier test's larger step leaves the
        # filling file too full for the next step, and a file is begun ahead then)
        assert after["files"] == 1 and after["created"] - now["created"] in (0, 1), (
            "reset_batched removes the row files nothing maps, and keeps or makes one ahead for the next step", now,
            after)
        files = {token.rpartition("#")[0] for token in tokens}
        assert not [p for p in glob.glob("/dev/shm/tl_vllm_hooks-*") if p.partition("#")[0] in files], (
            "the files the rounds filled again, and their tokens, removed")

    def test_a_dead_workers_row_files_are_removed_when_hooks_install(self, llm):
        assert not llm.stale_file.exists()

    @pytest.mark.parametrize("name, args", [("open_capture", ()), ("read_captures", (4,))])
    def test_the_one_prompt_flavours_calls_are_refused(self, llm, name, args):
        with pytest.raises(RuntimeError, match=rf"{name}: this engine has batched hooks; configure\(enable_batching=False\)"):
            getattr(tlh, name)(llm, *args)


@NO_ENGINE
def test_a_user_id_several_requests_share_is_refused_naming_them(tmp_path):
    """Two engines' llm.generate both number their requests from 0: in one sink_dir "0" then names two requests,
    which dataset["0"] refuses, naming both; each full id reads its own rows."""
    config = tlh.CaptureConfig({"blocks.0.hook_resid_post": (4,)}, enable_batching=True, sink_dir=str(tmp_path))
    rows = {"0-8e6792c5": torch.zeros(3, 4), "1-0123abcd": torch.full((1, 4), 2.0), "0-9fa42abc": torch.ones(2, 4)}
    for first, *others in (["0-8e6792c5", "1-0123abcd"], ["0-9fa42abc"]):  # one engine, then another
        writer = shard_writer(config)
        for request_id in (first, *others):
            write_request(writer, config, request_id, rows[request_id])
        writer.close()
    dataset = tools.CaptureDataset(tmp_path)
    assert dataset.request_ids == ["0-8e6792c5", "1", "0-9fa42abc"] and "0" in dataset  # a user id shared: full ids
    for read in (dataset.__getitem__, dataset.entry):
        with pytest.raises(KeyError, match=r"'0' matches 2 requests: \['0-8e6792c5', '0-9fa42abc'\]; .* full id"):
            read("0")
    assert torch.equal(dataset["1"]["blocks.0.hook_resid_post"], rows["1-0123abcd"]), "a user id of one request"
    for request_id, expected in rows.items():
        assert torch.equal(dataset[request_id]["blocks.0.hook_resid_post"], expected)
        assert dataset.entry(request_id)["positions"] == [[0, len(expected)]]


class TestTensorParallel:
    """Tensor parallel 2 on the CPU, and preemption."""

    def test_sink_joins_the_parts_tensor_parallel_ranks_write(self, models, tmp_path):
        """Tensor parallel 2, eager, on two CPU workers or two GPUs: rank 0 writes every hook,
        rank 1 only its parts of the split ones, and CaptureDataset joins them."""
        if torch.cuda.is_available() and not TWO_GPUS:
            pytest.skip("needs two CUDA GPUs")
        if not TWO_GPUS and len(os.sched_getaffinity(0)) < 2:
            pytest.skip("two CPU workers need two cores")
        dtype, tolerance, environment, reference = (
            ("bfloat16", BF16_TOLERANCE, (), bf16_reference(models["llama"])) if TWO_GPUS
            else ("float32", TOLERANCE, (("VLLM_CPU_OMP_THREADS_BIND", "0|1"),), models["llama"])
        )
        sink_dir = tmp_path / "dataset"
        with engine(
            models["llama"], in_process=False, eager=True, batching=True, dtype=dtype, environment=environment,
            sink_dir=str(sink_dir), tensor_parallel_size=2,
        ) as llm:
            (output,) = generate(llm, [PROMPT], extra_args=[tlh.request_args(llm.config, "prompt", EDIT)])
            dataset = tlh.flush_sink(llm)
        headers = {path.name: json.loads(path.read_text().splitlines()[0]) for path in sink_dir.glob("manifest-*")}
        split = {name for name in llm.hook_names if name.endswith(("attn.hook_z", "mlp.hook_post"))}
        assert set(headers) == {"manifest-pp0-tp0.jsonl", "manifest-pp0-tp1.jsonl"}
        assert set(headers["manifest-pp0-tp0.jsonl"]["writes"]) == set(llm.hook_names)
        assert set(headers["manifest-pp0-tp1.jsonl"]["writes"]) == split
        rows = dataset[output.request_id]
        assert set(rows) == set(llm.hook_names)
        assert_matches(rows, reference.reference(PROMPT, llm.hook_names, EDIT), "tp2 sink", tolerance)

    def test_tensor_parallel_splits_the_heads_of_q_k_v_and_the_mlp_units(self, models):
        """Tensor parallel 2 on two CPU workers, GPT-2 (two heads, two key-value heads), batched
        flavour, eager: every site but the attention matrices (refused under tensor parallelism),
        hook_q/k/v and mlp.hook_pre split by heads and units
        across the ranks and joined on read, unedited and under an edit at each site (each
        rank editing its own heads), against TransformerLens."""
        if torch.cuda.is_available() or len(os.sched_getaffinity(0)) < 2:
            pytest.skip("two CPU workers need two cores (two GPUs run test_parallel_layout_matches_one_device)")
        model = models["gpt2"]
        sites = [site for site in model.sites if site not in ("attn_scores", "pattern")]  # (refused here: see
        # test_attention_patterns_keep_each_query_and_key_and_refuse_what_they_cannot_rebuild)
        with engine(
            model, sites=sites, in_process=False, eager=True, batching=True,
            environment=(("VLLM_CPU_OMP_THREADS_BIND", "0|1"),), tensor_parallel_size=2,
        ) as llm:
            shards = [reply["result"]["shards"] for reply in llm.collective_rpc("tl_call", args=("status",))]
            split = {"attn.hook_q": 1, "attn.hook_k": 1, "attn.hook_v": 1, "attn.hook_z": 1, "mlp.hook_pre": 128,
                     "mlp.hook_post": 128}
            assert shards[1] == {
                f"blocks.{i}.{hook}": start for i in range(3) for hook, start in split.items()
            }, "rank 1 holds the second head and the second half of the MLP's units"
            check_batched(llm, model, prompts=BATCH[:2])
            check_every_site_edit_per_request(llm, model)
            check_logit_lens(llm, model, BATCH[0], TOLERANCE)  # the unembedding split by vocabulary, gathered

    def test_saes_on_replicated_hooks_under_tensor_parallelism(self, models, sae_oracle):
        """Tensor parallel 2 on two CPU workers, eager: each rank encodes a replicated hook's rows with its own copy
        of the SAE; the features come from rank 0, a feature edit (of an SAE, of a transcoder) changes both ranks'
        rows alike."""
        if torch.cuda.is_available() or len(os.sched_getaffinity(0)) < 2:
            pytest.skip("two CPU workers need two cores")
        model = models["llama"]
        saes = {h: d for h, d in sae_oracle.saes().items() if h != "blocks.2.attn.hook_z"}  # (split: refused)
        edits = {"blocks.0.hook_mlp_out": {"op": "scale", "features": [0, 7, 9], "value": 3.0},
                 "blocks.1.mlp.hook_in": {"op": "add", "features": fired(sae_oracle, "blocks.1.mlp.hook_in", 2), "value": 2.0}}
        with engine(
            model, sites=("resid_post",), in_process=False, eager=True, batching=True, tensor_parallel_size=2,
            environment=(("VLLM_CPU_OMP_THREADS_BIND", "0|1"),), saes=saes, sae_top_k=SAE_TOP_K,
        ) as llm:
            extra = [None, *(tlh.request_args(llm.config, edits={features(h): e}) for h, e in edits.items())]
            outputs = generate(llm, SAE_PROMPTS, 1, extra)
            read = tlh.read_batched(llm, [o.request_id for o in outputs])
        unedited, *edited = (read[o.request_id] for o in outputs)
        for name in saes:
            got = unedited[features(name) + ".indices"], unedited[features(name) + ".values"]
            assert_features(*got, sae_oracle.features[name][0], SAE_TOP_K, f"tp2 {name}")
        assert_matches({n: unedited[n] for n in llm.hook_names}, model.reference(SAE_PROMPTS[0], llm.hook_names))
        for i, (rows, (hook, edit)) in enumerate(zip(edited, edits.items()), 1):
            expected = model.reference(SAE_PROMPTS[i], llm.hook_names, sae_oracle.steered(i, hook, edit))
            assert_matches({n: rows[n] for n in llm.hook_names}, expected, f"tp2 feature edit at {hook}")

    def test_preempted_requests_come_back_without_duplicated_or_missing_rows(self, models):
        """A KV cache of 10 blocks of 32 tokens cannot hold four 100-token prompts
        growing by 40 tokens each: vLLM preempts requests and recomputes them."""
        model = models["llama"]
        prompts = [[(17 * i + 29 * r + 1) % 512 for i in range(100)] for r in range(4)]
        with engine(model, sites=("resid_post",), in_process=True, eager=True, batching=True,
                    num_gpu_blocks_override=10, block_size=32, max_model_len=256, disable_log_stats=False) as llm:
            check_batched(llm, model, max_tokens=40, prompts=prompts)
            preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
            assert preemptions > 0, "the test needs vLLM to preempt; it did not"


class TestAsyncLLM:
    def test_concurrent_requests_each_match_their_own_transformer_lens_run(self, async_engine):
        engine = async_engine
        requests = [(f"async-{n}", prompt, capture, edits) for n, (prompt, capture, edits) in enumerate(MIXED_REQUESTS[:6])]

        async def run_all():
            unread = (await tlh.status(engine))["unread_requests"]
            outputs = await asyncio.gather(*[
                run_request(engine, prompt, request_id, tlh.request_args(engine.config, capture or "all", edits))
                for request_id, prompt, capture, edits in requests
            ])
            read = await tlh.read_batched(engine, [request_id for request_id, *_ in requests])
            return outputs, read, await tlh.status(engine), unread

        outputs, captured, status, unread = engine.run(run_all())
        assert status["unread_requests"] == unread and status["config"] == engine.config
        names = list(engine.config.capture_specs)
        for output, (request_id, prompt, capture, edits) in zip(outputs, requests):
            sequence = list(prompt) + list(output.outputs[0].token_ids)[:-1]
            expected = engine.model.reference(sequence, names, edits)
            rows = kept_rows(capture or "all", len(prompt), len(sequence))
            assert_matches(captured[request_id], take_rows(expected, rows), request_id)

    def test_engine_wide_edits_are_refused_with_prefix_caching_on(self, async_engine):
        with pytest.raises(ValueError, match="engine-wide edits change every request's keys and values"):
            async_engine.run(tlh.set_edits(async_engine, {"blocks.1.hook_resid_post": {"op": "scale", "value": 2.0}}))
        async_engine.run(tlh.reset_edits(async_engine))

    def test_a_capture_after_its_prefix_was_cached_gets_every_row(self, async_engine):
        """The prefix runs first without options (and is cached); the same prefix then serves
        a request without options from the cache, and a capture of the full prompt runs it."""
        engine = async_engine
        prefix = [(11 * i + 2) % 512 for i in range(64)]
        names = list(engine.config.capture_specs)

        async def run_all():
            await engine.reset_prefix_cache()
            first = await run_request(engine, prefix + [5, 6], "prefix-first")
            plain = await run_request(engine, prefix + [7, 8], "prefix-plain")
            captured = await run_request(engine, prefix + [9, 10], "prefix-capture", tlh.request_args(engine.config, "prompt"))
            return first, plain, captured, await tlh.read_batched(engine, ["prefix-capture"])

        first, plain, captured, rows = engine.run(run_all())
        assert first.num_cached_tokens == 0 and plain.num_cached_tokens == 64, "requests without options hit the cache"
        assert captured.num_cached_tokens == 0, "a capture of the prompt runs all of it"
        assert_matches(rows["prefix-capture"], engine.model.reference(prefix + [9, 10], names), "capture after a cached prefix")
        with pytest.raises(KeyError, match="no captured request"):  # requests without options keep nothing here
            engine.run(tlh.read_batched(engine, ["prefix-plain"]))

    def test_a_steered_request_leaves_unsteered_ones_as_without_it(self, async_engine):
        """[A, S, B, C] against [A, B, C]: S (steered) shares its prefix with B, A with C. B and
        C must come out bit-identical, hitting the cache exactly as often; S reads no block
        that A left."""
        engine = async_engine
        shared_with_b = [(17 * i + 3) % 512 for i in range(64)]
        shared_with_c = [(19 * i + 7) % 512 for i in range(64)]
        steer = tlh.request_args(engine.config, "none", {"blocks.0.hook_resid_post": {"op": "add", "value": 4.0}})

        async def sequence(with_steered):
            await engine.reset_prefix_cache()
            outputs = {"A": await run_request(engine, shared_with_c + [1, 2, 3], "A", max_tokens=6)}
            if with_steered:
                outputs["S"] = await run_request(engine, shared_with_b + [4, 5, 6], "S", steer, max_tokens=6)
                outputs["S2"] = await run_request(engine, shared_with_c + [4, 5, 6], "S2", steer, max_tokens=6)
            outputs["B"] = await run_request(engine, shared_with_b + [7, 8, 9], "B", max_tokens=6)
            outputs["C"] = await run_request(engine, shared_with_c + [7, 8, 9], "C", max_tokens=6)
            return outputs

        steered = engine.run(sequence(True))
        alone = engine.run(sequence(False))
        assert steered["S2"].num_cached_tokens == 0, "an edited request read blocks an unedited one left"
        for name in "BC":
            ours, theirs = steered[name].outputs[0], alone[name].outputs[0]
            assert ours.token_ids == theirs.token_ids and ours.logprobs == theirs.logprobs, f"{name} changed"
            assert steered[name].num_cached_tokens == alone[name].num_cached_tokens, f"{name}'s cache hits changed"
        assert alone["C"].num_cached_tokens == 64 and alone["B"].num_cached_tokens == 0
        plain_s = engine.run(run_request(engine, shared_with_b + [4, 5, 6], "S-plain", max_tokens=6))
        assert plain_s.outputs[0].token_ids != steered["S"].outputs[0].token_ids, "the steering must change S"
