"""Read and edit a model's activations while vLLM serves it, under TransformerLens hook names.

One self-contained module. It installs PyTorch forward hooks inside vLLM's
workers after the weights load and before the first (traced) forward, so the
hooks become part of the graph that torch.compile and CUDA graphs run::

    config = configure(capture_specs(hf_config, sites=("resid_post",)))
    llm = LLM(model, **config.llm_kwargs)

Each hook name means the tensor TransformerLens 4.3's TransformerBridge means
by it on that architecture; a table per architecture says where vLLM's module
tree holds it, and an architecture not in the table is refused before the
first forward. Every hook writes its rows into a buffer allocated at install
time and applies an edit ``out * scale + bias`` read from tables that the host
rewrites between forwards. Two flavours:

* compiled (default): ``open_capture`` arms the hooks, the next forward's rows
  are kept (a multi-token generate keeps its prompt's); one prompt per capture.
* batched (``enable_batching=True``): many requests per generate, each with its
  own rows to keep and its own edits (``request_args``); after each step the
  kept rows go to host memory per request, whole across chunked prefill,
  preemption and decode steps; with a ``sink_dir``, each finished request's
  rows go on to safetensors shards on disk (written and read, as ``CaptureDataset``,
  by the companion module tl_vllm_hooks_tools, imported only for a sink).
  ``request_args`` is also what the OpenAI server's ``vllm_xargs`` takes, and
  with vLLM's prefix caching on, requests with options are kept apart from
  the cache as their rows and edits need.

The driver helpers take an ``LLM``, or an ``AsyncLLM`` and then return awaitables.

Loading: installed with pip, the ``vllm.general_plugins`` entry point calls
``register()`` in every vLLM process; copied in, the file registers itself when
a vLLM worker loads ``WorkerExtension`` from it, before it loads the model.
``TL_VLLM_HOOKS_DISABLE=1`` switches it off. Nothing crosses a process boundary
as pickle: the config is JSON, tensors travel as dtype, shape and raw bytes.
"""

from __future__ import annotations

import atexit
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
import socket
import sys
import warnings
from typing import Any

import numpy as np
import torch

__version__ = "0.3.0"

__all__ = [
    "SITES",
    "WORKER_EXTENSION",
    "CaptureConfig",
    "CaptureDataset",
    "WorkerExtension",
    "capture_specs",
    "configure",
    "decode_tensor",
    "encode_tensor",
    "flush_sink",
    "open_capture",
    "read_batched",
    "read_captures",
    "read_fire_counts",
    "register",
    "remove_hooks",
    "request_args",
    "reset_batched",
    "reset_edits",
    "reset_fire_counts",
    "segment_by_request",
    "set_edits",
    "status",
    "tiny_model",
    "unregister",
]

logger = logging.getLogger(__name__)


def _tools() -> Any:
    """The companion module, tl_vllm_hooks_tools (the dataset sink, CaptureDataset,
    tiny_model, the command line), imported the first time one of them is asked for."""
    try:
        import tl_vllm_hooks_tools
    except ModuleNotFoundError as error:
        if error.name != "tl_vllm_hooks_tools":
            raise
        raise ModuleNotFoundError(
            "sink_dir, CaptureDataset, tiny_model and the command line live in tl_vllm_hooks_tools.py: "
            f"copy it from the project beside {__file__}"
        ) from None
    return tl_vllm_hooks_tools


# ---------------------------------------------------------------------------
# Hook names and architectures. What a TransformerLens hook name means is fixed
# by TransformerLens 4.3's TransformerBridge; where that tensor lives depends on
# the model class vLLM instantiates, so every architecture has its own table of
# taps, checked against the bridge on the same weights. A name this table does
# not place for the loaded architecture is refused, never guessed.
# ---------------------------------------------------------------------------

SITES = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{i}.hook_resid_pre",
    "ln1": "blocks.{i}.ln1.hook_normalized",
    "attn_q": "blocks.{i}.attn.hook_q",
    "attn_k": "blocks.{i}.attn.hook_k",
    "attn_v": "blocks.{i}.attn.hook_v",
    "attn_rot_q": "blocks.{i}.attn.hook_rot_q",
    "attn_rot_k": "blocks.{i}.attn.hook_rot_k",
    "attn_z": "blocks.{i}.attn.hook_z",
    "attn_out": "blocks.{i}.hook_attn_out",
    "resid_mid": "blocks.{i}.hook_resid_mid",
    "ln2": "blocks.{i}.ln2.hook_normalized",
    "mlp_pre": "blocks.{i}.mlp.hook_pre",
    "expert_weights": "blocks.{i}.mlp.hook_expert_weights",
    "expert_indices": "blocks.{i}.mlp.hook_expert_indices",
    "mlp_post": "blocks.{i}.mlp.hook_post",
    "mlp_out": "blocks.{i}.hook_mlp_out",
    "resid_post": "blocks.{i}.hook_resid_post",
    "final_norm": "ln_final.hook_normalized",
}
"""site -> TransformerLens hook name, in the order a forward reaches them; ``{i}`` is the layer.

Rows are ``[d_model]`` but at attn_q, attn_rot_q and attn_z ``[n_heads, d_head]``
(attn_z: per head, the output projection's input), at attn_k, attn_v and
attn_rot_k ``[n_kv_heads, d_head]`` (q and k before rotary, then after it), and
at mlp_pre and mlp_post ``[d_mlp]`` (the activation's input, its gate on gated
MLPs, and the down projection's input) on dense MLPs; on mixture-of-experts
blocks TransformerLens's mlp_pre and mlp_post are the block's input and output,
``[d_model]``, and the router's choice per token is expert_weights ``[n_experts]``
(the weight each expert's output is summed with, 0 for those not chosen) and
expert_indices ``[top_k]`` (the chosen experts, highest weight first, as numbers
of the capture dtype; read-only). ln1, ln2 and final_norm are a norm's input
normalized (the mean taken out for LayerNorm), before its weight and bias.
"""

_READ_ONLY_SITES = ("expert_weights", "expert_indices")  # vLLM's fused MoE routes inside its kernel

_HOOK_NAME = {
    re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$"): site for site, template in SITES.items()
}


def _parse_hook_name(name: str) -> tuple[str, int | None] | None:
    """(site, layer or None) of a TransformerLens hook name this module knows, else None."""
    for pattern, site in _HOOK_NAME.items():
        match = pattern.match(name)
        if match:
            return site, int(match.group(1)) if match.groups() else None
    return None


@dataclasses.dataclass(frozen=True)
class _Tap:
    """Where one site's tensor is in vLLM's module tree, and how an edit of it flows on.

    module: path in the model vLLM loads; ``{i}`` is the layer.
    kind:
      output       the module's output (its first element if it returns a tuple);
                   edited in place.
      output_pair  the sum of the (hidden, residual) pair a fused-residual decoder
                   layer returns; the edit rewrites both halves.
      input        one input of the module; the module runs on the edited input.
      input_pair   the sum of two inputs, (hidden, residual) with residual None in
                   the first layer; the module runs on the edited pair.
      norm_input   the sum of a fused add-and-norm's two inputs. The edit reaches
                   the normalized output only: the residual the norm passes on
                   keeps the unedited sum (TransformerLens's hook_resid_mid is
                   ln2's input, so editing it changes the MLP's input alone).
      normalized   a norm's input, or the sum of its two, normalized before its
                   weight and bias; an edit reaches the norm's output as
                   ``edited * weight + bias``.
      router       a mixture of experts' router logits, turned into the top-k
                   experts (part ``indices``) or their weights over all experts
                   (part ``weights``): softmax, top-k, then renormalized over the k
                   where ``renormalize`` says (``always``, or a config attribute).
    inputs: (argument name, position) of each input an input kind reads.
    norm: for the norm kinds: ``rms``, ``rms_offset`` (weight applied as
        1 + weight, Gemma) or ``layer`` (mean-centred, with a bias where it has one).
    part: for the output and input kinds, the columns of the tensor the site
        is: ``q``, ``k`` or ``v``, those heads of a fused qkv projection's
        output; ``gate``, the first half of a gated activation's input (gate,
        then up); empty for the whole tensor.
    multiplier: a config attribute the module's output is multiplied by to
        give TransformerLens's tensor (Granite's residual_multiplier, applied
        where the branch joins the residual stream); the module's output is
        edited so that ``output * multiplier`` carries the edit.
    bias_apart: for the output kind, the module returns (output, bias) and its
        caller adds the bias (vLLM's skip_bias_add, Falcon's): TransformerLens's
        tensor is their sum, and the output is edited so that the sum carries the edit.
    """

    module: str
    kind: str
    inputs: tuple[tuple[str, int], ...] = ()
    norm: str = ""
    part: str = ""
    multiplier: str = ""
    bias_apart: bool = False
    renormalize: str = ""


_LAYER_PAIR = (("hidden_states", 1), ("residual", 2))  # vLLM's fused-residual decoder layers
_LAYER_INPUT = (("hidden_states", 1),)  # vLLM's decoder layers, forward(positions, hidden_states, ...)
_NORM_PAIR = (("x", 0), ("residual", 1))  # vLLM's RMSNorm(x, residual)
_NORM_INPUT = (("x", 0),)
_TORCH_NORM_INPUT = (("input", 0),)  # torch.nn.LayerNorm
_LINEAR_INPUT = (("input_", 0),)  # vLLM's RowParallelLinear
_QUERY, _KEY = (("query", 0),), (("key", 1),)  # vLLM's Attention(query, key, value)


def _attention_taps(
    attention: str, qkv: str = ".qkv_proj", o_proj: str = ".o_proj", rotary: bool = True, bias_apart: bool = False
):
    """q, k and v (before rotary) as heads of vLLM's fused qkv projection; after rotary,
    what vLLM's Attention receives; z, the output projection's input."""
    taps = {
        "attn_q": _Tap(attention + qkv, "output", part="q", bias_apart=bias_apart),
        "attn_k": _Tap(attention + qkv, "output", part="k", bias_apart=bias_apart),
        "attn_v": _Tap(attention + qkv, "output", part="v", bias_apart=bias_apart),
        "attn_z": _Tap(attention + o_proj, "input", _LINEAR_INPUT),
    }
    if rotary:
        taps.update(
            attn_rot_q=_Tap(attention + ".attn", "input", _QUERY), attn_rot_k=_Tap(attention + ".attn", "input", _KEY)
        )
    return taps


def _fused_residual_taps(
    norm: str,
    attn_out: str = "",
    ln2: str = ".post_attention_layernorm",
    mlp_out: str = ".mlp",
    embed_scaled: bool = False,
    embed: str = "model.embed_tokens",
    attention: str = ".self_attn",
    layer_pair: tuple[tuple[str, int], ...] = _LAYER_PAIR,
) -> dict[str, _Tap]:
    """vLLM's native Llama-style models: decoder layers take and return (hidden, residual)
    and each pre-norm adds the two (RMSNorm(x, residual)). Gemma scales the embedding by
    sqrt(d_model) after embed_tokens (embed_scaled): the scaled one, which enters layer 0,
    is TransformerLens's hook_embed. attn_out defaults to the attention module's output."""
    layer = "model.layers.{i}"
    return {
        "embed": _Tap("model.layers.0", "input", _LAYER_INPUT) if embed_scaled else _Tap(embed, "output"),
        "resid_pre": _Tap(layer, "input_pair", layer_pair),
        "ln1": _Tap(layer + ".input_layernorm", "normalized", _NORM_PAIR, norm),
        **_attention_taps(layer + attention),
        "attn_out": _Tap(layer + (attn_out or attention), "output"),
        "resid_mid": _Tap(layer + ln2, "norm_input", _NORM_PAIR, norm),
        "ln2": _Tap(layer + ln2, "normalized", _NORM_PAIR, norm),
        "mlp_pre": _Tap(layer + ".mlp.gate_up_proj", "output", part="gate"),
        "mlp_post": _Tap(layer + ".mlp.down_proj", "input", _LINEAR_INPUT),
        "mlp_out": _Tap(layer + mlp_out, "output"),
        "resid_post": _Tap(layer, "output_pair"),
        "final_norm": _Tap("model.norm", "normalized", _NORM_PAIR, norm),
    }


def _without(taps: dict[str, _Tap], *sites: str) -> dict[str, _Tap]:
    """taps less ``sites`` (those TransformerLens's bridge does not run on an architecture,
    or that another layout places elsewhere)."""
    return {site: tap for site, tap in taps.items() if site not in sites}


_LLAMA_TAPS = _fused_residual_taps("rms")
_GEMMA_TAPS = _fused_residual_taps("rms_offset", embed_scaled=True)
# Gemma 2 and 3 normalize each branch again before adding it (post-attention and
# post-feedforward norms, which TransformerLens's attn_out and mlp_out follow);
# the MLP's pre-norm is pre_feedforward_layernorm.
_GEMMA2_TAPS = _fused_residual_taps(
    "rms_offset", ".post_attention_layernorm", ".pre_feedforward_layernorm", ".post_feedforward_layernorm", True
)


def _sequential_taps(
    norm: str,
    norm_inputs: tuple[tuple[str, int], ...],
    multiplier: str = "",
    embed_scaled: bool = False,
) -> dict[str, _Tap]:
    """vLLM's native models whose decoder layers take and return the residual stream itself
    (Granite, StableLM): each branch is added to the stream inside the layer, the norms
    take one input, and the layer's first output is the stream. Granite multiplies the
    embedding (embed_scaled) and each branch's output (its residual_multiplier) first."""
    layer = "model.layers.{i}"
    embed = _Tap("model.layers.0", "input", _LAYER_INPUT) if embed_scaled else _Tap("model.embed_tokens", "output")
    return {
        "embed": embed,
        "resid_pre": _Tap(layer, "input", _LAYER_INPUT),
        "ln1": _Tap(layer + ".input_layernorm", "normalized", norm_inputs, norm),
        **_attention_taps(layer + ".self_attn"),
        "attn_out": _Tap(layer + ".self_attn", "output", multiplier=multiplier),
        "resid_mid": _Tap(layer + ".post_attention_layernorm", "input", norm_inputs),
        "ln2": _Tap(layer + ".post_attention_layernorm", "normalized", norm_inputs, norm),
        "mlp_pre": _Tap(layer + ".mlp.gate_up_proj", "output", part="gate"),
        "mlp_post": _Tap(layer + ".mlp.down_proj", "input", _LINEAR_INPUT),
        "mlp_out": _Tap(layer + ".mlp", "output", multiplier=multiplier),
        "resid_post": _Tap(layer, "output"),
        "final_norm": _Tap("model.norm", "normalized", norm_inputs, norm),
    }


# EXAONE 4 normalizes each branch after it and before adding it, with no norm
# before: attention reads the stream itself, and the MLP reads the mid-stream.
_EXAONE4_TAPS = {
    "embed": _Tap("model.embed_tokens", "output"),
    "resid_pre": _Tap("model.layers.{i}", "input", _LAYER_INPUT),
    **_attention_taps("model.layers.{i}.self_attn"),
    "attn_out": _Tap("model.layers.{i}.post_attention_layernorm", "output"),
    "resid_mid": _Tap("model.layers.{i}.mlp", "input", _NORM_INPUT),
    "mlp_pre": _Tap("model.layers.{i}.mlp.gate_up_proj", "output", part="gate"),
    "mlp_post": _Tap("model.layers.{i}.mlp.down_proj", "input", _LINEAR_INPUT),
    "mlp_out": _Tap("model.layers.{i}.post_feedforward_layernorm", "output"),
    "resid_post": _Tap("model.layers.{i}", "output"),
    "final_norm": _Tap("model.norm", "normalized", _NORM_INPUT, "rms"),
}
# Cohere: attention and MLP both read the one norm's output (parallel residual)
# and the layer adds both to the stream; its LayerNorm has a weight and no bias
# and passes the residual it is given through untouched.
_COHERE_NORM_INPUT = (("hidden_states", 0),)
_COHERE_TAPS = {
    "embed": _Tap("model.embed_tokens", "output"),
    "resid_pre": _Tap("model.layers.{i}", "input", _LAYER_INPUT),
    "ln1": _Tap("model.layers.{i}.input_layernorm", "normalized", _COHERE_NORM_INPUT, "layer"),
    **_attention_taps("model.layers.{i}.self_attn"),
    "attn_out": _Tap("model.layers.{i}.self_attn", "output"),
    "mlp_pre": _Tap("model.layers.{i}.mlp.gate_up_proj", "output", part="gate"),
    "mlp_post": _Tap("model.layers.{i}.mlp.down_proj", "input", _LINEAR_INPUT),
    "mlp_out": _Tap("model.layers.{i}.mlp", "output"),
    "resid_post": _Tap("model.layers.{i}", "output"),
    "final_norm": _Tap("model.norm", "normalized", _COHERE_NORM_INPUT, "layer"),
}


def _moe_taps(
    taps: dict[str, _Tap], block: str, renormalize: str, router: str = ".gate", block_input: str = "hidden_states"
) -> dict[str, _Tap]:
    """taps with the MLP a mixture-of-experts block at ``block`` (its router and experts
    inside): TransformerLens's mlp.hook_pre and mlp.hook_post are the block's input and
    output, and hook_mlp_out its output too; the router's choice comes from its logits."""
    layer = "model.layers.{i}"
    return {
        **taps,
        "mlp_pre": _Tap(layer + block, "input", ((block_input, 0),)),
        "expert_weights": _Tap(layer + block + router, "router", part="weights", renormalize=renormalize),
        "expert_indices": _Tap(layer + block + router, "router", part="indices", renormalize=renormalize),
        "mlp_post": _Tap(layer + block, "output"),
        "mlp_out": _Tap(layer + block, "output"),
    }


