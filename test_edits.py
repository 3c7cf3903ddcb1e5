"""Request options and edits: request_args' wire form, what a bad option is refused with (in the driver, before any
work), and how a request's options set the prefix cache's keys (the engines' edits are checked against TransformerLens
in test_flavours.py and test_families.py).
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

import tl_vllm_hooks as tlh
from conftest import NO_ENGINE  # the shared helpers


BATCHED_CONFIG = tlh.CaptureConfig(
    {"blocks.0.hook_resid_post": 128, "blocks.0.attn.hook_z": (2, 64)}, 64, torch.float32, enable_batching=True
)


@NO_ENGINE
@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (BATCHED_CONFIG, dict(capture="most"), r"capture: expected one of \['all', 'prompt'"),
        (BATCHED_CONFIG, dict(capture=[]), "must hold ints >= 0 and not be empty"),
        (BATCHED_CONFIG, dict(capture=[3, -1]), "must hold ints >= 0"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_pst": {"op": "suppress"}}), "close matches"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": torch.ones(3)}}), r"shape \[128\], got shape \[3\]"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.attn.hook_z": {"op": "set", "value": torch.ones(64, 2)}}), r"shape \[128\] or \[2, 64\], got shape \[64, 2\]"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "scale", "value": True}}), "finite number"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": [True] * 128}}), "finite number"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": float("nan")}}), "NaN or infinite"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "set", "value": torch.full((128,), float("inf"))}}), "NaN or infinite"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "suppress", "positions": [True]}}), "ints >= 0"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "suppress", "positions": [-2]}}), "ints >= 0"),
        (BATCHED_CONFIG, dict(edits=["suppress"]), "expected a dict"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": "one"}}), "a finite number"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": {"dtype": "float32", "shape": [128]}}}), r"the keys \['base64', 'dtype', 'shape'\]"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": {"dtype": "int8", "shape": [128], "base64": ""}}}), "dtype 'int8' is not one of"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": {"dtype": "float32", "shape": [128], "base64": "AAAA"}}}), r"3 bytes for a float32 tensor of shape \[128\]"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": {"dtype": "float32", "shape": [128], "base64": "%%"}}}), "not base64 text"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": {"dtype": "float32", "shape": [-1], "base64": ""}}}), "shape must be a list of ints"),
        (BATCHED_CONFIG, dict(edits={"blocks.0.hook_resid_post": {"op": "add", "value": np.full(128, np.nan, np.float32)}}), "NaN or infinite"),
        (tlh.CaptureConfig(BATCHED_CONFIG.capture_specs, 64, torch.float32), {}, "enable_batching=True"),
        ("config.json", {}, "CaptureConfig of the engine"),
    ],
)
def test_bad_request_args_are_refused_in_the_driver(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tlh.request_args(config, **kwargs)


@NO_ENGINE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_request_args_travel_as_plain_values(dtype):
    """A tensor value travels as its raw bytes in base64 inside the JSON text, exact in its own dtype; a list of
    numbers, as a hand-written request sends, parses to the same table rows."""
    vector = torch.linspace(-3, 3, 128, dtype=torch.float64).to(dtype)  # signs and exponents both vary
    options = tlh.request_args(
        BATCHED_CONFIG, "prompt", {"blocks.0.hook_resid_post": {"op": "add", "value": vector, "positions": [300]}}
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    (text,) = options.values()
    decoded = json.loads(text)
    edit = decoded["edits"]["blocks.0.hook_resid_post"]
    assert decoded["capture"] == "prompt" and edit["positions"] == [300]
    assert edit["value"]["dtype"] == str(dtype).removeprefix("torch.") and edit["value"]["shape"] == [128]
    assert len(text) < 128 * dtype.itemsize * 1.4 + 200, "raw bytes, not decimal text"
    (bias,) = tlh._parse_options(text, BATCHED_CONFIG).edits["blocks.0.hook_resid_post"][0][1:]
    assert torch.equal(bias, vector.double()), "values survive the wire exactly in their dtype"
    by_hand = {**decoded, "edits": {"blocks.0.hook_resid_post": {**edit, "value": vector.tolist()}}}
    assert torch.equal(tlh._parse_options(by_hand, BATCHED_CONFIG).edits["blocks.0.hook_resid_post"][0][1], bias)
    # The OpenAI server's vllm_xargs takes only flat values: these pass its checks unchanged.
    served = CompletionRequest(model="m", prompt=[1, 2], vllm_xargs=options).to_sampling_params(4, {})
    assert served.extra_args == options


@NO_ENGINE
def test_prefix_cache_settings_follow_each_requests_options():
    """Where vLLM's front end takes a request: edits salt its cache blocks (the same edits,
    the same salt, kept beside the user's own), keeping prompt rows before the last skips
    reading the cache, and the workers' mark is added."""
    import types

    from vllm import SamplingParams

    edit = {"blocks.0.hook_resid_post": {"op": "add", "value": torch.ones(128)}}

    def built(capture, edits=None, salt=None):
        params = SamplingParams(extra_args=tlh.request_args(BATCHED_CONFIG, capture, edits))
        request = types.SimpleNamespace(sampling_params=params, cache_salt=salt, prompt_token_ids=list(range(10)))
        tlh._keep_apart_in_prefix_cache(request, tlh._request_options(params.extra_args, BATCHED_CONFIG.to_json()))
        return request

    plain = built("prompt")
    assert plain.cache_salt is None and plain.sampling_params.skip_reading_prefix_cache is True
    assert plain.sampling_params.extra_args[tlh._CACHE_MARK] == ""
    last = built("last_prompt_token", edit)
    assert last.sampling_params.skip_reading_prefix_cache is False and last.cache_salt.startswith("tl_vllm_hooks:")
    assert built("none", edit).cache_salt == last.cache_salt, "the same edits share their blocks"
    assert built("none", {"blocks.0.hook_resid_post": {"op": "add", "value": torch.ones(128) * 2}}).cache_salt != last.cache_salt
    assert built("none", edit, salt="user").cache_salt == "user" + last.cache_salt
    assert built([9]).sampling_params.skip_reading_prefix_cache is False  # the last prompt token always runs
    assert built([3, 9]).sampling_params.skip_reading_prefix_cache is True
    assert tlh._request_options(SamplingParams().extra_args, BATCHED_CONFIG.to_json()) is None  # left as it is