# GPT-2 blocks take and return the residual stream itself; the MLP's norm reads
# the mid-stream while the block keeps its own copy for the skip connection.
_GPT2_TAPS = {
    "embed": _Tap("transformer.wte", "output"),
    "pos_embed": _Tap("transformer.wpe", "output"),
    "resid_pre": _Tap("transformer.h.{i}", "input", (("hidden_states", 0),)),
    "ln1": _Tap("transformer.h.{i}.ln_1", "normalized", _NORM_INPUT, "layer"),
    **_attention_taps("transformer.h.{i}.attn", ".c_attn", ".c_proj", rotary=False),
    "attn_out": _Tap("transformer.h.{i}.attn", "output"),
    "resid_mid": _Tap("transformer.h.{i}.ln_2", "input", _NORM_INPUT),
    "ln2": _Tap("transformer.h.{i}.ln_2", "normalized", _NORM_INPUT, "layer"),
    "mlp_pre": _Tap("transformer.h.{i}.mlp.c_fc", "output"),
    "mlp_post": _Tap("transformer.h.{i}.mlp.c_proj", "input", _LINEAR_INPUT),
    "mlp_out": _Tap("transformer.h.{i}.mlp", "output"),
    "resid_post": _Tap("transformer.h.{i}", "output"),
    "final_norm": _Tap("transformer.ln_f", "normalized", _NORM_INPUT, "layer"),
}
# GPT-J: attention and MLP both read ln_1's output (parallel residual); its block
# takes (position_ids, hidden_states) and returns the stream.
_GPTJ_TAPS = {
    "embed": _Tap("transformer.wte", "output"),
    "resid_pre": _Tap("transformer.h.{i}", "input", _LAYER_INPUT),
    "ln1": _Tap("transformer.h.{i}.ln_1", "normalized", _NORM_INPUT, "layer"),
    **_attention_taps("transformer.h.{i}.attn", o_proj=".out_proj", rotary=False),
    "attn_out": _Tap("transformer.h.{i}.attn", "output"),
    "mlp_pre": _Tap("transformer.h.{i}.mlp.fc_in", "output"),
    "mlp_post": _Tap("transformer.h.{i}.mlp.fc_out", "input", _LINEAR_INPUT),
    "mlp_out": _Tap("transformer.h.{i}.mlp", "output"),
    "resid_post": _Tap("transformer.h.{i}", "output"),
    "final_norm": _Tap("transformer.ln_f", "normalized", _NORM_INPUT, "layer"),
}
# OPT (norms before each branch, do_layer_norm_before): its layer holds the MLP's
# two linear layers itself, so the second's output is hook_mlp_out.
_OPT_LAYER = "model.decoder.layers.{i}"
_OPT_TAPS = {
    "embed": _Tap("model.decoder.embed_tokens", "output"),
    "pos_embed": _Tap("model.decoder.embed_positions", "output"),
    "resid_pre": _Tap(_OPT_LAYER, "input", (("hidden_states", 0),)),
    "ln1": _Tap(_OPT_LAYER + ".self_attn_layer_norm", "normalized", _NORM_INPUT, "layer"),
    **_attention_taps(_OPT_LAYER + ".self_attn", o_proj=".out_proj", rotary=False),
    "attn_out": _Tap(_OPT_LAYER + ".self_attn", "output"),
    "resid_mid": _Tap(_OPT_LAYER + ".final_layer_norm", "input", _NORM_INPUT),
    "ln2": _Tap(_OPT_LAYER + ".final_layer_norm", "normalized", _NORM_INPUT, "layer"),
    "mlp_pre": _Tap(_OPT_LAYER + ".fc1", "output"),
    "mlp_post": _Tap(_OPT_LAYER + ".fc2", "input", _LINEAR_INPUT),
    "mlp_out": _Tap(_OPT_LAYER + ".fc2", "output"),
    "resid_post": _Tap(_OPT_LAYER, "output"),
    "final_norm": _Tap("model.decoder.final_layer_norm", "normalized", _NORM_INPUT, "layer"),
}

# BLOOM (residual from before each norm, apply_residual_connection_post_layernorm off):
# its embedding is normalized once before layer 0, and that is TransformerLens's
# hook_embed. ALiBi, no rotary.
_BLOOM_LAYER = "transformer.h.{i}"
_BLOOM_TAPS = {
    "embed": _Tap("transformer.h.0", "input", _LAYER_INPUT),
    "resid_pre": _Tap(_BLOOM_LAYER, "input", _LAYER_INPUT),
    "ln1": _Tap(_BLOOM_LAYER + ".input_layernorm", "normalized", _TORCH_NORM_INPUT, "layer"),
    **_attention_taps(_BLOOM_LAYER + ".self_attention", ".query_key_value", ".dense", rotary=False),
    "attn_out": _Tap(_BLOOM_LAYER + ".self_attention", "output"),
    "resid_mid": _Tap(_BLOOM_LAYER + ".post_attention_layernorm", "input", _TORCH_NORM_INPUT),
    "ln2": _Tap(_BLOOM_LAYER + ".post_attention_layernorm", "normalized", _TORCH_NORM_INPUT, "layer"),
    "mlp_pre": _Tap(_BLOOM_LAYER + ".mlp.dense_h_to_4h", "output"),
    "mlp_post": _Tap(_BLOOM_LAYER + ".mlp.dense_4h_to_h", "input", _LINEAR_INPUT),
    "mlp_out": _Tap(_BLOOM_LAYER + ".mlp", "output"),
    "resid_post": _Tap(_BLOOM_LAYER, "output"),
    "final_norm": _Tap("transformer.ln_f", "normalized", _TORCH_NORM_INPUT, "layer"),
}

# Falcon (7B's layout: parallel_attn, one norm, no new_decoder_architecture):
# attention and MLP read input_layernorm's output, and their output projections
# leave the bias for the layer to add once both are summed.
_FALCON_LAYER = "transformer.h.{i}"
_FALCON_TAPS = {
    "embed": _Tap("transformer.word_embeddings", "output"),
    "resid_pre": _Tap(_FALCON_LAYER, "input", _LAYER_INPUT),
    "ln1": _Tap(_FALCON_LAYER + ".input_layernorm", "normalized", _TORCH_NORM_INPUT, "layer"),
    **_attention_taps(_FALCON_LAYER + ".self_attention", ".query_key_value", ".dense", rotary=False, bias_apart=True),
    "attn_out": _Tap(_FALCON_LAYER + ".self_attention", "output", bias_apart=True),
    "mlp_pre": _Tap(_FALCON_LAYER + ".mlp.dense_h_to_4h", "output", bias_apart=True),
    "mlp_post": _Tap(_FALCON_LAYER + ".mlp.dense_4h_to_h", "input", _LINEAR_INPUT),
    "mlp_out": _Tap(_FALCON_LAYER + ".mlp", "output", bias_apart=True),
    "resid_post": _Tap(_FALCON_LAYER, "output"),
    "final_norm": _Tap("transformer.ln_f", "normalized", _TORCH_NORM_INPUT, "layer"),
}


def _transformers_backend_taps(norm: str, **places: _Tap | None) -> dict[str, _Tap]:
    """Models vLLM runs through its Transformers backend: transformers' own decoder layers
    (which take and return the residual stream itself) with vLLM's linear layers, its
    attention and its norms (RMSNorm and LayerNorm, which take x alone), the q, k and v
    projections fused as qkv_proj and a gated MLP's as gate_up_proj, split in half by
    the activation. Rotary is applied inside transformers' attention, where no module
    holds it: hook_rot_q and hook_rot_k are not placed. ``places`` replaces a site's
    tap, or drops it with None."""
    layer = "model.layers.{i}"
    taps = {
        "embed": _Tap("model.embed_tokens", "output"),
        "resid_pre": _Tap(layer, "input", (("hidden_states", 0),)),
        "ln1": _Tap(layer + ".input_layernorm", "normalized", _NORM_INPUT, norm),
        **_attention_taps(layer + ".self_attn", rotary=False),
        "attn_out": _Tap(layer + ".self_attn", "output"),
        "resid_mid": _Tap(layer + ".post_attention_layernorm", "input", _NORM_INPUT),
        "ln2": _Tap(layer + ".post_attention_layernorm", "normalized", _NORM_INPUT, norm),
        "mlp_pre": _Tap(layer + ".mlp.gate_up_proj", "output", part="gate"),
        "mlp_post": _Tap(layer + ".mlp.down_proj", "input", _LINEAR_INPUT),
        "mlp_out": _Tap(layer + ".mlp", "output"),
        "resid_post": _Tap(layer, "output"),
        "final_norm": _Tap("model.norm", "normalized", _NORM_INPUT, norm),
    }
    taps.update(places)
    return {site: tap for site, tap in taps.items() if tap is not None}


# OLMo's LayerNorm has no weight and no bias (transformers' own module, which vLLM
# keeps); TransformerLens 4.3's bridge fails on a hook at its hook_normalized ("has no
# attribute 'weight'"), so ln1, ln2 and ln_final are not placed.
_OLMO_TAPS = _transformers_backend_taps(
    "layer",
    ln1=None,
    resid_mid=_Tap("model.layers.{i}.post_attention_layernorm", "input", (("hidden_states", 0),)),
    ln2=None,
    final_norm=None,
)
# OLMo 2 normalizes each branch after it, before adding it (no norm before).
_OLMO2_TAPS = _transformers_backend_taps(
    "rms",
    ln1=None,
    ln2=None,
    attn_out=_Tap("model.layers.{i}.post_attention_layernorm", "output"),
    resid_mid=_Tap("model.layers.{i}.mlp", "input", _NORM_INPUT),
    mlp_out=_Tap("model.layers.{i}.post_feedforward_layernorm", "output"),
)
# Phi: attention and MLP both read the one norm's output (parallel residual).
_PHI_TAPS = _transformers_backend_taps(
    "layer",
    attn_z=_Tap("model.layers.{i}.self_attn.dense", "input", _LINEAR_INPUT),
    resid_mid=None,
    ln2=None,
    mlp_pre=_Tap("model.layers.{i}.mlp.fc1", "output"),
    mlp_post=_Tap("model.layers.{i}.mlp.fc2", "input", _LINEAR_INPUT),
    final_norm=_Tap("model.final_layernorm", "normalized", _NORM_INPUT, "layer"),
)
_STARCODER2_TAPS = _transformers_backend_taps(
    "layer",
    mlp_pre=_Tap("model.layers.{i}.mlp.c_fc", "output"),
    mlp_post=_Tap("model.layers.{i}.mlp.c_proj", "input", _LINEAR_INPUT),
)
# GPT-NeoX: attention and MLP both read the block's input (parallel residual), so
# there is no mid-stream and no hook_resid_mid, as in TransformerLens. Its fused
# query_key_value interleaves q, k and v per head, which no part here describes.
_NEOX_TAPS = _transformers_backend_taps(
    "layer",
    embed=_Tap("model.embed_in", "output"),
    attn_q=None,
    attn_k=None,
    attn_v=None,
    attn_z=_Tap("model.layers.{i}.attention.dense", "input", _LINEAR_INPUT),
    attn_out=_Tap("model.layers.{i}.attention", "output"),
    resid_mid=None,
    mlp_pre=_Tap("model.layers.{i}.mlp.dense_h_to_4h", "output"),
    mlp_post=_Tap("model.layers.{i}.mlp.dense_4h_to_h", "input", _LINEAR_INPUT),
    final_norm=_Tap("model.final_layer_norm", "normalized", _NORM_INPUT, "layer"),
)

_ARCHITECTURES = {
    # transformers architecture: (the vLLM model classes it is checked with, taps)
    "LlamaForCausalLM": (("LlamaForCausalLM",), _LLAMA_TAPS),
    "MistralForCausalLM": (("MistralForCausalLM",), _LLAMA_TAPS),
    "Qwen2ForCausalLM": (("Qwen2ForCausalLM",), _LLAMA_TAPS),
    "Qwen3ForCausalLM": (("Qwen3ForCausalLM",), _LLAMA_TAPS),
    "Phi3ForCausalLM": (("Phi3ForCausalLM",), _without(_LLAMA_TAPS, "attn_rot_q", "attn_rot_k")),
    "GemmaForCausalLM": (("GemmaForCausalLM",), _GEMMA_TAPS),
    "Gemma2ForCausalLM": (("Gemma2ForCausalLM",), _GEMMA2_TAPS),
    "Gemma3ForCausalLM": (("Gemma3ForCausalLM",), _GEMMA2_TAPS),
    "GraniteForCausalLM": (
        ("GraniteForCausalLM",),
        _sequential_taps("rms", _NORM_INPUT, multiplier="residual_multiplier", embed_scaled=True),
    ),
    "StableLmForCausalLM": (("StablelmForCausalLM",), _sequential_taps("layer", _TORCH_NORM_INPUT)),
    "Exaone4ForCausalLM": (("Exaone4ForCausalLM",), _EXAONE4_TAPS),
    "CohereForCausalLM": (("CohereForCausalLM",), _COHERE_TAPS),
    "MixtralForCausalLM": (("MixtralForCausalLM",), _moe_taps(_LLAMA_TAPS, ".block_sparse_moe", "always")),
    "Qwen2MoeForCausalLM": (("Qwen2MoeForCausalLM",), _moe_taps(_LLAMA_TAPS, ".mlp", "norm_topk_prob")),
    "Qwen3MoeForCausalLM": (("Qwen3MoeForCausalLM",), _moe_taps(_LLAMA_TAPS, ".mlp", "norm_topk_prob")),
    "OlmoeForCausalLM": (("OlmoeForCausalLM",), _moe_taps(_LLAMA_TAPS, ".mlp", "norm_topk_prob")),
    "GptOssForCausalLM": (
        ("GptOssForCausalLM",),
        _moe_taps(
            _fused_residual_taps(
                "rms",
                embed="model.embedding",
                attention=".attn",
                # TransformerBlock(hidden_states, positions, residual)
                layer_pair=(("hidden_states", 0), ("residual", 2)),
            ),
            ".mlp",
            "always",  # softmax over the top-k logits
            router=".router",
            block_input="x",
        ),
    ),
    "GPT2LMHeadModel": (("GPT2LMHeadModel",), _GPT2_TAPS),
    "GPTJForCausalLM": (("GPTJForCausalLM",), _GPTJ_TAPS),
    "OPTForCausalLM": (("OPTForCausalLM",), _OPT_TAPS),
    "BloomForCausalLM": (("BloomForCausalLM",), _BLOOM_TAPS),
    "FalconForCausalLM": (("FalconForCausalLM",), _FALCON_TAPS),
    "OlmoForCausalLM": (("TransformersForCausalLM",), _OLMO_TAPS),
    "Olmo2ForCausalLM": (("TransformersForCausalLM",), _OLMO2_TAPS),
    "PhiForCausalLM": (("TransformersForCausalLM",), _PHI_TAPS),
    "Starcoder2ForCausalLM": (("TransformersForCausalLM",), _STARCODER2_TAPS),
    "GPTNeoXForCausalLM": (("TransformersForCausalLM",), _NEOX_TAPS),
}
"""Every entry checked against TransformerLens 4.3 on vLLM 0.32 (CPU); Llama and Gemma 2
also on vLLM 0.24 (CUDA), where Qwen2 and GPT-2 have the same classes. vLLM 0.24 serves
GPT-NeoX with a native class of its own, which is not in this table and so is refused."""


_LAYOUT_SETTINGS = {
    # architecture: {config attribute: the value its table is written for}
    "OPTForCausalLM": {"do_layer_norm_before": True},
    "BloomForCausalLM": {"apply_residual_connection_post_layernorm": False},
    "FalconForCausalLM": {"new_decoder_architecture": False, "parallel_attn": True},
    "StableLmForCausalLM": {"use_parallel_residual": False},
    "GPTNeoXForCausalLM": {"use_parallel_residual": True},
}
"""Settings that change where a family's tensors are; a model with another value is refused."""


def _architecture(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or ["(none given)"]
    return architectures[0]


def _taps(hf_config: Any, sites: set[str] | tuple[str, ...]) -> dict[str, _Tap]:
    """The taps of the model's architecture. ValueError naming it and the supported ones
    when the table lacks it, or naming the sites it lacks among ``sites``."""
    architecture = _architecture(hf_config)
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture}: TransformerLens hook names are placed per architecture "
            f"and this module has no table for it; supported: {sorted(_ARCHITECTURES)}. Hook "
            "modules of your choosing under names of your own with (module_path, width) specs"
        )
    for setting, value in _LAYOUT_SETTINGS.get(architecture, {}).items():
        if getattr(hf_config, setting) != value:
            raise ValueError(
                f"architecture {architecture} with {setting}={getattr(hf_config, setting)!r}: this module's "
                f"table describes {architecture} with {setting}={value!r}, where its tensors sit elsewhere"
            )
    taps = _ARCHITECTURES[architecture][1]
    missing = [site for site in SITES if site in sites and site not in taps]
    if missing:
        raise ValueError(
            f"{architecture} has no {[SITES[site] for site in missing]}"
            + (
                " (attention and MLP read the same residual stream, as in TransformerLens)"
                if "resid_mid" in missing
                else ""
            )
            + f"; its sites: {[site for site in SITES if site in taps]}"
        )
    return taps


def _num_experts(hf_config: Any) -> int | None:
    """The experts of each mixture-of-experts block, or None for a dense model."""
    return getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)


def _site_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """One row's shape at each site of a decoder-only model, from its transformers config
    (whose attribute names differ between families)."""
    d_model = hf_config.hidden_size
    n_heads = hf_config.num_attention_heads
    d_head = getattr(hf_config, "head_dim", None) or d_model // n_heads
    if getattr(hf_config, "multi_query", False) and not getattr(hf_config, "new_decoder_architecture", False):
        n_kv_heads = 1  # Falcon's multi-query attention
    else:
        n_kv_heads = getattr(hf_config, "num_key_value_heads", None) or getattr(hf_config, "num_kv_heads", None)
        n_kv_heads = n_kv_heads or n_heads
    d_mlp = next(
        (
            width
            for width in (
                getattr(hf_config, name, None)
                for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
            )
            if width
        ),
        4 * d_model,
    )
    n_experts = _num_experts(hf_config)
    if n_experts:
        d_mlp = d_model  # a mixture of experts: TransformerLens's mlp hooks are the block's input and output
    shapes = {site: (d_model,) for site in SITES}
    if n_experts:
        shapes.update(expert_weights=(n_experts,), expert_indices=(hf_config.num_experts_per_tok,))
    shapes.update(
        attn_q=(n_heads, d_head),
        attn_rot_q=(n_heads, d_head),
        attn_z=(n_heads, d_head),
        attn_k=(n_kv_heads, d_head),
        attn_v=(n_kv_heads, d_head),
        attn_rot_k=(n_kv_heads, d_head),
        mlp_pre=(d_mlp,),
        mlp_post=(d_mlp,),
    )
    return shapes


def capture_specs(
    hf_config: Any, sites: tuple[str, ...] = ("resid_post",), layers: list[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """``{hook_name: row shape}`` for the model, in the order a forward reaches them.

    hf_config: the model's transformers config, e.g.
        ``AutoConfig.from_pretrained(path)``; its architecture must be one the
        module's table places (ValueError naming it and the supported ones).
    sites: keys of ``SITES`` the architecture has; layer sites expand over
        ``layers`` (default all).
    """
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise ValueError(f"capture_specs: unknown sites {unknown}; valid: {list(SITES)}")
    _taps(hf_config, sites)
    num_layers = hf_config.num_hidden_layers
    layers = list(range(num_layers)) if layers is None else list(layers)
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"capture_specs: layers {bad} outside [0, {num_layers})")
    shapes = _site_shapes(hf_config)
    chosen = [site for site in SITES if site in sites]  # forward order
    specs = {SITES[site]: shapes[site] for site in chosen if site in ("embed", "pos_embed")}
    for i in sorted(set(layers)):
        specs.update({SITES[site].format(i=i): shapes[site] for site in chosen if "{i}" in SITES[site]})
    if "final_norm" in chosen:
        specs[SITES["final_norm"]] = shapes["final_norm"]
    return specs


# ---------------------------------------------------------------------------
# Config channel. vLLM builds its workers in other processes, so a module
# global set in the driver never reaches them: the config travels as JSON in
# vLLM's own additional_config (which every worker receives, Ray's included,
# and which vLLM hashes into its compile-cache key), or, for servers started
# by hand, in one environment variable. It is validated when written and again
# when read, since a worker may run another copy of this file.
# ---------------------------------------------------------------------------

_CONFIG_ENV = "TL_VLLM_HOOKS_CONFIG"
_DISABLE_ENV = "TL_VLLM_HOOKS_DISABLE"
_ADDITIONAL_CONFIG_KEY = "tl_vllm_hooks_config"
_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")

WORKER_EXTENSION = f"{__name__}.WorkerExtension"
"""vLLM's ``worker_extension_cls`` for this module (``config.llm_kwargs`` holds it)."""


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What the workers hook, and how.

    capture_specs: ``{hook_name: spec}``. A TransformerLens hook name
        (``blocks.3.hook_resid_post``) takes the shape of one of its rows
        (``128``, or ``(n_heads, d_head)`` for ``attn.hook_z``), and the
        architecture table places it; ``capture_specs(hf_config)`` writes
        these. Any other name takes ``(module_path, width)``: the output of
        that module of the model vLLM loads (its first element if it returns a
        tuple), ``width`` its last dimension. Names holding ``hook_`` are
        TransformerLens's and cannot be given a module path.
    max_num_batched_tokens: rows of every capture buffer and edit table, and
        the engine's tokens per forward (``llm_kwargs`` passes it on).
    dtype: dtype of the capture buffers (a floating dtype).
    enable_batching: the batched flavour (many requests per generate, each
        with its own rows and edits) instead of the compiled one.
    enable_position_interventions: engine-wide edits may be limited to token
        positions.
    sink_dir: batched flavour only: a directory (absolute path) where the
        workers write each finished request's kept rows, as safetensors shards
        with a manifest (see CaptureDataset), instead of holding them for
        read_batched.
    shard_bytes: a shard is closed once its rows reach this many bytes.
    shard_seconds: and once it has been open this long (seconds), so that a
        server's requests reach readers soon; None: by size (or flush_sink) only.
    """

    capture_specs: dict[str, tuple[int, ...] | tuple[str, int]]
    max_num_batched_tokens: int = 2048
    dtype: torch.dtype = torch.float32
    enable_batching: bool = False
    enable_position_interventions: bool = False
    sink_dir: str | None = None
    shard_bytes: int = 1 << 30
    shard_seconds: float | None = None

    def __post_init__(self) -> None:
        specs = self.capture_specs
        if not isinstance(specs, dict) or not specs:
            raise ValueError(
                "capture_specs: expected a non-empty dict {hook_name: row shape} "
                f"(see capture_specs(hf_config)), got {specs!r}"
            )
        object.__setattr__(self, "capture_specs", {n: _checked_spec(n, s) for n, s in specs.items()})
        if not _is_positive_int(self.max_num_batched_tokens):
            raise ValueError(f"max_num_batched_tokens: must be a positive int, got {self.max_num_batched_tokens!r}")
        if not isinstance(self.dtype, torch.dtype) or _dtype_name(self.dtype) not in _FLOAT_DTYPES:
            raise ValueError(f"dtype: expected one of torch.{', torch.'.join(_FLOAT_DTYPES)}, got {self.dtype!r}")
        for flag in ("enable_batching", "enable_position_interventions"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: must be a bool, got {getattr(self, flag)!r}")
        if self.sink_dir is not None:
            if not isinstance(self.sink_dir, str) or not self.sink_dir:
                raise ValueError(f"sink_dir: expected a directory path (str) or None, got {self.sink_dir!r}")
            if not self.enable_batching:
                raise ValueError("sink_dir: the sink writes per-request rows: configure(..., enable_batching=True)")
            object.__setattr__(self, "sink_dir", os.path.abspath(self.sink_dir))
        if not _is_positive_int(self.shard_bytes):
            raise ValueError(f"shard_bytes: must be a positive int, got {self.shard_bytes!r}")
        seconds = self.shard_seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf
        ):
            raise ValueError(f"shard_seconds: must be a finite number of seconds > 0, or None; got {seconds!r}")

    def row_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one row of hook ``name``: ``(width,)`` or ``(n_heads, d_head)``."""
        spec = self.capture_specs[name]
        return (spec[1],) if isinstance(spec[0], str) else spec

    def width(self, name: str) -> int:
        """Elements in one row of hook ``name``."""
        return math.prod(self.row_shape(name))

    @property
    def llm_kwargs(self) -> dict[str, Any]:
        """What ``LLM(model, **config.llm_kwargs)`` (or ``EngineArgs``, ``AsyncEngineArgs``)
        needs for these hooks: the worker extension, the config in ``additional_config``,
        the buffers' tokens per forward, and prefix caching off, so that every request
        keeps all its rows by default. The batched flavour may turn it back on (see
        ``request_args``); the compiled one refuses it."""
        return {
            "worker_extension_cls": WORKER_EXTENSION,
            "additional_config": {_ADDITIONAL_CONFIG_KEY: self.to_json()},
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": False,
        }

    @property
    def serve_args(self) -> list[str]:
        """The same for ``vllm serve MODEL *config.serve_args``, as command-line arguments.
        Batched engines keep vLLM's prefix caching, as servers run: a request then keeps
        rows only if its options ask (``request_args``)."""
        args = [
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--additional-config",
            json.dumps({_ADDITIONAL_CONFIG_KEY: self.to_json()}),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
        ]
        return args if self.enable_batching else [*args, "--no-enable-prefix-caching"]

    def to_json(self) -> str:
        """The wire form: JSON, with the module version that wrote it."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        fields.update(dtype=_dtype_name(self.dtype), version=__version__)
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, payload: str) -> CaptureConfig:
        """Parse and validate the wire form; ValueError names the bad field."""
        try:
            data = json.loads(payload)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{_CONFIG_ENV}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{_CONFIG_ENV}: expected a JSON object, got {type(data).__name__}")
        fields = {field.name for field in dataclasses.fields(cls)} | {"version"}
        if set(data) != fields:
            raise ValueError(
                f"{_CONFIG_ENV}: expected fields {sorted(fields)}, "
                f"missing {sorted(fields - set(data))}, unknown {sorted(set(data) - fields)}"
            )
        if data.pop("version") != __version__:
            raise ValueError(
                f"{_CONFIG_ENV}: written by another version of tl_vllm_hooks than {__version__!r}; "
                "driver and workers must load the same version"
            )
        if data["dtype"] not in _FLOAT_DTYPES:
            raise ValueError(f"dtype: expected one of {list(_FLOAT_DTYPES)}, got {data['dtype']!r}")
        if not isinstance(data["capture_specs"], dict):
            raise ValueError(f"capture_specs: expected an object, got {data['capture_specs']!r}")
        data["capture_specs"] = {n: tuple(s) if isinstance(s, list) else s for n, s in data["capture_specs"].items()}
        return cls(**{**data, "dtype": getattr(torch, data["dtype"])})


def _checked_spec(name: Any, spec: Any) -> tuple[int, ...] | tuple[str, int]:
    """One capture spec, normalized: a TransformerLens hook's row shape as a tuple of ints,
    or (module_path, width) for a module of the user's choosing."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"capture_specs: hook names must be non-empty strings, got {name!r}")
    if "hook_" in name:
        shape = (spec,) if _is_positive_int(spec) else spec
        if not isinstance(shape, (tuple, list)) or not shape or not all(map(_is_positive_int, shape)):
            raise ValueError(
                f"capture_specs[{name!r}]: a TransformerLens hook takes the shape of one row "
                f"(an int, or a tuple such as (n_heads, d_head)); the architecture table places "
                f"it, so it takes no module path; got {spec!r}. Write specs with capture_specs(hf_config)"
            )
        if re.fullmatch(r"blocks\.\d+\.attn\.(hook_pattern|hook_attn_scores)", name):
            raise ValueError(
                f"capture_specs: {name!r}: vLLM's attention kernels compute softmax(q k^T) blockwise and "
                "never hold the [query, key] matrix, so there is no tensor to read; capture "
                "attn.hook_rot_q and attn.hook_rot_k (or hook_q, hook_k) and form it from them"
            )
        if _parse_hook_name(name) is None:
            close = difflib.get_close_matches(name, [t.format(i=0) for t in SITES.values()], n=3)
            raise ValueError(
                f"capture_specs: {name!r} is not a hook this module knows; TransformerLens hooks "
                f"here: {sorted(SITES.values())}" + (f"; close matches: {close}" if close else "")
            )
        return tuple(shape)
    if (
        not isinstance(spec, (tuple, list))
        or len(spec) != 2
        or not isinstance(spec[0], str)
        or not spec[0]
        or not _is_positive_int(spec[1])
    ):
        raise ValueError(
            f"capture_specs[{name!r}]: expected (module_path: str, width: positive int) for a "
            f"module of your choosing, got {spec!r}"
        )
    return (spec[0], spec[1])


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_position_list(value: Any) -> bool:
    """A non-empty list (or tuple) of token positions: ints >= 0."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in value)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def configure(
    capture_specs: dict[str, tuple[int, ...] | tuple[str, int]],
    max_num_batched_tokens: int = 2048,
    dtype: torch.dtype = torch.float32,
    enable_batching: bool = False,
    enable_position_interventions: bool = False,
    sink_dir: str | None = None,
    shard_bytes: int = 1 << 30,
    shard_seconds: float | None = None,
) -> CaptureConfig:
    """Validate a config (ValueError naming the field) and register the patch in this process.

    Build the engine with ``LLM(model, **config.llm_kwargs)``: the config rides
    in the engine's own arguments, so nothing is left behind for later engines.
    A ``sink_dir`` is created if need be, and refused here if it cannot be
    written or holds captures of other hooks or another dtype.
    """
    config = CaptureConfig(
        capture_specs,
        max_num_batched_tokens,
        dtype,
        enable_batching,
        enable_position_interventions,
        sink_dir,
        shard_bytes,
        shard_seconds,
    )
    if sink_dir is not None:
        _tools().check_sink_dir(config)
    register()
    return config


def _disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------
# vLLM's internals: every place this module reads or wraps something of vLLM
# beyond its public API is in this section (the module paths and argument names
# of the architecture tables above aside), so a vLLM upgrade is read here.
# Checked on vLLM 0.24.0 (CUDA: V1 runner and Model Runner V2), 0.28.0 and
# 0.32.0 (CPU, V1 runner). Hooks must exist before vLLM's first forward (the
# profile run), where Dynamo traces the model: hooks added later are not in
# the compiled graph and never run, so they go in right after load_model.
# ---------------------------------------------------------------------------

_V2_BATCH = "_tl_step_batch"  # Model Runner V2's batch of the step in flight, see _wrap_steps
_SERVING_MODULES = (  # where the OpenAI server's request classes check a request's model
    ("vllm.entrypoints.serve.engine.serving", "BaseServing"),  # 0.32
    ("vllm.entrypoints.openai.serving_engine", "OpenAIServing"),  # 0.24-0.28
)
_originals: dict[tuple[Any, str], Any] = {}  # (vLLM class, attribute): what register() replaced


def _patch(owner: Any, attribute: str, replacement: Any) -> None:
    original = inspect.getattr_static(owner, attribute)  # a classmethod as itself, an inherited one too
    _originals[(owner, attribute)] = original
    setattr(owner, attribute, replacement)


def register() -> None:
    """Patch vLLM where a request and the hooks meet, once per process (``unregister``
    puts every original back):

    * ``Worker.load_model`` (0.24-0.32: ``vllm.v1.worker.gpu_worker``, which the
      CPU worker subclasses) installs the configured hooks after the weights load;
    * where the engine takes a request (``InputProcessor.process_inputs``), bad
      ``request_args`` options are refused with the message ``request_args`` gives,
      checked against that engine's config;
    * in a process that has loaded the OpenAI server, its request check
      (``_check_model``) does the same against the server's engine, so that it
      answers HTTP 400 before it streams;
    * where the engine builds its ``Request``, options become prefix-cache
      settings (see ``_keep_out_of_prefix_cache``).

    Idempotent; the ``vllm.general_plugins`` entry point calls it in every vLLM
    process. A worker whose engine has no config gets no hooks, and so does every
    worker of a process with ``TL_VLLM_HOOKS_DISABLE=1``.
    """
    if _originals or _disabled():
        return
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu_worker import Worker

    load_weights = Worker.load_model

    def load_model(self, *args, **kwargs):
        load_weights(self, *args, **kwargs)
        config = _engine_config(self.vllm_config)
        if config is not None and not _disabled():
            _install(self, config)

    _patch(Worker, "load_model", load_model)

    take_inputs = InputProcessor.process_inputs

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        _check_options(getattr(params, "extra_args", None), _engine_payload(self.vllm_config))
        return take_inputs(self, request_id, prompt, params, *args, **kwargs)

    _patch(InputProcessor, "process_inputs", process_inputs)

    build_request = Request.from_engine_core_request.__func__

    def from_engine_core_request(cls, request, *args, **kwargs):
        _keep_out_of_prefix_cache(request)
        return build_request(cls, request, *args, **kwargs)

    _patch(Request, "from_engine_core_request", classmethod(from_engine_core_request))

    # Only where the server is loaded already: importing it costs each vLLM process ~0.7 s.
    serving = next(
        (getattr(sys.modules[module], name) for module, name in _SERVING_MODULES if module in sys.modules), None
    )
    if serving is not None:
        check_model = serving._check_model

        async def check_request(self, request):
            error = await check_model(self, request)
            engine = getattr(self, "engine_client", None)  # the servings that generate have one
            if error is None and engine is not None:
                try:
                    _check_options(getattr(request, "vllm_xargs", None), _engine_payload(engine.vllm_config))
                except ValueError as refusal:
                    return self.create_error_response(str(refusal))
            return error

        _patch(serving, "_check_model", check_request)


def unregister() -> None:
    """Undo ``register()``: vLLM's patched attributes get their originals back. Hooks
    already installed stay; engines built afterwards get none."""
    while _originals:
        (owner, attribute), original = _originals.popitem()
        setattr(owner, attribute, original)


def _engine_payload(vllm_config: Any) -> str | None:
    """The config's JSON in the engine's additional_config, else in the environment, else None."""
    extra = vllm_config.additional_config
    payload = extra.get(_ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    return payload or os.environ.get(_CONFIG_ENV) or None


def _engine_config(vllm_config: Any) -> CaptureConfig | None:
    return _config_from_json(_engine_payload(vllm_config))


@functools.lru_cache(maxsize=16)
def _config_from_json(payload: str | None) -> CaptureConfig | None:
    return CaptureConfig.from_json(payload) if payload else None


def _check_options(extra_args: dict[str, Any] | None, payload: str | None) -> None:
    """Refuse a request's options (ValueError: what request_args would say) unless they
    suit an engine with the config ``payload`` (see _engine_payload)."""
    if not extra_args or _REQUEST_KEY not in extra_args:
        return
    options = extra_args[_REQUEST_KEY]
    # request_args' JSON text is checked once however many requests of a batch share it.
    (_check_options_text if isinstance(options, str) else _check_request_options)(options, payload)


def _check_request_options(options: Any, payload: str | None) -> None:
    config = _config_from_json(payload)
    if config is None or not config.enable_batching:
        raise ValueError(
            f"{_REQUEST_KEY} request options: this engine has {'no' if config is None else 'compiled'} hooks; "
            "per-request capture and edits need configure(..., enable_batching=True)"
        )
    _parse_request_options(options, config, torch.float32)


_check_options_text = functools.lru_cache(maxsize=256)(_check_request_options)


def _keep_out_of_prefix_cache(request: Any) -> None:
    """Before vLLM's engine builds a request, and hashes its prompt's blocks for the prefix cache.

    A request whose options edit rows gets a cache salt made from its edits: its
    blocks are shared only with requests making the same edits. One that keeps
    prompt rows before its last skips reading the cache, so those rows run through
    the model (its blocks are plain vLLM's unless it edits). Its options are marked,
    so the workers know this ran; options that do not parse are left to the
    workers, which refuse them.
    """
    params = request.sampling_params
    extra_args = getattr(params, "extra_args", None)
    if not extra_args or _REQUEST_KEY not in extra_args:
        return
    try:
        options = _options_from_wire(extra_args[_REQUEST_KEY])
        capture, edits = options.get("capture", "all"), options.get("edits") or {}
        prompt_len = len(request.prompt_token_ids or ()) or int(request.prompt_embeds.shape[0])
        keeps_prompt = capture in ("all", "prompt") if isinstance(capture, str) else min(capture) < prompt_len - 1
        digest = hashlib.sha256(json.dumps(edits, sort_keys=True, default=bytes.hex).encode()).hexdigest()[:32]
    except (ValueError, TypeError, AttributeError):
        return
    if edits:
        request.cache_salt = f"{request.cache_salt or ''}{_REQUEST_KEY}:{digest}"
    if keeps_prompt:
        params.skip_reading_prefix_cache = True
    params.extra_args = {**extra_args, _CACHE_MARK: digest if edits else ""}


def _key_compile_cache(vllm_config: Any, config: CaptureConfig) -> None:
    # vLLM keys its on-disk compile cache by VllmConfig.compute_hash(), which
    # hashes additional_config but knows nothing of hooks: a config that came
    # through the environment is added there, so a graph traced with other
    # hooks (or none) is never served.
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError(
            "additional_config: tl_vllm_hooks keys vLLM's compile cache through "
            f"LLM(additional_config=...), which must be a dict here, got {type(extra).__name__}"
        )
    extra["tl_vllm_hooks"] = hashlib.sha256(config.to_json().encode()).hexdigest()


def _engine_limits(vllm_config: Any) -> tuple[int, int, bool, Any]:
    """(tokens per forward, requests per step, prefix caching on, the transformers config)."""
    scheduler = vllm_config.scheduler_config
    return (
        scheduler.max_num_batched_tokens,
        scheduler.max_num_seqs,
        bool(vllm_config.cache_config.enable_prefix_caching),
        vllm_config.model_config.hf_config,
    )


def _after_warm_up(worker: Any, callback: Any) -> None:
    """Call ``callback()`` once vLLM's warm-up, compile and graph-capture forwards are done."""
    warm_up = worker.compile_or_warm_up_model  # on the instance: CPUWorker overrides it

    def compile_or_warm_up_model(*args, **kwargs):
        result = warm_up(*args, **kwargs)
        callback()
        return result

    worker.compile_or_warm_up_model = compile_or_warm_up_model


def _wrap_steps(runner: Any, steps: Any) -> None:
    """Around each step of the model runner: ``steps.schedule(scheduler_output)`` before it,
    ``steps.prepared()`` once its inputs are prepared (before the forward),
    ``steps.executed()`` after the forward, ``steps.finish()`` in any case.

    The V1 runner prepares a step in ``_prepare_inputs`` and keeps the batch in
    ``input_batch``; Model Runner V2 (0.24) builds a fresh InputBatch in
    ``prepare_inputs`` and keeps it only in a local variable, so the wrapper keeps
    it on the runner until execute_model returns, for segment_by_request.
    """
    execute_model = runner.execute_model
    tracks_v2 = not hasattr(runner, "input_batch")
    prepare_name = "prepare_inputs" if tracks_v2 else "_prepare_inputs"
    prepare = getattr(runner, prepare_name)
    if tracks_v2:
        setattr(runner, _V2_BATCH, None)

    def prepare_then_route(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        if tracks_v2:
            setattr(runner, _V2_BATCH, prepared)
        steps.prepared()
        return prepared

    def execute_then_collect(scheduler_output, *args, **kwargs):
        steps.schedule(scheduler_output)
        try:
            result = execute_model(scheduler_output, *args, **kwargs)
            steps.executed()
            return result
        finally:
            steps.finish()
            if tracks_v2:
                setattr(runner, _V2_BATCH, None)

    setattr(runner, prepare_name, prepare_then_route)
    runner.execute_model = execute_then_collect


def _unwrap(worker: Any, runner: Any) -> None:
    for method in ("prepare_inputs", "_prepare_inputs", "execute_model", _V2_BATCH):
        runner.__dict__.pop(method, None)
    worker.__dict__.pop("compile_or_warm_up_model", None)


def _scheduled(
    scheduler_output: Any,
) -> tuple[Any, list[tuple[str, int, list[int] | None, dict, int]], dict[str, int]]:
    """A step's scheduler output: (ids of requests finished since the last step,
    [(id, prompt tokens, prompt token ids or None for embeddings, SamplingParams.extra_args,
    first position)] of the requests new in it, {id: first position} of the others)."""
    new = []
    for request in scheduler_output.scheduled_new_reqs:
        if request.prompt_token_ids is not None:
            prompt_len = len(request.prompt_token_ids)
        else:
            prompt_len = int(request.prompt_embeds.shape[0])
        extra_args = getattr(request.sampling_params, "extra_args", None) or {}
        new.append((request.req_id, prompt_len, request.prompt_token_ids, extra_args, request.num_computed_tokens))
    cached = scheduler_output.scheduled_cached_reqs
    return scheduler_output.finished_req_ids, new, dict(zip(cached.req_ids, cached.num_computed_tokens))


def segment_by_request(model_runner: Any) -> tuple[list[int], list[str]]:
    """Row offsets and request ids of the forward in flight.

    Returns ``(starts, request_ids)``: request ``request_ids[i]`` owns rows
    ``starts[i]:starts[i + 1]`` of every ``[num_tokens, width]`` activation;
    rows past ``starts[-1]`` are padding. Ids are the worker's (the user's id
    plus a random suffix unless vLLM was told not to add one). Valid only while a
    forward is in flight. Raises RuntimeError when the runner's layout is not one
    this module knows.
    """
    input_batch = getattr(model_runner, "input_batch", None)
    query_start_loc = getattr(model_runner, "query_start_loc", None)
    if input_batch is not None and query_start_loc is not None:  # V1 runner
        request_ids = list(input_batch.req_ids)
        return query_start_loc.np[: len(request_ids) + 1].tolist(), request_ids
    if hasattr(model_runner, _V2_BATCH):  # Model Runner V2, see _wrap_steps
        batch = getattr(model_runner, _V2_BATCH)
        if batch is None:  # a forward vLLM runs without requests (profile, capture)
            return [0], []
        num_requests = batch.num_reqs
        return batch.query_start_loc_np[: num_requests + 1].tolist(), list(batch.req_ids[:num_requests])
    raise RuntimeError(
        f"segment_by_request: cannot tell requests apart in {type(model_runner).__name__}: it "
        "has neither input_batch.req_ids with query_start_loc (vLLM's V1 model runner) nor "
        "a tracked step batch (Model Runner V2)"
    )


def _model_positions(args: tuple, kwargs: dict) -> torch.Tensor:
    """The token positions a vLLM model's forward(input_ids, positions, ...) receives."""
    return kwargs["positions"] if "positions" in kwargs else args[1]


def _tensor_parallel_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 without tensor parallelism)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _pipeline_rank() -> int:
    """This worker's pipeline stage (0 without pipeline parallelism)."""
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


def _versions() -> dict[str, str]:
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "tl_vllm_hooks": __version__}


def _is_pp_missing(module: torch.nn.Module) -> bool:
    """A placeholder pipeline parallelism left where another rank holds the module."""
    return type(module).__name__ == "PPMissingLayer"


def _tensor_parallel_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def _tensor_parallel_share(module: torch.nn.Module, tap: _Tap, width: int) -> tuple[int, int] | None:
    """(first column, columns) of a row of ``width`` this rank holds, or None for all
    of it: a RowParallelLinear's input, heads of a QKVParallelLinear's output or of
    what Attention receives, and half a gated activation's input (gate, then up)."""
    if tap.kind == "input" and getattr(module, "input_is_parallel", False) and getattr(module, "tp_size", 1) > 1:
        share = module.input_size_per_partition
        return module.tp_rank * share, share
    ranks = _tensor_parallel_size()
    if ranks == 1:
        return None
    if tap.kind == "output" and any(
        type(linear).__name__ == "RowParallelLinear" and not linear.reduce_results
        for linear in (module, *module.children())
    ):
        raise ValueError(
            f"{tap.module}: under tensor parallelism its output is one rank's part of a sum the layer "
            "reduces later (RowParallelLinear without reduce_results), not the whole tensor; "
            "read it with tensor_parallel_size=1"
        )
    if tap.kind == "output" and not tap.part and not getattr(module, "gather_output", True):
        share = module.output_size_per_partition  # a ColumnParallelLinear's output
        return _tensor_parallel_rank() * share, share
    if not (tap.part in ("q", "k", "v", "gate") or tap.inputs in (_QUERY, _KEY)):
        return None
    if tap.part == "gate":
        share = width // ranks
    else:
        heads = module.num_heads if tap.part == "q" or tap.inputs == _QUERY else module.num_kv_heads
        share = heads * module.head_size
    if share * ranks != width:
        raise ValueError(
            f"{tap.module}: its {width} columns are not split evenly over {ranks} tensor-parallel ranks "
            f"(this rank holds {share}: key and value heads are replicated when there are fewer of them "
            "than ranks); read them with a tensor_parallel_size that divides the number of key-value heads"
        )
    return _tensor_parallel_rank() * share, share


def _qkv_columns(module: torch.nn.Module, part: str) -> tuple[int, int] | None:
    """The columns of q, k or v in a QKVParallelLinear's output on this rank."""
    if part not in ("q", "k", "v"):
        return None
    q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[part]


def _output_width(module: torch.nn.Module) -> int | None:
    """The width of a module's output rows where its parameters tell it (vLLM's linear
    layers and embeddings, norms), else None: the hook checks rows at the first forward."""
    if hasattr(module, "embedding_dim"):  # before the next: vLLM's vocabulary embeddings have both
        return module.embedding_dim
    if hasattr(module, "output_size_per_partition"):
        return module.output_size if getattr(module, "gather_output", False) else module.output_size_per_partition
    weight = getattr(module, "weight", None)
    if type(module).__name__.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.shape[0]
    return None


def _norm_eps(module: torch.nn.Module) -> float:
    """vLLM's RMSNorm keeps it as variance_epsilon, torch's LayerNorm as eps."""
    return getattr(module, "variance_epsilon", None) or module.eps


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the module's forward arguments (a CustomOp's, whose forward takes *args)."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters) and hasattr(module, "forward_native"):
        parameters = list(inspect.signature(module.forward_native).parameters.values())  # bound, or static
    return [p.name for p in parameters]