@NO_ENGINE
def test_with_prefix_caching_a_request_keeps_rows_only_if_asked_and_marked():
    """A request without options may be served from the cache: it keeps nothing. Options
    the front end did not mark (it lacks the module) are not applied, and say why."""
    config = tlh.CaptureConfig({"h": ("model.layers.0", 2)}, 32, enable_batching=True)
    state = types.SimpleNamespace(config=config, payload=config.to_json(), prefix_caching=True)
    options = tlh.request_args(config, "prompt", {"h": {"op": "scale", "value": 2.0}})
    kept, problem = tlh._worker_options({}, state)
    assert kept == tlh._RequestOptions("none") and problem is None
    unmarked, problem = tlh._worker_options(options, state)
    assert unmarked.capture == "none" and not unmarked.edits
    assert "vLLM's front end did not load tl_vllm_hooks" in problem
    marked, problem = tlh._worker_options({**options, tlh._CACHE_MARK: "digest"}, state)
    assert marked.capture == "prompt" and set(marked.edits) == {"h"} and problem is None
    state.prefix_caching = False
    kept, problem = tlh._worker_options({}, state)
    assert kept == tlh._RequestOptions("all") and problem is None
    # Where vLLM took the request without the module (nothing checked it): the workers refuse.
    refused, problem = tlh._worker_options({"tl_vllm_hooks": {"capture": "most"}}, state)
    assert refused.capture == "none" and "options were refused: capture: expected one of" in problem