def _driver_vllm_config(engine: Any) -> Any:
    """The VllmConfig of an offline ``LLM`` or an ``AsyncLLM``."""
    return getattr(engine, "llm_engine", engine).vllm_config


def _has_unfinished_requests(engine: Any) -> bool:
    engine = getattr(engine, "llm_engine", engine)  # an LLM's LLMEngine, or the AsyncLLM
    return engine.output_processor.has_unfinished_requests()


# ---------------------------------------------------------------------------
# Worker state. Built once, in _HookState, before the profile run,
# torch.compile and CUDA-graph capture, so compiled code always sees the same
# tensors; between forwards only their contents are rewritten.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _PlacedHook:
    """One hook as this worker holds it: its module and tap, its row shape and the
    columns of a full row it holds ([n_heads / tp, d_head] and a slice of the columns
    for a tensor-parallel shard of attn_z, the whole row otherwise)."""

    module: torch.nn.Module
    tap: _Tap
    row_shape: tuple[int, ...]
    columns: tuple[int, int]
    part_columns: tuple[int, int] | None = None  # a part's columns in the module's tensor

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]


class _HookState:
    """Everything one worker's hooks share: buffers, edit tables, handles and the flavour."""

    def __init__(
        self,
        config: CaptureConfig,
        model: torch.nn.Module,
        placed: dict[str, _PlacedHook],
        absent: list[str],
        max_num_seqs: int,
        prefix_caching: bool,
        hf_config: Any,
    ):
        self.config = config
        self.hf_config = hf_config
        self.prefix_caching = prefix_caching
        self.placed = placed
        self.hook_names = list(placed)
        self.absent = absent
        self.handles: list[Any] = []
        self.device = device = next(model.parameters()).device
        self.edit_dtype = next(model.parameters()).dtype
        max_rows = config.max_num_batched_tokens

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.fire_counts = zeros(len(placed))
        # One int64 per hook: 0 = open (the next forward writes its rows),
        # 1 = closed; one fill opens them all.
        self.capture_flags = zeros(len(placed))
        self.capture_buffers = {name: zeros(max_rows, hook.width, dtype=config.dtype) for name, hook in placed.items()}
        flavour = _Batched if config.enable_batching else _Compiled
        self.flavour = flavour(self, max_num_seqs)
        # Edit tables, out = out * scale + bias: the flavour gives their shape.
        self.scales = {
            name: torch.ones(self.flavour.table_shape(hook.width), dtype=self.edit_dtype, device=device)
            for name, hook in placed.items()
        }
        self.biases = {name: torch.zeros_like(scale) for name, scale in self.scales.items()}
        # Norm taps: a pre-hook edits the norm's input rows and a post-hook
        # rewrites the norm's output rows the edit changed; these carry the
        # edited rows (fp32) and which rows changed from one to the other.
        norm_taps = [name for name, hook in placed.items() if hook.tap.norm]
        self.norm_rows = {name: zeros(max_rows, placed[name].width, dtype=torch.float32) for name in norm_taps}
        self.norm_changed = {name: zeros(max_rows, 1, dtype=torch.bool) for name in norm_taps}

    def forget_warm_up(self) -> None:
        """Drop what vLLM's own warm-up and graph-capture forwards left behind."""
        self.fire_counts.zero_()
        self.capture_flags.fill_(1)
        self.flavour.forget_warm_up()

    def local_columns(self, name: str, row: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full-width edit row or table."""
        start, stop = self.placed[name].columns
        return row[..., start:stop]

    def shards(self) -> dict[str, int]:
        """For each hook this rank holds a tensor-parallel part of: where its part starts
        along the first dimension of a row (a head, or an MLP unit)."""
        return {
            name: hook.columns[0] // math.prod(hook.row_shape[1:])
            for name, hook in self.placed.items()
            if hook.width != self.config.width(name)
        }


def _install(worker: Any, config: CaptureConfig) -> None:
    runner = worker.model_runner
    model = runner.get_model()
    engine_rows, max_num_seqs, prefix_caching, hf_config = _engine_limits(worker.vllm_config)
    if engine_rows > config.max_num_batched_tokens:
        raise ValueError(
            f"max_num_batched_tokens: the engine schedules up to {engine_rows} tokens per "
            f"forward but the capture buffers hold {config.max_num_batched_tokens}; build it "
            "with LLM(model, **config.llm_kwargs), which passes the buffers' size on"
        )
    if prefix_caching and not config.enable_batching:
        raise ValueError(
            "enable_prefix_caching: the compiled flavour keeps the rows of one forward, and tokens served "
            "from vLLM's prefix cache never run through the model, so rows would be missing; build the "
            "engine with LLM(model, **config.llm_kwargs), which turns it off, or use the batched flavour "
            "(configure(..., enable_batching=True)), which keeps capturing requests off the cache"
        )
    _uninstall(worker)
    _sweep_shared_files()
    atexit.unregister(_sweep_shared_files)  # once per process, however many installs
    atexit.register(_sweep_shared_files, own=True)
    placed, absent = _place_hooks(model, hf_config, config)
    state = _HookState(config, model, placed, absent, max_num_seqs, prefix_caching, hf_config)
    for index in range(len(placed)):
        _attach_hook(state, index)
    state.flavour.attach(model, runner)
    if config.sink_dir is not None:
        _open_sink(state, worker.vllm_config)
    _after_warm_up(worker, state.forget_warm_up)
    worker._tl_hooks = state
    _key_compile_cache(worker.vllm_config, config)
    logger.info(
        "tl_vllm_hooks: %d hooks installed (%s flavour), %d absent on this rank",
        len(placed),
        state.flavour.name,
        len(absent),
    )


def _open_sink(state: _HookState, vllm_config: Any) -> None:
    """Give this rank a ShardWriter (tl_vllm_hooks_tools) if it writes: the first tensor-parallel rank of each
    pipeline stage writes its stage's hooks, the other ranks only their parts of split ones."""
    tensor_rank, shards = _tensor_parallel_rank(), state.shards()
    writes = [name for name in state.hook_names if tensor_rank == 0 or name in shards]
    if not writes:
        return
    writer, tools = f"pp{_pipeline_rank()}-tp{tensor_rank}", _tools()
    header = {
        **tools.sink_header(state.config),
        "writer": writer,
        "model": vllm_config.model_config.model,
        "versions": _versions(),
        "writes": writes,
        "shards": {name: shards[name] for name in writes if name in shards},
    }
    flavour = state.flavour
    config = state.config
    flavour.sink = tools.ShardWriter(config.sink_dir, writer, header, config.shard_bytes, config.shard_seconds)
    flavour.sink_hooks = writes
    atexit.register(flavour.sink.close)  # what was written stays readable if the engine is not flushed


def _uninstall(worker: Any) -> None:
    state = getattr(worker, "_tl_hooks", None)
    if state is not None:
        sink = getattr(state.flavour, "sink", None)
        if sink is not None:
            sink.close()
        for handle in state.handles:
            handle.remove()
        _unwrap(worker, worker.model_runner)
        worker._tl_hooks = None


def _place_hooks(
    model: torch.nn.Module, hf_config: Any, config: CaptureConfig
) -> tuple[dict[str, _PlacedHook], list[str]]:
    """Each configured hook's module and tap on this rank, in the order a forward reaches
    them (hooks on one module run in that order); names whose module pipeline
    parallelism put on another rank are returned apart."""
    modules = dict(model.named_modules())
    sites = {_parse_hook_name(name)[0] for name in config.capture_specs if "hook_" in name}
    if sites:
        taps = _taps(hf_config, sites)
        architecture = _architecture(hf_config)
        classes = _ARCHITECTURES[architecture][0]
        if type(model).__name__ not in classes:
            raise ValueError(
                f"architecture {architecture}: this vLLM serves it with {type(model).__name__}, "
                f"whose module tree this module's table does not describe (it describes "
                f"{list(classes)}); supported: {sorted(_ARCHITECTURES)}"
            )
        shapes = _site_shapes(hf_config)

    def forward_order(item: tuple[int, str]) -> tuple:
        position, name = item
        parsed = _parse_hook_name(name)
        if parsed is None:
            return (2, position)
        site, layer = parsed
        return (1 if site == "final_norm" else 0, -1 if layer is None else layer, list(SITES).index(site))

    placed, absent = {}, []
    for _position, name in sorted(enumerate(config.capture_specs), key=forward_order):
        spec = config.capture_specs[name]
        if isinstance(spec[0], str):
            tap, path = _Tap(spec[0], "output"), spec[0]
        else:
            site, layer = _parse_hook_name(name)
            if layer is not None and layer >= hf_config.num_hidden_layers:
                raise ValueError(f"{name}: the model has {hf_config.num_hidden_layers} layers")
            if spec != shapes[site]:
                raise ValueError(
                    f"capture_specs[{name!r}]: row shape {spec}, but this model's {name} has rows "
                    f"of {shapes[site]}: were the specs written for another model?"
                )
            tap = taps[site]
            path = tap.module.format(i=layer)
        module = _resolve_module(model, modules, path)
        if module is None:
            absent.append(name)
            continue
        _check_inputs(module, tap, path)
        row_shape, columns = _rank_share(module, tap, config.row_shape(name))
        placed[name] = _PlacedHook(module, tap, row_shape, columns, _qkv_columns(module, tap.part))
        width = _output_width(module) if tap.kind == "output" and not tap.part else None
        if width is not None and width != placed[name].width:
            raise ValueError(
                f"capture_specs[{name!r}]: width {placed[name].width}, but {path} "
                f"({type(module).__name__}) outputs rows of {width}"
            )
    return placed, absent


def _check_inputs(module: torch.nn.Module, tap: _Tap, path: str) -> None:
    """Refuse a tap whose inputs are not where the table says (a vLLM that renamed them)."""
    names = _forward_parameters(module) if tap.inputs else []
    for name, position in tap.inputs:
        if position >= len(names) or names[position] != name:
            raise ValueError(
                f"{path} ({type(module).__name__}) takes {names}: its input {name!r} is not at "
                f"position {position}, where this module's table for this vLLM expects it"
            )


def _rank_share(
    module: torch.nn.Module, tap: _Tap, row_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(row shape, columns) of the part of each row this rank holds. Under tensor
    parallelism the heads of q, k, v and z and the units of the MLP's hidden layer
    are split across ranks, heads first; everything else is whole on every rank."""
    width = math.prod(row_shape)
    share = _tensor_parallel_share(module, tap, width)
    if share is None:
        return row_shape, (0, width)
    start, columns = share
    return (row_shape[0] * columns // width, *row_shape[1:]), (start, start + columns)


def _resolve_module(model: torch.nn.Module, modules: dict, path: str) -> torch.nn.Module | None:
    """The module at ``path``; None when pipeline parallelism left it on another rank."""
    module = modules.get(path)
    if module is not None and not _is_pp_missing(module):
        return module
    prefix = path
    while prefix:
        if prefix in modules and _is_pp_missing(modules[prefix]):
            return None
        prefix = prefix.rpartition(".")[0]
    close = difflib.get_close_matches(path, list(modules), n=3, cutoff=0.6)
    raise ValueError(
        f"capture_specs: module path {path!r} does not exist in {type(model).__name__}"
        + (f"; close matches: {close}" if close else "")
        + "; paths look like 'model.layers.0.mlp' (see model.named_modules())"
    )


# ---------------------------------------------------------------------------
# Hooks. Traced into the compiled graph and replayed by CUDA graphs: no Python
# branching on tensor values, no host transfers, no side effects other than
# in-place writes into the state's buffers. Python branches on closure
# constants (the tap kind) and on static facts of a call (whether an argument
# came by name, whether the residual is None, the width) are fixed at trace
# time. Every activation is handled as [rows, width]: vLLM's native models pass
# [tokens, width], its Transformers backend [1, tokens, width].
# ---------------------------------------------------------------------------


def _select_edit(scale, bias, index, num_rows):
    """The edit's (scale, bias) for the forward's rows, broadcastable to [num_rows, width].

    scale, bias: [width], or 2-D tables whose row for forward row r is
    ``index[r]`` (a [max_rows] int64 buffer the flavour keeps), clamped to the
    table's last row.
    """
    if index is None:
        return scale, bias
    rows = index.narrow(0, 0, num_rows).clamp(max=scale.shape[0] - 1)
    return scale.index_select(0, rows), bias.index_select(0, rows)


def _argument(args, kwargs, name, position):
    if name in kwargs:
        return kwargs[name]
    return args[position] if position < len(args) else None


def _with_arguments(args, kwargs, replaced):
    """(args, kwargs) with the (name, position, value) of each of ``replaced`` put in."""
    args, kwargs = list(args), dict(kwargs)
    for name, position, value in replaced:
        if name in kwargs:
            kwargs[name] = value
        else:
            args[position] = value
    return tuple(args), kwargs


def _normalize(rows, norm, eps):
    """[rows, width] normalized over the last dimension in fp32, before any weight."""
    rows = rows.float()
    if norm == "layer":
        rows = rows - rows.mean(-1, keepdim=True)
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)


def _attach_hook(state: _HookState, index: int) -> None:
    """Register the forward hooks (and pre-hooks) that read and edit hook ``index``."""
    name = state.hook_names[index]
    placed = state.placed[name]
    tap, module, width = placed.tap, placed.module, placed.width
    capture_buffer = state.capture_buffers[name]
    capture_flag = state.capture_flags.narrow(0, index, 1)
    fire_count = state.fire_counts.narrow(0, index, 1)
    scale, bias, row_index = state.scales[name], state.biases[name], state.flavour.row_index(index)

    def columns_of(tensor):
        """(start, stop) of the site's columns in a module's [..., columns] tensor."""
        columns = tensor.shape[-1]
        if placed.part_columns is not None:
            return placed.part_columns
        return (0, columns // 2) if tap.part == "gate" else (0, columns)

    def as_rows(tensor):
        """The site's [rows, width] view of a module's input or output."""
        start, stop = columns_of(tensor)
        if stop - start != width:
            raise ValueError(
                f"{name}: {tap.module} gives rows of width {stop - start} at its {tap.kind}, "
                f"but the hook was configured with {width}"
            )
        rows = tensor.view(-1, tensor.shape[-1])
        return rows if stop - start == tensor.shape[-1] else rows[:, start:stop]

    def with_rows(tensor, rows):
        """``tensor`` with the site's columns replaced by ``rows``."""
        start, stop = columns_of(tensor)
        if stop - start == tensor.shape[-1]:
            return rows.view_as(tensor)
        whole = tensor.view(-1, tensor.shape[-1])
        return torch.cat([whole[:, :start], rows, whole[:, stop:]], dim=-1).view_as(tensor)

    def keep(activation):
        """The first forward after the flag opens wins; later ones rewrite what is there."""
        fire_count.add_(1)
        kept = capture_buffer.narrow(0, 0, activation.shape[0])
        kept.copy_(torch.where(capture_flag.bool(), kept, activation))
        capture_flag.fill_(1)

    def edit_of(rows):
        return _select_edit(scale, bias, row_index, rows.shape[0])

    if tap.kind == "router":  # read-only: vLLM's fused MoE routes inside its kernel
        top_k, num_experts = state.hf_config.num_experts_per_tok, _num_experts(state.hf_config)
        renormalize = tap.renormalize == "always" or bool(getattr(state.hf_config, tap.renormalize, False))

        def hook(_module, _inputs, output):
            logits = (output[0] if isinstance(output, tuple) else output).reshape(-1, num_experts).float()
            weights, indices = logits.softmax(-1).topk(top_k, dim=-1)
            if tap.part == "indices":
                keep(indices.to(capture_buffer.dtype))
                return output
            if renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            keep(torch.zeros_like(logits).scatter(-1, indices, weights).to(capture_buffer.dtype))
            return output

        state.handles.append(module.register_forward_hook(torch.no_grad()(hook)))
        return

    if tap.kind == "output":
        multiplier = float(getattr(state.hf_config, tap.multiplier)) if tap.multiplier else None

        def hook(_module, _inputs, output):
            rows = as_rows(output[0] if isinstance(output, tuple) else output)
            row_scale, row_bias = edit_of(rows)
            added = output[1] if tap.bias_apart else None
            if added is not None:
                start, stop = columns_of(output[0])
                added = added[start:stop]
            if multiplier is not None:  # the layer adds output * multiplier: the product carries the edit
                rows.mul_(row_scale).add_(row_bias / multiplier)
                keep(rows * multiplier)
            elif added is not None:  # the layer adds the bias: the sum carries the edit (+ 0 exactly unedited)
                rows.mul_(row_scale).add_(row_bias + added * row_scale - added)
                keep(rows + added)
            else:
                rows.mul_(row_scale).add_(row_bias)
                keep(rows)
            return output

        state.handles.append(module.register_forward_hook(torch.no_grad()(hook)))
        return

    if tap.kind == "output_pair":
        # (mlp_out * s + b, residual * s): the next layer's fused add+norm sums
        # exactly what vLLM sums unhooked at identity (x * 1 + 0 == x, bit for
        # bit), and exact zeros under suppress and set.
        def hook(_module, _inputs, output):
            hidden, residual = output
            row_scale, row_bias = edit_of(as_rows(hidden))
            residual = (as_rows(residual) * row_scale).view_as(residual)
            as_rows(hidden).mul_(row_scale).add_(row_bias)
            keep(as_rows(hidden) + as_rows(residual))
            return (hidden, residual)

        state.handles.append(module.register_forward_hook(torch.no_grad()(hook)))
        return

    (first, first_at), *rest = tap.inputs
    second, second_at = rest[0] if rest else (None, None)

    def inputs_of(args, kwargs):
        """(the first input, the second or None)."""
        residual = _argument(args, kwargs, second, second_at) if second else None
        return _argument(args, kwargs, first, first_at), residual

    if tap.kind in ("input", "input_pair"):

        def pre_hook(_module, args, kwargs):
            hidden, residual = inputs_of(args, kwargs)
            row_scale, row_bias = edit_of(as_rows(hidden))
            edited = as_rows(hidden) * row_scale + row_bias
            if residual is None:
                keep(edited)
                return _with_arguments(args, kwargs, [(first, first_at, with_rows(hidden, edited))])
            edited_residual = as_rows(residual) * row_scale
            keep(edited + edited_residual)
            replaced = [
                (first, first_at, edited.view_as(hidden)),
                (second, second_at, edited_residual.view_as(residual)),
            ]
            return _with_arguments(args, kwargs, replaced)

        state.handles.append(module.register_forward_pre_hook(torch.no_grad()(pre_hook), with_kwargs=True))
        return

    # Norm taps. On CUDA vLLM's fused add+norm overwrites its inputs in place,
    # so the pre-hook reads them and leaves the edited rows in norm_rows; the
    # post-hook rewrites only the output rows the edit changed, so an unedited
    # forward keeps vLLM's own output bit for bit. Where hook_resid_mid's tap
    # sits on the same norm (ln2's input), ln2 normalizes its edited rows.
    norm_rows, norm_changed = state.norm_rows[name], state.norm_changed[name]
    eps = _norm_eps(module)
    normalized = tap.kind == "normalized"
    weight, norm_bias = module.weight, getattr(module, "bias", None)  # Cohere's LayerNorm has no bias
    source = next(
        (
            earlier
            for earlier in state.hook_names[:index]
            if state.placed[earlier].module is module and state.placed[earlier].tap.kind == "norm_input"
        ),
        None,
    )

    def pre_hook(_module, args, kwargs):
        hidden, residual = inputs_of(args, kwargs)
        total = as_rows(hidden) if residual is None else as_rows(hidden) + as_rows(residual)
        if source is not None:
            num_rows = total.shape[0]
            changed = state.norm_changed[source].narrow(0, 0, num_rows)
            total = torch.where(changed, state.norm_rows[source].narrow(0, 0, num_rows).to(total.dtype), total)
        activation = _normalize(total, tap.norm, eps) if normalized else total
        row_scale, row_bias = edit_of(activation)
        edited = activation * row_scale + row_bias
        keep(edited)
        norm_rows.narrow(0, 0, edited.shape[0]).copy_(edited)
        norm_changed.narrow(0, 0, edited.shape[0]).copy_((edited != activation).any(-1, keepdim=True))

    def hook(_module, _inputs, output):
        out = as_rows(output[0] if isinstance(output, tuple) else output)
        edited = norm_rows.narrow(0, 0, out.shape[0])
        result = edited if normalized else _normalize(edited, tap.norm, eps)
        result = result * (weight.float() + 1.0 if tap.norm == "rms_offset" else weight.float())
        if tap.norm == "layer" and norm_bias is not None:
            result = result + norm_bias.float()
        out.copy_(torch.where(norm_changed.narrow(0, 0, out.shape[0]), result.to(out.dtype), out))
        return output

    state.handles.append(module.register_forward_pre_hook(torch.no_grad()(pre_hook), with_kwargs=True))
    state.handles.append(module.register_forward_hook(torch.no_grad()(hook)))


# ---------------------------------------------------------------------------
# Tensor wire format. vLLM's RPC carries msgpack values, not tensors, and this
# module never asks for pickle: a tensor travels as dtype name, shape and its
# raw bytes, so every dtype (bfloat16 included) round-trips bit for bit.
# ---------------------------------------------------------------------------

_WIRE_DTYPES = _FLOAT_DTYPES + ("int64", "int32", "bool")


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype": str, "shape": list[int], "data": bytes}``, exact for every dtype."""
    tensor = tensor.detach().to("cpu").contiguous()
    return {
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": tensor.reshape(-1).view(torch.uint8).numpy().tobytes(),
    }


def decode_tensor(message: dict[str, Any]) -> torch.Tensor:
    """Inverse of ``encode_tensor``: a CPU tensor of the encoded dtype and shape."""
    if not isinstance(message, dict) or set(message) != {"dtype", "shape", "data"}:
        raise ValueError(f"decode_tensor: expected keys dtype, shape, data; got {message!r:.200}")
    if message["dtype"] not in _WIRE_DTYPES:
        raise ValueError(f"decode_tensor: dtype {message['dtype']!r} is not one of {_WIRE_DTYPES}")
    dtype = getattr(torch, message["dtype"])
    shape = [int(size) for size in message["shape"]]
    data = bytes(message["data"])
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(
            f"decode_tensor: {len(data)} bytes for a {message['dtype']} tensor of shape {shape}, "
            f"expected {expected}"
        )
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


# Batched rows, which can be gigabytes, reach a driver on the worker's host through a
# file in /dev/shm (shared memory): the worker writes them there once, the RPC carries
# their dtypes, shapes and byte offsets, and the driver maps the file and unlinks it
# at once, so the rows live exactly as long as its tensors. A file whose writer died
# before the driver mapped it is removed when the next engine installs its hooks.

_SHARED_DIR = "/dev/shm"
_SHARED_PREFIX = "tl_vllm_hooks-"
_shared_file_numbers = itertools.count()


def _shared_file(driver_host: str) -> str | None:
    """A new file for rows to a driver on ``driver_host``; None if that is another host
    or this one has no /dev/shm."""
    if driver_host != socket.gethostname() or not os.path.isdir(_SHARED_DIR):
        return None
    return os.path.join(_SHARED_DIR, f"{_SHARED_PREFIX}{os.getpid()}-{next(_shared_file_numbers)}")


def _sweep_shared_files(own: bool = False) -> None:
    """Unlink the row files of processes that are gone (and, with ``own``, this one's)."""
    for path in glob.glob(os.path.join(_SHARED_DIR, _SHARED_PREFIX + "*")):
        pid = os.path.basename(path)[len(_SHARED_PREFIX) :].partition("-")[0]
        if pid.isdigit() and ((own and int(pid) == os.getpid()) or not _process_alive(int(pid))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _mapped_rows(path: str) -> torch.Tensor:
    """The worker's row file as a uint8 tensor, mapped copy-on-write (its tensors are
    writable, the file is never written) and unlinked: the mapping lives as long as the
    tensors made from it."""
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    os.unlink(path)
    return mapped


def _tensor_at(mapped: torch.Tensor, message: dict[str, Any]) -> torch.Tensor:
    """The tensor ``{"dtype", "shape", "offset"}`` describes in a mapped row file."""
    dtype = getattr(torch, message["dtype"])
    size = math.prod(message["shape"]) * dtype.itemsize
    return mapped[message["offset"] : message["offset"] + size].view(dtype).view(message["shape"])


def _write_rows(fd: int, chunks: list[torch.Tensor]) -> int:
    """Write the chunks' bytes one after another at the file's offset, from their own
    memory (no gathering copy); returns the bytes written."""
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


# ---------------------------------------------------------------------------
# Edits. One wire form for every flavour: per hook, an op, an optional value
# (a number or a row-shaped tensor) and optional positions. Each becomes a
# (scale, bias) pair with out = out * scale + bias. Checked in the driver
# before anything is sent, and again in the worker.
# ---------------------------------------------------------------------------

_EDIT_OPS = {"suppress": False, "scale": True, "add": True, "set": True}  # op -> takes a value
_REQUEST_KEY = "tl_vllm_hooks"  # in SamplingParams.extra_args, see request_args
_CACHE_MARK = "tl_vllm_hooks_cache"  # in extra_args where _keep_out_of_prefix_cache ran
_CAPTURE_MODES = ("all", "prompt", "last_prompt_token", "none")


def _parse_edit(
    edit: dict[str, Any], name: str, row_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """Validate one wire edit: its (scale, bias) rows, [width] float64, and its positions."""
    if not isinstance(edit, dict):
        raise ValueError(f"edits[{name!r}]: expected a dict with 'op', got {edit!r}")
    if not set(edit) <= {"op", "value", "positions"} or "op" not in edit:
        raise ValueError(
            f"edits[{name!r}]: keys must be 'op' plus optional 'value' and 'positions', got {sorted(edit)}"
        )
    op = edit["op"]
    if op not in _EDIT_OPS:
        raise ValueError(f"edits[{name!r}]: op {op!r} is not one of {sorted(_EDIT_OPS)}")
    if _EDIT_OPS[op] != ("value" in edit):
        need = "needs a 'value'" if _EDIT_OPS[op] else "takes no 'value'"
        raise ValueError(f"edits[{name!r}]: op {op!r} {need}")
    width = math.prod(row_shape)
    shapes = [(width,)] + ([row_shape] if len(row_shape) > 1 else [])
    valid = f"a finite number or a finite float tensor of shape {' or '.join(map(str, map(list, shapes)))}"
    value = torch.zeros(width, dtype=torch.float64)
    if _EDIT_OPS[op]:
        raw = edit["value"]
        try:
            if isinstance(raw, bool) or (isinstance(raw, (list, tuple)) and any(isinstance(v, bool) for v in raw)):
                raise TypeError("a bool is not a number")
            vector = decode_tensor(raw) if isinstance(raw, dict) else torch.tensor(raw, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"edits[{name!r}]: value must be {valid}, got {raw!r:.100}") from None
        if vector.dim() == 0:
            vector = vector.expand(width)
        if tuple(vector.shape) not in shapes or not vector.is_floating_point():
            raise ValueError(f"edits[{name!r}]: value must be {valid}, got shape {list(vector.shape)} ({vector.dtype})")
        value = vector.reshape(width).to(torch.float64)
        if not torch.isfinite(value).all():
            raise ValueError(f"edits[{name!r}]: value must be {valid}; it holds NaN or infinite numbers")
    keeps, adds = {"suppress": (0, 0), "scale": (value, 0), "add": (1, value), "set": (0, value)}[op]
    scale_row = torch.zeros(width, dtype=torch.float64).add_(keeps)
    bias_row = torch.zeros(width, dtype=torch.float64).add_(adds)
    positions = edit.get("positions")
    if positions is not None and not _is_position_list(positions):
        raise ValueError(
            f"edits[{name!r}]: positions must be a non-empty list of token positions " f"(ints >= 0), got {positions!r}"
        )
    return scale_row, bias_row, None if positions is None else list(positions)


def _global_rows(config: CaptureConfig) -> int:
    """Rows of the engine-wide part of an edit table: one per position (and one for every
    position past them), or one."""
    return config.max_num_batched_tokens + 1 if config.enable_position_interventions else 1


def _engine_wide_tables(
    edit: dict[str, Any], name: str, config: CaptureConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine-wide edit as (scale, bias): [width], or [max_rows + 1, width] by position."""
    width = config.width(name)
    scale_row, bias_row, positions = _parse_edit(edit, name, config.row_shape(name))
    if not config.enable_position_interventions:
        if positions is not None:
            raise ValueError(
                f"edits[{name!r}]: positions need configure(enable_position_interventions=True)"
                + (" or, per request, request_args(edits=...)" if config.enable_batching else "")
            )
        return scale_row.to(dtype), bias_row.to(dtype)
    shape = (_global_rows(config), width)
    if positions is None:
        # Every row, the last (every position past the table) included.
        return scale_row.expand(shape).to(dtype), bias_row.expand(shape).to(dtype)
    limit = shape[0] - 1
    if max(positions) >= limit:
        raise ValueError(
            f"edits[{name!r}]: positions must be < {limit} (max_num_batched_tokens) for an "
            f"engine-wide edit, got {positions!r}"
            + ("; request_args(edits=...) takes any position" if config.enable_batching else "")
        )
    scale = torch.ones(shape, dtype=torch.float64)
    bias = torch.zeros(shape, dtype=torch.float64)
    scale[positions] = scale_row
    bias[positions] = bias_row
    return scale.to(dtype), bias.to(dtype)


def _check_hook_name(name: Any, config: CaptureConfig) -> None:
    if name not in config.capture_specs:
        close = difflib.get_close_matches(str(name), list(config.capture_specs), n=3)
        raise ValueError(
            f"edits: {name!r} is not a configured hook"
            + (f"; close matches: {close}" if close else "")
            + f"; configured: {sorted(config.capture_specs)}"
        )
    if (_parse_hook_name(name) or ("",))[0] in _READ_ONLY_SITES:
        raise ValueError(
            f"edits: {name!r} is read-only: vLLM's fused mixture of experts routes inside its kernel, from "
            "the router's logits; edit the block's input (mlp.hook_pre) or output (hook_mlp_out) instead"
        )


def _options_from_wire(options: Any) -> Any:
    """A request's options as sent: the JSON text request_args writes (a value the OpenAI
    API's vllm_xargs accepts), or a dict written by hand."""
    if not isinstance(options, str):
        return options
    try:
        return json.loads(options)
    except json.JSONDecodeError as error:
        raise ValueError(f"request options: not valid JSON ({error}); write them with request_args") from None


def _parse_request_options(
    options: Any, config: CaptureConfig, dtype: torch.dtype
) -> tuple[str | np.ndarray, dict[str, tuple[torch.Tensor, torch.Tensor, np.ndarray | None]]]:
    """Validate one request's wire options (see request_args): (capture, edits by hook),
    each edit (scale row, bias row, sorted int64 positions or None) in ``dtype``."""
    options = _options_from_wire(options)
    if not isinstance(options, dict) or not set(options) <= {"capture", "edits"}:
        raise ValueError(f"request options: expected a dict with keys 'capture' and 'edits', got {options!r:.200}")
    capture = options.get("capture", "all")
    if isinstance(capture, (list, tuple)):
        if not _is_position_list(capture):
            raise ValueError(f"capture: a list of positions must hold ints >= 0 and not be empty, got {capture!r}")
        capture = np.unique(np.asarray(capture, dtype=np.int64))
    elif capture not in _CAPTURE_MODES:
        raise ValueError(
            f"capture: expected one of {list(_CAPTURE_MODES)} or a list of token positions, got {capture!r}"
        )
    edits = options.get("edits") or {}
    if not isinstance(edits, dict):
        raise ValueError(f"edits: expected a dict {{hook_name: edit}}, got {edits!r:.200}")
    parsed = {}
    for name, edit in edits.items():
        _check_hook_name(name, config)
        scale_row, bias_row, positions = _parse_edit(edit, name, config.row_shape(name))
        positions = None if positions is None else np.unique(np.asarray(positions, dtype=np.int64))
        parsed[name] = (scale_row.to(dtype), bias_row.to(dtype), positions)
    return capture, parsed


def _copy_to_device(array: np.ndarray, target: torch.Tensor) -> None:
    source = torch.from_numpy(array)
    if target.device.type == "cuda":
        source = source.pin_memory()  # the copy is queued; pinned memory outlives it
    target.copy_(source, non_blocking=True)


# ---------------------------------------------------------------------------
# Flavours: what differs between the compiled and the batched hooks, behind
# one interface (name, table_shape, row_index, engine_wide, attach,
# forget_warm_up, unread_requests). The hooks above run in every forward;
# what depends on which requests are in a step happens on the host, outside
# any graph, so both run under torch.compile and CUDA graphs as eagerly.
# ---------------------------------------------------------------------------


class _Compiled:
    """One prompt per capture: ``open_capture`` arms the hooks and the next forward's rows
    stay until the next open. Edit tables are [width], or, with edits by position,
    [max_rows + 1, width] indexed by each row's token position (the last row serves every
    position past max_rows: an edit without positions is there, identity under one
    limited to positions)."""

    name = "compiled"
    unread_requests = 0

    def __init__(self, state: _HookState, _max_num_seqs: int):
        self.config = state.config
        self.state = state
        # Token positions of the forward in flight, written by a pre-hook on the model.
        by_position = self.config.enable_position_interventions
        rows = self.config.max_num_batched_tokens
        self.positions = torch.zeros(rows, dtype=torch.int64, device=state.device) if by_position else None

    def table_shape(self, width: int) -> tuple[int, ...]:
        return (width,) if self.positions is None else (_global_rows(self.config), width)

    def row_index(self, _hook_index: int) -> torch.Tensor | None:
        return self.positions

    def engine_wide(self, table: torch.Tensor) -> torch.Tensor:
        return table

    def attach(self, model: torch.nn.Module, _runner: Any) -> None:
        if self.positions is None:
            return
        positions = self.positions

        def record_positions(_module, args, kwargs):
            given = _model_positions(args, kwargs)
            positions.narrow(0, 0, given.shape[0]).copy_(given)

        self.state.handles.append(model.register_forward_pre_hook(record_positions, with_kwargs=True))

    def forget_warm_up(self) -> None:
        pass

    def read(self, num_rows: int) -> dict[str, torch.Tensor]:
        """{hook: [num_rows, *row shape]} of the armed forward, on the device."""
        state = self.state
        if not _is_positive_int(num_rows) or num_rows > self.config.max_num_batched_tokens:
            raise ValueError(
                f"read_captures: num_rows must be an int in [1, {self.config.max_num_batched_tokens}] "
                f"(the capture buffer), got {num_rows!r}; a longer prompt is split by chunked "
                "prefill and only its first chunk is kept"
            )
        still_open = [n for n, flag in zip(state.hook_names, state.capture_flags.tolist()) if flag == 0]
        if still_open:
            raise RuntimeError(f"read_captures: no forward ran since open_capture for hooks {still_open}")
        return {
            name: buffer[:num_rows].view(num_rows, *state.placed[name].row_shape)
            for name, buffer in state.capture_buffers.items()
        }


_NO_LAST_POSITION = np.iinfo(np.int64).max
_KEEP_ALL = (0, _NO_LAST_POSITION)  # kept_range of a request without options


@dataclasses.dataclass
class _RequestPlan:
    """One request's options: which of its rows to keep, and its own edits.

    capture: one of _CAPTURE_MODES, or a sorted int64 array of positions.
    edits: hook -> (scale row, bias row, positions or None), rows [width] in
    the model's dtype on the CPU.
    prompt_token_ids: as the scheduler gave them (None for prompt embeddings).
    kept_range: (first, last) position kept; first == -1 marks a list of positions.
    """

    prompt_len: int
    capture: str | np.ndarray
    edits: dict[str, tuple[torch.Tensor, torch.Tensor, np.ndarray | None]]
    prompt_token_ids: list[int] | None = None
    kept_range: tuple[int, int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        last_prompt = self.prompt_len - 1
        if isinstance(self.capture, np.ndarray):
            self.kept_range = (-1, _NO_LAST_POSITION)
        else:
            self.kept_range = {
                "all": _KEEP_ALL,
                "prompt": (0, last_prompt),
                "last_prompt_token": (last_prompt, last_prompt),
                "none": (0, -1),
            }[self.capture]


class _RequestTable:
    """What every step reads of each of its requests, as int64 arrays with one entry per
    request from its first step to its end, so that a step reads and updates them for all
    its requests in a few array operations rather than request by request.

    kept_first, kept_last: the request's _RequestPlan.kept_range. next_position: the
    position its next row must have (0 before its first step). has_edits: 1 if its plan
    has edits.
    """

    _COLUMNS = ("kept_first", "kept_last", "next_position", "has_edits")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # request id -> its entry
        self.free: list[int] = []
        for column in self._COLUMNS:
            setattr(self, column, np.zeros(0, dtype=np.int64))

    def add(self, request_id: str, kept_range: tuple[int, int], has_edits: bool) -> int:
        """The request's entry, made on its first call; kept_range and has_edits written on every call."""
        entry = self.index.get(request_id)
        if entry is None:
            if not self.free:
                size = len(self.kept_first)
                for column in self._COLUMNS:
                    grown = np.concatenate([getattr(self, column), np.zeros(max(size, 64), np.int64)])
                    setattr(self, column, grown)
                self.free = list(range(len(self.kept_first) - 1, size - 1, -1))
            entry = self.index[request_id] = self.free.pop()
            self.next_position[entry] = 0
        self.kept_first[entry], self.kept_last[entry] = kept_range
        self.has_edits[entry] = has_edits
        return entry

    def remove(self, request_id: str) -> None:
        entry = self.index.pop(request_id, None)
        if entry is not None:
            self.free.append(entry)

    def entries(self, request_ids: list[str]) -> np.ndarray:
        """int64 [len(request_ids)]: each request's entry. One never added (running since
        before the hooks' first step) gets one that keeps every row."""
        entries = np.fromiter(
            map(self.index.get, request_ids, itertools.repeat(-1)), dtype=np.int64, count=len(request_ids)
        )
        for i in np.flatnonzero(entries < 0):
            entries[i] = self.add(request_ids[i], _KEEP_ALL, False)
        return entries


@dataclasses.dataclass
class _StepLayout:
    """The rows of one forward: request i owns rows starts[i]:starts[i + 1], the first of
    them at token position first_positions[i]; its numbers are entries[i] of the request table."""

    starts: np.ndarray  # int64 [num_requests + 1]
    request_ids: list[str]
    first_positions: np.ndarray  # int64 [num_requests]
    entries: np.ndarray  # int64 [num_requests]
    counts: np.ndarray = dataclasses.field(init=False)  # int64 [num_requests], rows each request runs
    row_positions: np.ndarray = dataclasses.field(init=False)  # int64 [num_rows], each row's position

    def __post_init__(self) -> None:
        self.counts = np.diff(self.starts)
        offsets = self.first_positions - self.starts[:-1]  # position minus row, per request
        self.row_positions = np.repeat(offsets, self.counts) + np.arange(self.starts[-1])


def _position_ranges(positions: np.ndarray) -> list[list[int]]:
    """Sorted positions as [start, stop) ranges of consecutive ones."""
    if not positions.size:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts, lasts = np.concatenate([[0], breaks]), np.concatenate([breaks, [positions.size]]) - 1
    return [[int(positions[first]), int(positions[last]) + 1] for first, last in zip(firsts, lasts)]


@dataclasses.dataclass
class _RequestRows:
    """What was kept of one request so far: one chunk per step that kept rows.

    A chunk is (that step's host rows by hook, first row, end row, the kept
    rows' positions as int64): rows are sliced out only when read, so a step
    costs each request one append, not one tensor per hook.
    """

    chunks: list[tuple[dict[str, torch.Tensor], int, int, np.ndarray]] = dataclasses.field(default_factory=list)

    def rows(self, name: str) -> list[torch.Tensor]:
        return [step_rows[name][start:end] for step_rows, start, end, _positions in self.chunks]


class _Batched:
    """Many requests per generate. Before each forward the host writes which edit-table
    row each token row uses (``row_edit_index``); after it, the rows each request keeps
    are gathered on the device and copied to host memory (on CUDA asynchronously, on a
    side stream, so the next step's forward overlaps the copy), keyed by request id.

    Edit tables: the engine-wide rows (as in the compiled flavour, always 2-D), then one
    identity row, then ``max_num_seqs`` slots that requests with their own edits hold
    while they run.
    """

    name = "batched"

    def __init__(self, state: _HookState, max_num_seqs: int):
        self.state = state
        self.config = state.config
        self.num_slots = max_num_seqs
        num_rows = self.config.max_num_batched_tokens
        # Row r of the forward in flight uses row row_edit_index[k, r] of hook k's tables.
        self.row_edit_index = torch.zeros(len(state.placed), num_rows, dtype=torch.int64, device=state.device)
        self.row_edit_index_dirty = False
        self.slots: dict[str, int] = {}  # request id -> slot holding its edits
        self.plans: dict[str, _RequestPlan] = {}
        self.request_table = _RequestTable()
        self.first_positions: dict[str, int] | None = None  # of the step being prepared
        self.step: _StepLayout | None = None  # of the step whose forward is in flight
        self.records: dict[str, _RequestRows] = {}
        self.incomplete: dict[str, str] = {}  # request id -> why its rows cannot be read
        self.copy_stream = torch.cuda.Stream(state.device) if state.device.type == "cuda" else None
        # With a sink_dir, finished requests' rows go to disk; _install gives the
        # ranks that write (and the hooks each writes) a _ShardWriter.
        self.sink: Any = None  # tl_vllm_hooks_tools.ShardWriter
        self.sink_hooks: list[str] = []
        # Model Runner V2 warms up with requests of its own (_warmup_{i}_), which finish
        # inside the warm-up: never written.
        self.warmed_up = False

    def table_shape(self, width: int) -> tuple[int, ...]:
        return (_global_rows(self.config) + 1 + self.num_slots, width)

    def row_index(self, hook_index: int) -> torch.Tensor:
        return self.row_edit_index[hook_index]

    def engine_wide(self, table: torch.Tensor) -> torch.Tensor:
        return table[: _global_rows(self.config)]

    def attach(self, _model: torch.nn.Module, runner: Any) -> None:
        self.runner = runner
        _wrap_steps(runner, self)

    def forget_warm_up(self) -> None:
        self.warmed_up = True
        self.plans.clear()
        self.request_table = _RequestTable()
        self.slots.clear()
        self.clear()

    def clear(self) -> None:
        self.records.clear()
        self.incomplete.clear()

    @property
    def unread_requests(self) -> int:
        return len(self.records)

    # Steps, in the order _wrap_steps calls them.

    def schedule(self, scheduler_output: Any) -> None:
        """Read the step's new requests' options and every request's first position."""
        finished, new, first_positions = _scheduled(scheduler_output)
        if self.config.sink_dir is not None and finished:
            self.write_to_sink(finished)
        for request_id in finished:
            self.plans.pop(request_id, None)
            self.request_table.remove(request_id)
            self.slots.pop(request_id, None)
        for request_id, prompt_len, prompt_token_ids, extra_args, first_position in new:
            plan = self._plan(request_id, prompt_len, extra_args)
            plan.prompt_token_ids = prompt_token_ids
            self.plans[request_id] = plan
            self.request_table.add(request_id, plan.kept_range, bool(plan.edits))
            if not (isinstance(plan.capture, str) and plan.capture == "none"):
                self.records.setdefault(request_id, _RequestRows())  # read_batched knows it from now on
            first_positions[request_id] = first_position
        self.first_positions = first_positions
        self.state.capture_flags.zero_()  # this step's forward writes its rows

    def _plan(self, request_id: str, prompt_len: int, extra_args: dict[str, Any]) -> _RequestPlan:
        options = extra_args.get(_REQUEST_KEY)
        if options is None:
            # With prefix caching on, the request may be served from the cache, so its
            # rows would not be whole: it runs as plain vLLM would run it.
            return _RequestPlan(prompt_len, "none" if self.state.prefix_caching else "all", {})
        if self.state.prefix_caching and _CACHE_MARK not in extra_args:
            # Its edits would reach blocks that unedited requests read: it runs unedited.
            self.incomplete[request_id] = (
                "its options were not applied: vLLM's engine process did not load tl_vllm_hooks, which keeps "
                "requests with options apart in the prefix cache; install the module (its entry point loads it "
                "in every vLLM process) or build the engine with enable_prefix_caching=False"
            )
            return _RequestPlan(prompt_len, "none", {})
        try:
            capture, edits = _parse_request_options(options, self.config, self.state.edit_dtype)
        except (ValueError, TypeError) as error:
            # request_args checks this in the driver; a hand-written extra_args that
            # fails here must not stop the engine: the request runs unedited and
            # reading it raises this message.
            self.incomplete[request_id] = f"its options were refused: {error}"
            return _RequestPlan(prompt_len, "none", {})
        edits = {name: edit for name, edit in edits.items() if name in self.state.capture_buffers}
        return _RequestPlan(prompt_len, capture, edits)

    def prepared(self) -> None:
        """After the step is prepared, before its forward: route each row to its edit."""
        if self.first_positions is None:  # preparation outside execute_model
            return
        starts, request_ids = segment_by_request(self.runner)
        if not request_ids:
            return
        first = np.fromiter(
            map(self.first_positions.get, request_ids, itertools.repeat(-1)), dtype=np.int64, count=len(request_ids)
        )
        if (first < 0).any():
            # Every request of a step is in its scheduler output; if one is not,
            # its rows cannot be placed: say so when read rather than guess.
            for i in np.flatnonzero(first < 0):
                self.incomplete[request_ids[i]] = "a step ran it without its scheduler output entry"
            return
        starts = np.asarray(starts, dtype=np.int64)
        self.step = _StepLayout(starts, request_ids, first, self.request_table.entries(request_ids))
        row_positions = self.step.row_positions
        global_rows = _global_rows(self.config)
        edited = np.flatnonzero(self.request_table.has_edits[self.step.entries])
        if global_rows == 1 and not edited.size:
            # Every row uses the engine-wide row 0: write the index only if a
            # request's edit changed it since.
            if self.row_edit_index_dirty:
                self.row_edit_index.zero_()
                self.row_edit_index_dirty = False
            return
        self.row_edit_index_dirty = True
        hook_names = self.state.hook_names
        index = np.minimum(row_positions, global_rows - 1)[None, :].repeat(len(hook_names), 0)
        for i in edited:
            plan = self.plans[request_ids[i]]
            slot_row = self._slot_row(request_ids[i], plan, request_ids)
            rows = slice(starts[i], starts[i + 1])
            for k, name in enumerate(hook_names):
                if name not in plan.edits:
                    continue
                positions = plan.edits[name][2]
                if positions is None:
                    index[k, rows] = slot_row
                else:
                    hit = np.isin(row_positions[rows], positions)
                    index[k, rows] = np.where(hit, slot_row, global_rows)  # identity row
        _copy_to_device(index, self.row_edit_index[:, : starts[-1]])

    def _slot_row(self, request_id: str, plan: _RequestPlan, step_ids: list[str]) -> int:
        """The edit-table row of the slot holding this request's edits, written there on first use."""
        first_slot_row = _global_rows(self.config) + 1  # past the engine-wide rows and identity
        if request_id in self.slots:
            return first_slot_row + self.slots[request_id]
        taken = set(self.slots.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        if not free:
            # A step holds at most max_num_seqs = num_slots requests, so some slot
            # belongs to a request outside this step (preempted or finished).
            in_step = set(step_ids)
            holder = next(r for r in self.slots if r not in in_step)
            free = [self.slots.pop(holder)]
        self.slots[request_id] = free[0]
        row = first_slot_row + free[0]
        state = self.state
        for name, (scale_row, bias_row, _positions) in plan.edits.items():
            state.scales[name][row].copy_(state.local_columns(name, scale_row))
            state.biases[name][row].copy_(state.local_columns(name, bias_row))
        return row

    def executed(self) -> None:
        """After the forward: send the kept rows to host memory, per request.

        Runs every step for every request in it: numpy over the step's rows and
        requests, and Python work only for the requests that kept rows or whose
        rows did not follow on from their last step's.
        """
        step = self.step
        if step is None:
            return
        starts = step.starts
        kept = self._kept_rows(step)
        num_run = step.counts
        running = num_run > 0  # (reduceat would read one row for an empty segment)
        kept_per_request = np.zeros(len(num_run), dtype=np.int64)
        if running.any():
            kept_per_request[running] = np.add.reduceat(kept.astype(np.int64), starts[:-1][running])
        kept_rows = np.flatnonzero(kept)
        host_rows = self._rows_to_host(kept_rows) if kept_rows.size else {}
        next_position = self.request_table.next_position
        expected = next_position[step.entries]
        next_position[step.entries[running]] = (step.first_positions + num_run)[running]
        offsets = np.cumsum(kept_per_request) - kept_per_request
        for i in np.flatnonzero(running & ((kept_per_request > 0) | (step.first_positions != expected))):
            start, end = int(offsets[i]), int(offsets[i] + kept_per_request[i])
            chunk = (host_rows, start, end, step.row_positions[kept_rows[start:end]])
            self._accumulate(step.request_ids[i], int(expected[i]), int(step.first_positions[i]), chunk)

    def finish(self) -> None:
        self.first_positions = None
        self.step = None

    def _kept_rows(self, step: _StepLayout) -> np.ndarray:
        """Boolean mask over the step's rows: which ones their request keeps."""
        first = self.request_table.kept_first[step.entries]
        last = self.request_table.kept_last[step.entries]
        positions = step.row_positions
        kept = (positions >= np.repeat(first, step.counts)) & (positions <= np.repeat(last, step.counts))
        for i in np.flatnonzero(first < 0):  # requests keeping a list of positions
            rows = slice(step.starts[i], step.starts[i + 1])
            kept[rows] = np.isin(positions[rows], self.plans[step.request_ids[i]].capture)
        return kept

    def _rows_to_host(self, kept_rows: np.ndarray) -> dict[str, torch.Tensor]:
        """{hook: [len(kept_rows), width]} on the host, gathered from the capture buffers.

        On CUDA the gather runs on the compute stream (the next forward rewrites
        the buffers) and the copy into pinned memory on a side stream: nothing
        waits for it until read_batched reads the rows.
        """
        buffers, device = self.state.capture_buffers, self.state.device
        if kept_rows.size == kept_rows[-1] + 1:  # rows 0..n-1: a copy of the slice
            gathered = {name: buffer[: kept_rows.size].clone() for name, buffer in buffers.items()}
        else:
            index = torch.empty(kept_rows.size, dtype=torch.int64, device=device)
            _copy_to_device(kept_rows, index)
            gathered = {name: buffer.index_select(0, index) for name, buffer in buffers.items()}
        if self.copy_stream is None:
            return gathered
        self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        host_rows = {}
        with torch.cuda.stream(self.copy_stream):
            for name, rows in gathered.items():
                host_rows[name] = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host_rows[name].copy_(rows, non_blocking=True)
                rows.record_stream(self.copy_stream)
        return host_rows

    def _accumulate(
        self, request_id: str, expected: int, first_position: int, chunk: tuple[dict, int, int, np.ndarray]
    ) -> None:
        """Add one step's chunk of a request whose rows ran from first_position; expected
        is the position its rows should have started at, had they followed on."""
        if first_position < expected:
            # Preempted and recomputed from first_position: drop what it kept past
            # that point, so no row appears twice.
            record = self.records.get(request_id)
            if record is not None:
                record.chunks = [
                    (rows, start, start + keep, positions[:keep])
                    for rows, start, _end, positions in record.chunks
                    if (keep := int(np.searchsorted(positions, first_position)))
                ]
        elif first_position > expected and self._keeps_any(request_id, expected, first_position):
            self.incomplete[request_id] = (
                f"rows for positions {expected}..{first_position - 1} never ran through the model "
                "(prefix caching reused them); build the engine with enable_prefix_caching=False"
            )
        if chunk[2] > chunk[1]:  # (reset_batched may have dropped its record meanwhile)
            self.records.setdefault(request_id, _RequestRows()).chunks.append(chunk)

    def _keeps_any(self, request_id: str, start: int, stop: int) -> bool:
        """Whether the request keeps the row of some position in [start, stop)."""
        plan = self.plans.get(request_id)
        if plan is None:
            return True
        if isinstance(plan.capture, np.ndarray):
            return bool(((plan.capture >= start) & (plan.capture < stop)).any())
        first, last = plan.kept_range
        return first <= last and first < stop and last >= start

    def read(
        self, request_ids: list[str], names: list[str], path: str | None
    ) -> tuple[dict[str, dict[str, Any]], str | None]:
        """({user id: {hook: message}}, the file written or None) for the given requests'
        rows at the hooks ``names``, which are then forgotten (every hook's); every id must
        match exactly one captured request, or nothing is read. Each message is the encoded
        [rows, *row shape], or, with ``path`` and rows to write, its dtype, shape and byte
        offset in that file, written here."""
        matches = _match_request_ids(request_ids, sorted(set(self.records) | set(self.incomplete)))
        for user_id, worker_id in matches.items():
            if worker_id in self.incomplete:
                raise RuntimeError(f"read_batched: request {user_id!r}: {self.incomplete[worker_id]}")
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # the copies to host still in flight
        records = {user_id: self.records.pop(worker_id) for user_id, worker_id in matches.items()}
        dtype, placed = self.config.dtype, self.state.placed
        parts = []  # (user id, hook, chunks, rows)
        for user_id, record in records.items():
            for name in names:
                chunks = record.rows(name)
                parts.append((user_id, name, chunks, sum(chunk.shape[0] for chunk in chunks)))
        item = torch.empty((), dtype=dtype).element_size()
        total = item * sum(placed[name].width * num_rows for _u, name, _c, num_rows in parts)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600) if path and total else None
        messages: dict[str, dict[str, Any]] = {user_id: {} for user_id in records}
        offset, in_file_order = 0, []
        try:
            for user_id, name, chunks, num_rows in parts:
                shape = [num_rows, *placed[name].row_shape]
                if fd is None:  # ordinary memory, not the pinned pages the chunks live in
                    rows = torch.cat(chunks) if chunks else torch.empty(0, placed[name].width, dtype=dtype)
                    messages[user_id][name] = encode_tensor(rows.view(shape))
                else:
                    messages[user_id][name] = {"dtype": _dtype_name(dtype), "shape": shape, "offset": offset}
                    offset += num_rows * placed[name].width * item
                    in_file_order += chunks
            if fd is not None:
                _write_rows(fd, in_file_order)
        except BaseException:
            if fd is not None:
                os.close(fd)
                os.unlink(path)
            raise
        if fd is not None:
            os.close(fd)
        return messages, None if fd is None else path

    def write_to_sink(self, request_ids: list[str]) -> None:
        """Write these finished requests' kept rows (or why they have none) to the sink,
        on the ranks that write, and forget them."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # the copies to host still in flight
        placed = self.state.placed
        for request_id in request_ids:
            reason = self.incomplete.pop(request_id, None)
            record = self.records.pop(request_id, None)
            if self.sink is None or not self.warmed_up or (record is None and reason is None):
                continue
            plan = self.plans.get(request_id)
            prompt = None if plan is None or plan.prompt_token_ids is None else list(plan.prompt_token_ids)
            if reason is not None:
                self.sink.write(request_id, {"prompt_token_ids": prompt, "positions": [], "error": reason}, [])
                continue
            positions = (
                np.concatenate([chunk[3] for chunk in record.chunks]) if record.chunks else np.zeros(0, np.int64)
            )
            parts = [
                (name, [int(positions.size), *placed[name].row_shape], record.rows(name)) for name in self.sink_hooks
            ]
            self.sink.write(request_id, {"prompt_token_ids": prompt, "positions": _position_ranges(positions)}, parts)


_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # what vLLM adds to a user's request id


def _match_request_ids(user_ids: list[str], worker_ids: list[str]) -> dict[str, str]:
    """Join the user's ids to the worker's, which may carry a ``-{8 hex}`` suffix."""
    by_user_id: dict[str, list[str]] = {}
    for worker_id in worker_ids:
        by_user_id.setdefault(worker_id, []).append(worker_id)
        if _VLLM_SUFFIX.search(worker_id):
            by_user_id.setdefault(_VLLM_SUFFIX.sub("", worker_id), []).append(worker_id)
    matches = {}
    for user_id in user_ids:
        found = by_user_id.get(user_id, [])
        if len(found) != 1:
            problem = "no captured request" if not found else f"several captured requests {found}"
            raise KeyError(
                f"read_batched: request id {user_id!r} matches {problem}; captured ids: {sorted(worker_ids)[:10]}"
            )
        matches[user_id] = found[0]
    return matches


# ---------------------------------------------------------------------------
# Worker calls. Mixed into vLLM's worker by worker_extension_cls and reached
# through llm.collective_rpc; arguments and results are msgpack values.
# ---------------------------------------------------------------------------

_USER_ERRORS = (ValueError, KeyError, RuntimeError)


def _errors_as_data(method):
    """Return a caller's mistake as data, so the driver raises it with its own type.

    Raised inside a worker process, it would reach the driver as vLLM's generic
    RuntimeError with the worker's traceback in the log.
    """

    def wrapper(self, *args):
        try:
            return {"result": method(self, *args)}
        except _USER_ERRORS as error:
            return {"error": [type(error).__name__, str(error.args[0]) if error.args else ""]}

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


class _WorkerExtension:
    """``WorkerExtension``: methods vLLM mixes into each worker; call them with the driver
    helpers. Each returns ``{"result": value}`` or ``{"error": [exception type, message]}``.
    """

    def _tl_state(self) -> _HookState:
        state = getattr(self, "_tl_hooks", None)
        if state is None:
            raise RuntimeError(
                "tl_vllm_hooks: this engine has no hooks: build it with "
                "LLM(model, **tl_vllm_hooks.configure(...).llm_kwargs), and keep TL_VLLM_HOOKS_DISABLE unset"
            )
        return state

    def _tl_flavour(self, flavour: type, call: str) -> Any:
        current = self._tl_state().flavour
        if not isinstance(current, flavour):
            raise RuntimeError(
                f"{call}: this engine has {current.name} hooks; configure(enable_batching="
                f"{flavour is _Batched}) gives {flavour.name} ones"
            )
        return current

    @_errors_as_data
    def tl_status(self) -> dict[str, Any]:
        state = self._tl_state()
        return {
            "version": __version__,
            "module": __file__,
            "config": state.config.to_json(),
            "hooks": list(state.hook_names),
            "absent": list(state.absent),
            "shards": state.shards(),
            "unread_requests": state.flavour.unread_requests,
            "sink": sink.status() if (sink := getattr(state.flavour, "sink", None)) is not None else None,
        }

    @_errors_as_data
    def tl_set_edits(self, edits: dict[str, Any]) -> None:
        state = self._tl_state()
        if edits and state.prefix_caching:
            raise ValueError(
                "set_edits: engine-wide edits change every request's keys and values, and vLLM's prefix "
                "cache would go on serving blocks computed without them; on an engine with prefix caching, "
                "edit per request: request_args(config, edits=...)"
            )
        unknown = sorted(set(edits) - set(state.hook_names) - set(state.absent))
        if unknown:
            raise ValueError(f"edits: unknown hooks {unknown}; configured: {state.hook_names}")
        tables = {  # every edit checked before any table changes
            name: _engine_wide_tables(edits[name], name, state.config, state.edit_dtype)
            for name in state.hook_names
            if name in edits
        }
        for name in state.hook_names:
            scale, bias = state.flavour.engine_wide(state.scales[name]), state.flavour.engine_wide(state.biases[name])
            if name in tables:
                scale.copy_(state.local_columns(name, tables[name][0]))
                bias.copy_(state.local_columns(name, tables[name][1]))
            else:
                scale.fill_(1)
                bias.zero_()

    @_errors_as_data
    def tl_open_capture(self) -> None:
        self._tl_state().capture_flags.zero_()

    @_errors_as_data
    def tl_read_captures(self, num_rows: int) -> dict[str, Any]:
        rows = self._tl_flavour(_Compiled, "read_captures").read(num_rows)
        return {"shards": self._tl_state().shards(), "rows": {n: encode_tensor(r) for n, r in rows.items()}}

    @_errors_as_data
    def tl_read_fire_counts(self) -> dict[str, int]:
        state = self._tl_state()
        return dict(zip(state.hook_names, state.fire_counts.tolist()))

    @_errors_as_data
    def tl_reset_fire_counts(self) -> None:
        self._tl_state().fire_counts.zero_()

    @_errors_as_data
    def tl_read_batched(self, request_ids: list[str], driver_host: str = "") -> dict[str, Any]:
        """``{"shards", "shared", "file", "rows": {request_id: {hook_name: message}}}``.

        For a driver on this host (``driver_host``) with /dev/shm, ``shared`` is true and
        the rows are in ``file`` (None when there are none), each message their dtype,
        shape and byte offset; else each message is the encoded rows. Replicated hooks
        come from the first tensor-parallel rank only.
        """
        flavour = self._tl_flavour(_Batched, "read_batched")
        if flavour.config.sink_dir is not None:
            raise RuntimeError(
                f"read_batched: this engine writes captured rows to its sink_dir {flavour.config.sink_dir}: "
                "call flush_sink(llm), which returns them as a CaptureDataset"
            )
        path = _shared_file(driver_host)
        reply = {"shards": flavour.state.shards(), "shared": path is not None, "file": None, "rows": {}}
        if not flavour.state.hook_names:  # a pipeline rank that holds none of the hooks
            return reply
        first_rank, shards = _tensor_parallel_rank() == 0, reply["shards"]
        names = [name for name in flavour.state.hook_names if first_rank or name in shards]
        reply["rows"], reply["file"] = flavour.read(request_ids, names, path)
        return reply

    @_errors_as_data
    def tl_flush_sink(self) -> dict[str, Any] | None:
        """Write every held request to the sink (the driver saw them all finish) and close
        the open shard; this rank's writer's status, None where the rank writes nothing."""
        flavour = self._tl_flavour(_Batched, "flush_sink")
        if flavour.config.sink_dir is None:
            raise RuntimeError("flush_sink: this engine has no sink: configure(..., sink_dir=directory)")
        flavour.write_to_sink(sorted(set(flavour.records) | set(flavour.incomplete)))
        if flavour.sink is not None:
            flavour.sink.close()
        return flavour.sink.status() if flavour.sink is not None else None

    @_errors_as_data
    def tl_reset_batched(self) -> None:
        self._tl_flavour(_Batched, "reset_batched").clear()

    @_errors_as_data
    def tl_remove_hooks(self) -> None:
        _uninstall(self)


def __getattr__(name: str) -> Any:
    if name == "WorkerExtension":
        # How a vLLM worker loads its worker_extension_cls, before it loads the model.
        # A copied-in file has no entry point to register it: it registers here.
        register()
        return _WorkerExtension
    if name in ("CaptureDataset", "tiny_model", "main"):
        return getattr(_tools(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# Driver helpers: a user's script calls these with its engine, an offline LLM
# or an AsyncLLM (whose collective_rpc is a coroutine). Each is written once, as
# a generator that yields (worker method, args) and is sent the workers'
# results; _drive runs it at once on an LLM, or returns an awaitable that runs
# it on an AsyncLLM. Results come back as torch tensors keyed by hook name.
# ---------------------------------------------------------------------------


def _drive(engine: Any, steps: Any) -> Any:
    """Run a helper's steps on ``engine`` and return what it returns (on an AsyncLLM,
    an awaitable of it). A worker's error is raised here with its own type."""
    extension = _driver_vllm_config(engine).parallel_config.worker_extension_cls
    if extension != WORKER_EXTENSION:
        raise RuntimeError(
            f"tl_vllm_hooks: the engine's worker_extension_cls is {extension!r}; build it with "
            "LLM(model, **config.llm_kwargs)"
        )

    def results(replies: list[dict[str, Any]]) -> list[Any]:
        for reply in replies:
            if "error" in reply:
                kind, message = reply["error"]
                raise {e.__name__: e for e in _USER_ERRORS}[kind](message)
        return [reply["result"] for reply in replies]

    if inspect.iscoroutinefunction(engine.collective_rpc):

        async def run_async() -> Any:
            sent = None
            while True:
                try:
                    method, args = steps.send(sent)
                except StopIteration as done:
                    return done.value
                sent = results(await engine.collective_rpc(method, args=args))

        return run_async()
    sent = None
    while True:
        try:
            method, args = steps.send(sent)
        except StopIteration as done:
            return done.value
        sent = results(engine.collective_rpc(method, args=args))


def _status_steps():
    ranks = yield "tl_status", ()
    hooks = list(dict.fromkeys(name for rank in ranks for name in rank["hooks"]))
    return {
        "version": ranks[0]["version"],
        "module": ranks[0]["module"],
        "config": CaptureConfig.from_json(ranks[0]["config"]),
        "hooks": hooks,
        "absent": sorted({name for rank in ranks for name in rank["absent"]} - set(hooks)),
        "unread_requests": max(rank["unread_requests"] for rank in ranks),
        "ranks": len(ranks),
        "sink": [rank["sink"] for rank in ranks if rank["sink"] is not None] or None,
    }


def status(engine: Any) -> dict[str, Any]:
    """The hooks as the engine's workers hold them (every helper here takes an ``LLM``,
    or an ``AsyncLLM`` and then returns an awaitable).

    ``{"version": str, "module": path of the workers' copy, "config": CaptureConfig,
    "hooks": names installed on some rank in forward order, "absent": names whose module is
    on no rank, "unread_requests": batched requests with rows not yet read (the most of any
    rank), "ranks": number of workers, "sink": None, or per writing rank ``{"directory",
    "shards" and "requests" whole on disk, "lost": requests not written since "error",
    "busy_seconds": time its writer thread spent writing}``}``.
    """
    return _drive(engine, _status_steps())


def _join_ranks(per_rank: list[tuple[dict[str, int], dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """One tensor per hook from each rank's (shards, {hook_name: rows}).

    Tensor-parallel ranks hold a replicated activation whole, or, for the input
    of a row-split projection (attn_z, mlp_post), each its part of the row's
    first dimension: the parts are joined in order. Pipeline ranks hold
    disjoint hooks.
    """
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for shards, rows in per_rank:
        for name, tensor in rows.items():
            parts.setdefault(name, {}).setdefault(shards.get(name, -1), tensor)
    return {
        name: by_start[-1] if -1 in by_start else torch.cat([by_start[start] for start in sorted(by_start)], dim=1)
        for name, by_start in parts.items()
    }


def _one_call(method: str, *args: Any):
    yield method, args


def open_capture(engine: Any) -> None:
    """Arm the compiled hooks: the next forward's rows are kept until the next open."""
    return _drive(engine, _one_call("tl_open_capture"))


def _read_captures_steps(num_rows: int):
    replies = yield "tl_read_captures", (num_rows,)
    return _join_ranks(
        [(reply["shards"], {n: decode_tensor(m) for n, m in reply["rows"].items()}) for reply in replies]
    )


def read_captures(engine: Any, num_rows: int) -> dict[str, torch.Tensor]:
    """``{hook_name: [num_rows, *row shape]}`` CPU tensors (config dtype) from the armed forward.

    The row shape is ``[d_model]``, ``[n_heads, d_head]`` (attn_z) or ``[d_mlp]``
    (mlp_post), whole also under tensor parallelism. num_rows is the prompt length
    in tokens; the prompt must fit one forward (``<= max_num_batched_tokens``).
    """
    return _drive(engine, _read_captures_steps(num_rows))


def _edits_to_wire(edits: Any, as_lists: bool = False) -> Any:
    """Edits with tensor (and numpy) values as plain values: encoded tensors for
    collective_rpc, or, ``as_lists``, nested lists of numbers for JSON (exact: every
    float dtype's values are float64 values)."""
    if not isinstance(edits, dict):
        return edits  # the checks name the problem
    wire = {}
    for name, edit in edits.items():
        if isinstance(edit, dict):
            edit = dict(edit)
            value = edit.get("value")
            if isinstance(value, torch.Tensor) and not as_lists:
                edit["value"] = encode_tensor(value)
            elif isinstance(value, (torch.Tensor, np.ndarray)):
                edit["value"] = value.tolist()
            if isinstance(edit.get("positions"), (torch.Tensor, np.ndarray)):
                edit["positions"] = edit["positions"].tolist()
        wire[name] = edit
    return wire


def _set_edits_steps(edits: Any):
    wire = _edits_to_wire(edits)
    if not isinstance(wire, dict):
        raise ValueError(f"edits: expected a dict {{hook_name: edit}}, got {edits!r}")
    config = (yield from _status_steps())["config"]
    for name, edit in wire.items():
        _check_hook_name(name, config)
        _engine_wide_tables(edit, name, config, torch.float32)
    yield "tl_set_edits", (wire,)


def set_edits(engine: Any, edits: dict[str, dict[str, Any]]) -> None:
    """Replace every engine-wide edit: hooks not named go back to identity.

    edits: ``{hook_name: {"op": op, "value": v, "positions": [p, ...]}}`` with op
    one of ``suppress`` (no value), ``scale``, ``add`` or ``set``; v a finite
    number or a float tensor of the row's shape (or flat); positions (optional)
    token positions, needing ``enable_position_interventions=True``. Checked here
    (ValueError) before any rank changes; applies from the next forward on.
    Refused on an engine with prefix caching (edit per request there).
    """
    return _drive(engine, _set_edits_steps(edits))


def reset_edits(engine: Any) -> None:
    """Every hook back to identity."""
    return _drive(engine, _one_call("tl_set_edits", {}))


def request_args(
    config: CaptureConfig,
    capture: str | list[int] = "all",
    edits: dict[str, dict[str, Any]] | None = None,
) -> dict[str, str]:
    """One request's options in the batched flavour, as ``{"tl_vllm_hooks": JSON text}``:
    ``SamplingParams(extra_args=request_args(...))``, or to a server (``vllm serve``)
    ``extra_body={"vllm_xargs": request_args(...)}``.

    config: the engine's config (what ``configure`` returned).
    capture: which of the request's rows ``read_batched`` (or the sink) gets:
        ``"all"`` (prompt and generated tokens), ``"prompt"``,
        ``"last_prompt_token"``, ``"none"``, or a list of token positions. Rows
        not kept never leave the device. A request without options keeps all
        its rows, or none on an engine with prefix caching on (it may then be
        served from the cache, as plain vLLM would serve it).
    edits: as in ``set_edits``, for this request's rows only; a hook edited
        here ignores the engine-wide edit on that hook for this request.
        Positions may be any token position.

    With prefix caching on, a request that keeps prompt rows before its last
    skips reading the cache, and one with edits shares cached blocks only with
    requests making the same edits (vLLM's cache salt).

    Validated here (ValueError naming the problem) before anything is sent, and
    again where vLLM takes the request (a server answers HTTP 400 with the same
    message). Tensor values travel as lists of numbers. Merge the result into any
    extra_args of your own.
    """
    if not isinstance(config, CaptureConfig):
        raise ValueError(f"request_args: config must be the CaptureConfig of the engine, got {config!r:.100}")
    if not config.enable_batching:
        raise ValueError(
            "request_args: per-request options need the batched flavour: configure(..., enable_batching=True)"
        )
    options: dict[str, Any] = {"capture": list(capture) if isinstance(capture, tuple) else capture}
    if edits:
        options["edits"] = _edits_to_wire(edits, as_lists=True)
    _parse_request_options(options, config, torch.float32)
    return {_REQUEST_KEY: json.dumps(options)}


def _read_batched_steps(request_ids: list[str]):
    if isinstance(request_ids, str) or not all(isinstance(r, str) for r in request_ids):
        raise ValueError(f"read_batched: request_ids must be a list of str, got {request_ids!r}")
    per_rank = []
    for reply in (yield "tl_read_batched", (list(request_ids), socket.gethostname())):
        if not reply["shared"] and any(reply["rows"].values()):
            warnings.warn(
                "read_batched: rows come through vLLM's RPC, which is slow: a worker runs on another host "
                "than this driver, or its host has no /dev/shm",
                stacklevel=4,
            )
        mapped = _mapped_rows(reply["file"]) if reply["file"] else None
        rows = {
            request_id: {n: decode_tensor(m) if mapped is None else _tensor_at(mapped, m) for n, m in by_hook.items()}
            for request_id, by_hook in reply["rows"].items()
        }
        per_rank.append((reply["shards"], rows))
    read = {request_id for _shards, rows in per_rank for request_id in rows}
    return {
        request_id: _join_ranks([(shards, rows.get(request_id, {})) for shards, rows in per_rank])
        for request_id in read
    }


def read_batched(engine: Any, request_ids: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Batched captures: ``{request_id: {hook_name: [rows, *row shape]}}``, then freed.

    request_ids: the ids the user sees (``RequestOutput.request_id``). Rows, in
    position order, are those the request's ``request_args(capture=...)`` kept;
    by default every token that ran through the model for it: its prompt, then
    each generated token but the last. Tensors are CPU, in the config's dtype,
    rows shaped as in ``read_captures``; a request that kept no row gets zero rows.
    """
    return _drive(engine, _read_batched_steps(request_ids))


def _flush_sink_steps():
    writers = [reply for reply in (yield "tl_flush_sink", ()) if reply is not None]
    failures = [f"{writer['error']}; {writer['lost']} requests not written" for writer in writers if writer["error"]]
    if failures:
        raise RuntimeError("flush_sink: " + " | ".join(failures))
    return _tools().CaptureDataset(writers[0]["directory"])


def flush_sink(engine: Any) -> Any:
    """Write every request that ran to the engine's ``sink_dir``, close the open shards,
    and return the directory's ``CaptureDataset``.

    Call it once ``generate`` has returned: vLLM tells its workers that a request
    finished only at their next step, so the last requests of a generate wait on
    disk for this call (or for the next generate). RuntimeError if a write failed
    (disk full, directory removed): it names the file and the requests not written;
    the shards the manifests list stay whole and readable.
    """
    if _has_unfinished_requests(engine):
        raise RuntimeError("flush_sink: requests are still running; call it once generate has returned")
    return _drive(engine, _flush_sink_steps())


def reset_batched(engine: Any) -> None:
    """Drop every batched row not yet read."""
    return _drive(engine, _one_call("tl_reset_batched"))


def _read_fire_counts_steps():
    counts: dict[str, int] = {}
    for rank in (yield "tl_read_fire_counts", ()):
        for name, count in rank.items():
            counts.setdefault(name, count)
    return counts


def read_fire_counts(engine: Any) -> dict[str, int]:
    """How often each hook ran since the last reset (the first rank holding it)."""
    return _drive(engine, _read_fire_counts_steps())


def reset_fire_counts(engine: Any) -> None:
    """Zero every hook's fire count."""
    return _drive(engine, _one_call("tl_reset_fire_counts"))


def remove_hooks(engine: Any) -> None:
    """Remove every hook from every worker (a compiled graph keeps what it traced)."""
    return _drive(engine, _one_call("tl_remove_hooks"))


if __name__ == "__main__":
    # The command line is the companion's; it imports this file as tl_vllm_hooks, whose
    # WORKER_EXTENSION and registration state are the ones vLLM's workers see.
    sys.exit(_tools().main())
