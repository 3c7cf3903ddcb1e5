"""Read and edit a model's activations while vLLM serves it, under TransformerLens hook names.

One self-contained module. It installs PyTorch forward hooks inside vLLM's workers after the weights load and before
the first (traced) forward, so the hooks become part of the graph that torch.compile and CUDA graphs run::

    config = configure(capture_specs(hf_config, sites=("resid_post",)))
    llm = LLM(model, **config.llm_kwargs)

Each hook name means the tensor TransformerLens 4.3's TransformerBridge means by it; a table per architecture says
where vLLM's module tree holds it (others are refused). Every hook writes its rows into a buffer made at install time
and applies ``out * scale + bias`` from tables the host rewrites between forwards. Two flavours:

* one-prompt (default): ``open_capture`` arms the hooks and the next forward's rows are kept.
* batched (``enable_batching=True``): many requests per generate, each with its own rows to keep and its own edits
  (``request_args``, also the OpenAI server's ``vllm_xargs``), whole across chunked prefill, preemption and decode;
  with a ``sink_dir``, finished requests' rows go to the sink writer the config names (by default the companion
  module tl_vllm_hooks_tools's, which writes safetensors shards that its ``CaptureDataset`` reads), loaded by that
  name where it is needed; this module imports nothing of the companion. SAEs in SAELens's format (``saes``) are
  read and run here.

The driver helpers take an ``LLM``, or an ``AsyncLLM`` and then return awaitables. Installed with pip, the
``vllm.general_plugins`` entry point calls ``register()`` in every vLLM process; copied in, the file registers itself
when a vLLM worker loads ``WorkerExtension`` from it. ``TL_VLLM_HOOKS_DISABLE=1`` switches it off. Nothing crosses a
process boundary as pickle: the config is JSON, tensors travel as dtype, shape and bytes.
"""

from __future__ import annotations

import atexit
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import glob
import hashlib
import importlib
import inspect
import itertools
import json
import logging
import math
import mmap
import os
import re
import socket
import sys
import types
import warnings
import weakref
import typing
from typing import Any

import numpy as np
import torch

__version__ = "0.3.0"

# fmt: off
__all__ = [
    "ATTENTION_READ_BYTES", "ATTENTION_SITES", "ActivationRows", "CAPTURE_DTYPES", "CaptureConfig", "FAMILIES",
    "REFUSED", "SAESpec", "SAE_FEATURES", "SAE_SITES", "SAE_WEIGHTS", "SITES", "SinkRequest", "WORKER_EXTENSION",
    "WorkerExtension", "capture_specs", "configure", "decode_tensor", "encode_tensor", "flush_sink", "join_ranks",
    "logit_lens", "model_sites", "open_capture", "parse_hook_name", "read_batched", "read_captures",
    "read_fire_counts", "register", "remove_hooks", "request_args", "reset_batched", "reset_edits",
    "reset_fire_counts", "row_dtype", "segment_by_request", "set_edits", "status", "unembed", "unregister",
    "user_request_id",
]
# fmt: on

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Hook names and sites. What a TransformerLens hook name means is fixed by TransformerLens 4.3's TransformerBridge,
# the same for every family: SITES names each site's hook, and the tap kinds say how a site's tensor is read from a
# vLLM module and how an edit of it flows on. Where that tensor lives depends on the model class vLLM instantiates,
# which the family records below say.
# ---------------------------------------------------------------------------

# fmt: off
SITES = {
    "embed": "hook_embed", "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{i}.hook_resid_pre", "ln1_scale": "blocks.{i}.ln1.hook_scale",
    "ln1": "blocks.{i}.ln1.hook_normalized",
    "block_norm_scale": "blocks.{i}.norm.hook_scale", "block_norm": "blocks.{i}.norm.hook_normalized",
    "attn_q_latent": "blocks.{i}.attn.hook_q_latent", "attn_kv_latent": "blocks.{i}.attn.hook_kv_latent",
    "attn_q": "blocks.{i}.attn.hook_q", "attn_k": "blocks.{i}.attn.hook_k", "attn_v": "blocks.{i}.attn.hook_v",
    "attn_rot_q": "blocks.{i}.attn.hook_rot_q", "attn_rot_k": "blocks.{i}.attn.hook_rot_k",
    "attn_scores": "blocks.{i}.attn.hook_attn_scores", "pattern": "blocks.{i}.attn.hook_pattern",
    "attn_z": "blocks.{i}.attn.hook_z", "attn_out": "blocks.{i}.hook_attn_out",
    "linear_attn_in": "blocks.{i}.linear_attn.hook_in", "linear_attn_out": "blocks.{i}.linear_attn.hook_out",
    "conv_in": "blocks.{i}.conv.hook_in", "conv_in_proj": "blocks.{i}.conv.hook_in_proj",
    "conv_gated": "blocks.{i}.conv.hook_gated", "conv_out": "blocks.{i}.conv.hook_out",
    "mixer_in": "blocks.{i}.mixer.hook_in",
    "mixer_in_proj": "blocks.{i}.mixer.hook_in_proj", "mixer_norm_in": "blocks.{i}.mixer.inner_norm.hook_in",
    "mixer_norm_gate": "blocks.{i}.mixer.inner_norm.hook_gate", "mixer_norm": "blocks.{i}.mixer.hook_inner_norm",
    "mixer_out": "blocks.{i}.mixer.hook_out",
    "mamba_in": "blocks.{i}.mamba.hook_in", "mamba_in_proj": "blocks.{i}.mamba.hook_in_proj",
    "mamba_norm_in": "blocks.{i}.mamba.inner_norm.hook_in", "mamba_norm_gate": "blocks.{i}.mamba.inner_norm.hook_gate",
    "mamba_norm": "blocks.{i}.mamba.hook_inner_norm",
    "mamba_out": "blocks.{i}.mamba.hook_out",
    "resid_mid": "blocks.{i}.hook_resid_mid", "ln2_scale": "blocks.{i}.ln2.hook_scale",
    "ln2": "blocks.{i}.ln2.hook_normalized",
    "mlp_in": "blocks.{i}.mlp.hook_in", "mlp_pre": "blocks.{i}.mlp.hook_pre",
    "mlp_pre_linear": "blocks.{i}.mlp.hook_pre_linear",
    "expert_weights": "blocks.{i}.mlp.hook_expert_weights", "expert_indices": "blocks.{i}.mlp.hook_expert_indices",
    "mlp_post": "blocks.{i}.mlp.hook_post",
    "mlp_out": "blocks.{i}.hook_mlp_out",
    "moe_in": "blocks.{i}.moe.hook_in", "moe_pre": "blocks.{i}.moe.hook_pre",
    "moe_expert_weights": "blocks.{i}.moe.hook_expert_weights",
    "moe_expert_indices": "blocks.{i}.moe.hook_expert_indices", "moe_post": "blocks.{i}.moe.hook_post",
    "moe_out": "blocks.{i}.moe.hook_out", "shared_mlp_in": "blocks.{i}.shared_mlp.hook_in",
    "shared_mlp_pre": "blocks.{i}.shared_mlp.hook_pre",
    "shared_mlp_pre_linear": "blocks.{i}.shared_mlp.hook_pre_linear",
    "shared_mlp_post": "blocks.{i}.shared_mlp.hook_post", "shared_mlp_out": "blocks.{i}.shared_mlp.hook_out",
    "resid_post": "blocks.{i}.hook_resid_post",
    "final_norm_scale": "ln_final.hook_scale", "final_norm": "ln_final.hook_normalized",
}
# fmt: on
"""site -> TransformerLens hook name, in forward order; ``{i}`` is the layer. Rows are ``[d_model]`` but ``[n_heads,
d_head]`` at attn_q (``[2 * n_heads, d_head]`` where the query projection gives each head's output gate too, Qwen
3.5's), attn_rot_q and attn_z (per head, the output projection's input), ``[n_kv_heads, d_head]`` at attn_k, attn_v and
attn_rot_k (q and k before rotary, then after it); attn_scores and pattern keep per token the query and key vLLM's
attention receives, ``[n_heads + n_kv_heads, d_head]``, from which reads rebuild TransformerLens's ``[n_heads, queries,
keys]`` (see _attention_rows; read-only). Multi-head latent attention (DeepSeek's) has attn_q_latent ``[q_lora_rank]``
and attn_kv_latent ``[kv_lora_rank]``, the normed latents the query and the keys and values are projected up from;
there attn_q and attn_k are ``[n_heads, qk_nope_head_dim + qk_rope_head_dim]``, each head's part without rotary, then
its rotary part after rotary (as attn_rot_q, ``[n_heads, qk_rope_head_dim]``, and attn_rot_k, ``[1, qk_rope_head_dim]``,
the one rotary key all heads share), attn_v and attn_z ``[n_heads, v_head_dim]``; attn_k and attn_v are computed from
the latent (vLLM's decode never projects them up; read-only), and attn_scores and pattern keep ``[2 * n_heads,
qk_nope_head_dim + qk_rope_head_dim]``; ``[d_mlp]`` at mlp_pre, mlp_pre_linear and mlp_post on dense MLPs (the
activation's input, its gate on gated ones; a gated MLP's linear (up) projection; the down projection's input); on
mixture-of-experts layers mlp_pre and mlp_post are the block's input and output, and the router's choice is
expert_weights ``[n_experts]`` (each expert's weight, 0 if not chosen) and expert_indices ``[top_k]`` (highest weight
first, int64, as TransformerLens's; both read-only). Linear attention (Qwen 3.5's Gated DeltaNet) has linear_attn_in and
linear_attn_out, its input and output. A short convolution (LFM2's) has conv_in, its input, conv_in_proj ``[3 *
d_model]``, its input projection (B, C and x), conv_gated, C times the convolution of B times x, and conv_out, its
output. A Mamba-2 mixer has mixer_in, its input, mixer_in_proj ``[d_in_proj]``, its input projection (z, x, B, C and dt,
before a family's multipliers), mixer_norm_in, the scan's output y, and mixer_norm_gate, z, ``[d_inner]``, the gated
norm's inputs, mixer_norm its output ``[d_inner]``, and mixer_out ``[d_model]``, the mixer's output (before a multiplier
the layer scales it by); the mamba_* sites are the same where TransformerLens names the mixer mamba (Falcon-H1, beside
the attention), and block_norm and block_norm_scale are ln1's where it names the pre-norm norm (Mamba-2's). Where it
names a layer's experts moe and a shared MLP beside them shared_mlp (Granite 4.0's), the moe_* sites are the
mixture-of-experts block's (moe_out its output, as moe_post) and the shared_mlp_* sites the shared MLP's, as a dense
MLP's (``[shared_intermediate_size]`` at shared_mlp_pre, shared_mlp_pre_linear and shared_mlp_post), with no
hook_mlp_out. ln1, ln2 and final_norm are a norm's input normalized, before weight and bias, and their ``*_scale`` the
divisor, ``[1]``: sqrt(mean(x**2) + eps) of the (mean-centred, for LayerNorm) input; mlp_in is the MLP's own input (its
norm's output, weight and bias applied)."""

ATTENTION_SITES = ("attn_scores", "pattern")
"""The sites whose rows are each token's query and key, from which a read rebuilds TransformerLens's [n_heads,
queries, keys] (read-only; a sink stores no such rows)."""

# Which edits are refused, decided here alone (_read_only_reason): sites read-only on every model, and those read-only
# where the model's attention is multi-head latent attention (known once the model is).
_READ_ONLY_SITES = {  # site -> why an edit of it is refused
    **dict.fromkeys(("expert_weights", "expert_indices", "moe_expert_weights", "moe_expert_indices"), "vLLM's fused "
                    "mixture of experts routes inside its kernel, from the router's logits; edit the block's input "
                    "(mlp.hook_pre, moe.hook_pre) or output (hook_mlp_out, moe.hook_out) instead"),
    **dict.fromkeys(ATTENTION_SITES, "vLLM's attention kernels never hold the [query, key] matrix, which is "
                    "rebuilt when read; edit the query or key (attn.hook_rot_q, hook_rot_k, hook_q, hook_k) instead"),
}
_READ_ONLY_UNDER_LATENT_ATTENTION = dict.fromkeys(
    ("attn_k", "attn_v"),
    "multi-head latent attention attends from the cached latent, and vLLM's decode never projects it up to per-head "
    "keys and values (the hook computes them); edit the latent (attn.hook_kv_latent) or the rotary key "
    "(attn.hook_rot_k) instead",
)


def _read_only_reason(name: str, latent_attention: bool = False) -> str | None:
    """Why an edit of this hook is refused (None: it is editable), on a model with multi-head latent attention or
    not (not yet known: only the sites read-only on every model)."""
    site = (parse_hook_name(name) or ("",))[0]
    return _READ_ONLY_SITES.get(site) or (_READ_ONLY_UNDER_LATENT_ATTENTION.get(site) if latent_attention else None)


_NORM_SITES = (
    "ln1_scale", "ln1", "block_norm_scale", "block_norm", "ln2_scale", "ln2", "final_norm_scale", "final_norm"
)
_RESIDUAL_SITES = ("resid_pre", "resid_mid", "resid_post")  # the rows the logit lens reads (logit_lens, config's too)
_LOGITS = ".logits"  # a config's logit_lens keeps {hook}.logits.values and .indices

_HOOK_NAME = {re.compile("^" + re.escape(name).replace(r"\{i\}", r"(\d+)") + "$"): site for site, name in SITES.items()}


@functools.lru_cache(maxsize=4096)  # (each request's options name their hooks)
def parse_hook_name(name: str) -> tuple[str, int | None] | None:
    """(site, layer) of a TransformerLens hook name this module knows (a key of SITES, and the layer or None for a
    site outside the layers), else None: ``parse_hook_name("blocks.3.hook_resid_post") == ("resid_post", 3)``."""
    for pattern, site in _HOOK_NAME.items():
        match = pattern.match(name)
        if match:
            return site, int(match.group(1)) if match.groups() else None
    return None


def _forward_order(name: str) -> tuple:
    """Sorts hook names in the order a forward reaches them, decided here alone: the sites outside the layers, each
    layer's in SITES' order, the final norm's; then names of modules (not hook names), as given."""
    site, layer = parse_hook_name(name) or (None, None)
    if site is None:
        return (2,)
    return (int(site.startswith("final_norm")), -1 if layer is None else layer, list(SITES).index(site))


# Tap kinds: how a site's tensor is read from its module, and how an edit of it flows on.
_OUTPUT = "output"  # the module's output (its first element if it returns a tuple); edited in place
_OUTPUT_PAIR = "output_pair"  # the sum of the (hidden, residual) a fused-residual decoder layer returns
_INPUT = "input"  # one input of the module, which runs on the edited input
_INPUT_PAIR = "input_pair"  # the sum of (hidden, residual) inputs, residual None in the first layer
# the sum of a fused add-and-norm's inputs; the edit reaches its output only (hook_resid_mid is ln2's input)
_NORM_INPUT = "norm_input"
_NORM_SCALE = "norm_scale"  # a norm's divisor; an edit reaches its output as input / edited * weight + bias
_NORMALIZED = "normalized"  # a norm's input (or sum of two) normalized; an edit reaches it as edited * weight + bias
_ROUTER = "router"  # a mixture of experts' choice per token, from its router's logits (read-only)
_QUERY_KEY = "query_key"  # the query and key vLLM's attention receives, side by side (read-only)
_LATENT = "latent"  # a part of what vLLM's multi-head latent attention receives (q, the latent, the rotary key)


@dataclasses.dataclass(frozen=True)
class _Tap:
    """Where one site's tensor is in vLLM's module tree, and how an edit of it flows on.

    module: path in the model vLLM loads; ``{i}`` is the layer. kind: a tap kind above.
    inputs: (argument name, position) of each input an input or norm kind reads.
    norm: ``rms``, ``layer`` (mean-centred, with a bias where it has one), or either with ``_offset`` (the weight
        applied as 1 + weight: Gemma's, Nemotron's).
    part: the site's columns of the tensor: ``q``, ``k`` or ``v``, those heads of a fused qkv projection's output
        (``kv``: k's, where V holds K too, and an edit of K is written into V);
        ``gate`` and ``up``, the first and second half of a gated activation's input; for _ROUTER, ``indices``
        (top-k experts) or ``weights`` (over all experts); for _LATENT, ``q``, ``rot_q`` or ``rot_k`` (its inputs),
        ``k`` or ``v`` (computed from the latent), ``qk`` (query and key side by side, as _QUERY_KEY keeps them).
    multiplier: a config attribute the module's output is multiplied by where the branch joins the stream (Granite's
        residual_multiplier): the product is TransformerLens's tensor and carries the edit; for an input, the one it
        was multiplied by on its way in (Falcon-H1's ssm_in_multiplier): the quotient is TransformerLens's tensor, and
        the edit reaches the module times it. bias_apart: the module
        returns (output, bias) for its caller to add (skip_bias_add, Falcon's): the sum carries the edit.
    moe: for _ROUTER, the block whose routing it reads.
    direct: vLLM calls the module's forward itself, past module hooks (its Transformers backend's attention): the
        hooks wrap that forward (see _wrap_forward).
    """

    module: str
    kind: str
    inputs: tuple[tuple[str, int], ...] = ()
    norm: str = ""
    part: str = ""
    multiplier: str = ""
    bias_apart: bool = False
    moe: _MoE | None = None
    direct: bool = False


_GATED_UP = (".gate_up_proj", ".w13")  # an MLP's merged gate and up projections, gate first (LFM2's w1 and w3)
_LAYER_PAIR = (("hidden_states", 1), ("residual", 2))  # vLLM's fused-residual decoder layers
_LAYER_INPUT = (("hidden_states", 1),)  # vLLM's decoder layers, forward(positions, hidden_states, ...)
_HIDDEN_INPUT = (("hidden_states", 0),)  # decoder layers and norms of transformers' own
_NORM_PAIR = (("x", 0), ("residual", 1))  # vLLM's RMSNorm(x, residual)
_X_INPUT = (("x", 0),)  # vLLM's norms
_TORCH_NORM_INPUT = (("input", 0),)  # torch.nn.LayerNorm
_LINEAR_INPUT = (("input_", 0),)  # vLLM's RowParallelLinear
_QUERY, _KEY = (("query", 0),), (("key", 1),)  # vLLM's Attention(query, key, value)
_LATENT_INPUTS = (("q", 0), ("kv_c_normed", 1), ("k_pe", 2))  # vLLM's MLAAttention(q, kv_c_normed, k_pe)


# ---------------------------------------------------------------------------
# What a family record says. Each family is one record (_Family), the one owner of what the module knows of it: module
# paths, residual layout, multipliers, its config's settings, and in sub-records its norms (_Norms), attention
# (_Attention), dense MLP (_MLP), experts and routing (_MoE) and Mamba mixer (_Mixer), each with the config
# attributes its widths and rules come from. An architecture fact that differs between families lives in a field
# here (or a function a record names, as LFM2's MLP width), read where the sites are placed (_layer_sites).
# ---------------------------------------------------------------------------

# the config attribute that says which layers hold the experts (the others a dense MLP) -> whether layer i does
_MOE_LAYERS = {
    "every": lambda config, i: True,
    "decoder_sparse_step": lambda config, i: (  # Qwen2-MoE's
        i not in (getattr(config, "mlp_only_layers", None) or []) and (i + 1) % config.decoder_sparse_step == 0
    ),
    "first_k_dense_replace": lambda config, i: i >= config.first_k_dense_replace,
    "num_dense_layers": lambda config, i: i >= config.num_dense_layers,
    "moe_layer_interval": lambda config, i: (  # ERNIE 4.5's
        (i + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= i <= config.moe_layer_end_index
    ),
    "interleave_moe_layer_step": lambda config, i: (i + 1) % config.interleave_moe_layer_step == 0,  # Llama 4's
    "layers_num_experts": lambda config, i: config.layers_num_experts[i] > 1,  # Jamba's
}


@dataclasses.dataclass(frozen=True)
class _MoE:
    """A mixture-of-experts block in place of a layer's MLP: its input is mlp.hook_in and mlp.hook_pre, its output
    mlp.hook_post (and hook_mlp_out where no post-norm follows), and the router's choice comes from its logits, as
    the family routes and vLLM's fused kernel computes inside.

    block: its path under the layer; block_input: its forward's input argument; router: the path under the block of
        the layer whose output is the logits ("": TransformerLens runs no expert hooks on the family); layers: a key
        of _MOE_LAYERS.
    Routing: ``scoring`` (softmax or sigmoid of the logits); ``correction_bias``, the router's attribute added to the
        scores to choose experts but not to weigh them; ``groups``, experts chosen within the config's topk_group best
        of n_group groups (each scored by its two best), or ``sparsemixer`` (PhiMoE's); ``renormalize``, ``always``
        when the chosen weights are divided by their sum, ``""`` never, or the config attribute that says; ``scale``,
        the config attribute they are then multiplied by.
    shared_width: the config attribute of the width of a shared MLP beside the experts (Granite 4.0's), whose
        shared_mlp_* sites the family's taps place.
    """

    block: str = ".mlp"
    block_input: str = "hidden_states"
    router: str = ".gate"
    layers: str = "every"
    scoring: str = "softmax"
    correction_bias: str = ""
    groups: bool = False
    renormalize: str = "norm_topk_prob"
    scale: str = ""
    shared_width: str = ""


@dataclasses.dataclass(frozen=True)
class _Norms:
    """A family's norms.

    kind: their kind (see _Tap). ln1 and ln2: under a layer, the attention's and the MLP's pre-norms ("" where there
        are none); post: each branch's norm before it joins the stream (the attention's, the MLP's), which
        hook_attn_out and hook_mlp_out follow (None: none); final: the final norm's path. inputs: (argument, position)
        of the inputs a norm takes; () for the residual layout's (pair: x and residual; stream: x).
    """

    kind: str = "rms"
    ln1: str = ".input_layernorm"
    ln2: str = ".post_attention_layernorm"
    post: tuple[str, str] | None = None
    final: str = "model.norm"
    inputs: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class _Attention:
    """A layer's attention: its projections, and vLLM's Attention module under it (``.attn``), which receives q and k
    after rotary (TransformerLens's hook_rot_q and hook_rot_k) and v.

    path: under the layer ("." where its projections and attention sit in the layer itself, hook_attn_out then its
        o_proj's output); qkv: its q, k and v projection, o_proj its output projection, under it.
    rotary: vLLM's Attention receives q and k after rotary, which TransformerLens hooks as hook_rot_q and hook_rot_k.
    qk_halves: vLLM reorders each head of q and k at load, rotary's pairs of columns (interleaved in the checkpoint)
        into two halves (Llama 4's), which hook_q and hook_k put back. query_gate: the query projection gives each
        head's query, then its output gate (Qwen 3.5's), which hook_q keeps together, ``[2 * n_heads, d_head]``.
    latent: multi-head latent attention (DeepSeek's, vLLM's MultiHeadLatentAttentionWrapper): the attention's
        q_a_layernorm and kv_a_layernorm give the latents, its ``.mla_attn.mla_attn`` receives q (after rotary), the
        latent and the rotary key; where the config's rope_interleave is set, vLLM rotates each pair of columns in
        place and transformers puts them in two halves, which the rotary columns of hook_q, hook_k, hook_rot_q and
        hook_rot_k put back.
    rotary_3d: vLLM's attention hands its rotary embedding q and k as ``[tokens, heads, d_head]``, which vLLM's CPU
        kernel (RotaryEmbedding.forward_cpu) rotates as if each head were a token (LFM2's, after its per-head q and k
        norms; latent attention's q): refused where the engine runs that kernel.
    multi_query: the config attribute that says the attention has one key and value head (Falcon's and GPT-BigCode's
        multi-query attention).
    kv_shared: the config attribute that says how many last layers reuse earlier layers' keys and values: their
        attention projects q alone (``.q_proj``) and has no hook_k or hook_v. k_as_v: the config attribute that says
        full-attention layers use the keys as values: no hook_v, and an edit of hook_k reaches V (Gemma 4's
        attention_k_eq_v).
    direct: vLLM calls its Attention modules' forward itself (see _Tap.direct).
    """

    path: str = ".self_attn"
    qkv: str = ".qkv_proj"
    o_proj: str = ".o_proj"
    rotary: bool = True
    qk_halves: bool = False
    query_gate: bool = False
    latent: bool = False
    rotary_3d: bool = False
    multi_query: str = ""
    kv_shared: str = ""
    k_as_v: str = ""
    direct: bool = False


@dataclasses.dataclass(frozen=True)
class _MLP:
    """A layer's dense MLP.

    path: under the layer ("" where its projections sit in the layer itself); up: its input projection, gated (the
        gate first) where it is one of _GATED_UP; down: its output projection. inputs: (argument, position) of the input
        its forward takes.
    width: the config attribute of its width ("": the first of the usual names), or a function of the config that
        gives it; double_wide: the config attribute that says the MLP of a layer reusing earlier keys and values (see
        _Attention.kv_shared) is twice as wide (Gemma 4's).
    """

    path: str = ".mlp"
    up: str = ".gate_up_proj"
    down: str = ".down_proj"
    inputs: tuple[tuple[str, int], ...] = _X_INPUT
    width: str | typing.Callable[[Any], int] = ""
    double_wide: str = ""

    def d_mlp(self, config: Any, d_model: int, kv_shared: bool) -> int:
        """Its width in a layer of the model whose (text) config is ``config``, reusing earlier keys and values or
        not."""
        if callable(self.width):
            d_mlp = self.width(config)
        else:
            names = (self.width,) if self.width else ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
            d_mlp = next(filter(None, (getattr(config, name, None) for name in names)), 4 * d_model)
        return 2 * d_mlp if kv_shared and self.double_wide and getattr(config, self.double_wide) else d_mlp


@dataclasses.dataclass(frozen=True)
class _Mixer:
    """A Mamba mixer in a layer (TransformerLens's mixer), and the config attributes its widths come from, whose names
    differ between families.

    path: its path under the layer. mamba1: it is Mamba-1's (vLLM's MambaMixer): no inner norm, an input projection of
        x and z alone, and its output written into an argument, so that mixer.hook_out is its out_proj's output; else
        Mamba-2's (vLLM's MambaMixer2). normed: the config attribute that says a Mamba-2 mixer normalizes its gated
        output (Falcon-H1's mamba_rms_norm; "": it always does); where it is false, vLLM's gated norm only gates,
        TransformerLens's mixer has no inner norm, and the mixer_norm_* sites are not placed.
    Widths: d_inner is the attribute ``d_inner`` names where the config sets it, else the heads' (``head_dim`` times
        ``heads``, Nemotron-H's, whatever its expand says), else ``expand`` times d_model; Mamba-2's input projection
        holds z and x (d_inner each), B and C (``n_groups`` times ``d_state`` each) and a dt per head (``heads``).
    """

    path: str
    mamba1: bool = False
    normed: str = ""
    d_inner: str = ""
    head_dim: str = ""
    expand: str = "expand"
    heads: str = "num_heads"
    n_groups: str = "n_groups"
    d_state: str = "state_size"

    def widths(self, config: Any, d_model: int) -> tuple[int, int]:
        """(d_inner, its input projection's width) in the model whose (text) config is ``config``."""
        if self.d_inner and getattr(config, self.d_inner, None):
            d_inner = getattr(config, self.d_inner)
        elif self.head_dim:
            d_inner = getattr(config, self.heads) * getattr(config, self.head_dim)
        else:
            d_inner = getattr(config, self.expand) * d_model
        if self.mamba1:  # x and z
            return d_inner, 2 * d_inner
        groups_state = getattr(config, self.n_groups) * getattr(config, self.d_state)
        return d_inner, 2 * d_inner + 2 * groups_state + getattr(config, self.heads)


# The config attributes of Mamba-2 mixers in hybrids whose config names them mamba_* (Granite 4.0's, Falcon-H1's).
_MAMBA_PREFIXED = dict(expand="mamba_expand", heads="mamba_n_heads", n_groups="mamba_n_groups", d_state="mamba_d_state")


@dataclasses.dataclass(frozen=True)
class _Family:
    """One family: where the model class vLLM runs it with holds each TransformerLens tensor, and what else the module
    knows of it. Read by _taps and _row_shapes, by tiny_model, the tests and the README's table.

    name: its short name (tiny_model's); architecture: as checkpoints name it (``config.architectures[0]``);
        vllm_class: the vLLM model class the record was checked with, hf_class transformers' ("": the architecture).
    residual: ``pair`` where vLLM's decoder layers take and return (hidden, residual) and each pre-norm adds the two
        (fused add+norm), ``stream`` where a layer takes and returns the residual stream itself.
    Paths, those under a layer starting with ``.``: ``layer`` ({i} the layer), ``embed``, ``pos_embed`` (""),
        ``linear_attention`` (linear attention), ``conv`` (a short convolution, vLLM's ShortConv). norms: its norms;
        attention: its attention (None where there is none); mlp: its dense MLP (None where there is none); moe: its
        mixture-of-experts block, in the MLP's place in the layers its config says; mixer: its Mamba mixer, where its
        layers hold one.
    parallel: attention and MLP read the same stream (no hook_resid_mid). embed_at_layer0: hook_embed is what layer 0
        receives (Gemma's sqrt(d_model) scale, Granite's multiplier and BLOOM's norm come after the embedding).
    layer_inputs: (argument, position) of the inputs a layer takes; () for the residual layout's (pair:
        (hidden_states, residual); stream: hidden_states). multiplier, bias_apart: see _Tap.
    layer_kinds: the config attribute naming each layer's kind, and kind_sites, what a layer of each kind holds beside
        the stream: the sites of its ``attention``, ``linear`` attention, ``conv`` or ``mixer`` alone, ``mixer_ends``
        (a mixer's input and output alone, where TransformerLens hooks nothing inside it), or ``stream`` (the
        stream's sites alone, where TransformerLens hooks nothing inside the layer); kind_layer_inputs, by the
        config's kind, the layer_inputs of a kind whose layers take them elsewhere (LFM2's convolution layers,
        hidden_states first).
    taps: taps replacing those the fields give; kind_taps, by the config's kind, on that kind's layers (Nemotron-H's
        MLP takes x where its other mixers take hidden_states). renamed: {site: the site TransformerLens names that
        tensor as on this family} (Falcon-H1's mixer is mamba, Mamba-2's ln1 norm).
    refused: {site: why it is not placed} for sites TransformerLens runs on the family. settings: {config attribute:
        the value the record describes}; other values are refused.
    lm_head_bias: the output layer has a bias that vLLM's compute_logits leaves out (PhiMoE's: vLLM samples without
        it), which unembed adds, as TransformerLens's hook_unembed does.
    text_classes: for a multimodal checkpoint, the vLLM classes of its text model that the record describes, which
        sits under ``text_prefix`` in vLLM's tree and takes the shapes of ``config.get_text_config()``.
    gpu_only: why vLLM's CPU cannot run the family, which then runs on a GPU only ("": it runs on either; CI compares
        every family, running the kernel the CPU lacks in torch).
    """

    name: str
    architecture: str
    _: dataclasses.KW_ONLY
    vllm_class: str = ""
    hf_class: str = ""
    residual: str = "pair"
    layer: str = "model.layers.{i}"
    embed: str = "model.embed_tokens"
    pos_embed: str = ""
    attention: _Attention | None = _Attention()
    norms: _Norms = _Norms()
    mlp: _MLP | None = _MLP()
    linear_attention: str = ""
    conv: str = ""
    mixer: _Mixer | None = None
    parallel: bool = False
    embed_at_layer0: bool = False
    layer_inputs: tuple[tuple[str, int], ...] = ()
    multiplier: str = ""
    bias_apart: bool = False
    moe: _MoE | None = None
    layer_kinds: str = ""
    kind_sites: dict[str, str] = dataclasses.field(default_factory=dict)
    kind_layer_inputs: dict[str, tuple[tuple[str, int], ...]] = dataclasses.field(default_factory=dict)
    taps: dict[str, _Tap] = dataclasses.field(default_factory=dict)
    kind_taps: dict[str, dict[str, _Tap]] = dataclasses.field(default_factory=dict)
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    text_prefix: str = ""
    text_classes: tuple[str, ...] = ()
    lm_head_bias: bool = False
    gpu_only: str = ""


# ---------------------------------------------------------------------------
# Family records, one per family (its tiny test model is the companion's, which builds it). The records drive
# tiny_model, the tests and the README's table; an architecture no record describes is refused, with the measured
# reason where REFUSED holds one, never guessed.
# ---------------------------------------------------------------------------

# vLLM's Transformers backend: transformers' module tree with vLLM's linear layers, norms and attention, whose forward
# it calls itself.
_BACKEND = _Family(
    "", "", vllm_class="TransformersForCausalLM", residual="stream", layer_inputs=_HIDDEN_INPUT,
    attention=_Attention(direct=True),
)  # fmt: skip
# Qwen 3.5 and Qwen3-Next: Gated DeltaNet linear attention in most layers (TransformerLens hooks its input and output
# alone), gated full attention in the others (q_proj's output holds each head's query and output gate), norms of
# 1 + weight; the MoE blocks' shared expert, under a sigmoid gate, inside the block.
_GATED_DELTANET = _Family(
    "qwen3_5", "Qwen3_5ForCausalLM", norms=_Norms("rms_offset"), layer_inputs=(("hidden_states", 0), ("residual", 1)),
    linear_attention=".linear_attn", layer_kinds="layer_types",
    kind_sites={"linear_attention": "linear", "full_attention": "attention"},
    attention=_Attention(query_gate=True),
)  # fmt: skip


def _lfm2_d_mlp(config: Any) -> int:
    """LFM2's dense MLP width: intermediate_size, or where block_auto_adjust_ff_dim is set 2/3 of it, scaled by
    block_ffn_dim_multiplier to a multiple of block_multiple_of (as transformers' Lfm2MLP)."""
    d_mlp = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        d_mlp = int(2 * d_mlp / 3)
        if config.block_ffn_dim_multiplier is not None:
            multiple = config.block_multiple_of
            d_mlp = multiple * ((int(config.block_ffn_dim_multiplier * d_mlp) + multiple - 1) // multiple)
    return d_mlp


# LFM2: short-convolution layers (B, C and x from one projection, C times the convolution of B times x) beside
# attention layers whose q and k are normed per head before rotary; LFM2-MoE's router scores by sigmoid with a
# correction bias, its first num_dense_layers layers dense.
_LFM2 = _Family(
    "lfm2", "Lfm2ForCausalLM", norms=_Norms(ln1=".operator_norm", ln2=".ffn_norm", final="model.embedding_norm"),
    attention=_Attention(o_proj=".out_proj", rotary_3d=True),
    mlp=_MLP(".feed_forward", up=".w13", down=".w2", width=_lfm2_d_mlp),
    conv=".short_conv",
    layer_kinds="layer_types", kind_sites={"conv": "conv", "full_attention": "attention"},
    kind_layer_inputs={"conv": (("hidden_states", 0), ("residual", 1))},
)  # fmt: skip
_H_LAYER = "transformer.h.{i}"
_SANDWICH = (".post_attention_layernorm", ".post_feedforward_layernorm")  # Gemma 2's post-norms, as others name them
# Where TransformerLens 4.3's adapter keeps transformers' own attention, which hands it the softmax's output alone.
_SCORES_ARE_PATTERN = {"attn_scores": "TransformerLens 4.3's adapter fires hook_attn_scores with the softmax's output "
                                      "(what hook_pattern holds), not the scores"}

# Mamba-1: Mamba-2's layout (a pre-norm and a mixer in each layer, no attention and no MLP) with Mamba-1 mixers, which
# vLLM's CPU cannot run.
_MAMBA1 = _Family(
    "mamba", "MambaForCausalLM", layer="backbone.layers.{i}", embed="backbone.embeddings",
    norms=_Norms(ln1=".norm", ln2="", final="backbone.norm_f"), attention=None, mlp=None,
    mixer=_Mixer(".mixer", mamba1=True),
    layer_inputs=(("hidden_states", 0), ("residual", 1)),
    renamed={"ln1_scale": "block_norm_scale", "ln1": "block_norm"},
    gpu_only="Mamba-1 layers, which vLLM 0.32 CPU cannot run ('_C' object has no attribute 'selective_scan_fwd')",
)  # fmt: skip

# fmt: off
FAMILIES = {family.name: family for family in (
    _Family("llama", "LlamaForCausalLM"),
    _Family("qwen2", "Qwen2ForCausalLM"),
    _Family("qwen3", "Qwen3ForCausalLM"),
    _Family("mistral", "MistralForCausalLM"),
    _Family("phi3", "Phi3ForCausalLM", attention=_Attention(rotary=False)),
    _Family("gemma", "GemmaForCausalLM", norms=_Norms("rms_offset"), embed_at_layer0=True),
    # Gemma 2 and 3 normalize each branch again before adding it; the MLP's pre-norm is pre_feedforward_layernorm.
    *(_Family(name, architecture, norms=_Norms("rms_offset", ln2=".pre_feedforward_layernorm", post=_SANDWICH),
              embed_at_layer0=True)
      for name, architecture in (("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"))),
    _Family("mixtral", "MixtralForCausalLM", moe=_MoE(".block_sparse_moe", renormalize="always")),
    _Family("qwen2_moe", "Qwen2MoeForCausalLM", moe=_MoE(layers="decoder_sparse_step")),
    _Family("qwen3_moe", "Qwen3MoeForCausalLM", moe=_MoE()),
    _Family("olmoe", "OlmoeForCausalLM", moe=_MoE()),
    # GPT-OSS: TransformerBlock(hidden_states, positions, residual); softmax over the top-k logits.
    _Family("gpt_oss", "GptOssForCausalLM", embed="model.embedding", attention=_Attention(".attn"),
            layer_inputs=(("hidden_states", 0), ("residual", 2)),
            moe=_MoE(block_input="x", router=".router", renormalize="always")),
    # Granite multiplies the embedding (after embed_tokens) and each branch's output.
    _Family("granite", "GraniteForCausalLM", residual="stream", embed_at_layer0=True, multiplier="residual_multiplier"),
    # Mamba-2: a pre-norm (TransformerLens's norm) and a mixer in each layer, no attention and no MLP. transformers'
    # gated norm (and so the bridge's) normalizes over all of d_inner where vLLM's, as mamba_ssm's, does per group.
    _Family("mamba2", "Mamba2ForCausalLM", layer="backbone.layers.{i}", embed="backbone.embeddings",
            norms=_Norms(ln1=".norm", ln2="", final="backbone.norm_f"), attention=None, mlp=None,
            mixer=_Mixer(".mixer"),
            layer_inputs=(("hidden_states", 0), ("residual", 1)), settings=dict(n_groups=1),
            renamed={"ln1_scale": "block_norm_scale", "ln1": "block_norm"}),
    _MAMBA1,
    # Falcon Mamba: Mamba-1's, with weightless RMS norms of the scan's dt, B and C (vLLM runs it as Mamba-1).
    dataclasses.replace(_MAMBA1, name="falcon_mamba", architecture="FalconMambaForCausalLM",
                        vllm_class="MambaForCausalLM"),
    _GATED_DELTANET,
    dataclasses.replace(_GATED_DELTANET, name="qwen3_5_moe", architecture="Qwen3_5MoeForCausalLM",
                        moe=_MoE(renormalize="always")),
    dataclasses.replace(_GATED_DELTANET, name="qwen3_next", architecture="Qwen3NextForCausalLM",
                        moe=_MoE(layers="decoder_sparse_step")),
    _LFM2,
    dataclasses.replace(_LFM2, name="lfm2_moe", architecture="Lfm2MoeForCausalLM", moe=_MoE(
        ".feed_forward", layers="num_dense_layers", scoring="sigmoid", correction_bias="e_score_correction_bias",
        scale="routed_scaling_factor")),
    # Granite 4.0 (H): Mamba-2 layers (TransformerLens's mixer) and attention layers without positions, each with
    # experts (moe) and a shared MLP beside them (shared_mlp), whose sum, times residual_multiplier, no hook holds.
    # transformers' gated norm (and so the bridge's) normalizes over all of d_inner, as Mamba-2's.
    _Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", residual="stream", embed_at_layer0=True,
            multiplier="residual_multiplier", attention=_Attention(rotary=False),
            mixer=_Mixer(".mamba", **_MAMBA_PREFIXED),
            layer_kinds="layer_types",
            kind_sites={"linear_attention": "mixer", "full_attention": "attention"},
            kind_layer_inputs={"linear_attention": _HIDDEN_INPUT},
            settings=dict(position_embedding_type="nope", mamba_n_groups=1),
            moe=_MoE(".block_sparse_moe", renormalize="always", shared_width="shared_intermediate_size"),
            renamed={"mlp_in": "moe_in", "mlp_pre": "moe_pre", "expert_weights": "moe_expert_weights",
                     "expert_indices": "moe_expert_indices", "mlp_post": "moe_post"},
            taps={"mlp_out": None, "moe_out": _Tap("model.layers.{i}.block_sparse_moe", _OUTPUT),
                  "shared_mlp_in": _Tap("model.layers.{i}.shared_mlp", _INPUT, _HIDDEN_INPUT),
                  "shared_mlp_pre": _Tap("model.layers.{i}.shared_mlp.input_linear", _OUTPUT, part="gate"),
                  "shared_mlp_pre_linear": _Tap("model.layers.{i}.shared_mlp.input_linear", _OUTPUT, part="up"),
                  "shared_mlp_post": _Tap("model.layers.{i}.shared_mlp.output_linear", _INPUT, _LINEAR_INPUT),
                  "shared_mlp_out": _Tap("model.layers.{i}.shared_mlp", _OUTPUT)}),
    # Zamba2: Mamba-2 layers as Mamba-2's, and hybrid ones where an attention block shared by all of them runs before
    # the mixer, inside which TransformerLens hooks nothing (the stream alone). vLLM ties its output layer always, and
    # its scan takes no floor under dt (transformers' Zamba2 clamps dt at time_step_min).
    _Family("zamba2", "Zamba2ForCausalLM", residual="stream", layer_inputs=_HIDDEN_INPUT,
            norms=_Norms(ln2="", final="model.final_layernorm"), attention=None,
            mlp=None, mixer=_Mixer(".mamba", **{**_MAMBA_PREFIXED, "heads": "n_mamba_heads",
                                                 "n_groups": "mamba_ngroups"}),
            layer_kinds="layers_block_type",
            kind_sites={"linear_attention": "mixer", "hybrid": "stream"},  # (transformers' names; "mamba" in the file)
            renamed={"ln1_scale": "block_norm_scale", "ln1": "block_norm"}),
    # Nemotron-H: one pre-norm (TransformerLens's norm) and one mixer a layer: a Mamba-2 mixer, attention without
    # positions, or a dense MLP (relu2, not gated). TransformerLens hooks each mixer's input and output, and inside
    # only the Mamba-2 mixer's parts (its gated norm per group, as vLLM's). vLLM's scan takes no floor under dt
    # (transformers' clamps dt at time_step_min). Experts (layers of kind moe) are left out: vLLM's CPU cannot run
    # their relu2 ('is_act_and_mul=False is supported only for CUDA, XPU and ROCm').
    _Family("nemotron_h", "NemotronHForCausalLM", norms=_Norms(ln1=".norm", ln2="", final="model.norm_f"),
            attention=None,
            mlp=None, mixer=_Mixer(".mixer", head_dim="mamba_head_dim", heads="mamba_num_heads",
                                   d_state="ssm_state_size"),
            layer_kinds="layers_block_type",
            kind_sites={"linear_attention": "mixer", "full_attention": "mixer_ends", "mlp": "mixer_ends"},
            kind_layer_inputs=dict.fromkeys(("linear_attention", "mlp"), (("hidden_states", 0), ("residual", 1))),
            kind_taps={"mlp": {"mixer_in": _Tap("model.layers.{i}.mixer", _INPUT, _X_INPUT)}},
            renamed={"ln1_scale": "block_norm_scale", "ln1": "block_norm"}),
    # Jamba: Mamba-1 mixers and attention without positions, whose projections and attention sit in the layer itself;
    # experts where layers_num_experts gives more than one, on which TransformerLens runs no expert hooks.
    # TransformerLens's hooks inside the mixer beyond its ends and input projection (x_proj's, the dt, B and C norms')
    # have no SITES name.
    _Family("jamba", "JambaForCausalLM", norms=_Norms(ln2=".pre_ff_layernorm", final="model.final_layernorm"),
            mlp=_MLP(".feed_forward"), attention=_Attention(".", rotary=False),
            mixer=_Mixer(".mamba", mamba1=True, expand="mamba_expand"),
            layer_kinds="layers_block_type", kind_sites={"mamba": "mixer", "attention": "attention"},
            kind_layer_inputs={"mamba": (("hidden_states", 0), ("residual", 1))},
            moe=_MoE(".feed_forward", router="", layers="layers_num_experts", renormalize=""),
            refused=_SCORES_ARE_PATTERN, gpu_only=_MAMBA1.gpu_only),
    # Attention and a Mamba-2 mixer read the normed stream side by side, each under its in and out multipliers;
    # mamba.hook_in is the mixer's input before ssm_in_multiplier, hook_attn_out and mamba.hook_out the branches'
    # outputs before theirs.
    _Family("falcon_h1", "FalconH1ForCausalLM", residual="stream",
            norms=_Norms(ln2=".pre_ff_layernorm", final="model.final_layernorm"), mlp=_MLP(".feed_forward"),
            mixer=_Mixer(".mamba.mamba", normed="mamba_rms_norm", d_inner="mamba_d_ssm", **_MAMBA_PREFIXED),
            taps={"mixer_in": _Tap("model.layers.{i}.mamba.mamba", _INPUT, _HIDDEN_INPUT,
                                   multiplier="ssm_in_multiplier")},
            renamed={f"mixer_{part}": f"mamba_{part}" for part in ("in", "in_proj", "norm_in", "norm_gate", "norm",
                                                                   "out")}),
    _Family("stablelm", "StableLmForCausalLM", vllm_class="StablelmForCausalLM", residual="stream",
            norms=_Norms("layer", inputs=_TORCH_NORM_INPUT), settings=dict(use_parallel_residual=False)),
    # A norm after each branch, before adding it, and none before: attention reads the stream itself, the MLP the
    # mid-stream.
    _Family("exaone4", "Exaone4ForCausalLM", residual="stream", norms=_Norms(ln1="", ln2="", post=_SANDWICH)),
    # Cohere's LayerNorm has a weight and no bias, and passes the residual it is given on.
    _Family("cohere", "CohereForCausalLM", residual="stream", norms=_Norms("layer", ln2="", inputs=_HIDDEN_INPUT),
            parallel=True),
    # GPT-2's MLP norm reads the mid-stream while the block keeps its own copy for the skip.
    _Family("gpt2", "GPT2LMHeadModel", residual="stream", layer=_H_LAYER, embed="transformer.wte",
            pos_embed="transformer.wpe", layer_inputs=_HIDDEN_INPUT,
            norms=_Norms("layer", ln1=".ln_1", ln2=".ln_2", final="transformer.ln_f"),
            attention=_Attention(".attn", qkv=".c_attn", o_proj=".c_proj", rotary=False),
            mlp=_MLP(up=".c_fc", down=".c_proj", inputs=_HIDDEN_INPUT)),
    # GPT-J's block takes (position_ids, hidden_states).
    _Family("gptj", "GPTJForCausalLM", residual="stream", layer=_H_LAYER, embed="transformer.wte",
            norms=_Norms("layer", ln1=".ln_1", ln2="", final="transformer.ln_f"),
            attention=_Attention(".attn", o_proj=".out_proj", rotary=False), parallel=True,
            mlp=_MLP(up=".fc_in", down=".fc_out", inputs=_HIDDEN_INPUT),
            refused=_SCORES_ARE_PATTERN),
    # OPT (norms before each branch, do_layer_norm_before): its layer holds the MLP's two linear layers itself, so
    # the first's input is mlp.hook_in and the second's output hook_mlp_out.
    _Family("opt", "OPTForCausalLM", residual="stream", layer="model.decoder.layers.{i}",
            embed="model.decoder.embed_tokens", pos_embed="model.decoder.embed_positions",
            layer_inputs=_HIDDEN_INPUT,
            norms=_Norms("layer", ln1=".self_attn_layer_norm", ln2=".final_layer_norm",
                         final="model.decoder.final_layer_norm"),
            attention=_Attention(o_proj=".out_proj", rotary=False), mlp=_MLP("", up=".fc1", down=".fc2"),
            settings=dict(do_layer_norm_before=True),
            refused=_SCORES_ARE_PATTERN,
            taps=dict(mlp_in=_Tap("model.decoder.layers.{i}.fc1", _INPUT, _LINEAR_INPUT),
                      mlp_out=_Tap("model.decoder.layers.{i}.fc2", _OUTPUT))),
    # BLOOM (residual from before each norm) normalizes its embedding once before layer 0: that is hook_embed. ALiBi.
    _Family("bloom", "BloomForCausalLM", residual="stream", layer=_H_LAYER, embed_at_layer0=True,
            norms=_Norms("layer", final="transformer.ln_f", inputs=_TORCH_NORM_INPUT),
            attention=_Attention(".self_attention", qkv=".query_key_value", o_proj=".dense", rotary=False),
            mlp=_MLP(up=".dense_h_to_4h", down=".dense_4h_to_h"),
            settings=dict(apply_residual_connection_post_layernorm=False)),
    # Falcon (7B's layout: parallel_attn, one norm): the output projections leave the bias for the layer to add
    # once both are summed.
    _Family("falcon", "FalconForCausalLM", residual="stream", layer=_H_LAYER, embed="transformer.word_embeddings",
            norms=_Norms("layer", ln2="", final="transformer.ln_f", inputs=_TORCH_NORM_INPUT),
            attention=_Attention(".self_attention", qkv=".query_key_value", o_proj=".dense", rotary=False,
                                 multi_query="multi_query"),
            parallel=True, mlp=_MLP(up=".dense_h_to_4h", down=".dense_4h_to_h"), bias_apart=True,
            settings=dict(new_decoder_architecture=False, parallel_attn=True)),
    # OLMo's LayerNorm has no weight and no bias (transformers' own module, which vLLM keeps).
    dataclasses.replace(
        _BACKEND, name="olmo", architecture="OlmoForCausalLM", norms=_Norms("layer", inputs=_HIDDEN_INPUT),
        refused=dict.fromkeys(
            ("ln1_scale", "ln1", "ln2_scale", "ln2", "final_norm_scale", "final_norm"),
            "TransformerLens 4.3's bridge fails on a hook at OLMo's weightless norms (\"has no attribute 'weight'\")"),
    ),
    dataclasses.replace(_BACKEND, name="olmo2", architecture="Olmo2ForCausalLM",
                        norms=_Norms(ln1="", ln2="", post=_SANDWICH)),
    dataclasses.replace(_BACKEND, name="phi", architecture="PhiForCausalLM",
                        norms=_Norms("layer", ln2="", final="model.final_layernorm"),
                        attention=dataclasses.replace(_BACKEND.attention, o_proj=".dense"), parallel=True,
                        mlp=_MLP(up=".fc1", down=".fc2", inputs=_HIDDEN_INPUT)),
    dataclasses.replace(_BACKEND, name="starcoder2", architecture="Starcoder2ForCausalLM", norms=_Norms("layer"),
                        mlp=_MLP(up=".c_fc", down=".c_proj", inputs=_HIDDEN_INPUT)),
    # GPT-NeoX: its fused query_key_value interleaves q, k and v per head, which no part here describes.
    dataclasses.replace(
        _BACKEND, name="gpt_neox", architecture="GPTNeoXForCausalLM", embed="model.embed_in",
        attention=dataclasses.replace(_BACKEND.attention, path=".attention", o_proj=".dense", rotary=False),
        norms=_Norms("layer", final="model.final_layer_norm"), parallel=True,
        mlp=_MLP(up=".dense_h_to_4h", down=".dense_4h_to_h", inputs=_HIDDEN_INPUT),
        settings=dict(use_parallel_residual=True),
        refused=dict.fromkeys(("attn_q", "attn_k", "attn_v"),
                              "its fused query_key_value interleaves q, k and v per head")),
    _Family("ministral3", "Ministral3ForCausalLM", vllm_class="MistralForCausalLM"),  # rot_q: Llama 4's query scale
    # GLM-4-0414: Gemma 2's sandwich norms with plain weights.
    _Family("glm4", "Glm4ForCausalLM", norms=_Norms(post=(".post_self_attn_layernorm", ".post_mlp_layernorm"))),
    # GLM-4.5: dense first layers, then sigmoid scores chosen with a correction bias among the best groups; the
    # shared experts are inside the block's output.
    _Family("glm4_moe", "Glm4MoeForCausalLM",
            moe=_MoE(layers="first_k_dense_replace", scoring="sigmoid", correction_bias="e_score_correction_bias",
                     groups=True, scale="routed_scaling_factor")),
    # GLM-4.7-Flash: GLM-4.5's mixture of experts under multi-head latent attention.
    _Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", attention=_Attention(latent=True, rotary_3d=True),
            moe=_MoE(layers="first_k_dense_replace", scoring="sigmoid", correction_bias="e_score_correction_bias",
                     groups=True, scale="routed_scaling_factor")),
    # DeepSeek V3: the same, with no expert hooks in TransformerLens; vLLM routes as transformers does only where the
    # config names its sigmoid scoring and correction bias (else by softmax, without the bias).
    _Family("deepseek_v3", "DeepseekV3ForCausalLM", attention=_Attention(latent=True, rotary_3d=True),
            moe=_MoE(router="", layers="first_k_dense_replace"),
            settings={"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    # DeepSeek V2: softmax scores, weights not renormalized; vLLM chooses within the config's groups where transformers
    # does so for topk_method group_limited_greedy alone (greedy, with one group, is V2-Lite's).
    _Family("deepseek_v2", "DeepseekV2ForCausalLM", attention=_Attention(latent=True, rotary_3d=True),
            moe=_MoE(router="", layers="first_k_dense_replace"),
            settings={"topk_method": "greedy", "n_group": 1, "norm_topk_prob": False}),
    # ERNIE 4.5 MoE: dense and MoE layers; TransformerLens names no expert hooks here.
    _Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", moe=_MoE(router="", layers="moe_layer_interval")),
    # AFMoE: a norm before and after each branch; no rotary or expert hooks in TransformerLens.
    _Family("afmoe", "AfmoeForCausalLM", attention=_Attention(rotary=False),
            norms=_Norms(ln2=".pre_mlp_layernorm", post=(".post_attention_layernorm", ".post_mlp_layernorm")),
            moe=_MoE(router="", layers="num_dense_layers"), refused=_SCORES_ARE_PATTERN),
    _Family("granitemoe", "GraniteMoeForCausalLM", residual="stream", embed_at_layer0=True,
            multiplier="residual_multiplier", moe=_MoE(".block_sparse_moe", renormalize="always")),
    dataclasses.replace(_BACKEND, name="glm", architecture="GlmForCausalLM", mlp=_MLP(inputs=_HIDDEN_INPUT)),
    dataclasses.replace(_BACKEND, name="smollm3", architecture="SmolLM3ForCausalLM"),  # NoPE layers: rot_q is q
    dataclasses.replace(_BACKEND, name="vaultgemma", architecture="VaultGemmaForCausalLM",
                        norms=_Norms("rms_offset", ln2=".pre_feedforward_layernorm")),
    dataclasses.replace(_BACKEND, name="flexolmo", architecture="FlexOlmoForCausalLM",
                        vllm_class="TransformersMoEForCausalLM", norms=_Norms(ln1="", ln2="", post=_SANDWICH),
                        moe=_MoE(router="")),
    _Family("ernie4_5", "Ernie4_5ForCausalLM"),
    # Gemma 4: decoder layers return the stream; Gemma 2's sandwich norms with plain weights; per-layer inputs and a
    # layer scalar inside each layer (in hook_resid_post); layers of two head sizes, the last ones reusing earlier
    # layers' keys and values. A mixture of experts beside the MLP is inside hook_mlp_out, which TransformerLens's
    # MLP hooks do not see.
    _Family("gemma4", "Gemma4ForCausalLM", residual="stream", embed_at_layer0=True,
            norms=_Norms(ln2=".pre_feedforward_layernorm", post=_SANDWICH),
            mlp=_MLP(double_wide="use_double_wide_mlp"),
            attention=_Attention(kv_shared="num_kv_shared_layers", k_as_v="attention_k_eq_v"),
            refused={**dict.fromkeys(_NORM_SITES, "TransformerLens 4.3's Gemma 4 adapter runs no hook_normalized or "
                                     "hook_scale (its norms are bare components)"),
                     **dict.fromkeys(("attn_rot_q", "attn_rot_k"), "TransformerLens 4.3's Gemma 4 adapter keeps "
                                     "transformers' attention, with no hook_rot_q or hook_rot_k"),
                     **dict.fromkeys(("attn_scores", "pattern"), "its last layers attend with earlier layers' keys, "
                                     "which vLLM's attention is handed as None")}),
    # Llama 4: dense and MoE layers under feed_forward, NoPE layers, chunked attention; no rotary hooks or expert
    # hooks in TransformerLens.
    _Family("llama4", "Llama4ForCausalLM", mlp=_MLP(".feed_forward", width="intermediate_size_mlp"),
            attention=_Attention(rotary=False, qk_halves=True),
            moe=_MoE(".feed_forward", router="", layers="interleave_moe_layer_step"),
            refused=_SCORES_ARE_PATTERN),
    # Apertus: ungated xIELU MLP, whose parameters vLLM keeps in bf16 (its rows from mlp.hook_post on differ from
    # transformers' by about 1e-3 in fp32).
    _Family("apertus", "ApertusForCausalLM", norms=_Norms(ln1=".attention_layernorm", ln2=".feedforward_layernorm"),
            mlp=_MLP(up=".up_proj")),
    _Family("nemotron", "NemotronForCausalLM", norms=_Norms("layer_offset"), mlp=_MLP(up=".up_proj")),
    # Cohere 2: Cohere's layout; full-attention layers have no rotary (q and k pass unrotated).
    _Family("cohere2", "Cohere2ForCausalLM", vllm_class="CohereForCausalLM", residual="stream",
            norms=_Norms("layer", ln2="", inputs=_HIDDEN_INPUT), parallel=True),
    # PhiMoE (a stream layout returning (stream, residual)): LayerNorms, sparsemixer routing.
    _Family("phimoe", "PhiMoEForCausalLM", hf_class="PhimoeForCausalLM", residual="stream",
            norms=_Norms("layer", inputs=_TORCH_NORM_INPUT), attention=_Attention(rotary=False),
            refused=_SCORES_ARE_PATTERN,
            lm_head_bias=True,
            moe=_MoE(".block_sparse_moe", scoring="sparsemixer", renormalize="")),
    dataclasses.replace(_BACKEND, name="arcee", architecture="ArceeForCausalLM", mlp=_MLP(up=".up_proj")),
    dataclasses.replace(_BACKEND, name="jais2", architecture="Jais2ForCausalLM", norms=_Norms("layer"),
                        mlp=_MLP(up=".up_proj")),
    dataclasses.replace(_BACKEND, name="seed_oss", architecture="SeedOssForCausalLM"),
    dataclasses.replace(_BACKEND, name="olmo3", architecture="Olmo3ForCausalLM",
                        norms=_Norms(ln1="", ln2="", post=_SANDWICH)),
    # HunYuan: q and k normalized after rotary, inside transformers' attention, on [heads, tokens, d_head].
    dataclasses.replace(_BACKEND, name="hunyuan_dense", architecture="HunYuanDenseV1ForCausalLM",
                        refused=dict.fromkeys(("attn_rot_q", "attn_rot_k"), "TransformerLens's hook_rot_q/k are the "
                                              "inputs of its q/k norms, which take [heads, tokens, d_head]")),
    # GPTBigCode: GPT-2's layout under the backend, with multi-query attention.
    dataclasses.replace(_BACKEND, name="gpt_bigcode", architecture="GPTBigCodeForCausalLM", layer="model.h.{i}",
                        embed="model.wte", pos_embed="model.wpe",
                        norms=_Norms("layer", ln1=".ln_1", ln2=".ln_2", final="model.ln_f"),
                        attention=dataclasses.replace(_BACKEND.attention, path=".attn", qkv=".c_attn",
                                                      o_proj=".c_proj", rotary=False, multi_query="multi_query"),
                        mlp=_MLP(up=".c_fc", down=".c_proj", inputs=_HIDDEN_INPUT),
                        taps=dict(mlp_post=_Tap("model.h.{i}.mlp.c_proj", _INPUT, _X_INPUT))),  # (a ReplicatedLinear)
)}
# Multimodal checkpoints: the text model is its text family's record under text_prefix in vLLM's tree (vLLM runs it
# with language_model_only=True, or beside the towers on image prompts; TransformerLens's bridge names its hooks as the
# text family's).
_LM = "language_model."


# A multimodal checkpoint's image features replace its placeholder tokens' embeddings before layer 0. Where hook_embed
# is what layer 0 receives (embed_at_layer0: Gemma's), it would read the image features at an image's positions, where
# TransformerLens's is the placeholder's scaled embedding (Gemma 3's tiny model: rows 1.2-1.3 apart, 2026-12-07).
_EMBED_AT_LAYER0_UNDER_IMAGES = (
    "what vLLM's layer 0 receives, which is TransformerLens's hook_embed at text positions, holds the image features at "
    "an image's (TransformerLens's: the placeholder token's scaled embedding): read blocks.0.hook_resid_pre, the same "
    "rows at text positions"
)


def _text_model_under_lm(text: str, name: str, architecture: str, text_classes: tuple[str, ...], **changes) -> _Family:
    """The record of a multimodal checkpoint whose text model is the ``text`` family's, at language_model."""
    family = FAMILIES[text]
    if family.embed_at_layer0:
        changes["refused"] = {**family.refused, **changes.get("refused", {}), "embed": _EMBED_AT_LAYER0_UNDER_IMAGES}
    return dataclasses.replace(family, name=name, architecture=architecture, text_prefix=_LM,
                               text_classes=text_classes, **changes)


_LLAVA_TEXT = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# fmt: off
FAMILIES.update({family.name: family for family in (
    _text_model_under_lm("gemma3", "gemma3_mm", "Gemma3ForConditionalGeneration", ("Gemma3ForCausalLM",)),
    _text_model_under_lm("gemma4", "gemma4_mm", "Gemma4ForConditionalGeneration", ("Gemma4ForCausalLM",)),
    _text_model_under_lm("mistral", "mistral3", "Mistral3ForConditionalGeneration", ("MistralForCausalLM",)),
    _text_model_under_lm("llama4", "llama4_mm", "Llama4ForConditionalGeneration", ("Llama4ForCausalLM",)),
    _text_model_under_lm("llama", "llava", "LlavaForConditionalGeneration", _LLAVA_TEXT),
    # Qwen-VL: TransformerLens 4.3's adapters run no rotary hooks (M-RoPE, applied inside transformers' attention), and
    # keep transformers' attention.
    _text_model_under_lm("qwen2", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", ("Qwen2ForCausalLM",),
                         attention=_Attention(rotary=False), refused=_SCORES_ARE_PATTERN),
    _text_model_under_lm("qwen3", "qwen3_vl", "Qwen3VLForConditionalGeneration", ("Qwen3LLMForCausalLM",),
                         attention=_Attention(rotary=False), refused=_SCORES_ARE_PATTERN),
    _text_model_under_lm("qwen3_moe", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
                         ("Qwen3MoeLLMForCausalLM",), attention=_Attention(rotary=False), refused=_SCORES_ARE_PATTERN),
    _text_model_under_lm("qwen3_5", "qwen3_5_mm", "Qwen3_5ForConditionalGeneration", ("Qwen3_5ForCausalLM",)),
    _text_model_under_lm("qwen3_5_moe", "qwen3_5_moe_mm", "Qwen3_5MoeForConditionalGeneration",
                         ("Qwen3_5MoeForCausalLM",)),
    _text_model_under_lm("llama", "llava_next", "LlavaNextForConditionalGeneration", _LLAVA_TEXT),
    _text_model_under_lm("qwen2", "llava_onevision", "LlavaOnevisionForConditionalGeneration", ("Qwen2ForCausalLM",)),
    # Audio towers beside a text model (no torchvision needed).
    _text_model_under_lm("qwen2", "audioflamingo3", "AudioFlamingo3ForConditionalGeneration", ("Qwen2ForCausalLM",)),
    _text_model_under_lm("qwen2", "qwen2_audio", "Qwen2AudioForConditionalGeneration", ("Qwen2ForCausalLM",)),
    _text_model_under_lm("llama", "glmasr", "GlmAsrForConditionalGeneration", ("LlamaForCausalLM",)),
    # Idefics3: vLLM's text model is a LlamaModel at model.text_model (lm_head at the top).
    dataclasses.replace(
        FAMILIES["llama"], name="idefics3", architecture="Idefics3ForConditionalGeneration",
        text_prefix="model.text_model.", layer="layers.{i}", embed="embed_tokens", norms=_Norms(final="norm"),
        text_classes=("LlamaModel",)),
    _text_model_under_lm("gemma4", "gemma4_unified", "Gemma4UnifiedForConditionalGeneration", ("Gemma4ForCausalLM",)),
    # Emu3: vLLM serves it with its Transformers backend (transformers' tree; its VQ-VAE is built beside the text
    # model), which reads the processor at boot.
    dataclasses.replace(
        _BACKEND, name="emu3", architecture="Emu3ForConditionalGeneration",
        vllm_class="TransformersMultiModalForCausalLM", text_prefix="model.text_model.", layer="layers.{i}",
        embed="embed_tokens", norms=_Norms(final="norm"), text_classes=("Emu3TextModel",)),
    # MuseGlimmer: vLLM's MuseGlimmerForCausalLM holds the text model at its root; Gemma 2's sandwich norms (1 + w),
    # each taking the stream alone; the embedding is normalized (weightless) before layer 0, inside transformers'
    # embedding module (so hook_embed is what layer 0 receives). TransformerLens's norms and attention there are bare
    # components: no hook_scale, hook_normalized or rotary hooks.
    _Family("muse_glimmer", "MuseGlimmerForConditionalGeneration", vllm_class="MuseGlimmerForCausalLM",
            residual="stream", embed_at_layer0=True,
            norms=_Norms("rms_offset", ln2=".pre_feedforward_layernorm", post=_SANDWICH, inputs=_HIDDEN_INPUT),
            attention=_Attention(rotary=False), text_prefix="",
            text_classes=("MuseGlimmerForCausalLM",),
            refused={**_SCORES_ARE_PATTERN, **dict.fromkeys(
                _NORM_SITES, "TransformerLens 4.3's MuseGlimmer adapter runs no hook_normalized or hook_scale (its "
                "norms are bare components)")}),
)})
# fmt: on
"""name -> the family's record (a frozen _Family: ``architecture``, ``vllm_class``, module paths, ``refused`` sites
with why, ...), text families first, then multimodal checkpoints (``text_classes``); tiny_model takes the names."""
_ARCHITECTURES = {family.architecture: family for family in FAMILIES.values()}
# fmt: off
# architecture -> why no record describes it, as measured with vLLM 0.32 CPU, TransformerLens 4.3, transformers 5.19
REFUSED = {
    **dict.fromkeys(("ExaoneForCausalLM", "InternLM2ForCausalLM"), "transformers 5.19 has no class for it (its "
                    "checkpoints need remote code): 'Transformers does not recognize this architecture'"),
    **dict.fromkeys(("LagunaForCausalLM", "MiniMaxM2ForCausalLM"), "vLLM 0.32's CPU MoE router takes softmax "
                    "scoring only, not its sigmoid routing (AssertionError: assert self.scoring_func == 'softmax')"),
    "HrmTextForCausalLM": "TransformerLens names its layers L_blocks and H_blocks and runs each several times a "
                          "forward, keeping the last; vLLM's prefill attends both ways over the prompt",
    "GlmMoeDsaForCausalLM": "sparse multi-head latent attention: 'Sparse Attention is not supported on CPU'",
    "DeepseekV4ForCausalLM": "compressed sparse attention with hyper-connection streams; vLLM 0.32 refuses its "
                             "config ('mlp_layer_types entries must be in (sparse, dense)')",
    "OlmoHybridForCausalLM": "Gated DeltaNet linear attention; vLLM 0.32 CPU fails to build it (module 'triton' has "
                             "no attribute 'set_allocator')",
    "Glm4vForConditionalGeneration": "vLLM's text model of it differs from transformers' (greedy tokens from the "
                                     "first; the same weights as Glm4ForCausalLM agree)",
    "Gemma3nForConditionalGeneration": "vLLM runs its text model only with its vision tower, which needs timm: with "
                                       "language_model_only the first forward fails ('inputs_embeds is required on "
                                       "the first PP rank')",
}
# fmt: on
"""architecture (``config.architectures[0]``) -> why no record describes it: capture_specs refuses it saying so."""


def _family(hf_config: Any) -> _Family:
    """The record of the model's architecture; ValueError naming it, why it is refused (or the supported ones), or a
    setting the record does not describe."""
    if not hasattr(hf_config, "get_text_config"):
        raise ValueError(
            f"hf_config: expected a transformers config, got {hf_config!r:.100}: pass AutoConfig.from_pretrained(path)"
        )
    if not getattr(hf_config, "architectures", None):
        raise ValueError(
            f"hf_config: {type(hf_config).__name__} (model_type {getattr(hf_config, 'model_type', None)!r}) names no "
            "architecture (config.architectures), which says where vLLM holds each tensor: if it is the text part of "
            "a multimodal checkpoint's config (get_text_config()), pass the whole checkpoint's config, "
            "AutoConfig.from_pretrained(path); one made by hand needs config.architectures = ['LlamaForCausalLM'] (or "
            "another supported class)"
        )
    architecture = hf_config.architectures[0]
    family = _ARCHITECTURES.get(architecture)
    if architecture in REFUSED:
        raise ValueError(f"architecture {architecture}: refused: {REFUSED[architecture]}")
    if family is None:
        raise ValueError(
            f"architecture {architecture}: TransformerLens hook names are placed per architecture and this module has "
            f"no record for it; supported: {sorted(_ARCHITECTURES)}. Hook modules of your choosing under names of "
            "your own with (module_path, width) specs, e.g. {'my_mlp_in': ('model.layers.1.mlp.gate_up_proj', 512)} "
            "(vLLM's module path; the README's 'Any module, under a name of your own')"
        )
    for setting, value in family.settings.items():
        found = getattr(hf_config, setting, None)
        if found != value:
            raise ValueError(
                f"architecture {architecture} with {setting}={found!r}: this module's record "
                f"describes {architecture} with {setting}={value!r} only: otherwise its tensors sit elsewhere, or "
                "TransformerLens's bridge computes them otherwise than vLLM (the record's comment says which)"
            )
    return family


# ---------------------------------------------------------------------------
# A layer's sites. _layer_sites decides, for one layer of a model, each site's tap and row shape together (_Site), from
# the family's record and the (text) config: what the layer is (its kind, whether it holds experts, whether it reuses
# an earlier layer's keys and values, its widths) is worked out once, in _layer; _taps and _row_shapes read that, and
# renames, the sites a layer's kind lacks and the record's refusals are applied once, to both. capture_specs and
# model_sites, the public view, list what a config's model offers.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Site:
    """One site on one layer: where its tensor is (its tap), and the shape of one token's row of it."""

    tap: _Tap
    row_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer as the family's record and the (text) model's config make it, the facts every site of it reads.

    index: the layer, None for the sites outside the layers. kind: its kind as the config names it (a key of
    _Family.kind_sites; "" where layers do not differ). moe: its mixture-of-experts block, where it holds one.
    kv_shared: it reuses an earlier layer's keys and values (see _Attention.kv_shared); k_as_v: its keys are its
    values too (see _Attention.k_as_v). Widths, from the config, whose attribute names differ between families: d_model,
    n_heads, d_head, n_kv_heads, d_mlp (its MLP's, d_model where experts hold the MLP's place); num_experts and
    experts_per_token where it holds experts.
    """

    index: int | None
    kind: str
    moe: _MoE | None
    kv_shared: bool
    k_as_v: bool
    d_model: int
    n_heads: int
    d_head: int
    n_kv_heads: int
    d_mlp: int
    num_experts: int | None
    experts_per_token: int | None


def _layer(family: _Family, config: Any, index: int | None) -> _Layer:
    """The facts of layer ``index`` (None: outside the layers) of the model whose (text) config is ``config``."""
    kind = _layer_kind(family, config, index)
    moe = family.moe if index is not None and _moe_layer(family, config, index) else None
    kv_shared = index is not None and _kv_shared(family, config, index)
    k_as_v = bool(index is not None and family.attention and family.attention.k_as_v
                  and getattr(config, family.attention.k_as_v) and config.layer_types[index] == "full_attention")
    d_model, n_heads = config.hidden_size, getattr(config, "num_attention_heads", 1)  # (none: Mamba-2's)
    attention = config  # a layer's own, where layers differ (transformers' per_layer_config)
    if getattr(config, "is_heterogeneous", False):
        attention = config.per_layer_config[index or 0]
    d_head = getattr(attention, "head_dim", None) or d_model // n_heads
    if family.attention and family.attention.multi_query and getattr(config, family.attention.multi_query):
        n_kv_heads = 1
    else:
        n_kv_heads = getattr(attention, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
    d_mlp = family.mlp.d_mlp(config, d_model, kv_shared) if family.mlp else d_model
    if moe is not None:  # TransformerLens's mlp hooks: the block's
        d_mlp = d_model
    return _Layer(
        index, kind, moe, kv_shared, k_as_v, d_model, n_heads, d_head, n_kv_heads or n_heads, d_mlp,
        _num_experts(config) if moe is not None else None, config.num_experts_per_tok if moe is not None else None,
    )


def _moe_layer(family: _Family, config: Any, layer: int) -> bool:
    return family.moe is not None and _MOE_LAYERS[family.moe.layers](config, layer)


def _layer_sites(family: _Family, config: Any, layer: int | None) -> dict[str, _Site]:
    """Each site the family has on ``layer`` (None: the sites outside the layers) -> its tap and row shape, in
    forward order, under the name TransformerLens gives it on the family; the sites in ``family.refused`` are left
    out. config: the (text) model's transformers config."""
    facts = _layer(family, config, layer)
    taps, shapes = _taps(family, config, facts), _row_shapes(family, config, facts)
    absent = (*(_ATTENTION_SITES if not family.attention else ()), *(_MLP_SITES if not family.mlp else ()))
    held = family.kind_sites[facts.kind] if facts.kind else ""
    if held == "stream":
        absent = tuple(site for site in taps if site not in ("resid_pre", "resid_post"))
    inner = {"attention": _ATTENTION_SITES, "linear": _LINEAR_SITES, "conv": _CONV_SITES, "mixer": _MIXER_SITES,
             "mixer_ends": _MIXER_ENDS}
    if held in inner:  # the other kinds' sites
        absent += tuple(site for other, sites in inner.items() if other != held for site in sites
                        if site not in inner[held])
    sites = {family.renamed.get(site, site): None if site in absent or tap is None else _Site(tap, shapes[site])
             for site, tap in taps.items()}
    return {
        site: sites[site]
        for site, name in SITES.items()
        if sites.get(site) is not None and site not in family.refused and ("{i}" in name) == (layer is not None)
    }


def _taps(family: _Family, config: Any, layer: _Layer) -> dict[str, _Tap | None]:
    """Each site's tap on the layer, by the name the record's fields give it (None: not there); see _layer_sites."""
    f, at = family, family.layer
    pair = f.residual == "pair"

    def inputs_of(layer_kind: str) -> tuple[tuple[str, int], ...]:  # a layer's of that kind
        return f.kind_layer_inputs.get(layer_kind) or f.layer_inputs or (_LAYER_PAIR if pair else _LAYER_INPUT)

    layer_inputs = inputs_of(layer.kind)
    n = f.norms
    norm_inputs = n.inputs or (_NORM_PAIR if pair else _X_INPUT)
    a, m = f.attention, f.mlp
    attention = (at if a.path == "." else at + a.path) if a else ""
    mid_norm = at + n.ln2 if n.ln2 else None
    mixer = at + f.mixer.path if f.mixer else ""

    def norm(path: str, kind: str = _NORMALIZED) -> _Tap:
        return _Tap(path, kind, norm_inputs, n.kind)

    moe, gated = layer.moe, bool(m and m.up in _GATED_UP)
    if moe is None and m is None:
        mlp = {}
    elif moe is None:
        mlp = {
            "mlp_in": _Tap(at + m.path, _INPUT, m.inputs),
            "mlp_pre": _Tap(at + m.path + m.up, _OUTPUT, part="gate" if gated else "", bias_apart=f.bias_apart),
            "mlp_pre_linear": _Tap(at + m.path + m.up, _OUTPUT, part="up") if gated else None,
            "mlp_post": _Tap(at + m.path + m.down, _INPUT, _LINEAR_INPUT),
            "mlp_out": _Tap(at + m.path, _OUTPUT, multiplier=f.multiplier, bias_apart=f.bias_apart),
        }
    else:  # TransformerLens's MLP hooks are the block's input and output
        block, router = at + moe.block, at + moe.block + moe.router
        mlp = {
            "mlp_in": _Tap(block, _INPUT, ((moe.block_input, 0),)),
            "mlp_pre": _Tap(block, _INPUT, ((moe.block_input, 0),)),
            "expert_weights": _Tap(router, _ROUTER, part="weights", moe=moe) if moe.router else None,
            "expert_indices": _Tap(router, _ROUTER, part="indices", moe=moe) if moe.router else None,
            "mlp_post": _Tap(block, _OUTPUT),
            "mlp_out": _Tap(block, _OUTPUT, multiplier=f.multiplier),
        }
    if n.post:  # each branch's output is its post-norm's
        mlp["mlp_out"] = _Tap(at + n.post[1], _OUTPUT)
    taps = {
        "embed": _Tap(f.layer.format(i=0), _INPUT, inputs_of(_layer_kind(f, config, 0))[:1]) if f.embed_at_layer0
        else _Tap(f.embed, _OUTPUT),
        "pos_embed": _Tap(f.pos_embed, _OUTPUT) if f.pos_embed else None,
        "resid_pre": _Tap(at, _INPUT_PAIR if pair else _INPUT, layer_inputs),
        "ln1_scale": norm(at + n.ln1, _NORM_SCALE) if n.ln1 else None,
        "ln1": norm(at + n.ln1) if n.ln1 else None,
        **({
            **{f"attn_{part}": _Tap(attention + a.qkv, _OUTPUT, part=part, bias_apart=f.bias_apart) for part in "qkv"},
            "attn_rot_q": _Tap(attention + ".attn", _INPUT, _QUERY, direct=a.direct) if a.rotary else None,
            "attn_rot_k": _Tap(attention + ".attn", _INPUT, _KEY, direct=a.direct) if a.rotary else None,
            "attn_scores": _Tap(attention + ".attn", _QUERY_KEY, _QUERY + _KEY, direct=a.direct),
            "pattern": _Tap(attention + ".attn", _QUERY_KEY, _QUERY + _KEY, direct=a.direct),
            "attn_z": _Tap(attention + a.o_proj, _INPUT, _LINEAR_INPUT),
            "attn_out": _Tap(at + n.post[0], _OUTPUT) if n.post
            else _Tap(attention + a.o_proj, _OUTPUT) if a.path == "."
            else _Tap(attention, _OUTPUT, multiplier=f.multiplier, bias_apart=f.bias_apart),
        } if a else {}),
        **({
            "attn_q_latent": _Tap(attention + ".q_a_layernorm", _OUTPUT) if config.q_lora_rank else None,
            "attn_kv_latent": _Tap(attention + ".kv_a_layernorm", _OUTPUT),
            **{site: _Tap(attention + ".mla_attn.mla_attn", _LATENT, _LATENT_INPUTS, part=part) for site, part in (
                ("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_rot_q", "rot_q"), ("attn_rot_k", "rot_k"),
                ("attn_scores", "qk"), ("pattern", "qk"))},
        } if a and a.latent else {}),
        **({
            "linear_attn_in": _Tap(at + f.linear_attention, _INPUT, _HIDDEN_INPUT),
            "linear_attn_out": _Tap(at + f.linear_attention, _OUTPUT),
        } if f.linear_attention else {}),
        **({
            "conv_in": _Tap(at + f.conv, _INPUT, _HIDDEN_INPUT),
            "conv_in_proj": _Tap(at + f.conv + ".in_proj", _OUTPUT),
            "conv_gated": _Tap(at + f.conv + ".out_proj", _INPUT, _LINEAR_INPUT),
            "conv_out": _Tap(at + f.conv + ".out_proj", _OUTPUT),  # (vLLM's ShortConv writes it into an argument)
        } if f.conv else {}),
        **({
            "mixer_in": _Tap(mixer, _INPUT, _HIDDEN_INPUT),
            "mixer_in_proj": _Tap(mixer + ".in_proj", _OUTPUT),
            **({
                "mixer_norm_in": _Tap(mixer + ".norm", _INPUT, (("x", 0),)),
                "mixer_norm_gate": _Tap(mixer + ".norm", _INPUT, (("gate", 1),)),
                "mixer_norm": _Tap(mixer + ".out_proj", _INPUT, _LINEAR_INPUT),
            } if not f.mixer.mamba1 and (not f.mixer.normed or getattr(config, f.mixer.normed)) else {}),
            "mixer_out": _Tap(mixer + ".out_proj", _OUTPUT) if f.mixer.mamba1 else _Tap(mixer, _OUTPUT),
        } if f.mixer else {}),
        # the stream between the branches: ln2's input, or the MLP's where it has no pre-norm
        "resid_mid": None if f.parallel else _Tap(mid_norm, _NORM_INPUT, norm_inputs, n.kind) if mid_norm and pair
        else _Tap(mid_norm, _INPUT, norm_inputs) if mid_norm else mlp.get("mlp_in"),
        "ln2_scale": norm(mid_norm, _NORM_SCALE) if mid_norm else None,
        "ln2": norm(mid_norm) if mid_norm else None,
        **mlp,
        "resid_post": _Tap(at, _OUTPUT_PAIR if pair else _OUTPUT),
        "final_norm_scale": norm(n.final, _NORM_SCALE),
        "final_norm": norm(n.final),
        **f.taps,
        **f.kind_taps.get(layer.kind, {}),
    }  # fmt: skip
    if layer.kv_shared:
        taps.update(attn_q=_Tap(attention + ".q_proj", _OUTPUT), attn_k=None, attn_v=None)
    elif layer.k_as_v:
        taps.update(attn_k=_Tap(attention + a.qkv, _OUTPUT, part="kv"), attn_v=None)
    return taps


_ATTENTION_SITES = ("attn_q_latent", "attn_kv_latent", "attn_q", "attn_k", "attn_v", "attn_rot_q", "attn_rot_k",
                    "attn_scores", "pattern", "attn_z", "attn_out")
_LINEAR_SITES = ("linear_attn_in", "linear_attn_out")
_CONV_SITES = ("conv_in", "conv_in_proj", "conv_gated", "conv_out")
_MIXER_SITES = ("mixer_in", "mixer_in_proj", "mixer_norm_in", "mixer_norm_gate", "mixer_norm", "mixer_out")
_MIXER_ENDS = ("mixer_in", "mixer_out")  # a mixer's input and output alone (Nemotron-H's attention and MLP layers)
_MLP_SITES = ("resid_mid", "mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_post", "mlp_out")  # (and ln2's, where ln2 is)


def _layer_kind(family: _Family, config: Any, layer: int | None) -> str:
    """``layer``'s kind as its config names it (a key of _Family.kind_sites; "" where layers do not differ);
    ValueError naming a kind the record does not know."""
    if not family.layer_kinds or layer is None:
        return ""
    kind = getattr(config, family.layer_kinds)[layer]
    if kind not in family.kind_sites:
        raise ValueError(
            f"{family.architecture}: layer {layer} is of kind {kind!r} ({family.layer_kinds}); this module's record "
            f"knows {sorted(family.kind_sites)}"
        )
    return kind


def _kv_shared(family: _Family, config: Any, layer: int) -> bool:
    """Whether ``layer`` reuses an earlier layer's keys and values (see _Attention.kv_shared)."""
    shared = getattr(config, family.attention.kv_shared) if family.attention and family.attention.kv_shared else 0
    return bool(shared) and layer >= config.num_hidden_layers - shared


def _num_experts(config: Any) -> int | None:
    """The experts of each mixture-of-experts block, or None for a dense model."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)


def _row_shapes(family: _Family, config: Any, layer: _Layer) -> dict[str, tuple[int, ...]]:
    """One row's shape at each site of the layer, by the name the record's fields give it; see _layer_sites."""
    d_model, n_heads, d_head = layer.d_model, layer.n_heads, layer.d_head
    shapes = {site: (d_model,) for site in SITES}
    if layer.moe is not None:
        shapes.update(expert_weights=(layer.num_experts,), expert_indices=(layer.experts_per_token,))
    q, kv, mlp = (n_heads, d_head), (layer.n_kv_heads, d_head), (layer.d_mlp,)
    shapes.update(attn_q=(2 * n_heads, d_head) if family.attention and family.attention.query_gate else q,
                  attn_rot_q=q, attn_z=q)
    shapes.update(attn_k=kv, attn_v=kv, attn_rot_k=kv)
    shapes.update(attn_scores=(q[0] + kv[0], d_head), pattern=(q[0] + kv[0], d_head))
    shapes.update(mlp_pre=mlp, mlp_pre_linear=mlp, mlp_post=mlp, ln1_scale=(1,), ln2_scale=(1,), final_norm_scale=(1,))
    shapes.update(conv_in_proj=(3 * d_model,))
    if family.attention and family.attention.latent:
        qk, rope, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        shapes.update(attn_q_latent=(config.q_lora_rank or 0,), attn_kv_latent=(config.kv_lora_rank,),
                      attn_q=(n_heads, qk), attn_k=(n_heads, qk), attn_v=(n_heads, v), attn_rot_q=(n_heads, rope),
                      attn_rot_k=(1, rope), attn_z=(n_heads, v), attn_scores=(2 * n_heads, qk),
                      pattern=(2 * n_heads, qk))
    if layer.moe is not None and layer.moe.shared_width:
        shared = (getattr(config, layer.moe.shared_width),)
        shapes.update(shared_mlp_pre=shared, shared_mlp_pre_linear=shared, shared_mlp_post=shared)
    if family.mixer:
        d_inner, d_in_proj = family.mixer.widths(config, d_model)
        shapes.update(mixer_in_proj=(d_in_proj,), mixer_norm_in=(d_inner,), mixer_norm_gate=(d_inner,),
                      mixer_norm=(d_inner,))
    return shapes


def capture_specs(
    hf_config: Any, sites: str | tuple[str, ...] = ("resid_post",), layers: int | list[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """``{hook_name: row shape}`` for the model, in the order a forward reaches them: the shape of what a forward keeps
    of each token (see SITES), which a read gives as [rows, *row shape], but for attn_scores and pattern, whose row
    is the query and key vLLM's attention receives, ``[n_heads + n_kv_heads, d_head]``, which a read rebuilds into
    TransformerLens's ``[n_heads, queries, keys]`` (a sink stores no such rows). hf_config: its transformers
    config (``AutoConfig.from_pretrained(path)``), of an architecture a record describes (else ValueError naming the
    supported ones). sites: keys of ``SITES`` (or one); layer sites expand over ``layers`` (or one; default all;
    -1 the last) that have them (a mixture of experts' sites over its MoE layers), and a site none of them has is
    refused by name."""
    family = _family(hf_config)
    config = hf_config.get_text_config()
    sites, layers = _sites_and_layers(sites, layers, config.num_hidden_layers, family, config)
    specs, found = {}, set()
    for layer in (None, *layers):
        chosen = {site: placed for site, placed in _layer_sites(family, config, layer).items() if site in sites}
        specs.update({SITES[site].format(i=layer): placed.row_shape for site, placed in chosen.items()})
        found.update(chosen)
    missing = [site for site in sites if site not in found]
    if missing:
        absent = [SITES[site] for site in missing if site not in family.refused]
        parallel = " (attention and MLP read the same residual stream, as in TransformerLens)"
        parallel = parallel if family.parallel and "resid_mid" in missing else ""
        problems = [f"has no {absent}{parallel}"] if absent else []
        problems += [f"does not place {SITES[site]}: {family.refused[site]}"
                     for site in missing if site in family.refused]
        raise ValueError(
            f"{family.architecture} " + "; ".join(problems) + f" (layers {layers}); its sites: "
            f"{_family_sites(family, config)}"
        )
    return {name: specs[name] for name in sorted(specs, key=_forward_order)}


def _sites_and_layers(
    sites: Any, layers: Any, num_layers: int, family: _Family, config: Any
) -> tuple[list[str], list[int]]:
    """capture_specs's sites, and its layers sorted, once each, negative ones counted from the end as in Python and
    TransformerLens; a str is one site and an int one layer. ValueError naming what is neither, and what is valid:
    for a site, the close ones and every one the family has."""
    listed = _listed(sites, str)
    unknown = [sites] if listed is None else [s for s in listed if not isinstance(s, str) or s not in SITES]
    if unknown:
        offered = _family_sites(family, config)
        close = {str(site): difflib.get_close_matches(str(site), offered, n=3) for site in unknown}
        hints = "; ".join(f"{site!r}: did you mean {' or '.join(found)}?" for site, found in close.items() if found)
        raise ValueError(
            f"capture_specs: unknown sites {unknown}" + (f" ({hints})" if hints else "")
            + f"; one site or a list of them, of those {family.architecture} has: {offered}"
        )
    chosen = list(range(num_layers)) if layers is None else _listed(layers, int)
    bad = [layers] if chosen is None else [i for i in chosen if not _int_at_least(i, -num_layers) or i >= num_layers]
    if bad:
        raise ValueError(
            f"capture_specs: layers {bad}: expected ints in [-{num_layers}, {num_layers}) (-1: the last), one or a "
            "list of them, or None for all"
        )
    return listed, sorted({i % num_layers for i in chosen})


def _listed(value: Any, one: type) -> list | None:
    """``value`` as a list (one ``one`` alone as a list of it), or None where it is neither iterable nor that."""
    if isinstance(value, one):
        return [value]
    try:
        return list(value)
    except TypeError:
        return None


def _family_sites(family: _Family, config: Any) -> list[str]:
    """The sites the family has on some layer, or outside them, in forward order."""
    present = set(_layer_sites(family, config, None))
    for layer in range(config.num_hidden_layers):
        present.update(_layer_sites(family, config, layer))
    return [site for site in SITES if site in present]


def model_sites(hf_config: Any) -> list[str]:
    """The sites (keys of SITES) the model has, on some layer or outside them, in forward order: those capture_specs
    takes. hf_config: as capture_specs's (ValueError for an architecture no record describes)."""
    return _family_sites(_family(hf_config), hf_config.get_text_config())


# ---------------------------------------------------------------------------
# Config channel. vLLM builds its workers in other processes, so a module global set in the driver never reaches
# them: the config travels as JSON in vLLM's own additional_config (which every worker receives, Ray's included, and
# which vLLM hashes into its compile-cache key), or, for servers started by hand, in one environment variable.
# Validated when written and again when read (a worker may run another copy); a config's saes are read as it is made
# (_read_sae, in the driver and in each worker), its sink_dir checked by its sink writer in configure.
# ---------------------------------------------------------------------------

_CONFIG_ENV = "TL_VLLM_HOOKS_CONFIG"
_DISABLE_ENV = "TL_VLLM_HOOKS_DISABLE"
_ADDITIONAL_CONFIG_KEY = "tl_vllm_hooks_config"
CAPTURE_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The dtypes a CaptureConfig's buffers take, as torch names."""

WORKER_EXTENSION = f"{__name__}.WorkerExtension"
"""vLLM's ``worker_extension_cls`` for this module (``config.llm_kwargs`` holds it)."""


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What the workers hook, and how.

    capture_specs: ``{hook_name: spec}``. A TransformerLens hook name (``blocks.3.hook_resid_post``) takes the shape
        of one of its rows (``128``, or ``(n_heads, d_head)`` for ``attn.hook_z``), and the architecture table
        places it; ``capture_specs(hf_config)`` writes these. Any other name takes ``(module_path, width)``: the
        output of that module of the model vLLM loads (its first element if it returns a tuple), ``width`` its last
        dimension. Names holding ``hook_`` are TransformerLens's and cannot be given a module path.
    max_num_batched_tokens: rows of every capture buffer and edit table, and the engine's tokens per forward
        (``llm_kwargs`` passes it on).
    dtype: dtype of the capture buffers (a floating dtype).
    enable_batching: the batched flavour (many requests per generate, each with its own rows and edits) instead of
        the one-prompt one.
    enable_position_interventions: engine-wide edits may be limited to token positions.
    sink_dir: batched flavour only: a directory where the workers write each finished request's kept rows, as
        safetensors shards with a manifest (see CaptureDataset), instead of holding them for read_batched.
    shard_bytes: a shard is closed once its rows reach this many bytes.
    shard_seconds: and once it has been open this long (seconds), so that a server's requests reach readers soon;
        None: by size (or flush_sink) only.
    sink_writer: with a sink_dir, the class that writes it in each batched worker, ``"module:Class"``, loaded by that
        name in the driver and the workers: by default the companion's (tl_vllm_hooks_tools.py beside this file),
        whose safetensors shards CaptureDataset reads. Any class with the sink writer's interface (see SinkRequest).
    saes: ``{hook_name: directory}`` of sparse autoencoders saved in SAELens's format (``cfg.json`` and
        ``sae_weights.safetensors``; architectures standard, jumprelu and topk) that encode the hook's rows in every
        forward. Their features are read as ``{hook_name}.hook_sae_acts_post`` (see SAE_FEATURES) and edited
        under that name; a hook named here but not in capture_specs keeps its features and no rows. Transcoders
        (transcoder, skip_transcoder, jumprelu_transcoder, jumprelu_skip_transcoder) go under the hook they read,
        Gemma Scope 2's under ``blocks.L.mlp.hook_in``; their feature edits change the same layer's hook_mlp_out.
    sae_top_k: features kept per token and SAE, the highest first (a batched request may keep fewer).
    sae_chosen_features: batched flavour: the most features of each SAE a request may choose to read densely,
        ``{features name}.chosen`` (see request_args); 0, none.
    attention_heads: ``{attn_scores or pattern hook: [head, ...]}``: the heads whose scores or pattern a read of that
        hook rebuilds, in this order, ``[len(heads), queries, keys]`` (every head of a hook not named). Its rows, and
        so its cost on the engine, stay every head's query and key; the read's work and memory shrink by heads kept.
    logit_lens: batched flavour: ``{residual-stream hook in capture_specs: k}``: the workers unembed each kept row of
        that hook (the final norm, then the unembedding, as ``unembed`` does) in the step that makes it, and keep its
        k highest logits, highest first, as ``{hook}.logits.values`` (float32 ``[k]``) and ``.indices`` (int64
        ``[k]``): a read or the sink hands them over beside the rows, and no row travels back for ``unembed``.
    """

    capture_specs: dict[str, tuple[int, ...] | tuple[str, int]]
    max_num_batched_tokens: int = 2048
    dtype: torch.dtype = torch.float32
    enable_batching: bool = False
    enable_position_interventions: bool = False
    sink_dir: str | None = None
    shard_bytes: int = 1 << 30
    shard_seconds: float | None = None
    sink_writer: str = "tl_vllm_hooks_tools:RankSink"
    saes: dict[str, str] = dataclasses.field(default_factory=dict)
    sae_top_k: int = 64
    sae_chosen_features: int = 0
    attention_heads: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    logit_lens: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        specs, saes = self.capture_specs, self.saes
        if not isinstance(saes, dict):
            raise ValueError(f"saes: expected a dict {{hook_name: SAELens directory}}, got {saes!r:.200}")
        if not isinstance(specs, dict) or not (specs or saes):
            raise ValueError(
                "capture_specs: expected a non-empty dict {hook_name: row shape} (see capture_specs(hf_config)), "
                f"got {specs!r}"
            )
        object.__setattr__(self, "capture_specs", {n: _checked_spec(n, s) for n, s in specs.items()})
        if not _int_at_least(self.sae_top_k, 1):
            raise ValueError(f"sae_top_k: must be a positive int, got {self.sae_top_k!r}")
        if not _int_at_least(self.sae_chosen_features, 0) or self.sae_chosen_features and not self.enable_batching:
            raise ValueError(
                "sae_chosen_features: an int >= 0, and above 0 only with enable_batching=True (a request chooses "
                f"them), got {self.sae_chosen_features!r}"
            )
        object.__setattr__(self, "saes", {n: os.path.abspath(d) if isinstance(d, str) else d for n, d in saes.items()})
        object.__setattr__(self, "_sae_specs", {n: _read_sae(n, d, self) for n, d in self.saes.items()})
        for field in ("max_num_batched_tokens", "shard_bytes"):
            if not _int_at_least(getattr(self, field), 1):
                raise ValueError(f"{field}: must be a positive int, got {getattr(self, field)!r}")
        if not isinstance(self.dtype, torch.dtype) or _dtype_name(self.dtype) not in CAPTURE_DTYPES:
            raise ValueError(f"dtype: expected one of torch.{', torch.'.join(CAPTURE_DTYPES)}, got {self.dtype!r}")
        for flag in ("enable_batching", "enable_position_interventions"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: must be a bool, got {getattr(self, flag)!r}")
        if self.sink_dir is not None:
            if not isinstance(self.sink_dir, str) or not self.sink_dir:
                raise ValueError(f"sink_dir: expected a directory path (str) or None, got {self.sink_dir!r}")
            if not self.enable_batching:
                raise ValueError("sink_dir: the sink writes per-request rows: configure(..., enable_batching=True)")
            if self.attention_hooks:
                raise ValueError(
                    f"sink_dir: {self.attention_hooks[0]} is rebuilt when read_batched reads it, not written by a "
                    "sink; capture attn.hook_rot_q and hook_rot_k (or hook_q and hook_k) into it instead"
                )
            object.__setattr__(self, "sink_dir", os.path.abspath(self.sink_dir))
        if not isinstance(self.sink_writer, str) or not re.fullmatch(r"[\w.]+:\w+", self.sink_writer):
            raise ValueError(f"sink_writer: expected 'module:Class', got {self.sink_writer!r}")
        object.__setattr__(self, "attention_heads", self._checked_attention_heads())
        self._check_logit_lens()
        seconds = self.shard_seconds
        if seconds is not None and (
            not isinstance(seconds, (int, float)) or seconds is True or not 0 < seconds < math.inf
        ):
            raise ValueError(f"shard_seconds: must be a finite number of seconds > 0, or None; got {seconds!r}")

    def _checked_attention_heads(self) -> dict[str, tuple[int, ...]]:
        """attention_heads, each a tuple (ValueError naming what is wrong); head indices are checked against the
        model's heads where the hooks are placed."""
        chosen = self.attention_heads
        if not isinstance(chosen, dict):
            raise ValueError(
                f"attention_heads: expected a dict {{attn_scores or pattern hook: [head, ...]}}, got {chosen!r:.200}"
            )
        for name, heads in chosen.items():
            if name not in self.attention_hooks:
                raise ValueError(
                    f"attention_heads: {name!r} is not an attn_scores or pattern hook in capture_specs; those are "
                    f"{self.attention_hooks}"
                )
            listed = isinstance(heads, (list, tuple)) and all(_int_at_least(head, 0) for head in heads)
            if not listed or not heads or len(set(heads)) != len(heads):
                raise ValueError(
                    f"attention_heads[{name!r}]: expected a non-empty list of distinct head indices >= 0, got "
                    f"{heads!r:.200}"
                )
        return {name: tuple(heads) for name, heads in chosen.items()}

    def _check_logit_lens(self) -> None:
        """ValueError naming what is wrong with logit_lens (its k is checked against the vocabulary in the workers)."""
        lens = self.logit_lens
        residual = [n for n in self.capture_specs if (parse_hook_name(n) or ("",))[0] in _RESIDUAL_SITES]
        if not isinstance(lens, dict) or lens and not self.enable_batching:
            raise ValueError(
                "logit_lens: a dict {residual-stream hook: k}, with enable_batching=True (the batched flavour keeps "
                f"each request's logits), got {lens!r:.200}"
            )
        for name, k in lens.items():
            if name not in residual:
                raise ValueError(f"logit_lens: {name!r} is not a residual-stream hook in capture_specs; those are {residual}")
            if not _int_at_least(k, 1):
                raise ValueError(f"logit_lens[{name!r}]: k must be a positive int, got {k!r}")

    def logit_rows(self, name: str) -> dict[str, tuple[int]]:
        """What a forward keeps of hook ``name``'s logit lens (a key of logit_lens), each with one row's shape:
        ``{name}.logits.values`` and ``.indices``."""
        top = (self.logit_lens[name],)
        return {name + _LOGITS + ".values": top, name + _LOGITS + ".indices": top}

    def row_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one row of hook ``name``: ``(width,)`` or ``(n_heads, d_head)``."""
        return _row_shape(self.capture_specs[name])

    def sae(self, name: str) -> SAESpec:
        """The SAE encoding hook ``name`` (a key of ``saes``), as its files describe it."""
        return self._sae_specs[name]

    def feature_rows(self, name: str) -> dict[str, tuple[int]]:
        """What a forward keeps of hook ``name``'s SAE, each with one row's shape: ``{name}{SAE_FEATURES}.indices``,
        ``.values`` (and ``.chosen``)."""
        features, top = name + SAE_FEATURES, (self.sae_top_k,)
        chosen = {features + ".chosen": (self.sae_chosen_features,)} if self.sae_chosen_features else {}
        return {features + ".indices": top, features + ".values": top, **chosen}

    @functools.cached_property
    def attention_hooks(self) -> list[str]:
        """The hooks whose reads rebuild attention (attn_scores, pattern) from each position's query and key; worked
        out once per config, as every request taken is checked against it."""
        return [n for n in self.capture_specs if (parse_hook_name(n) or ("",))[0] in ATTENTION_SITES]

    def width(self, name: str) -> int:
        """Elements in one row of hook ``name``."""
        return math.prod(self.row_shape(name))

    @property
    def llm_kwargs(self) -> dict[str, Any]:
        """What ``LLM(model, **config.llm_kwargs)`` (or ``EngineArgs``, ``AsyncEngineArgs``)
        needs for these hooks: the worker extension, the config in ``additional_config``, the
        buffers' tokens per forward, and prefix caching as _PREFIX_CACHING says (off)."""
        return {
            "worker_extension_cls": WORKER_EXTENSION,
            "additional_config": {_ADDITIONAL_CONFIG_KEY: self.to_json()},
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": _PREFIX_CACHING,
        }

    @property
    def serve_args(self) -> list[str]:
        """``llm_kwargs`` as ``vllm serve MODEL *config.serve_args`` arguments."""
        args = []
        for key, value in self.llm_kwargs.items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):
                args.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                args += [f"--{flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
        return args

    def to_json(self) -> str:
        """The wire form: JSON, with the module version that wrote it."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return json.dumps({**fields, "dtype": _dtype_name(self.dtype), "version": __version__}, sort_keys=True)

    @classmethod
    def from_json(cls, payload: str) -> CaptureConfig:
        """Parse and validate the wire form; ValueError names the bad field."""
        try:
            data = json.loads(payload)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{_CONFIG_ENV}: not valid JSON ({exc})") from None
        fields = {field.name for field in dataclasses.fields(cls)} | {"version"}
        if not isinstance(data, dict) or set(data) != fields:
            given = set(data) if isinstance(data, dict) else set()
            raise ValueError(
                f"{_CONFIG_ENV}: expected a JSON object with fields {sorted(fields)}, "
                f"missing {sorted(fields - given)}, unknown {sorted(given - fields)}"
            )
        if data.pop("version") != __version__:
            raise ValueError(
                f"{_CONFIG_ENV}: written by another version of tl_vllm_hooks than {__version__!r}; driver and workers "
                "must load the same version"
            )
        if data["dtype"] not in CAPTURE_DTYPES or not isinstance(data["capture_specs"], dict):
            raise ValueError(f"{_CONFIG_ENV}: dtype must be one of {list(CAPTURE_DTYPES)} and capture_specs an object")
        data["capture_specs"] = {n: tuple(s) if isinstance(s, list) else s for n, s in data["capture_specs"].items()}
        return cls(**{**data, "dtype": getattr(torch, data["dtype"])})


def _checked_spec(name: Any, spec: Any) -> tuple[int, ...] | tuple[str, int]:
    """One capture spec, normalized: a TransformerLens hook's row shape as a tuple of ints,
    or (module_path, width) for a module of the user's choosing."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"capture_specs: hook names must be non-empty strings, got {name!r}")
    if "hook_" not in name:
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and spec[0]):
            spec = None
        if spec is None or not _int_at_least(spec[1], 1):
            raise ValueError(
                f"capture_specs[{name!r}]: expected (module_path: str, width: positive int) for a "
                f"module of your choosing, got {spec!r}"
            )
        return (spec[0], spec[1])
    shape = (spec,) if _int_at_least(spec, 1) else spec
    if not isinstance(shape, (tuple, list)) or not shape or not all(_int_at_least(size, 1) for size in shape):
        raise ValueError(
            f"capture_specs[{name!r}]: a TransformerLens hook takes the shape of one row (an int, or a tuple such as "
            f"(n_heads, d_head)); the architecture table places it, so it takes no module path; got {spec!r}. Write "
            "specs with capture_specs(hf_config)"
        )
    if parse_hook_name(name) is None:
        close = difflib.get_close_matches(name, [t.format(i=0) for t in SITES.values()], n=3)
        raise ValueError(
            f"capture_specs: {name!r} is not a hook this module knows; TransformerLens hooks here: "
            f"{sorted(SITES.values())}" + (f"; close matches: {close}" if close else "")
        )
    return tuple(shape)


def _row_shape(spec: tuple[int, ...] | tuple[str, int]) -> tuple[int, ...]:
    """One row's shape under a (checked) capture spec."""
    return (spec[1],) if isinstance(spec[0], str) else tuple(spec)


def _int_at_least(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_position_list(value: Any) -> bool:
    """A non-empty list (or tuple) of token positions: ints >= 0."""
    return isinstance(value, (list, tuple)) and bool(value) and all(_int_at_least(p, 0) for p in value)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def configure(capture_specs: dict[str, tuple[int, ...] | tuple[str, int]], *args: Any, **kwargs: Any) -> CaptureConfig:
    """``CaptureConfig(capture_specs, *args, **kwargs)`` (ValueError naming a bad field), with vLLM patched in this
    process. Build the engine with ``LLM(model, **config.llm_kwargs)``: the config rides in the engine's own
    arguments, leaving nothing behind for later engines. A ``sink_dir`` is checked by its sink writer (the
    companion's creates it, and refuses one it cannot write or that holds captures of other hooks or another
    dtype)."""
    config = CaptureConfig(capture_specs, *args, **kwargs)
    if config.sink_dir is not None:
        _sink_writer(config.sink_writer).check(config)
    register()
    return config


def _disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------
# Edits and request options. One wire form for every flavour: per hook, an op, an optional value (a number or a
# row-shaped tensor) and optional positions. Each becomes a (scale, bias) pair with out = out * scale + bias. A
# request's options are parsed into one _RequestOptions, by the same function wherever they are read (the driver,
# the engine's front end and the workers), and checked there before anything runs; what a request keeps is decided
# by _RequestOptions alone.
# ---------------------------------------------------------------------------

# op -> its (scale, bias), out = out * scale + bias: each a number, or "value" where the edit's value goes (the ops that
# take one)
_EDIT_OPS = {"suppress": (0, 0), "scale": ("value", 0), "add": (1, "value"), "set": (0, "value")}
_REQUEST_KEY = "tl_vllm_hooks"  # in SamplingParams.extra_args, see request_args
_CAPTURE_MODES = ("all", "prompt", "last_prompt_token", "none")
_NO_LAST_POSITION = np.iinfo(np.int64).max


def _parse_edit(edit: Any, name: str, config: CaptureConfig) -> tuple[tuple[torch.Tensor, ...], list[int] | None]:
    """Validate one wire edit: its table rows and its positions. A hook's rows are (scale, bias), [width] float64,
    out = out * scale + bias; a hook's features' (see _parse_feature_edit) are (features, scale, bias)."""
    if name.endswith(SAE_FEATURES):
        return _parse_feature_edit(edit, name, config)
    _check_edit_keys(edit, name, {"op", "value", "positions"})
    row_shape = config.row_shape(name)
    width = math.prod(row_shape)
    shapes = [(width,)] + ([row_shape] if len(row_shape) > 1 else [])
    valid = f"a finite number, or finite numbers of shape {' or '.join(map(str, map(list, shapes)))}"
    rows = tuple(_float64_row(part, width) for part in _scale_and_bias(edit, name, shapes, valid))
    return rows, _edit_positions(edit, name)


def _float64_row(part: float | torch.Tensor, width: int) -> torch.Tensor:
    """One of an edit's (scale, bias), float64 [width]: a number as a row of it, a value (made fresh by the parse) as
    it is."""
    if isinstance(part, torch.Tensor):
        return part
    return torch.from_numpy(np.full(width, part, dtype=np.float64))


def _scale_and_bias(edit: dict[str, Any], name: str, shapes: list[tuple[int, ...]], valid: str) -> tuple:
    """An edit's (scale, bias) as its op says (see _EDIT_OPS), its value float64 [the first shape's elements], made
    fresh: one number for every element, or finite numbers of one of ``shapes``; ValueError saying ``valid``
    otherwise. In numpy, where a request's few small arrays cost microseconds each, not torch's tens."""
    form, width = _EDIT_OPS[edit["op"]], math.prod(shapes[0])
    if "value" not in form:
        return form
    raw = edit["value"]
    try:
        if _holds_bool(raw):
            raise TypeError("a bool is not a number")
        # torch's list parse, which refuses text ("1") that numpy would read as a number
        vector = _values_from_wire(raw) if isinstance(raw, dict) else torch.tensor(raw, dtype=torch.float64).numpy()
    except (TypeError, ValueError, RuntimeError) as error:
        why = f" ({error})" if isinstance(raw, dict) else ""
        raise ValueError(f"edits[{name!r}]: value must be {valid}, got {raw!r:.100}{why}") from None
    if vector.ndim == 0:
        vector = np.full(width, vector, dtype=np.float64)
    if vector.shape not in shapes:
        raise ValueError(f"edits[{name!r}]: value must be {valid}, got shape {list(vector.shape)}")
    value = vector.reshape(width)
    if not np.isfinite(value).all():
        raise ValueError(f"edits[{name!r}]: value must be {valid}; it holds NaN or infinite numbers")
    return tuple(torch.from_numpy(value) if part == "value" else part for part in form)


# A tensor value travels in request options (JSON text, which `vllm serve`'s vllm_xargs carries too) as its raw
# little-endian bytes in base64, not as decimal text: exact for every float dtype, and 2,048 floats take ~11 KB and
# microseconds where a list of numbers takes ~40 KB and milliseconds. Lists of numbers are taken as well.
_WIRE_VALUE_KEYS = {"dtype", "shape", "base64"}
_WIRE_VALUE_DTYPES = {"float32": "<f4", "float64": "<f8", "bfloat16": "<u2", "float16": "<f2"}  # bfloat16 as its bits


def _values_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """A float tensor's wire form, encode_tensor's with its bytes in base64: ``{"dtype": str, "shape": list[int],
    "base64": str}`` (a dtype not among _WIRE_VALUE_DTYPES as float64)."""
    if _dtype_name(tensor.dtype) not in _WIRE_VALUE_DTYPES:
        tensor = tensor.to(torch.float64)
    message = encode_tensor(tensor)
    return {"dtype": message["dtype"], "shape": message["shape"], "base64": base64.b64encode(message["data"]).decode()}


def _values_from_wire(message: dict[str, Any]) -> np.ndarray:
    """Inverse of _values_to_wire, as a new float64 array; ValueError saying what is wrong with the message."""
    if set(message) != _WIRE_VALUE_KEYS:
        raise ValueError(f"a tensor's wire form has the keys {sorted(_WIRE_VALUE_KEYS)}, not {sorted(message)}")
    if message["dtype"] not in _WIRE_VALUE_DTYPES:
        raise ValueError(f"dtype {message['dtype']!r} is not one of {list(_WIRE_VALUE_DTYPES)}")
    shape = message["shape"]
    if not isinstance(shape, list) or not all(_int_at_least(size, 0) for size in shape):
        raise ValueError(f"shape must be a list of ints >= 0, got {shape!r:.100}")
    try:
        data = base64.b64decode(message["base64"], validate=True)
    except (TypeError, ValueError):
        raise ValueError("base64 is not base64 text") from None
    stored = np.dtype(_WIRE_VALUE_DTYPES[message["dtype"]])
    if len(data) != math.prod(shape) * stored.itemsize:
        raise ValueError(f"{len(data)} bytes for a {message['dtype']} tensor of shape {shape}")
    values = np.frombuffer(data, stored)
    if message["dtype"] == "bfloat16":  # a float32's upper half
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float64).reshape(shape)


def _check_edit_keys(edit: Any, name: str, keys: set[str]) -> None:
    """The edit is a dict of these keys, 'op' among them, and its op takes a value if and only if it has one."""
    if not isinstance(edit, dict) or "op" not in edit or not set(edit) <= keys:
        found = sorted(edit) if isinstance(edit, dict) else edit
        raise ValueError(
            f"edits[{name!r}]: keys must be 'op' plus optional {sorted(keys - {'op'})}, got {found!r:.200}"
        )
    op = edit["op"]
    if op not in _EDIT_OPS:
        raise ValueError(f"edits[{name!r}]: op {op!r} is not one of {sorted(_EDIT_OPS)}")
    takes_value = "value" in _EDIT_OPS[op]
    if takes_value != ("value" in edit):
        raise ValueError(f"edits[{name!r}]: op {op!r} {'needs a' if takes_value else 'takes no'} 'value'")


def _edit_positions(edit: dict[str, Any], name: str) -> list[int] | None:
    positions = edit.get("positions")
    if positions is not None and not _is_position_list(positions):
        raise ValueError(f"edits[{name!r}]: positions must be a non-empty list of ints >= 0, got {positions!r}")
    return None if positions is None else list(positions)


def _identity_rows(name: str, width: int) -> tuple[torch.Tensor, ...]:
    """The table rows of no edit: scale 1 and bias 0 (and for features, feature 0)."""
    ones, zeros = torch.ones(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
    return (torch.zeros(width, dtype=torch.int64), ones, zeros) if name.endswith(SAE_FEATURES) else (ones, zeros)


def _holds_bool(value: Any) -> bool:
    return isinstance(value, bool) or isinstance(value, (list, tuple)) and any(map(_holds_bool, value))


def _global_rows(config: CaptureConfig) -> int:
    """Rows of the engine-wide part of an edit table: one per position and one past, or one."""
    return config.max_num_batched_tokens + 1 if config.enable_position_interventions else 1


def _engine_wide_tables(edit: dict[str, Any], name: str, config: CaptureConfig) -> tuple[torch.Tensor, ...]:
    """An engine-wide edit's tables (see _parse_edit): each a row, or [max_rows + 1, row] by position."""
    rows, positions = _parse_edit(edit, name, config)
    per_request = "; request_args(edits=...) takes any position" if config.enable_batching else ""
    if not config.enable_position_interventions:
        if positions is not None:
            raise ValueError(f"edits[{name!r}]: positions need enable_position_interventions=True{per_request}")
        return rows
    num_rows = _global_rows(config)
    if positions is None:  # every row, the last (every position past the table) included
        return tuple(row.expand(num_rows, *row.shape) for row in rows)
    if max(positions) >= num_rows - 1:
        raise ValueError(
            f"edits[{name!r}]: positions must be < {num_rows - 1} (max_num_batched_tokens) for an engine-wide edit, "
            f"got {positions!r}{per_request}"
        )
    tables = tuple(row.expand(num_rows, *row.shape).clone() for row in _identity_rows(name, rows[0].shape[0]))
    for table, row in zip(tables, rows):
        table[positions] = row
    return tables


def _check_hook_name(name: Any, config: CaptureConfig) -> None:
    editable = [*config.capture_specs, *(hook + SAE_FEATURES for hook in config.saes)]
    if name not in editable:
        close = difflib.get_close_matches(str(name), editable, n=3)
        raise ValueError(
            f"edits: {name!r} is not a configured hook or SAE's features"
            + (f"; close matches: {close}" if close else "")
            + f"; configured: {sorted(editable)}"
        )
    reason = _read_only_reason(name)
    if reason is not None:
        raise ValueError(f"edits: {name!r} is read-only: {reason}")


def _check_editable(names: Any, hf_config: Any) -> None:
    """ValueError for an edit of a hook the model (whose checkpoint config is hf_config) makes read-only."""
    attention = _family(hf_config).attention if names else None
    latent_attention = bool(attention and attention.latent)
    for name in names:
        reason = _read_only_reason(name, latent_attention)
        if reason is not None:
            raise ValueError(f"edits: {name!r} is read-only: {reason}")


@dataclasses.dataclass(frozen=True)
class _RequestOptions:
    """One request's options (see request_args), checked against its engine's config.

    capture: one of _CAPTURE_MODES, or the positions kept, sorted int64.
    edits: hook or features name -> (its table rows (see _parse_edit), sorted int64 positions or None).
    digest: of the edits ("" without): the request's prefix-cache salt.
    chosen: ``{features name}.chosen`` -> (its features, int64 [sae_chosen_features], None): read densely.
    columns: source name (see _HookState.sources) -> the first columns of it the request keeps, where fewer.
    from_start: the engine reads attention (attn_scores, pattern), whose keys are every position up to each query:
        the request keeps its rows from position 0 to the last it asks for, and a read hands over those it asked for
        (see asked).
    """

    capture: str | np.ndarray = "all"
    edits: dict[str, tuple[tuple[torch.Tensor, ...], np.ndarray | None]] = dataclasses.field(default_factory=dict)
    digest: str = ""
    chosen: dict[str, tuple[tuple[torch.Tensor], None]] = dataclasses.field(default_factory=dict)
    columns: dict[str, int] = dataclasses.field(default_factory=dict)
    from_start: bool = False

    @property
    def slot_tables(self) -> dict[str, tuple[tuple[torch.Tensor, ...], np.ndarray | None]]:
        """What a slot of the batched edit tables holds for the request: its edits and chosen features."""
        return {**self.edits, **self.chosen}

    # What the request keeps, decided here alone: kept_range for a step's array operations, keeps for a list of
    # positions (which kept_range marks with first -1), keeps_any for a span; asked for what a read hands over.
    def kept_range(self, prompt_len: int) -> tuple[int, int]:
        """(first, last) position kept; first is -1 for a list of positions."""
        last = prompt_len - 1
        if isinstance(self.capture, np.ndarray):
            first, last = (-1, _NO_LAST_POSITION) if not self.from_start else (0, int(self.capture[-1]))
        else:
            ranges = {"all": (0, _NO_LAST_POSITION), "prompt": (0, last), "last_prompt_token": (last, last)}
            first, last = ranges.get(self.capture, (0, -1))
        return (0 if self.from_start and first <= last else first), last

    def keeps(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Whether the row of each of these positions is kept (bool, positions' shape)."""
        if isinstance(self.capture, np.ndarray) and not self.from_start:
            return np.isin(positions, self.capture)
        first, last = self.kept_range(prompt_len)
        return (positions >= first) & (positions <= last)

    def keeps_any(self, start: int, stop: int, prompt_len: int) -> bool:
        """Whether the row of some position in [start, stop) is kept."""
        if isinstance(self.capture, np.ndarray) and not self.from_start:
            return bool(((self.capture >= start) & (self.capture < stop)).any())
        first, last = self.kept_range(prompt_len)
        return first <= last and first < stop and last >= start

    def asked(self, kept_positions: typing.Callable[[], np.ndarray], prompt_len: int) -> list[int] | None:
        """Of the rows kept, at the positions kept_positions() gives (called only where this needs them), the indices
        of those the capture asks for where it keeps more (from_start), else None (all)."""
        if isinstance(self.capture, np.ndarray) and self.from_start:
            return np.flatnonzero(np.isin(kept_positions(), self.capture)).tolist()
        if self.from_start and self.capture == "last_prompt_token":
            return np.flatnonzero(kept_positions() == prompt_len - 1).tolist()
        return None


_KEEP_ALL, _KEEP_NONE = _RequestOptions("all"), _RequestOptions("none")


def _parse_options(options: Any, config: CaptureConfig | None) -> _RequestOptions:
    """The one parser of a request's options (request_args' JSON text, or a dict by hand);
    ValueError naming the problem."""
    if config is None or not config.enable_batching:
        raise ValueError(
            f"{_REQUEST_KEY} request options: this engine has {'no' if config is None else 'one-prompt'} hooks; "
            "per-request capture and edits need configure(..., enable_batching=True)"
        )
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as error:
            raise ValueError(f"request options: not valid JSON ({error}); write them with request_args") from None
    if not isinstance(options, dict) or not set(options) <= {"capture", "edits", "top_k", "features"}:
        raise ValueError(
            f"request options: expected a dict with keys 'capture', 'edits', 'top_k' and 'features', got "
            f"{options!r:.200}"
        )
    capture = options.get("capture", "all")
    if isinstance(capture, (list, tuple)):
        if not _is_position_list(capture):
            raise ValueError(f"capture: a list of positions must hold ints >= 0 and not be empty, got {capture!r}")
        capture = np.unique(np.asarray(capture, dtype=np.int64))
    elif capture not in _CAPTURE_MODES:
        raise ValueError(f"capture: expected one of {list(_CAPTURE_MODES)} or a list of positions, got {capture!r}")
    edits = options.get("edits") or {}
    if not isinstance(edits, dict):
        raise ValueError(f"edits: expected a dict {{hook_name: edit}}, got {edits!r:.200}")
    parsed = {}
    for name, edit in edits.items():
        _check_hook_name(name, config)
        rows, positions = _parse_edit(edit, name, config)
        parsed[name] = (rows, None if positions is None else np.unique(np.asarray(positions, np.int64)))
    digest = hashlib.sha256(json.dumps(edits, sort_keys=True).encode()).hexdigest()[:32] if edits else ""
    top_k = options.get("top_k") or {}
    features = [hook + SAE_FEATURES for hook in config.saes]
    if not isinstance(top_k, dict) or not all(name in features for name in top_k):
        raise ValueError(f"top_k: expected a dict {{features name: k}} of names in {features}, got {top_k!r:.200}")
    for name, k in top_k.items():
        if not _int_at_least(k, 1) or k > config.sae_top_k:
            raise ValueError(f"top_k[{name!r}]: must be an int in [1, {config.sae_top_k}] (sae_top_k), got {k!r}")
    columns = {n + part: k for n, k in top_k.items() if k < config.sae_top_k for part in (".indices", ".values")}
    chosen, most = options.get("features") or {}, config.sae_chosen_features
    if not isinstance(chosen, dict) or not all(name in features for name in chosen) or chosen and not most:
        raise ValueError(
            f"features: expected a dict {{features name: [feature, ...]}} of names in {features}, on an engine "
            f"configured with sae_chosen_features > 0 (here {most}), got {chosen!r:.200}"
        )
    parsed_chosen = {}
    for name in features if most else ():
        listed, d_sae = chosen.get(name, []), config.sae(name.removesuffix(SAE_FEATURES)).d_sae
        if not _lists_features(listed, 0, most, d_sae):
            raise ValueError(
                f"features[{name!r}]: up to {most} (sae_chosen_features) distinct feature indices in [0, {d_sae}), "
                f"got {listed!r:.200}"
            )
        columns[name + ".chosen"] = len(listed)
        if listed:
            row = torch.tensor([*listed, *[0] * (most - len(listed))], dtype=torch.int64)  # padded with feature 0
            parsed_chosen[name + ".chosen"] = ((row,), None)
    return _RequestOptions(capture, parsed, digest, parsed_chosen, columns, bool(config.attention_hooks))


ATTENTION_READ_BYTES = 8 << 30
"""The most a read of one request's attention matrices may build (bytes), on the worker's device where they are
rebuilt: a request that could need more is refused before it runs. Set it in the process that sends the requests."""


def _refuse_large_attention(request: Any, options: _RequestOptions | None, config: CaptureConfig | None) -> None:
    """ValueError, before the request runs, where reading its attention matrices (see _attention_rows: scores and
    pattern, float32 [heads, queries, keys], for each attn_scores and pattern hook, with n_heads + n_kv_heads heads
    where attention_heads chooses none) could take more than
    ATTENTION_READ_BYTES: over its prompt and max_tokens, the positions it keeps, and one forward's rows for the
    one-prompt flavour."""
    hooks = config.attention_hooks if config is not None else []
    if not hooks:
        return
    prompt_len = _prompt_len(request)
    rows = prompt_len + (request.sampling_params.max_tokens or 1) - 1
    if options is not None:
        rows = min(rows, options.kept_range(prompt_len)[1] + 1)
    if not config.enable_batching:
        rows = min(rows, config.max_num_batched_tokens)
    heads = {name: len(config.attention_heads.get(name, ())) or config.row_shape(name)[0] for name in hooks}
    need = sum(2 * 4 * heads[name] * rows * rows for name in hooks)
    if need > ATTENTION_READ_BYTES:
        raise ValueError(
            f"{request.request_id}: reading its attention matrices ({len(hooks)} hooks, {rows} positions) could take "
            f"{need / 2**20:,.0f} MiB, past the {ATTENTION_READ_BYTES / 2**20:,.0f} MiB a read builds at most in a "
            "worker (tl_vllm_hooks.ATTENTION_READ_BYTES): keep fewer positions (request_args(capture=...)), read "
            "fewer layers, or send a shorter request"
        )


def _refuse_unreachable_positions(request: Any, options: _RequestOptions | None) -> None:
    """ValueError, before the request runs, for a position its options keep or edit past the last one it can run:
    its prompt's, then one per generated token but the last (max_tokens; a request without it is not checked)."""
    max_tokens = request.sampling_params.max_tokens
    if options is None or max_tokens is None:
        return
    prompt_len = _prompt_len(request)
    last = prompt_len + max_tokens - 2
    asked = {"capture": options.capture} if isinstance(options.capture, np.ndarray) else {}
    asked.update((f"edits[{name!r}]", positions) for name, (_rows, positions) in options.edits.items())
    for what, positions in asked.items():
        if positions is not None and positions.size and positions[-1] > last:
            past = positions[positions > last].tolist()
            raise ValueError(
                f"request {request.request_id!r}: {what} positions {past[:10]} are past the request's last "
                f"position, {last}: its {prompt_len} prompt tokens run positions 0-{prompt_len - 1}, and its "
                f"max_tokens={max_tokens} "
                f"generated tokens, but the last, run the {max_tokens - 1} after them; give positions below "
                f"{last + 1} (the request's length), or a larger max_tokens"
            )


@functools.lru_cache(maxsize=256)
def _parse_options_text(text: str, payload: str | None) -> _RequestOptions:
    """request_args' JSON text, parsed once however many requests share it."""
    return _parse_options(text, _config_from_json(payload))


def _request_options(extra_args: dict[str, Any] | None, payload: str | None) -> _RequestOptions | None:
    """The options in a request's extra_args (None without) for an engine with the config
    ``payload``; ValueError if they do not suit it."""
    options = (extra_args or {}).get(_REQUEST_KEY)
    if options is None:
        return None
    if isinstance(options, str):
        return _parse_options_text(options, payload)
    return _parse_options(options, _config_from_json(payload))


# ---------------------------------------------------------------------------
# Prefix caching. Tokens vLLM serves from its prefix cache never run through the model, so their rows are missing,
# and a block computed under an edit would be served to requests that never asked for it. Engines built with
# llm_kwargs or serve_args have it off; with the batched flavour a user may turn it on, and every rule that then
# applies is in this section, what a request without options keeps (_default_options) among them.
# ---------------------------------------------------------------------------

_PREFIX_CACHING = False  # what llm_kwargs and serve_args set: every request keeps all its rows
_CACHE_MARK = "tl_vllm_hooks_cache"  # in extra_args once _keep_apart_in_prefix_cache ran


def _keep_apart_in_prefix_cache(request: Any, options: _RequestOptions) -> None:
    """On the EngineCoreRequest vLLM's front end made, before its blocks are hashed: edits
    salt its cache blocks (shared only by requests making the same edits), keeping prompt
    rows before the last skips reading the cache, and the mark tells the workers."""
    params = request.sampling_params
    if options.edits:
        request.cache_salt = f"{request.cache_salt or ''}{_REQUEST_KEY}:{options.digest}"
    prompt_len = _prompt_len(request)
    if options.keeps_any(0, prompt_len - 1, prompt_len):
        params.skip_reading_prefix_cache = True
    params.extra_args = {**params.extra_args, _CACHE_MARK: options.digest}


def _refuse_prefix_caching(prefix_caching: bool, config: CaptureConfig, edits: Any = None) -> None:
    """Refuse the one-prompt flavour on an engine with prefix caching, and engine-wide edits on any."""
    if prefix_caching and not config.enable_batching:
        raise ValueError(
            "enable_prefix_caching: the one-prompt flavour keeps the rows of one forward, and tokens served from "
            "vLLM's prefix cache never run through the model, so rows would be missing; build the engine with "
            "LLM(model, **config.llm_kwargs), which turns it off, or use the batched flavour (configure(..., "
            "enable_batching=True)), which keeps capturing requests off the cache"
        )
    if prefix_caching and edits:
        raise ValueError(
            "set_edits: engine-wide edits change every request's keys and values, and vLLM's prefix cache would go "
            "on serving blocks computed without them; on an engine with prefix caching, edit per request: "
            "request_args(config, edits=...)"
        )


def _default_options(prefix_caching: bool) -> _RequestOptions:
    """What a request without options keeps, wherever the workers meet one: every row, or none with prefix caching on
    (it may be served from the cache)."""
    return _KEEP_NONE if prefix_caching else _KEEP_ALL


def _worker_options(extra_args: dict[str, Any], state: _HookState) -> tuple[_RequestOptions, str | None]:
    """A new request's options as the workers apply them, and why its rows cannot be read
    (None if they can); without options, _default_options."""
    if _REQUEST_KEY not in extra_args:
        return _default_options(state.prefix_caching), None
    if state.prefix_caching and _CACHE_MARK not in extra_args:  # its edits would reach others' blocks
        return _KEEP_NONE, (
            "its options were not applied: vLLM's front end did not load tl_vllm_hooks, which keeps "
            "requests with options apart in the prefix cache; install the module (its entry point loads it "
            "in every vLLM process) or build the engine with enable_prefix_caching=False"
        )
    try:
        return _request_options(extra_args, state.payload), None
    except (ValueError, TypeError) as error:
        # The driver or the front end checked them; hand-written extra_args that fail here must not stop the engine:
        # the request runs unedited, reading it raises.
        return _KEEP_NONE, f"its options were refused: {error}"


def _skipped_rows_problem(expected: int, first_position: int) -> str:
    """Why a request's rows are not whole: positions it keeps never ran (served from the cache)."""
    return (
        f"rows for positions {expected}..{first_position - 1} never ran through the model "
        "(prefix caching reused them); build the engine with enable_prefix_caching=False"
    )


# ---------------------------------------------------------------------------
# vLLM's internals: every place this module reads or wraps something of vLLM beyond its public API is in this
# section (the module paths and argument names of the architecture tables above aside), so a vLLM upgrade is read
# here. Checked on vLLM 0.24.0 (CUDA: V1 runner and Model Runner V2), 0.28.0 and 0.32.0 (CPU, V1 runner). Hooks must
# exist before vLLM's first forward (the profile run), where Dynamo traces the model: hooks added later are not in
# the compiled graph and never run, so they go in right after load_model. What the hooks know of their engine is read
# once per install (_EngineFacts), what they know of a step once per step (_Step); which columns of a hook a
# tensor-parallel rank holds is decided here alone (_tensor_parallel_share; join_ranks joins them), and what the hooks
# read of vLLM's modules beyond their paths and arguments is read here (_attention_facts, _norm_parameters,
# _latent_widths, _latent_up_projection, _output_width). One exception:
# _keep_apart_in_prefix_cache, the prefix-cache policy, sets three fields of the request vLLM's front end made.
# ---------------------------------------------------------------------------

_V2_BATCH = "_tl_step_batch"  # Model Runner V2's batch of the step in flight, see _wrap_steps
_SERVING_CLASSES = (  # where the OpenAI server checks a request's model
    ("vllm.entrypoints.serve.engine.serving", "BaseServing"),  # 0.32
    ("vllm.entrypoints.openai.serving_engine", "OpenAIServing"),  # 0.24-0.28
)
# vLLM class or object -> {attribute: what _patch replaced}; weak, so that an engine's worker and runner go when the
# engine does.
_originals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ABSENT = object()  # an attribute the owner inherited (from its class, or a base class)


def _patch(owner: Any, attribute: str, replacement: Any) -> None:
    """Every change this module makes to vLLM's classes and objects: undone by _restore."""
    _originals.setdefault(owner, {}).setdefault(attribute, vars(owner).get(attribute, _ABSENT))
    setattr(owner, attribute, replacement)


def _restore(owners: Any) -> None:
    """Put back what _patch replaced on these classes or objects."""
    for owner in list(owners):
        for attribute, original in _originals.pop(owner, {}).items():
            if original is _ABSENT:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


def register() -> None:
    """Patch vLLM where a request and the hooks meet, once per process (idempotent; the entry point calls it in
    every vLLM process, ``unregister`` undoes it): ``Worker.load_model`` installs the configured hooks after the
    weights load (none if the engine has no config, or with ``TL_VLLM_HOOKS_DISABLE=1``);
    ``InputProcessor.process_inputs``, where an engine takes a request, refuses bad ``request_args`` options against
    that engine's config, with the message ``request_args`` gives, and applies the prefix-cache rules; where the
    OpenAI server is loaded, its ``_check_model`` does the same check, so that it answers HTTP 400."""
    if any(isinstance(owner, type) for owner in _originals) or _disabled():
        return
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_worker import Worker

    load_weights, take_inputs = Worker.load_model, InputProcessor.process_inputs

    def load_model(self, *args, **kwargs):
        load_weights(self, *args, **kwargs)
        config = _config_from_json(_engine_payload(self.vllm_config))
        if config is not None and not _disabled():
            _install(self, config)

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        options = _checked_options(getattr(params, "extra_args", None), self.vllm_config)
        request = take_inputs(self, request_id, prompt, params, *args, **kwargs)
        if options is not None:
            _keep_apart_in_prefix_cache(request, options)
        _refuse_large_attention(request, options, _config_from_json(_engine_payload(self.vllm_config)))
        _refuse_unreachable_positions(request, options)
        return request

    _patch(Worker, "load_model", load_model)
    _patch(InputProcessor, "process_inputs", process_inputs)
    # Only where the server is loaded already: importing it costs each vLLM process ~0.7 s.
    serving = next((getattr(sys.modules[m], name) for m, name in _SERVING_CLASSES if m in sys.modules), None)
    if serving is not None:
        check_model = serving._check_model

        async def check_request(self, request):
            error = await check_model(self, request)
            engine = getattr(self, "engine_client", None)  # the servings that generate have one
            if error is None and engine is not None:
                try:
                    _checked_options(getattr(request, "vllm_xargs", None), engine.vllm_config)
                except ValueError as refusal:
                    return self.create_error_response(str(refusal))
            return error

        _patch(serving, "_check_model", check_request)


def _checked_options(extra_args: dict[str, Any] | None, vllm_config: Any) -> _RequestOptions | None:
    """A request's options (None without) as the front end checks them before it runs: parsed for the engine's config
    (see _request_options), with no edit of a hook the model makes read-only (see _check_editable)."""
    options = _request_options(extra_args, _engine_payload(vllm_config))
    if options is not None:
        _check_editable(options.edits, vllm_config.model_config.hf_config)
    return options


def unregister() -> None:
    """Undo ``register()``: vLLM's patched attributes get their originals back (installed hooks stay)."""
    _restore([owner for owner in _originals if isinstance(owner, type)])


def _engine_payload(vllm_config: Any) -> str | None:
    """The config's JSON in the engine's additional_config, else in the environment, else None."""
    extra = vllm_config.additional_config
    payload = extra.get(_ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    return payload or os.environ.get(_CONFIG_ENV) or None


@functools.lru_cache(maxsize=16)
def _config_from_json(payload: str | None) -> CaptureConfig | None:
    return CaptureConfig.from_json(payload) if payload else None


def _key_compile_cache(vllm_config: Any, config: CaptureConfig) -> None:
    """vLLM keys its compile cache by VllmConfig.compute_hash(), which hashes
    additional_config but knows nothing of hooks: the config goes there (if it came
    through the environment), so a graph traced with other hooks is never served."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError(
            "additional_config: tl_vllm_hooks keys vLLM's compile cache through LLM(additional_config=...), which "
            f"must be a dict here, got {type(extra).__name__}"
        )
    extra["tl_vllm_hooks"] = hashlib.sha256(config.to_json().encode()).hexdigest()


def _after_warm_up(worker: Any, callback: Any) -> None:
    """Call ``callback()`` once vLLM's warm-up, compile and graph-capture forwards are done."""
    warm_up = worker.compile_or_warm_up_model  # bound here: CPUWorker overrides it

    def compile_or_warm_up_model(*args, **kwargs):
        result = warm_up(*args, **kwargs)
        callback()
        return result

    _patch(worker, "compile_or_warm_up_model", compile_or_warm_up_model)


def _before_shutdown(worker: Any, callback: Any) -> None:
    """callback(worker) before the worker's shutdown: vLLM's engine shuts its worker down on SIGINT and SIGTERM (a
    server's Ctrl-C), and the hooks go first, so that a sink writes the rows it holds (a process vLLM forks never runs
    atexit) and the row files are removed."""
    shutdown = worker.shutdown

    def shutdown_after(*args: Any, **kwargs: Any) -> Any:
        callback(worker)
        return shutdown(*args, **kwargs)

    _patch(worker, "shutdown", shutdown_after)


def _restore_worker(worker: Any) -> None:
    """Undo what the hooks' install patched on the worker and its model runner (_before_shutdown, _wrap_steps)."""
    _restore([worker, worker.model_runner])


def _wrap_steps(worker: Any, steps: Any) -> Any:
    """Around each step of the worker's model runner (returned): ``steps.schedule(_scheduled(scheduler_output))``
    before it, ``steps.prepared()`` before the forward, ``steps.executed()`` after it and ``steps.finish()`` in any
    case. Model Runner V2 (0.24) builds a fresh InputBatch in ``prepare_inputs`` and keeps it in a local variable: the
    wrapper keeps it on the runner until execute_model returns, for segment_by_request."""
    runner = worker.model_runner
    execute_model = runner.execute_model
    tracks_v2 = not hasattr(runner, "input_batch")
    prepare_name = "prepare_inputs" if tracks_v2 else "_prepare_inputs"
    prepare = getattr(runner, prepare_name)
    if tracks_v2:
        _patch(runner, _V2_BATCH, None)

    def prepare_then_route(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        if tracks_v2:
            setattr(runner, _V2_BATCH, prepared)
        steps.prepared()
        return prepared

    def execute_then_collect(scheduler_output, *args, **kwargs):
        steps.schedule(_scheduled(scheduler_output))
        try:
            result = execute_model(scheduler_output, *args, **kwargs)
            steps.executed()
            return result
        finally:
            steps.finish()
            if tracks_v2:
                setattr(runner, _V2_BATCH, None)

    _patch(runner, prepare_name, prepare_then_route)
    _patch(runner, "execute_model", execute_then_collect)
    return runner


def _step_positions(runner: Any) -> torch.Tensor:
    """The token positions of the step the runner has prepared (int64, on its device, at least its tokens long)."""
    batch = getattr(runner, _V2_BATCH, None)
    if batch is not None:  # Model Runner V2
        return batch.positions
    return getattr(runner.positions, "gpu", runner.positions)  # V1 (a CpuGpuBuffer on some versions)


def _prompt_len(request: Any) -> int:
    """Prompt tokens of a scheduler's new request or an EngineCoreRequest (token ids or embeddings)."""
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(request.prompt_embeds.shape[0])


class _NewRequest(typing.NamedTuple):
    """A request in its first step, as its scheduler output entry gives it."""

    request_id: str
    prompt_len: int
    prompt_token_ids: list[int] | None  # None for prompt embeddings
    extra_args: dict[str, Any]
    first_position: int


class _Step(typing.NamedTuple):
    """What a step's scheduler output says: the requests that finished since the last, the new ones, the others with
    each one's first position (two lists, in the scheduler's order), and the tokens the step runs."""

    finished: Any
    new: list[_NewRequest]
    cached_request_ids: list[str]
    cached_first_positions: list[int]
    num_tokens: int

    def first_positions(self, request_ids: list[str]) -> np.ndarray:
        """int64 [len(request_ids)]: each request's first position in this step, -1 for one the step does not
        name. A decode step's runner usually holds its requests in the scheduler's order: then no lookup is made."""
        if not self.new and request_ids == self.cached_request_ids:
            return np.fromiter(self.cached_first_positions, np.int64, len(request_ids))
        first_positions = dict(zip(self.cached_request_ids, self.cached_first_positions))
        first_positions.update((request.request_id, request.first_position) for request in self.new)
        return np.fromiter(map(first_positions.get, request_ids, itertools.repeat(-1)), np.int64, len(request_ids))


def _scheduled(scheduler_output: Any) -> _Step:
    output, cached = scheduler_output, scheduler_output.scheduled_cached_reqs
    new = [
        _NewRequest(
            r.req_id, _prompt_len(r), r.prompt_token_ids, r.sampling_params.extra_args or {}, r.num_computed_tokens
        )
        for r in output.scheduled_new_reqs
    ]
    return _Step(
        output.finished_req_ids, new, cached.req_ids, cached.num_computed_tokens, output.total_num_scheduled_tokens
    )


def segment_by_request(model_runner: Any) -> tuple[list[int], list[str]]:
    """``(starts, request_ids)`` of the forward in flight: request ``request_ids[i]`` owns rows ``starts[i]:starts[i +
    1]`` of every ``[num_tokens, width]`` activation; rows past ``starts[-1]`` are padding. Ids are the worker's (the
    user's id plus a random suffix unless vLLM was told not to add one). RuntimeError for a runner it does not know."""
    starts, request_ids = _step_segments(model_runner)
    return starts.tolist(), request_ids


def _step_segments(model_runner: Any) -> tuple[np.ndarray, list[str]]:
    """segment_by_request's answer with ``starts`` as an int64 array (a copy: the runner reuses its own)."""
    input_batch = getattr(model_runner, "input_batch", None)
    query_start_loc = getattr(model_runner, "query_start_loc", None)
    if input_batch is not None and query_start_loc is not None:  # V1 runner
        request_ids = list(input_batch.req_ids)
        return query_start_loc.np[: len(request_ids) + 1].astype(np.int64), request_ids
    if hasattr(model_runner, _V2_BATCH):  # Model Runner V2, see _wrap_steps
        batch = getattr(model_runner, _V2_BATCH)
        if batch is None:  # a forward vLLM runs without requests (profile, capture)
            return np.zeros(1, dtype=np.int64), []
        starts = batch.query_start_loc_np[: batch.num_reqs + 1].astype(np.int64)
        return starts, list(batch.req_ids[: batch.num_reqs])
    raise RuntimeError(
        f"segment_by_request: cannot tell requests apart in {type(model_runner).__name__}: it has neither "
        "input_batch.req_ids with query_start_loc (vLLM's V1 model runner) nor a tracked step batch (Model Runner V2)"
    )


class _Ranks(typing.NamedTuple):
    """Where this worker sits in the engine: tensor-parallel rank and size, pipeline stage."""

    tensor_rank: int
    tensor_size: int
    stage: int


def _worker_extension_of(engine: Any) -> str:
    """The worker_extension_cls of an LLM's or an AsyncLLM's engine."""
    return getattr(engine, "llm_engine", engine).vllm_config.parallel_config.worker_extension_cls


def _has_unfinished_requests(engine: Any) -> bool:
    return getattr(engine, "llm_engine", engine).output_processor.has_unfinished_requests()


def _model_config(engine: Any) -> Any:
    """vLLM's ModelConfig of an LLM's or an AsyncLLM's model, as its driver holds it (d_model: get_hidden_size(),
    d_vocab: get_vocab_size(), layers: hf_text_config.num_hidden_layers)."""
    return getattr(engine, "llm_engine", engine).vllm_config.model_config


def _readout(
    model: torch.nn.Module, final_norm: torch.nn.Module, rows: torch.Tensor, apply_ln: bool, bias: bool
) -> torch.Tensor | None:
    """The model's logits for rows [n, d_model] of the residual stream, as vLLM's own readout computes them: the final
    norm's forward (past its module hooks: this module's own on it neither keep these rows nor edit them; Cohere's
    returns (rows, residual)) where ``apply_ln``, then ``compute_logits`` (the unembedding, joined across
    tensor-parallel ranks, and the family's final softcap or scale), or where ``bias`` (_Family.lm_head_bias) its
    logits processor given the output layer's bias; [n, d_vocab] in the model's dtype, or None on a rank the join
    leaves without them."""
    if apply_ln:
        rows = final_norm.forward(rows)
        rows = rows[0] if isinstance(rows, tuple) else rows
    if bias:
        return model.logits_processor(model.lm_head, rows, model.lm_head.bias)
    return model.compute_logits(rows)


def _parallel_ranks() -> _Ranks:
    from vllm.distributed import parallel_state

    tensor_group = parallel_state.get_tp_group()
    return _Ranks(tensor_group.rank_in_group, tensor_group.world_size, parallel_state.get_pp_group().rank_in_group)


@dataclasses.dataclass(frozen=True)
class _EngineFacts:
    """What the hooks know of their worker and its engine, read once per install (_engine_facts): the model vLLM
    loaded, its checkpoint's transformers config, the engine's tokens per forward and requests per step, whether it
    caches prefixes, the device and dtype of the model's parameters (the edit tables'), the worker's ranks, whether
    the model's rotary embeddings run vLLM's CPU kernel (see _Attention.rotary_3d), and whether the engine's custom_ops
    asked for vLLM's rotary in torch instead."""

    model: torch.nn.Module
    hf_config: Any
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool
    device: torch.device
    dtype: torch.dtype
    ranks: _Ranks
    cpu_rotary: bool
    rotary_in_torch_asked: bool


def _engine_facts(worker: Any) -> _EngineFacts:
    vllm_config, model = worker.vllm_config, worker.model_runner.get_model()
    scheduler = vllm_config.scheduler_config
    # (not a tower vLLM left on the meta device: language_model_only builds a multimodal checkpoint's text model
    # alone, and LLaVA-NeXT's first parameter, image_newline, is the tower's)
    parameter = next(p for p in model.parameters() if p.device.type != "meta")
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    kernel = getattr(RotaryEmbedding, "forward_cpu", None)  # (its subclasses' own, and torch's forward_native, are not)
    cpu_rotary = kernel is not None and any(
        getattr(getattr(module, "_forward_method", None), "__func__", None) is kernel for module in model.modules()
    )
    return _EngineFacts(
        model, vllm_config.model_config.hf_config, scheduler.max_num_batched_tokens, scheduler.max_num_seqs, caching,
        parameter.device, parameter.dtype, _parallel_ranks(), cpu_rotary, _rotary_in_torch_asked(vllm_config),
    )  # fmt: skip


def _rotary_in_torch_asked(vllm_config: Any) -> bool:
    """Whether the engine's compilation_config.custom_ops turn vLLM's rotary op off (vLLM's rule: '-rotary_embedding',
    or 'none' without 'all' or '+rotary_embedding'; vLLM fills in 'none' or 'all' when it starts)."""
    ops = list(vllm_config.compilation_config.custom_ops or ())
    return "-rotary_embedding" in ops or ("none" in ops and "all" not in ops and "+rotary_embedding" not in ops)


def _wrap_forward(module: torch.nn.Module, pre_hook: Any, hook: Any) -> Any:
    """Run these hooks, as torch runs a module's (pre_hook(module, args, kwargs) may return new (args, kwargs),
    hook(module, args, output) a new output), around ``module.forward`` itself, where vLLM calls it directly (its
    Transformers backend's attention), in the order they are added. Returns a handle whose remove() puts back the
    module's forward."""
    hooks = getattr(module, "_tl_forward_hooks", None)
    if hooks is None:
        hooks, forward = {"pre": [], "post": []}, module.forward

        def forward_with_hooks(*args, **kwargs):
            for run in hooks["pre"]:
                args, kwargs = run(module, args, kwargs) or (args, kwargs)
            output = forward(*args, **kwargs)
            for run in hooks["post"]:
                replaced = run(module, args, output)
                output = output if replaced is None else replaced
            return output

        _patch(module, "forward", forward_with_hooks)
        _patch(module, "_tl_forward_hooks", hooks)
    for kind, run in (("pre", pre_hook), ("post", hook)):
        if run is not None:
            hooks[kind].append(torch.no_grad()(run))
    return types.SimpleNamespace(remove=lambda: _restore([module]))


def _tensor_parallel_share(module: torch.nn.Module, tap: _Tap, width: int, ranks: _Ranks) -> tuple[int, int] | None:
    """(first column, columns) of a row of ``width`` this rank holds, or None for all of it:
    under tensor parallelism heads of q, k, v and z and the MLP's hidden units are split."""
    if tap.kind == _INPUT and getattr(module, "input_is_parallel", False) and getattr(module, "tp_size", 1) > 1:
        share = module.input_size_per_partition
        return module.tp_rank * share, share
    rank, ranks, _stage = ranks
    if ranks == 1:
        return None
    if tap.kind == _QUERY_KEY:
        raise ValueError(
            f"{tap.module}: attention patterns are rebuilt from every head's query and key, which tensor parallelism "
            "splits across ranks; read them with tensor_parallel_size=1"
        )
    if tap.kind == _LATENT:
        raise ValueError(
            f"{tap.module}: multi-head latent attention's query, key, value and pattern hooks split by heads under "
            "tensor parallelism are not checked against TransformerLens: they are placed with tensor_parallel_size=1 "
            "alone (its latents, attn.hook_q_latent and hook_kv_latent, under any)"
        )
    if tap.kind == _OUTPUT and any(
        type(linear).__name__ == "RowParallelLinear" and not linear.reduce_results
        for linear in (module, *module.children())
    ):
        raise ValueError(
            f"{tap.module}: under tensor parallelism its output is one rank's part of a sum the layer reduces later "
            "(RowParallelLinear without reduce_results), not the whole tensor; read it with tensor_parallel_size=1"
        )
    if type(module).__name__ in ("MergedColumnParallelLinear", "Mixer2RMSNormGated") and not tap.part:
        raise ValueError(
            f"{tap.module}: under tensor parallelism each rank holds its heads' and groups' part of each block of "
            "columns (a Mamba mixer's input projection and gated norm), which reads do not join; read it with "
            "tensor_parallel_size=1"
        )
    if tap.kind == _OUTPUT and not tap.part and not getattr(module, "gather_output", True):
        return rank * module.output_size_per_partition, module.output_size_per_partition  # ColumnParallelLinear
    if tap.part in ("gate", "up"):
        share = width // ranks
    elif tap.part in ("q", "k", "kv", "v") or tap.inputs in (_QUERY, _KEY):
        heads = module.num_heads if tap.part == "q" or tap.inputs == _QUERY else module.num_kv_heads
        share = heads * module.head_size
    else:
        return None
    if share * ranks != width:
        raise ValueError(
            f"{tap.module}: its {width} columns are not split evenly over {ranks} tensor-parallel ranks (this rank "
            f"holds {share}: key and value heads are replicated when there are fewer of them than ranks); read them "
            "with a tensor_parallel_size that divides the number of key-value heads"
        )
    return rank * share, share


def _attention_facts(attention: torch.nn.Module) -> dict[str, Any]:
    """What rebuilding the scores and pattern of vLLM's Attention module from the query and key it receives takes (see
    _attention_rows), as the module and its backend's implementation hold them: heads, kv_heads and head_size; scale;
    softcap (0: none); window, the keys a query sees, itself included (0: all); chunk, chunked attention's size (0:
    none); sinks, a logit per head (or None); alibi, a slope per head (or None)."""
    impl = attention.impl
    sinks, slopes = getattr(impl, "sinks", None), getattr(impl, "alibi_slopes", None)
    latent = hasattr(attention, "kv_lora_rank")  # multi-head latent attention: a key per head (see _latent_hooks)
    return {
        "heads": attention.num_heads,
        "kv_heads": attention.num_heads if latent else attention.num_kv_heads,
        "head_size": attention.qk_head_dim if latent else attention.head_size,
        "scale": float(impl.scale),
        "softcap": float(getattr(impl, "logits_soft_cap", None) or 0),
        "window": int(getattr(attention, "sliding_window", None) or 0),  # (vLLM 0.24's MLA has none)
        "chunk": int(getattr(attention, "attention_chunk_size", None) or 0),
        "sinks": None if sinks is None else torch.as_tensor(sinks).float().tolist(),
        "alibi": None if slopes is None else torch.as_tensor(slopes).float().tolist(),
    }


def _norm_parameters(norm: torch.nn.Module) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """(eps, weight, bias or None) of a norm module: vLLM's RMSNorm (variance_epsilon) or torch's LayerNorm (eps);
    Cohere's LayerNorm has no bias."""
    return getattr(norm, "variance_epsilon", None) or norm.eps, norm.weight, getattr(norm, "bias", None)


def _latent_widths(attention: torch.nn.Module) -> tuple[int, int]:
    """(qk_nope_head_dim, this rank's heads) of vLLM's multi-head latent attention module (MLAAttention)."""
    return attention.qk_nope_head_dim, attention.num_heads


def _latent_up_projection(attention: torch.nn.Module, name: str, path: str) -> typing.Callable:
    """up(latent [tokens, kv_lora_rank]) -> [tokens, heads, nope + v_head_dim]: each of this rank's heads' key (its
    first qk_nope_head_dim columns) and value, vLLM's MLAAttention's kv_b_proj of the latent. ValueError naming hook
    ``name`` (at ``path``) where vLLM released kv_b_proj's weight after packing it (its AMX_MLA backend)."""
    if not attention.kv_b_proj.weight.numel():
        raise ValueError(
            f"{name}: vLLM released {path}.kv_b_proj's weight after packing it for its AMX_MLA backend (vLLM's choice "
            "on a CPU with AMX tiles), and a latent attention's per-head key and value are its latent projected up by "
            "that weight. Start the engine with attention_config={'backend': 'CPU_MLA'} (vLLM's reference CPU MLA, "
            "which keeps it), or leave out the attn hook_k, hook_v, hook_attn_scores and hook_pattern hooks"
        )
    heads = attention.num_heads
    return lambda latent: attention.kv_b_proj(latent)[0].view(latent.shape[0], heads, -1)


def _qkv_columns(module: torch.nn.Module, part: str) -> tuple[int, int] | None:
    """The columns of q, k or v in a QKVParallelLinear's output on this rank."""
    if part not in ("q", "k", "v", "kv"):
        return None
    q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
    return {"q": (0, q), "k": (q, q + kv), "kv": (q, q + kv), "v": (q + kv, q + 2 * kv)}[part]


def _output_width(module: torch.nn.Module) -> int | None:
    """A module's output width where its parameters tell it, else None (checked at the first forward)."""
    if hasattr(module, "embedding_dim"):  # before the next: vLLM's vocabulary embeddings have both
        return module.embedding_dim
    if hasattr(module, "output_size_per_partition"):
        return module.output_size if getattr(module, "gather_output", False) else module.output_size_per_partition
    weight = getattr(module, "weight", None)
    if type(module).__name__.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.shape[0]
    return None


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the module's forward arguments (a CustomOp's, whose forward takes *args)."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters) and hasattr(module, "forward_native"):
        parameters = list(inspect.signature(module.forward_native).parameters.values())  # bound, or static
    return [p.name for p in parameters]


# ---------------------------------------------------------------------------
# Worker state. Built once, in _HookState, before the profile run, torch.compile and CUDA-graph capture, so compiled
# code always sees the same tensors; between forwards only their contents are rewritten. _place_hooks places every
# configured hook and checks it against the model; sent_sources says what a rank hands over (replicated hooks from
# the first tensor-parallel rank alone).
# ---------------------------------------------------------------------------


_UNEMBED_CHUNK_BYTES = 1 << 30  # the most float32 logits a worker holds at once for unembed's top k
_ATTENTION_CHUNK_BYTES = 1 << 30  # the most float32 scores a worker holds at once rebuilding attention matrices


class _Source(typing.NamedTuple):
    """One thing a forward keeps: its name, its device buffer [max_rows, width] and one row's shape."""

    name: str
    buffer: torch.Tensor
    row_shape: tuple[int, ...]


class _HookState:
    """One worker's hooks: their flags, fire counts and handles (each _Hook holds its capture buffer and edit tables),
    subclassed by the two flavours. ``table_rows``: rows of each edit table (None: one, [width]); ``row_index(hook
    index)``: the buffer that picks each forward row's row of them (None: one); ``attach(worker)`` once the hooks are
    in. The reads are each flavour's own (open_capture and read_captures, or read_batched, flush_sink and
    reset_batched), so that a call of the other flavour's is refused."""

    name = ""
    unread_requests = 0
    table_rows: int | None = None
    sink: Any = None  # the batched flavour's, with a sink_dir: its sink writer (see _sink_writer)
    logit_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the batched flavour's logit lens, see _Batched
    shared: _SharedRows | None = None  # the batched flavour's row files

    def __init__(self, config: CaptureConfig, engine: _EngineFacts, placed: dict[str, _Hook], absent: list[str]):
        self.config, self.placed, self.hook_names, self.absent = config, placed, list(placed), absent
        # What edits target, each with its lane of the flavour's row_index: the hooks, then their SAEs' features.
        saes = [name + SAE_FEATURES for name in placed if name in config.saes]
        self.lanes = [*placed, *saes, *(name + ".chosen" for name in saes if config.sae_chosen_features)]
        self.hf_config = engine.hf_config.get_text_config()  # the routers' and multipliers'
        self.model, self.checkpoint_config = engine.model, engine.hf_config  # unembed's
        self.payload = config.to_json()  # what request options are checked against
        self.prefix_caching, self.max_num_seqs, self.ranks = engine.prefix_caching, engine.max_num_seqs, engine.ranks
        self.device, self.edit_dtype = engine.device, engine.dtype
        self.handles: list[Any] = []
        self.fire_counts = torch.zeros(len(placed), dtype=torch.int64, device=self.device)
        # One int64 per hook: 0 = open (the next forward writes its rows), 1 = closed.
        self.capture_flags = torch.zeros(len(placed), dtype=torch.int64, device=self.device)

    def attach(self, worker: Any) -> None:
        """Once the hooks are in: the flavour's steps run around each of the worker's (see _wrap_steps)."""
        self.runner = _wrap_steps(worker, self)

    def forget_warm_up(self) -> None:
        """Drop what vLLM's own warm-up and graph-capture forwards left behind."""
        self.fire_counts.zero_()
        self.capture_flags.fill_(1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    @functools.cached_property
    def targets(self) -> dict[str, Any]:
        """Each lane's name -> what holds its edit tables (a _Hook, or its _SAE), once the hooks are bound."""
        saes = {name + SAE_FEATURES: hook.sae for name, hook in self.placed.items() if hook.sae}
        chosen = {name + ".chosen": sae.chosen for name, sae in saes.items() if sae.chosen is not None}
        return {**self.placed, **saes, **chosen}

    @functools.cached_property
    def sources(self) -> list[_Source]:
        """What a forward keeps: each hook's rows (whose rows are kept), then each SAE's features as ``{features
        name}.indices``, ``.values`` (and ``.chosen``; see SAE_FEATURES)."""
        sources = [_Source(name, hook.buffer, hook.row_shape) for name, hook in self.placed.items() if hook.keeps_rows]
        for name, hook in self.placed.items():
            if hook.sae is not None:
                buffers = {"indices": hook.sae.indices, "values": hook.sae.values}
                if hook.sae.chosen is not None:
                    buffers["chosen"] = hook.sae.chosen_values
                rows = self.config.feature_rows(name).items()
                sources += [_Source(source, buffers[source.rpartition(".")[2]], shape) for source, shape in rows]
        for name, (values, indices) in self.logit_buffers.items():
            buffers = {"values": values, "indices": indices}
            rows = self.config.logit_rows(name).items()
            sources += [_Source(source, buffers[source.rpartition(".")[2]], shape) for source, shape in rows]
        return sources

    @functools.cached_property
    def sent_sources(self) -> list[_Source]:
        """The sources this rank hands over (reads and the sink): each replicated one from the first tensor-parallel
        rank alone, each rank's part of a split one."""
        shards = self.shards()
        return [source for source in self.sources if self.ranks.tensor_rank == 0 or source.name in shards]

    def attention(self) -> dict[str, dict[str, Any]]:
        """{name: _attention_facts} of each hook this rank hands over whose reads rebuild attention (attn_scores,
        pattern) from its rows."""
        sent = {name for name, *_ in self.sent_sources}
        return {name: hook.attention for name, hook in self.placed.items() if name in sent and hook.attention}

    def shards(self) -> dict[str, int]:
        """Where this rank's part of each hook split by tensor parallelism starts in a row's first dimension."""
        return {
            name: hook.columns[0] // math.prod(hook.row_shape[1:])
            for name, hook in self.placed.items()
            if name in self.config.capture_specs and hook.width != self.config.width(name)  # (an SAE's never is)
        }

    # The worker calls (_WORKER_CALLS), each named after the driver helper that makes it.

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "module": __file__,
            "config": self.payload,
            "hooks": list(self.hook_names),
            "absent": list(self.absent),
            "shards": self.shards(),
            "unread_requests": self.unread_requests,
            "sink": None if self.sink is None else self.sink.status(),
            "row_files": None if self.shared is None else self.shared.status(),
        }

    def set_edits(self, edits: dict[str, Any]) -> None:
        _refuse_prefix_caching(self.prefix_caching, self.config, edits)
        for name in edits:
            _check_hook_name(name, self.config)
        _check_editable(edits, self.checkpoint_config)
        tables = {name: _engine_wide_tables(edit, name, self.config) for name, edit in edits.items()}
        for name, target in self.targets.items():  # every edit checked (on every rank) before any table changes
            target.set_engine_wide(tables.get(name))

    def read_fire_counts(self) -> dict[str, int]:
        return dict(zip(self.hook_names, self.fire_counts.tolist()))

    @functools.cached_property
    def readout(self) -> tuple[torch.nn.Module | None, bool]:
        """(the module of the family's final norm, or None on a pipeline rank without the readout; whether the output
        layer's bias is added, see _Family.lm_head_bias), for unembed."""
        family = _family(self.checkpoint_config)
        modules = dict(self.model.named_modules())
        final_norm = _resolve_module(self.model, modules, _text_prefix(family, modules) + family.norms.final)
        return final_norm, family.lm_head_bias

    def unembed(self, rows: dict[str, Any], apply_ln: bool, top_k: int) -> dict[str, Any] | None:
        """Logits of residual-stream rows (encoded [n, d_model]) through the model's final norm (where apply_ln) and
        unembedding (see _readout): ``{"logits": float32 [n, d_vocab]}``, or with top_k ``{"values": float32,
        "indices": int64}``, each [n, top_k], highest first; None on a rank without them."""
        final_norm, bias = self.readout
        if final_norm is None:
            return None
        with torch.inference_mode():
            hidden = decode_tensor(rows).to(self.device, self.edit_dtype)
            if not top_k:  # (the driver sends at most _UNEMBED_CALL_BYTES of logits a call)
                logits = _readout(self.model, final_norm, hidden, apply_ln, bias)
                return None if logits is None else {"logits": encode_tensor(logits.float())}
            best = self.top_logits(hidden, apply_ln, top_k)
            return None if best is None else {"values": encode_tensor(best[0]), "indices": encode_tensor(best[1])}

    def top_logits(self, rows: torch.Tensor, apply_ln: bool, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The k highest logits of rows [n, d_model] (in the model's dtype, on the device; see _readout), highest
        first: (float32, int64), each [n, k]; None on a rank without them. Rows go in chunks of at most
        _UNEMBED_CHUNK_BYTES of float32 logits (every tensor-parallel rank the same chunks). For unembed's top_k and
        the batched flavour's logit lens."""
        final_norm, bias = self.readout
        step = max(1, _UNEMBED_CHUNK_BYTES // (4 * self.hf_config.vocab_size))
        best = []
        for chunk in rows.split(step):
            logits = _readout(self.model, final_norm, chunk, apply_ln, bias)
            if logits is None:
                return None
            best.append(logits.float().topk(k, dim=-1))
        values, indices = (torch.cat(parts) for parts in zip(*best))
        return values, indices

    def reset_fire_counts(self) -> None:
        self.fire_counts.zero_()


def _attention_rows(
    name: str, rows: torch.Tensor, facts: dict[str, Any], queries: list[int] | None
) -> torch.Tensor:
    """TransformerLens's attn.hook_attn_scores or hook_pattern (as ``name`` ends) of B requests of n rows each,
    [B, heads, queries, keys] in rows' dtype on rows' device, rebuilt from rows [B, n, n_heads + n_kv_heads, d_head],
    each token's query and key as vLLM's attention received them, at positions 0..n-1: for the rows ``queries``
    (None: all), over the keys up to the last of them; facts: _attention_facts, with "chosen", the heads to rebuild in
    order (None: all). Scores are q k^T * scale, softcapped, plus ALiBi's slope times the key's position, with the keys
    a query does not see (later ones, past its window, outside its chunk) at the lowest number of rows' dtype; the
    pattern is their softmax over the keys (and a sink's logit, whose share is then dropped). Computed in float32
    (float64 rows in float64): B * heads * queries * keys * d_head multiply-adds and 2 * B * heads * queries * keys * 4
    bytes."""
    device, n = rows.device, rows.shape[1]
    heads = list(range(facts["heads"])) if facts["chosen"] is None else facts["chosen"]
    last = (n if queries is None else (queries[-1] + 1 if queries else 0))  # keys: positions 0..last-1
    positions = torch.arange(n, device=device)
    query_at = positions if queries is None else torch.tensor(queries, dtype=torch.int64, device=device)
    key_at = positions[:last]
    query, key = rows[:, :last].to(torch.promote_types(rows.dtype, torch.float32)).split(
        [facts["heads"], facts["kv_heads"]], 2
    )
    group = facts["heads"] // facts["kv_heads"]  # query heads sharing a key head
    if queries is not None:
        query = query[:, query_at]
    if facts["chosen"] is not None:
        query = query[:, :, heads]
    if group > 1 or facts["chosen"] is not None:
        key = key[:, :, [head // group for head in heads]]
    scores = torch.matmul(query.transpose(1, 2), key.permute(0, 2, 3, 1)) * facts["scale"]  # [B, heads, q, k]
    if facts["softcap"]:
        scores = torch.tanh(scores / facts["softcap"]) * facts["softcap"]
    if facts["alibi"] is not None:
        slopes = torch.tensor(facts["alibi"], dtype=scores.dtype, device=device)[heads, None, None]
        scores = scores + slopes * key_at
    query_at, key_at = query_at[:, None], key_at[None, :]
    seen = key_at <= query_at
    if facts["window"]:
        seen &= query_at - key_at < facts["window"]
    if facts["chunk"]:
        seen &= query_at // facts["chunk"] == key_at // facts["chunk"]
    scores = scores.masked_fill(~seen, torch.finfo(rows.dtype).min)
    if name.endswith(".hook_attn_scores"):
        return scores.to(rows.dtype)
    if facts["sinks"] is None:
        return scores.softmax(-1).to(rows.dtype)
    sinks = torch.tensor(facts["sinks"], dtype=scores.dtype, device=device)[heads, None, None]
    sinks = sinks.expand(rows.shape[0], len(heads), query_at.shape[0], 1)
    return torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1].to(rows.dtype)


def _install(worker: Any, config: CaptureConfig) -> None:
    engine = _engine_facts(worker)
    if engine.max_num_batched_tokens > config.max_num_batched_tokens:
        raise ValueError(
            f"max_num_batched_tokens: the engine schedules up to {engine.max_num_batched_tokens} tokens per forward "
            f"but the capture buffers hold {config.max_num_batched_tokens}; build it with LLM(model, "
            "**config.llm_kwargs), which passes the buffers' size on, or, where vLLM raises it anyway (it turns "
            "chunked prefill off for multi-head latent attention on its CPU platform), configure() with as many"
        )
    _refuse_prefix_caching(engine.prefix_caching, config)
    _uninstall(worker)
    _sweep_shared_files()
    atexit.unregister(_sweep_shared_files)  # once per process, however many installs
    atexit.register(_sweep_shared_files, own=True)
    placed, absent = _place_hooks(engine, config)
    state = (_Batched if config.enable_batching else _OnePrompt)(config, engine, placed, absent)
    for index, hook in enumerate(state.placed.values()):  # the hooks that read and edit each
        hook.bind(state, index)
        _HOOK_BUILDERS[hook.tap.kind](hook)
    state.attach(worker)
    _after_warm_up(worker, state.forget_warm_up)
    worker._tl_hooks = state
    _before_shutdown(worker, _uninstall)
    _key_compile_cache(worker.vllm_config, config)
    logger.info("tl_vllm_hooks: %d %s hooks, %d absent on this rank", len(state.placed), state.name, len(state.absent))


def _uninstall(worker: Any) -> None:
    state = getattr(worker, "_tl_hooks", None)
    if state is not None:
        state.close()
        _restore_worker(worker)
        worker._tl_hooks = None


def _place_hooks(engine: _EngineFacts, config: CaptureConfig) -> tuple[dict[str, _Hook], list[str]]:
    """This rank's hooks in forward order (the order hooks on one module run in), and those on other pipeline ranks."""
    model, hf_config = engine.model, engine.hf_config
    modules = dict(model.named_modules())
    # An SAE's hook, and the hook a transcoder writes, are placed whether or not their rows are kept (_Hook.keeps_rows).
    writes = [config.sae(name).writes for name in config.saes]
    hook_names = list(dict.fromkeys([*config.capture_specs, *config.saes, *filter(None, writes)]))
    if any("hook_" in name for name in hook_names):
        family, text_config = _family(hf_config), hf_config.get_text_config()
        described = family.vllm_class or family.architecture
        if type(model).__name__ != described:
            raise ValueError(
                f"architecture {family.architecture}: this vLLM serves it with {type(model).__name__}, whose module "
                f"tree this module's record does not describe (it describes {described}); supported: "
                f"{sorted(_ARCHITECTURES)}"
            )
        prefix = _text_prefix(family, modules)
        if family.attention and family.attention.rotary_3d and engine.cpu_rotary:
            mis_rotates = (
                f"architecture {family.architecture}: vLLM hands its rotary embedding q and k of [tokens, heads, "
                "d_head], which vLLM's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates as if each head were a "
                "token: every row from the first attention layer on would differ from transformers' (by ~0.3 on a "
                "tiny model). "
            )
            if engine.rotary_in_torch_asked:  # asked, and handed an earlier engine's module
                raise ValueError(
                    mis_rotates + "This engine's custom_ops ask for vLLM's rotary in torch, but vLLM's get_rope keeps "
                    "one rotary module per shape for the whole process, and an earlier engine in this process built "
                    "this one with the kernel. Start this engine in a process of its own "
                    "(VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default), or clear "
                    "vllm.model_executor.layers.rotary_embedding._ROPE_DICT before it starts"
                )
            raise ValueError(
                mis_rotates + "Start the engine with compilation_config={'custom_ops': ['-rotary_embedding']} (vLLM's "
                "own rotary in torch; a compiled engine's default, custom_ops ['none'], already runs it)"
            )

    placed, absent = {}, []
    layers: dict[int | None, dict[str, _Site]] = {}  # each layer's sites, worked out once for all its hooks
    for name in sorted(hook_names, key=_forward_order):
        spec = config.capture_specs.get(name)
        if spec is not None and isinstance(spec[0], str):
            tap, path = _Tap(spec[0], _OUTPUT), spec[0]
        else:
            site, layer = parse_hook_name(name)
            if layer is not None and layer >= text_config.num_hidden_layers:
                raise ValueError(f"{name}: the model has {text_config.num_hidden_layers} layers")
            if layer not in layers:
                layers[layer] = _layer_sites(family, text_config, layer)
            placed_here = layers[layer].get(site)
            if placed_here is None:
                why = family.refused.get(site, "TransformerLens's bridge runs no such hook there")
                raise ValueError(f"{name}: {family.architecture} has no {SITES[site]} on this layer: {why}")
            spec = spec or placed_here.row_shape
            if spec != placed_here.row_shape:
                raise ValueError(
                    f"capture_specs[{name!r}]: row shape {spec}, but this model's {name} has rows "
                    f"of {placed_here.row_shape}: were the specs written for another model?"
                )
            tap = placed_here.tap
            path = prefix + tap.module.format(i=layer)
        module = _resolve_module(model, modules, path)
        if module is None:
            absent.append(name)
            continue
        names = _forward_parameters(module) if tap.inputs else []
        for argument, position in tap.inputs:  # a vLLM that renamed them is refused
            if position >= len(names) or names[position] != argument:
                raise ValueError(
                    f"{path} ({type(module).__name__}) takes {names}: its input {argument!r} is not at "
                    f"position {position}, where this module's table for this vLLM expects it"
                )
        row_shape = _row_shape(spec)
        width = math.prod(row_shape)
        start, columns = _tensor_parallel_share(module, tap, width, engine.ranks) or (0, width)
        for sae in config.saes:  # those that read or write this hook
            verb, expected = ("reads", config.sae(sae).d_in) if sae == name else ("writes", config.sae(sae).d_out)
            if name in (sae, config.sae(sae).writes) and (width != expected or columns != width):
                raise ValueError(
                    f"saes[{sae!r}]: the SAE {verb} rows of {expected} at {name}, but this model's rows there are "
                    f"{width} wide"
                    + (f", split across tensor-parallel ranks ({columns} on each)" if columns != width else "")
                )
        row_shape = (row_shape[0] * columns // width, *row_shape[1:])
        order = None
        # TransformerLens's column 2a + b of a head is vLLM's b*d/2 + a
        if tap.part in ("q", "k") and family.attention.qk_halves:
            d_head = row_shape[-1]
            order = torch.arange(columns).view(-1, d_head // 2, 2).transpose(1, 2).reshape(-1)
            order = torch.argsort(order)
        if tap.kind == _LATENT and tap.part in ("q", "k", "rot_q", "rot_k"):
            order = _latent_order(text_config, row_shape, tap.part)
        attention = _attention_facts(module) if tap.kind == _QUERY_KEY or tap.part == "qk" else None
        if attention is not None:
            chosen = attention["chosen"] = list(config.attention_heads.get(name, ())) or None
            if chosen and max(chosen) >= attention["heads"]:
                raise ValueError(
                    f"attention_heads[{name!r}]: head {max(chosen)}, but {path} has {attention['heads']} heads "
                    f"(0 to {attention['heads'] - 1})"
                )
        placed[name] = _Hook(
            name, module, tap, row_shape, (start, start + columns), _qkv_columns(module, tap.part), order, attention
        )
        output_width = _output_width(module) if tap.kind == _OUTPUT and not tap.part else None
        if output_width is not None and output_width != columns:
            raise ValueError(
                f"capture_specs[{name!r}]: width {columns}, but {path} ({type(module).__name__}) "
                f"outputs rows of {output_width}"
            )
    return placed, absent


def _latent_order(config: Any, row_shape: tuple[int, ...], part: str) -> torch.Tensor | None:
    """vLLM's column of each of TransformerLens's in a row of multi-head latent attention's ``part`` (see
    _Attention.latent), or None where they are the same (no rope_interleave): in each head's rotary columns
    TransformerLens's column h * rope / 2 + a is vLLM's 2a + h; its other columns (nope, before them in q and k) are
    where they are."""
    if not getattr(config, "rope_interleave", False):
        return None
    rope, nope = config.qk_rope_head_dim, 0 if part.startswith("rot") else config.qk_nope_head_dim
    head = torch.cat([torch.arange(nope), nope + torch.arange(rope).view(rope // 2, 2).t().reshape(-1)])
    return (head + torch.arange(row_shape[0])[:, None] * row_shape[1]).reshape(-1)


def _resolve_module(model: torch.nn.Module, modules: dict, path: str) -> torch.nn.Module | None:
    """The module at ``path``; None where pipeline parallelism left it (or one above) elsewhere."""
    prefix = path
    while prefix:
        if type(modules.get(prefix)).__name__ == "PPMissingLayer":
            return None
        prefix = prefix.rpartition(".")[0]
    if path in modules:
        return modules[path]
    close = difflib.get_close_matches(path, list(modules), n=3, cutoff=0.6)
    raise ValueError(
        f"capture_specs: module path {path!r} does not exist in {type(model).__name__}"
        + (f"; close matches: {close}" if close else "")
        + "; paths look like 'model.layers.0.mlp' (see model.named_modules())"
    )


def _text_prefix(family: _Family, modules: dict) -> str:
    """Where the text model sits in vLLM's tree ("" but in a multimodal checkpoint's); ValueError where its class is
    not one the record describes."""
    if not family.text_classes:
        return ""
    found = type(modules.get(family.text_prefix.rstrip("."))).__name__
    if found not in family.text_classes:
        raise ValueError(
            f"architecture {family.architecture}: its text model at {family.text_prefix.rstrip('.')!r} is vLLM's "
            f"{found}, where this module's record describes {list(family.text_classes)}"
        )
    return family.text_prefix


# ---------------------------------------------------------------------------
# Hooks. Traced into the compiled graph and replayed by CUDA graphs: no Python branching on tensor values, no host
# transfers, no side effects other than in-place writes into the state's buffers. Python branches on constants (the
# tap) and on static facts of a call (whether an argument came by name, whether the residual is None, the width) are
# fixed at trace time. Every activation is handled as [rows, width]: vLLM's native models pass [tokens, width], its
# Transformers backend [1, tokens, width]. Each tap kind has one builder.
# ---------------------------------------------------------------------------


def _with_arguments(args, kwargs, inputs, values):
    """(args, kwargs) with each of ``values`` put in as the (name, position) of ``inputs``."""
    args, kwargs = list(args), dict(kwargs)
    for (name, position), value in zip(inputs, values):
        if name in kwargs:
            kwargs[name] = value
        else:
            args[position] = value
    return tuple(args), kwargs


def _normalize(rows, norm, eps):
    """(the rows centred (for LayerNorm), their variance + eps) in fp32, as TransformerLens normalizes [rows, width]
    over the last dimension, before any weight: normalized, centred * rsqrt(variance + eps)."""
    centered = rows.float()
    if norm.startswith("layer"):
        centered = centered - centered.mean(-1, keepdim=True)
    return centered, centered.pow(2).mean(-1, keepdim=True) + eps


class _EditTables:
    """What an edit lane writes (a hook, its SAE's features, their chosen features): its ``tables``, whose rows the
    flavour's row_index picks, and their ``identity`` values (None: no engine-wide edit, a request's own alone)."""

    identity: tuple | None = None

    def local(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full edit row or table (all of it but for a hook split by tensor parallelism)."""
        return row

    def set_engine_wide(self, values: tuple[torch.Tensor, ...] | None) -> None:
        """Copy an engine-wide edit's tables (see _engine_wide_tables) into the engine-wide rows (all of a 1-row
        table), or identity."""
        if self.identity is None:
            return
        for table, value, same in zip(self.tables, values or self.identity, self.identity):
            rows = table if table.dim() == 1 else table[: _global_rows(self.state.config)]
            rows.copy_(self.local(value) if values is not None else torch.tensor(same))

    def slot_writes(self, rows: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(table, its new row as this rank holds it) for each of a request's table rows (see _SlotWrites)."""
        return [(table, self.local(value)) for table, value in zip(self.tables, rows)]


@dataclasses.dataclass(eq=False)
class _Hook(_EditTables):
    """One configured hook as this worker holds it: module, tap, row shape and the columns of
    a full row it holds (a slice under tensor parallelism); once bound, its capture buffer,
    flag, fire count and edit tables, and the [rows, width] views its builder's hooks use."""

    name: str
    module: torch.nn.Module
    tap: _Tap
    row_shape: tuple[int, ...]
    columns: tuple[int, int]
    part_columns: tuple[int, int] | None = None  # a part's columns in the module's tensor
    column_order: torch.Tensor | None = None  # vLLM's column of each of TransformerLens's, where they differ (int64)
    attention: dict[str, Any] | None = None  # for attn_scores and pattern: see _attention_facts
    transcoder: _SAE | None = None  # the transcoder that writes this hook, once bound

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    def bind(self, state: _HookState, index: int) -> None:
        self.state, self.index, rows, device = state, index, state.config.max_num_batched_tokens, state.device
        self.keeps_rows = self.name in state.config.capture_specs  # (else only its SAE's features are kept)
        self.buffer = torch.zeros(rows, self.width, dtype=row_dtype(self.name, state.config.dtype), device=device)
        self.flag = state.capture_flags.narrow(0, index, 1)
        self.fire_count = state.fire_counts.narrow(0, index, 1)
        # Edit tables, out = out * scale + bias, of the flavour's rows.
        self.scale = torch.ones(*filter(None, (state.table_rows, self.width)), dtype=state.edit_dtype, device=device)
        self.bias = torch.zeros_like(self.scale)
        self.tables, self.identity = (self.scale, self.bias), (1, 0)
        self.row_index = state.row_index(index)
        # (set here, as row_index is, not held in a field: with a tensor in the field, torch 2.11's Dynamo failed to
        # build its guard on the GPU, "Unexpected type <class 'torch.Tensor'>" in a CONSTANT_MATCH)
        self.order = None if self.column_order is None else self.column_order.to(device)
        if self.order is not None:
            self.inverse = torch.argsort(self.order)  # TransformerLens's column of each of vLLM's
        if self.tap.norm:  # the rows (fp32) a norm's pre-hook leaves its hook, and which changed (see _norm_hooks)
            width = _norm_parameters(self.module)[1].shape[-1] if self.tap.kind == _NORM_SCALE else self.width
            self.norm_rows = torch.zeros(rows, width, dtype=torch.float32, device=device)
            self.norm_changed = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        features = self.name + SAE_FEATURES
        self.sae = _SAE(self, state, state.lanes.index(features)) if features in state.lanes else None

    def steer(self, activation: torch.Tensor, into: torch.Tensor, factor: float | None = None) -> None:
        """With an SAE here: keep the features of ``activation`` (the edited rows) and add the feature edits' change
        of it to ``into``, the module's rows that carry it (times ``factor`` where they carry activation * factor). A
        transcoder's change waits in its ``pending`` rows for the hook it writes, which adds it there."""
        changes = []
        if self.sae is not None:
            change = self.sae.change(self.in_order(activation))
            if self.sae.pending is None:
                changes.append(change if self.order is None else change.index_select(-1, self.inverse))
            else:
                self.sae.pending.narrow(0, 0, change.shape[0]).copy_(change)
        if self.transcoder is not None:
            changes.append(self.transcoder.pending.narrow(0, 0, into.shape[0]).to(into.dtype))
        for change in changes:
            into.add_(change if factor is None else change * factor)

    def local(self, row: torch.Tensor) -> torch.Tensor:
        return row[..., self.columns[0] : self.columns[1]]

    def columns_of(self, tensor):
        """(start, stop) of the site's columns in a module's [..., columns] tensor."""
        if self.part_columns is not None:
            return self.part_columns
        half = tensor.shape[-1] // 2
        return {"gate": (0, half), "up": (half, 2 * half)}.get(self.tap.part, (0, tensor.shape[-1]))

    def as_rows(self, tensor):
        """The site's [rows, width] view of a module's input or output."""
        start, stop = self.columns_of(tensor)
        if stop - start != self.width:
            raise ValueError(
                f"{self.name}: {self.tap.module} gives rows of width {stop - start} at its {self.tap.kind}, "
                f"but the hook was configured with {self.width}"
            )
        rows = tensor.view(-1, tensor.shape[-1])
        return rows if stop - start == tensor.shape[-1] else rows[:, start:stop]

    def with_rows(self, tensor, rows):
        """``tensor`` with the site's columns replaced by ``rows``."""
        start, stop = self.columns_of(tensor)
        if stop - start == tensor.shape[-1]:
            return rows.view_as(tensor)
        whole = tensor.view(-1, tensor.shape[-1])
        return torch.cat([whole[:, :start], rows, whole[:, stop:]], dim=-1).view_as(tensor)

    def keep(self, activation):
        """The first forward after the flag opens wins; later ones rewrite what is there."""
        self.fire_count.add_(1)
        kept = self.buffer.narrow(0, 0, activation.shape[0])
        kept.copy_(torch.where(self.flag.bool(), kept, self.in_order(activation)))
        self.flag.fill_(1)

    def in_order(self, rows):
        """[rows, width] of the module's tensor in TransformerLens's column order."""
        return rows if self.order is None else rows.index_select(-1, self.order)

    def edit_of(self, rows):
        """The edit's (scale, bias) for these rows, broadcastable to them (see _rows_of_tables), in the module's
        column order."""
        tables = _rows_of_tables((self.scale, self.bias), self.row_index, rows.shape[0])
        return tables if self.order is None else tuple(table.index_select(-1, self.inverse) for table in tables)

    def inputs_of(self, args, kwargs):
        """(the first input the tap reads, the second or None)."""
        found = [kwargs[n] if n in kwargs else args[at] if at < len(args) else None for n, at in self.tap.inputs]
        return found[0], found[1] if len(found) > 1 else None

    def add(self, hook=None, pre_hook=None, first=False) -> None:
        """Register the hooks (first: the pre-hook before those already on the module)."""
        handles, module = self.state.handles, self.module
        if self.tap.direct:
            handles.append(_wrap_forward(module, pre_hook, hook))
            return
        if pre_hook is not None:
            pre_hook = torch.no_grad()(pre_hook)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=first))
        if hook is not None and "output" in _forward_parameters(module):
            # (vLLM 0.24's Qwen3-Next and Qwen 3.5 attention write their result into an ``output`` argument and
            # return None: the hook reads and edits that tensor)
            def hook_written(module, args, kwargs, output, hook=hook):
                return hook(module, args, kwargs.get("output") if output is None else output)

            handles.append(module.register_forward_hook(torch.no_grad()(hook_written), with_kwargs=True))
        elif hook is not None:
            handles.append(module.register_forward_hook(torch.no_grad()(hook)))


def _rows_of_tables(tables: tuple[torch.Tensor, ...], row_index: torch.Tensor | None, num_rows: int) -> tuple:
    """Each edit table's row for each of num_rows forward rows: the table itself where it is one row, else the rows
    that the flavour's row_index ([max_rows] int64) picks, clamped to the table."""
    if row_index is None:
        return tables
    picked = row_index.narrow(0, 0, num_rows).clamp(max=tables[0].shape[0] - 1)
    return tuple(table.index_select(0, picked) for table in tables)


def row_dtype(name: str, capture_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rows a read (or a dataset) gives under ``name``: int64 for the router's expert indices (as
    TransformerLens's, and exact past the 256 experts bfloat16 holds) and a logit lens's indices, int32 for an SAE's
    feature indices (``{features name}.indices``), float32 for a logit lens's values, else the capture dtype."""
    if name.endswith(SAE_FEATURES + ".indices"):
        return torch.int32
    if name.endswith(_LOGITS + ".values"):
        return torch.float32
    return torch.int64 if name.endswith(("hook_expert_indices", _LOGITS + ".indices")) else capture_dtype


def _router_hooks(site: _Hook) -> None:
    """The router's choice from its logits, as the family routes (see _MoE) and vLLM's fused MoE computes it inside
    its kernel: the indices, highest choice score first, and the weights scattered over all experts."""
    config, moe = site.state.hf_config, site.tap.moe
    top_k, num_experts = config.num_experts_per_tok, _num_experts(config)
    renormalize = moe.renormalize == "always" or bool(getattr(config, moe.renormalize, False))
    scale = float(getattr(config, moe.scale)) if moe.scale else 1.0
    bias = getattr(site.module, moe.correction_bias) if moe.correction_bias else None
    groups = (config.n_group, config.topk_group) if moe.groups else None

    def hook(_module, _inputs, output):
        logits = (output[0] if isinstance(output, tuple) else output).reshape(-1, num_experts).float()
        if moe.scoring == "sparsemixer":
            weights, indices = _sparsemixer(logits)
        else:
            scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
            choice = scores if bias is None else scores + bias.float()
            if groups is not None:
                n_group, topk_group = groups
                grouped = choice.view(-1, n_group, num_experts // n_group)
                best = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
                kept = torch.zeros_like(grouped[..., 0]).scatter(1, best, 1.0).bool()
                choice = choice.masked_fill(~kept.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
            indices = choice.topk(top_k, dim=-1).indices
            weights = scores.gather(1, indices)
        if site.tap.part == "indices":
            site.keep(indices.to(site.buffer.dtype))
            return output
        if renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        site.keep(torch.zeros_like(logits).scatter(-1, indices, weights * scale).to(site.buffer.dtype))
        return output

    site.add(hook)


def _sparsemixer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's top-2 routing of [tokens, experts] logits: (weights, indices), each [tokens, 2]. Each round takes
    the best expert not yet taken, weighted by its softmax among the experts within 2% (relative) of it."""
    weights, indices, remaining = [], [], logits
    for _round in range(2):
        best, index = remaining.max(-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 0.02
        weights.append(remaining.masked_fill(far, float("-inf")).softmax(-1).gather(-1, index))
        indices.append(index)
        remaining = remaining.scatter(-1, index, float("-inf"))
    return torch.cat(weights, -1), torch.cat(indices, -1)


def _output_hooks(site: _Hook) -> None:
    tap = site.tap
    multiplier = float(getattr(site.state.hf_config, tap.multiplier)) if tap.multiplier else None

    def hook(_module, _inputs, output):
        whole = output[0] if isinstance(output, tuple) else output
        rows, (start, stop) = site.as_rows(whole), site.columns_of(whole)
        row_scale, row_bias = site.edit_of(rows)
        added = output[1][start:stop] if tap.bias_apart and output[1] is not None else None
        if multiplier is not None:  # the layer adds output * multiplier: the product carries the edit
            rows.mul_(row_scale).add_(row_bias / multiplier)
            site.steer(rows * multiplier, rows, 1 / multiplier)
            site.keep(rows * multiplier)
        elif added is not None:  # the layer adds the bias: the sum carries the edit (+ 0 exactly unedited)
            rows.mul_(row_scale).add_(row_bias + added * row_scale - added)
            site.steer(rows + added, rows)
            site.keep(rows + added)
        else:
            rows.mul_(row_scale).add_(row_bias)
            site.steer(rows, rows)
            site.keep(rows)
        if tap.part == "kv":  # V is K here (vLLM loads k_proj into both): what the edit made of K, V is too
            whole.view(-1, whole.shape[-1])[:, stop : stop + stop - start].copy_(rows)
        return output

    site.add(hook)


def _output_pair_hooks(site: _Hook) -> None:
    # (mlp_out * s + b, residual * s): the next layer's fused add+norm sums exactly what vLLM sums unhooked at
    # identity (x * 1 + 0 == x, bit for bit), and exact zeros under suppress and set.
    def hook(_module, _inputs, output):
        hidden, residual = output
        row_scale, row_bias = site.edit_of(site.as_rows(hidden))
        residual = (site.as_rows(residual) * row_scale).view_as(residual)
        site.as_rows(hidden).mul_(row_scale).add_(row_bias)
        site.steer(site.as_rows(hidden) + site.as_rows(residual), site.as_rows(hidden))
        site.keep(site.as_rows(hidden) + site.as_rows(residual))
        return (hidden, residual)

    site.add(hook)


def _input_hooks(site: _Hook) -> None:
    """An input, or the sum of two (residual None in the first layer); the module runs on the edit."""
    tap = site.tap
    multiplier = float(getattr(site.state.hf_config, tap.multiplier)) if tap.multiplier else None

    def pre_hook(_module, args, kwargs):
        hidden, residual = site.inputs_of(args, kwargs)
        row_scale, row_bias = site.edit_of(site.as_rows(hidden))
        if multiplier is not None:  # the module receives TransformerLens's tensor times multiplier
            row_bias = row_bias * multiplier
        edited = site.as_rows(hidden) * row_scale + row_bias
        values, total = [site.with_rows(hidden, edited)], edited
        if residual is not None:  # (a pair's rows are whole: with_rows is a view)
            edited_residual = site.as_rows(residual) * row_scale
            values.append(edited_residual.view_as(residual))
            total = edited + edited_residual
        if multiplier is not None:
            total = edited / multiplier
        site.steer(total, edited, multiplier)
        site.keep(total)
        return _with_arguments(args, kwargs, tap.inputs, values)

    site.add(pre_hook=pre_hook)


def _norm_hooks(site: _Hook) -> None:
    """On CUDA vLLM's fused add+norm overwrites its inputs in place, so the pre-hook reads them and leaves in norm_rows
    what the edit makes of the norm (the edited input at hook_resid_mid, ln2's input; the rows normalized by the
    edited divisor at hook_scale; the edited rows at hook_normalized); the post-hook rewrites only the output rows the
    edit changed, so an unedited forward keeps vLLM's own output bit for bit. Hooks on one norm run in forward order,
    each from what the earlier ones left."""
    state, tap, module = site.state, site.tap, site.module
    norm_rows, norm_changed = site.norm_rows, site.norm_changed
    eps, weight, norm_bias = _norm_parameters(module)
    earlier = {hook.tap.kind: hook for hook in list(state.placed.values())[: site.index] if hook.module is module}

    def edited_by(kind, rows):
        """rows, with those an earlier hook of this kind on the norm changed as it left them."""
        if kind not in earlier:
            return rows
        source, num_rows = earlier[kind], rows.shape[0]
        changed = source.norm_changed.narrow(0, 0, num_rows)
        return torch.where(changed, source.norm_rows.narrow(0, 0, num_rows).to(rows.dtype), rows)

    def pre_hook(_module, args, kwargs):
        hidden, residual = (None if t is None else t.view(-1, t.shape[-1]) for t in site.inputs_of(args, kwargs))
        total = edited_by(_NORM_INPUT, hidden if residual is None else hidden + residual)
        activation = total
        if tap.kind != _NORM_INPUT:
            centered, variance = _normalize(total, tap.norm, eps)
            normalized = edited_by(_NORM_SCALE, centered * torch.rsqrt(variance))
            activation = variance.sqrt() if tap.kind == _NORM_SCALE else normalized
        row_scale, row_bias = site.edit_of(activation)
        edited = activation * row_scale + row_bias
        site.steer(edited, edited)
        site.keep(edited)
        norm_rows.narrow(0, 0, edited.shape[0]).copy_(centered / edited if tap.kind == _NORM_SCALE else edited)
        norm_changed.narrow(0, 0, edited.shape[0]).copy_((edited != activation).any(-1, keepdim=True))

    def hook(_module, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        out = out.view(-1, out.shape[-1])
        edited = norm_rows.narrow(0, 0, out.shape[0])
        result = edited
        if tap.kind == _NORM_INPUT:
            centered, variance = _normalize(edited, tap.norm, eps)
            result = centered * torch.rsqrt(variance)
        result = result * (weight.float() + 1.0 if tap.norm.endswith("_offset") else weight.float())
        if tap.norm.startswith("layer") and norm_bias is not None:
            result = result + norm_bias.float()
        out.copy_(torch.where(norm_changed.narrow(0, 0, out.shape[0]), result.to(out.dtype), out))
        return output

    site.add(hook, pre_hook)


def _query_key_hooks(site: _Hook) -> None:
    """The query and key vLLM's attention receives, each token's side by side: [rows, (n_heads + n_kv_heads) *
    d_head], from which a read rebuilds attn_scores and pattern (see _attention_rows)."""

    def pre_hook(_module, args, kwargs):
        query, key = site.inputs_of(args, kwargs)
        rows = torch.cat([query.reshape(query.shape[0], -1), key.reshape(key.shape[0], -1)], dim=-1)
        if rows.shape[-1] != site.width:
            raise ValueError(
                f"{site.name}: {site.tap.module} receives a query and key of {rows.shape[-1]} columns together, but "
                f"the hook was configured with {site.width}"
            )
        site.keep(rows)

    site.add(pre_hook=pre_hook)


def _latent_hooks(site: _Hook) -> None:
    """Multi-head latent attention's ``part`` (see _Tap.part) from what vLLM's MLAAttention receives: q ``[tokens,
    heads, nope + rope]`` after rotary, the normed latent ``[tokens, kv_lora_rank]`` and the rotary key ``[tokens, 1,
    rope]``. Each head's key is its part of the latent projected up by kv_b_proj beside the rotary key, its value the
    rest of that projection: vLLM's prefill computes the same, its decode never (it attends in the latent); the first
    of the module's hooks that keep those (k, v, qk) keeps every one's rows, from one projection a forward. An edit of
    q, rot_q or rot_k is what the attention receives; rot_q's and rot_k's pre-hooks run first, as TransformerLens fires
    hook_rot_q and hook_rot_k before hook_q (a hook_q of rotary columns)."""
    module, part = site.module, site.tap.part
    (nope, heads), up_projection = _latent_widths(module), None
    projected = [h for h in site.state.placed.values() if h.module is module and h.tap.part in ("k", "v", "qk")]
    if part in ("k", "v", "qk") and site is not projected[0]:
        return
    if part in ("k", "v", "qk"):
        up_projection = _latent_up_projection(module, site.name, site.tap.module)

    def pre_hook(_module, args, kwargs):
        query, latent, rotary_key = (kwargs[n] if n in kwargs else args[at] for n, at in site.tap.inputs)
        tokens = query.shape[0]
        if part in ("k", "v", "qk"):
            up = up_projection(latent)  # (this rank's heads)
            keys = torch.cat([up[..., :nope], rotary_key.view(tokens, 1, -1).expand(-1, heads, -1)], -1)
            kept = {}
            for hook in projected:
                if hook.tap.part not in kept:
                    rows = {"k": keys, "v": up[..., nope:]}.get(hook.tap.part)
                    both = torch.cat([query, keys], dim=1) if rows is None else rows
                    kept[hook.tap.part] = both.reshape(tokens, -1)
                hook.keep(kept[hook.tap.part])
            return None
        target, argument = (rotary_key, "k_pe") if part == "rot_k" else (query, "q")
        whole = target.reshape(tokens, -1, target.shape[-1])  # [tokens, heads, columns]
        rows = (whole[..., nope:] if part == "rot_q" else whole).reshape(tokens, -1)
        row_scale, row_bias = site.edit_of(rows)
        edited = rows * row_scale + row_bias
        site.steer(edited, edited)
        site.keep(edited)
        if part == "rot_q":
            edited = torch.cat([whole[..., :nope], edited.view(tokens, whole.shape[1], -1)], dim=-1)
        inputs = [(name, at) for name, at in site.tap.inputs if name == argument]
        return _with_arguments(args, kwargs, inputs, [edited.view_as(target)])

    site.add(pre_hook=pre_hook, first=part in ("rot_q", "rot_k"))


# fmt: off
_HOOK_BUILDERS = {  # tap kind -> the builder of its hooks
    _OUTPUT: _output_hooks, _OUTPUT_PAIR: _output_pair_hooks, _INPUT: _input_hooks, _INPUT_PAIR: _input_hooks,
    _NORM_INPUT: _norm_hooks, _NORM_SCALE: _norm_hooks, _NORMALIZED: _norm_hooks, _ROUTER: _router_hooks,
    _QUERY_KEY: _query_key_hooks, _LATENT: _latent_hooks,
}
# fmt: on


# ---------------------------------------------------------------------------
# SAEs. A sparse autoencoder in SAELens's on-disk format encodes a hook's rows inside the graph, in every forward:
# each token's top-k features are kept beside (or instead of) its rows, and an edit of features f changes the
# stream by (new_f - old_f) * W_dec[f] alone, so the SAE's reconstruction error stays in it and an unedited row is
# left as it was. A transcoder encodes the rows of one hook, and its edits change those of its layer's hook_mlp_out.
# SAELens's files are read here (_read_sae, as a config is made, in the driver and in each worker, and checked against
# its hooks); each worker loads the weights onto its device before the first forward (_SAE). The rest of SAE handling is
# here too: the feature edits' parsing and the features a batched request reads densely; elsewhere SAEs are only
# named (a config's saes, the lanes, sources and targets of a worker's hooks, the width _place_hooks checks).
# ---------------------------------------------------------------------------

SAE_FEATURES = ".hook_sae_acts_post"
"""The suffix that names a hook's SAE features (SAELens's name for them): ``blocks.6.hook_resid_post`` with an SAE
has features ``blocks.6.hook_resid_post.hook_sae_acts_post``, which edits name. Reads give ``{that}.indices``
(int32) and ``{that}.values`` (the capture dtype), each ``[rows, k]``: per token its k highest features, highest
first, so ``torch.zeros(rows, d_sae).scatter_(1, indices.long(), values)`` is SAELens's ``sae.encode(rows)``
wherever at most k features fire (a value 0 is a feature that did not). With ``sae_chosen_features``,
``{that}.chosen`` holds the activations of the features a request chose, in its order (``[rows, 0]`` for one that
chose none)."""

SAE_WEIGHTS = {
    name: ("W_enc", "W_dec", "b_enc", "b_dec", *(("threshold",) if "jumprelu" in name else ()))
    for name in (
        "standard",
        "jumprelu",
        "topk",
        "transcoder",
        "skip_transcoder",
        "jumprelu_transcoder",
        "jumprelu_skip_transcoder",
    )
}
"""SAELens architecture -> the tensors of its sae_weights.safetensors that encode and steer (a skip transcoder's
W_skip, its linear path from input to output, does not change with its features)."""
SAE_SITES = tuple(site for site in SITES if site not in (*_NORM_SITES, *_READ_ONLY_SITES))
"""The sites an SAE may read: those whose hooks can add a feature edit's change to the stream, not the norms' (whose
edits reach the norm's output as edited * weight + bias), not the router's (read-only)."""
_FEATURE_EDITS = 8  # the most features one edit changes at a hook: the width of the feature edit tables


@dataclasses.dataclass(frozen=True)
class SAESpec:
    """An SAE as its cfg.json and the header of its weights file describe it (``config.sae(hook)``; _read_sae reads
    them): architecture, a key of SAE_WEIGHTS; d_in, d_sae, d_out: widths of its input rows, features
    and output rows; k: a topk SAE's features per token; writes: the hook a transcoder writes (its layer's
    hook_mlp_out), else None."""

    directory: str
    architecture: str
    d_in: int
    d_sae: int
    apply_b_dec_to_input: bool
    k: int | None
    writes: str | None
    d_out: int


def _read_sae(name: Any, directory: Any, config: CaptureConfig) -> SAESpec:
    """One ``saes`` entry as its files describe it, checked against them and the config; ValueError naming the
    problem."""
    where = f"saes[{name!r}]"
    site = (parse_hook_name(name) if isinstance(name, str) else None) or (None,)
    if site[0] not in SAE_SITES:
        raise ValueError(
            f"{where}: an SAE reads a TransformerLens hook whose rows this module can edit, one of "
            f"{[SITES[s] for s in SAE_SITES]}; got {name!r}"
        )
    if not isinstance(directory, str) or not os.path.isdir(directory):
        raise ValueError(
            f"{where}: expected a directory holding cfg.json and sae_weights.safetensors, got {directory!r}"
        )
    try:
        with open(os.path.join(directory, "cfg.json")) as file:
            cfg = json.load(file)
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: {directory}/cfg.json: {error}") from None
    architecture = cfg.get("architecture", "standard")
    if architecture not in SAE_WEIGHTS:
        raise ValueError(
            f"{where}: architecture {architecture!r} is not implemented here; implemented: {list(SAE_WEIGHTS)}"
        )
    # (SAELens before 6 wrote normalize_activations as a bool, the hook name at the top level, as hook_point too)
    implemented = {  # key -> (values implemented, as said)
        "normalize_activations": ((None, "none", False), "'none'"),
        "reshape_activations": ((None, "none", "hook_z"), "'none' and 'hook_z'"),
        "rescale_acts_by_decoder_norm": ((None, False), "false"),
    }
    for key, (allowed, said) in implemented.items():
        if cfg.get(key) not in allowed:
            raise ValueError(f"{where}: {key} {cfg.get(key)!r} is not implemented here, only {said}")
    metadata = cfg.get("metadata") or {}
    trained_on = metadata.get("hook_name", cfg.get("hook_name", cfg.get("hook_point")))
    # SAELens names Gemma Scope 2's transcoders' input blocks.L.hook_mlp_in, which TransformerLens 4.3 means as ln2's
    # input; their hf_hook_name, pre_feedforward_layernorm's output, is the MLP's input: mlp.hook_in.
    gemma_scope_2 = re.fullmatch(r"blocks\.(\d+)\.hook_mlp_in", str(trained_on))
    if gemma_scope_2 and str(metadata.get("hf_hook_name")).endswith("pre_feedforward_layernorm.output"):
        trained_on = SITES["mlp_in"].format(i=gemma_scope_2[1])
    if trained_on is not None and trained_on != name:
        raise ValueError(f"{where}: the SAE in {directory} was trained on {trained_on!r}, not {name!r}")
    transcoder = "transcoder" in architecture
    d_in, d_sae, k = cfg.get("d_in"), cfg.get("d_sae"), cfg.get("k")
    d_out = cfg.get("d_out") if transcoder else d_in
    sizes = (d_in, d_sae, d_out, k if architecture == "topk" else 1)
    if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in sizes):
        raise ValueError(
            f"{where}: {directory}/cfg.json must give d_in and d_sae (d_out for a transcoder, k for topk) as positive "
            "ints"
        )
    writes = None
    if transcoder:  # it reads a hook of a layer before that layer's MLP output, and writes that output
        writes, wrote = SITES["mlp_out"].format(i=site[1]), metadata.get("hook_name_out", cfg.get("hook_name_out"))
        layer_before_mlp_out = site[1] is not None and list(SITES).index(site[0]) < list(SITES).index("mlp_out")
        if not layer_before_mlp_out or wrote not in (None, writes):
            raise ValueError(
                f"{where}: a transcoder reads a hook of a layer before its hook_mlp_out and writes that hook_mlp_out; "
                f"this one reads {name!r} and writes {wrote!r}"
            )
        if cfg.get("apply_b_dec_to_input"):
            raise ValueError(f"{where}: apply_b_dec_to_input is for SAEs; a transcoder's b_dec is of its output")
    for hook, width, verb in ((name, d_in, "reads"), (writes, d_out, "writes")):
        if hook in config.capture_specs and config.width(hook) != width:
            raise ValueError(
                f"{where}: the SAE {verb} rows of {width} at {hook}, but its rows are {config.width(hook)} wide"
            )
    for field in ("sae_top_k", "sae_chosen_features"):
        if getattr(config, field) > d_sae:
            raise ValueError(f"{field}: {getattr(config, field)} is more than the {d_sae} features of {where}")
    shapes = {"W_enc": [d_in, d_sae], "W_dec": [d_sae, d_out], "b_enc": [d_sae], "b_dec": [d_out], "threshold": [d_sae]}
    path = os.path.join(directory, "sae_weights.safetensors")
    try:
        import safetensors  # (vLLM brings it)

        with safetensors.safe_open(path, framework="pt") as weights:
            found = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    except Exception as error:  # a missing or damaged file: safetensors' own error types differ by version
        raise ValueError(f"{where}: {path} is not a readable safetensors file ({error})") from None
    for key in SAE_WEIGHTS[architecture]:
        if found.get(key) != shapes[key]:
            raise ValueError(
                f"{where}: {path} must hold {key} of shape {shapes[key]} (d_in {d_in}, d_sae {d_sae}, d_out {d_out}), "
                f"found {found.get(key, 'none')}"
            )
    apply_b_dec = bool(cfg.get("apply_b_dec_to_input", not transcoder))
    return SAESpec(directory, architecture, d_in, d_sae, apply_b_dec, k, writes, d_out)


class _SAE(_EditTables):
    """A hook's SAE (or transcoder) on its worker's device, its weights in the capture dtype: each forward's top
    features (kept as the hook keeps its rows: the first forward after an open wins) and the tables of feature
    edits, rows picked by the features' own lane of the flavour's row_index: the features edited, int64 [..,
    _FEATURE_EDITS], and each one's new activation as old * scale + bias."""

    def __init__(self, hook: _Hook, state: _HookState, lane: int):
        import safetensors  # (vLLM brings it)

        config, device, dtype = state.config, state.device, state.config.dtype
        self.spec, self.hook = config.sae(hook.name), hook
        path = os.path.join(self.spec.directory, "sae_weights.safetensors")
        with safetensors.safe_open(path, framework="pt", device=str(device)) as file:
            weights = {name: file.get_tensor(name).to(dtype) for name in SAE_WEIGHTS[self.spec.architecture]}
        self.W_enc, self.W_dec, self.b_enc, self.b_dec = (weights[n] for n in ("W_enc", "W_dec", "b_enc", "b_dec"))
        self.threshold = weights.get("threshold")
        rows = config.max_num_batched_tokens
        self.pending = None  # a transcoder's change of the hook it writes, [rows, d_out], until that hook runs
        if self.spec.writes is not None:
            self.pending = torch.zeros(rows, self.spec.d_out, dtype=dtype, device=device)
            state.placed[self.spec.writes].transcoder = self
        self.indices = torch.zeros(rows, config.sae_top_k, dtype=torch.int32, device=device)
        self.values = torch.zeros(rows, config.sae_top_k, dtype=dtype, device=device)
        shape = (*filter(None, (state.table_rows,)), _FEATURE_EDITS)
        self.features = torch.zeros(shape, dtype=torch.int64, device=device)
        self.scale = torch.ones(shape, dtype=dtype, device=device)
        self.bias = torch.zeros(shape, dtype=dtype, device=device)
        self.tables, self.identity = (self.features, self.scale, self.bias), (0, 1, 0)
        self.row_index, self.state = state.row_index(lane), state
        self.chosen = None  # with sae_chosen_features: the features each request reads densely, by its own lane
        if config.sae_chosen_features:
            width = (rows, config.sae_chosen_features)
            self.chosen = _ChosenFeatures(torch.zeros(state.table_rows, width[1], dtype=torch.int64, device=device))
            self.chosen_values = torch.zeros(width, dtype=dtype, device=device)
            self.chosen_index = state.row_index(state.lanes.index(hook.name + SAE_FEATURES + ".chosen"))

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """SAELens's ``encode`` of rows [n, d_in]: their feature activations, [n, d_sae] in the capture dtype."""
        x = rows.to(self.W_enc.dtype)
        if self.spec.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.threshold is not None:  # (jumprelu, and its transcoders)
            return pre.relu() * (pre > self.threshold)
        if self.spec.architecture == "topk":
            values, indices = pre.topk(self.spec.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, indices, values.relu())
        return pre.relu()

    def change(self, rows: torch.Tensor) -> torch.Tensor:
        """Keep the top features of rows ([n, d_in], the hook's edited rows) and return what the feature edits add
        to the rows it writes, the sum over edited f of (new_f - old_f) * W_dec[f]: [n, d_out], rows' dtype; exact
        zeros unedited."""
        activations, num_rows = self.encode(rows), rows.shape[0]
        values, indices = activations.topk(self.values.shape[1], dim=-1)
        closed = self.hook.flag.bool()  # (the hook's keep closes it after this)
        kept = [(self.values, values), (self.indices, indices.to(torch.int32))]
        if self.chosen is not None:
            (chosen,) = _rows_of_tables(self.chosen.tables, self.chosen_index, num_rows)
            kept.append((self.chosen_values, activations.gather(1, chosen)))
        for buffer, new in kept:
            buffer.narrow(0, 0, num_rows).copy_(torch.where(closed, buffer.narrow(0, 0, num_rows), new))
        features, scale, bias = _rows_of_tables((self.features, self.scale, self.bias), self.row_index, num_rows)
        features, scale, bias = (t.expand(num_rows, _FEATURE_EDITS) for t in (features, scale, bias))
        old = activations.gather(1, features)
        change = old * scale + bias - old
        bag = torch.nn.functional.embedding_bag(features, self.W_dec, per_sample_weights=change, mode="sum")
        return bag.to(rows.dtype)


class _ChosenFeatures(_EditTables):
    """An SAE's table of the features each batched request reads densely: int64 [table_rows, sae_chosen_features], a
    request's slot row holding its choice (padded with feature 0); no engine-wide choice."""

    def __init__(self, table: torch.Tensor):
        self.tables = (table,)


def _lists_features(features: Any, least: int, most: int, d_sae: int) -> bool:
    """Whether ``features`` is a list of ``least`` to ``most`` distinct feature indices (ints) in [0, d_sae)."""
    return (
        isinstance(features, (list, tuple))
        and least <= len(features) <= most
        and all(_int_at_least(f, 0) and f < d_sae for f in features)
        and len(set(features)) == len(features)
    )


def _parse_feature_edit(
    edit: Any, name: str, config: CaptureConfig
) -> tuple[tuple[torch.Tensor, ...], list[int] | None]:
    """A feature edit, ``{"op", "features": [f, ...], "value": a number or one per feature, "positions"}``, as table
    rows: the features (int64), and each one's new activation as old * scale + bias (float64), each
    [_FEATURE_EDITS], padded with feature 0 left as it is."""
    _check_edit_keys(edit, name, {"op", "features", "value", "positions"})
    d_sae, features = config.sae(name.removesuffix(SAE_FEATURES)).d_sae, edit.get("features")
    if not _lists_features(features, 1, _FEATURE_EDITS, d_sae):
        raise ValueError(
            f"edits[{name!r}]: 'features' must list 1 to {_FEATURE_EDITS} distinct feature indices in [0, {d_sae}) "
            f"(d_sae), got {features!r:.200}"
        )
    valid = f"a finite number or a list of {len(features)}, one per feature"
    keeps, adds = _scale_and_bias(edit, name, [(len(features),)], valid)
    rows = _identity_rows(name, _FEATURE_EDITS)
    rows[0][: len(features)] = torch.tensor(features)
    rows[1][: len(features)], rows[2][: len(features)] = keeps, adds
    return rows, _edit_positions(edit, name)


# ---------------------------------------------------------------------------
# Flavours: what differs between the one-prompt and the batched hooks, behind _HookState's interface. The hooks
# above run in every forward; what depends on which requests are in a step happens on the host, outside any graph,
# so both flavours run under torch.compile and CUDA graphs as they run eagerly.
# ---------------------------------------------------------------------------


class _OnePrompt(_HookState):
    """``open_capture`` arms the hooks; the next forward's rows stay until the next open.
    Edit tables are [width], or, with edits by position, [max_rows + 1, width] indexed by
    token position (the last row serves every position past max_rows)."""

    name = "one-prompt"

    def __init__(self, *args: Any):
        super().__init__(*args)
        # Token positions of the forward in flight, copied from the runner's before it (a hook on the model would
        # miss the models vLLM compiles whole, whose __call__ skips hooks).
        rows, by_position = self.config.max_num_batched_tokens, self.config.enable_position_interventions
        self.positions = torch.zeros(rows, dtype=torch.int64, device=self.device) if by_position else None
        self.table_rows = _global_rows(self.config) if by_position else None
        # The rows the first forward since open_capture wrote: None before any open_capture, 0 until that forward;
        # the requests that forward ran, and how many requests started after it (a read says its rows are theirs).
        self.forward_rows: int | None = None
        self.armed_requests: list[str] = []
        self.later_requests = 0

    def row_index(self, _hook_index: int) -> torch.Tensor | None:
        return self.positions

    def open_capture(self) -> None:
        self.capture_flags.zero_()
        self.forward_rows = 0

    # The steps _wrap_steps calls: the rows of the captured forward, and the positions of each.
    def schedule(self, step: _Step) -> None:
        if self.forward_rows == 0:
            self.forward_rows = step.num_tokens
            self.armed_requests = [request.request_id for request in step.new] + list(step.cached_request_ids)
            self.later_requests = 0
        elif self.forward_rows:
            self.later_requests += sum(request.request_id not in self.armed_requests for request in step.new)

    def prepared(self) -> None:
        if self.positions is None:
            return
        given = _step_positions(self.runner)
        rows = min(given.shape[0], self.positions.shape[0])
        self.positions.narrow(0, 0, rows).copy_(given.narrow(0, 0, rows))

    def executed(self) -> None:
        """(The rows stay in the buffers until read.)"""

    def finish(self) -> None:
        """(Nothing held per step.)"""

    def read_captures(self, num_rows: int) -> dict[str, Any]:
        """``{"shards", "rows": {name: encoded [num_rows, *row shape]}}`` of the armed forward (see sources), an
        attention hook's rows as the matrices they rebuild (see _attention_rows)."""
        limit = self.config.max_num_batched_tokens
        if not _int_at_least(num_rows, 1) or num_rows > limit:
            raise ValueError(
                f"read_captures: num_rows must be an int in [1, {limit}] (the capture buffer), got {num_rows!r}; "
                "a longer prompt is split by chunked prefill and only its first chunk is kept"
            )
        if self.forward_rows is None:
            raise RuntimeError("read_captures: nothing captured yet: call open_capture, then generate, then read")
        still_open = [n for n, flag in zip(self.hook_names, self.capture_flags.tolist()) if flag == 0]
        if not self.forward_rows:
            raise RuntimeError("read_captures: no forward ran since open_capture")
        if still_open:
            raise RuntimeError(f"read_captures: no forward ran since open_capture for hooks {still_open}")
        many = "; for many prompts, configure(..., enable_batching=True) keeps each request's rows (read_batched)"
        if len(self.armed_requests) > 1:
            raise RuntimeError(
                f"read_captures: the forward after open_capture ran {len(self.armed_requests)} requests at once, "
                "their rows one after another: the one-prompt flavour keeps one prompt's rows, so give generate "
                f"one prompt after each open_capture{many}"
            )
        if self.later_requests:
            raise RuntimeError(
                f"read_captures: the rows held are those of the forward open_capture armed, and {self.later_requests} "
                "requests started after it (a later generate, or another prompt of the same one): call open_capture "
                f"right before the generate whose rows you want, one prompt each{many}"
            )
        if num_rows > self.forward_rows:
            raise ValueError(
                f"read_captures: the forward after open_capture wrote {self.forward_rows} rows (one per token it "
                f"ran), so {num_rows} would include rows it never wrote; read at most {self.forward_rows}"
            )
        rows = {name: buffer[:num_rows].view(num_rows, *shape) for name, buffer, shape in self.sources}
        for name, facts in self.attention().items():  # rebuilt here, on the device
            rows[name] = _attention_rows(name, rows[name][None], facts, None)[0]
        return {"shards": self.shards(), "rows": {name: encode_tensor(r) for name, r in rows.items()}}


# ---------------------------------------------------------------------------
# The batched flavour's records: what a step reads of its requests (_StepRequests, _RequestTable, _StepLayout), what a
# running request is and keeps (_RunningRequest, _RowChunk, _RequestRows), and what a finished one hands its sink
# (SinkRequest, the one record of this flavour that code outside this module reads). A decode step reads hundreds of
# requests, so a step's view of them is int64 arrays, not a Python object per request.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _StepRequests:
    """A step's requests in row order and what the request table holds for each: int64 [num_requests] arrays of
    entries, kept_first and kept_last; the indices of those keeping a list of positions (kept_first -1) and of those
    with edits; the last position any of them keeps (-1 for none). Valid while the table's version is."""

    request_ids: list[str]
    version: int
    entries: np.ndarray
    kept_first: np.ndarray
    kept_last: np.ndarray
    listed: np.ndarray
    edited: np.ndarray
    last_kept: int


class _RequestTable:
    """What every step reads of its requests, as int64 arrays with an entry per running request, so that a step
    reads and updates them in a few array operations: kept_first and kept_last (_RequestOptions.kept_range),
    next_position (that of its next row) and has_edits."""

    _COLUMNS = ("kept_first", "kept_last", "next_position", "has_edits")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # request id -> its entry
        self.free: list[int] = []
        for column in self._COLUMNS:
            setattr(self, column, np.zeros(0, dtype=np.int64))
        self.version = 0  # changes with every add and remove
        self.last_step: _StepRequests | None = None  # of_step's last answer

    def add(self, request_id: str, kept_range: tuple[int, int], has_edits: bool) -> int:
        """The request's entry, made on its first call; kept_range and has_edits written on every call."""
        entry = self.index.get(request_id)
        if entry is None:
            if not self.free:
                size = len(self.kept_first)
                for column in self._COLUMNS:
                    setattr(self, column, np.concatenate([getattr(self, column), np.zeros(max(size, 64), np.int64)]))
                self.free = list(range(len(self.kept_first) - 1, size - 1, -1))
            entry = self.index[request_id] = self.free.pop()
            self.next_position[entry] = 0
        self.kept_first[entry], self.kept_last[entry] = kept_range
        self.has_edits[entry] = has_edits
        self.version += 1
        return entry

    def remove(self, request_id: str) -> None:
        entry = self.index.pop(request_id, None)
        if entry is not None:
            self.free.append(entry)
            self.version += 1

    def entries(self, request_ids: list[str], default: tuple[int, int]) -> np.ndarray:
        """int64 [len(request_ids)]: each request's entry. One never added (running since before the hooks' first
        step) gets one keeping the ``default`` range, a request's without options."""
        entries = np.fromiter(map(self.index.get, request_ids, itertools.repeat(-1)), np.int64, len(request_ids))
        for i in np.flatnonzero(entries < 0):
            entries[i] = self.add(request_ids[i], default, False)
        return entries

    def of_step(self, request_ids: list[str], default: tuple[int, int]) -> _StepRequests:
        """A step's requests, in its row order, with their numbers here (entries as ``entries`` makes them). A decode
        step usually runs the requests the last one ran, in that order, with the table unchanged: then it is the last
        answer again, and a step's host work is a few array operations whatever its number of requests."""
        last = self.last_step
        if last is not None and last.version == self.version and last.request_ids == request_ids:
            return last
        entries = self.entries(request_ids, default)
        first, last = self.kept_first[entries], self.kept_last[entries]
        self.last_step = _StepRequests(
            request_ids, self.version, entries, first, last, np.flatnonzero(first < 0),
            np.flatnonzero(self.has_edits[entries]), int(np.max(last, initial=-1, where=first <= last)),
        )
        return self.last_step


@dataclasses.dataclass
class _StepLayout:
    """The rows of one forward: request i of ``requests`` owns rows starts[i]:starts[i + 1], the first of them at
    token position first_positions[i]."""

    starts: np.ndarray  # int64 [num_requests + 1]
    first_positions: np.ndarray  # int64 [num_requests]
    requests: _StepRequests
    counts: np.ndarray = dataclasses.field(init=False)  # int64 [num_requests], rows each request runs
    row_positions: np.ndarray = dataclasses.field(init=False)  # int64 [num_rows], each row's position
    one_row_each: bool = dataclasses.field(init=False)  # (a decode step): row i is request i's
    # A decode step past every row its requests keep (each decode step of requests keeping prompt rows): no row kept.
    keeps_no_row: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.diff(self.starts)
        self.one_row_each = bool((self.counts == 1).all())
        self.keeps_no_row = self.one_row_each and self.first_positions.min() > self.requests.last_kept
        if self.one_row_each:
            self.row_positions = self.first_positions
        else:
            offsets = self.first_positions - self.starts[:-1]  # position minus row, per request
            self.row_positions = np.repeat(offsets, self.counts) + np.arange(self.starts[-1])

    @property
    def request_ids(self) -> list[str]:
        return self.requests.request_ids

    @property
    def entries(self) -> np.ndarray:
        return self.requests.entries


@dataclasses.dataclass(frozen=True)
class _RunningRequest:
    """A request from its first step to its end: its options, its prompt, and its arrival: how many requests this
    worker scheduled before it first ran (the order requests were given, as vLLM schedules them first come, first
    served)."""

    options: _RequestOptions
    prompt_len: int
    prompt_token_ids: list[int] | None  # None for prompt embeddings
    arrival: int


@dataclasses.dataclass(eq=False, slots=True)  # (compared by identity: positions is an array; never changed once made)
class _RowChunk:
    """A request's rows of one step: rows [start:end] of that step's host rows by hook, sliced only when read."""

    step_rows: dict[str, torch.Tensor]
    start: int
    end: int
    positions: np.ndarray  # int64 [end - start]: each row's token position
    file: _RowFile | None  # the row file holding step_rows, where they are in one


@dataclasses.dataclass
class _RequestRows:
    """What one request kept so far: a chunk per step that kept rows."""

    columns: dict[str, int]  # the request's (see _RequestOptions)
    request: _RunningRequest | None = None  # None for one running since before the hooks' first step
    chunks: list[_RowChunk] = dataclasses.field(default_factory=list)

    def asked(self) -> list[int] | None:
        """The indices of the rows a read hands over, where the request kept more (see _RequestOptions.asked)."""
        if self.request is None:
            return None
        return self.request.options.asked(lambda: self.positions, self.request.prompt_len)

    def missing(self) -> list[int]:
        """The positions the request's capture listed that it holds no row of (its sequence ended before them)."""
        if self.request is None or not isinstance(self.request.options.capture, np.ndarray):
            return []
        return np.setdiff1d(self.request.options.capture, self.positions).tolist()

    def rows(self, name: str) -> list[torch.Tensor]:
        return [chunk.step_rows[name][chunk.start : chunk.end] for chunk in self.chunks]

    @property
    def positions(self) -> np.ndarray:
        """int64 [rows]: the token position of each row kept."""
        return np.concatenate([c.positions for c in self.chunks]) if self.chunks else np.zeros(0, np.int64)

    @property
    def files(self) -> list[_RowFile | None]:
        return [chunk.file for chunk in self.chunks]


def _sink_writer(name: str) -> Any:
    """The sink writer class a config names (``"module:Class"``, see CaptureConfig.sink_writer), imported by that
    name: this module knows none of its own. Its interface: ``check(config)``, in configure, refuses a sink_dir it
    cannot write to; ``Class(state, worker)`` in each batched worker, given this flavour (the interface _Batched
    declares for it: take_finished's SinkRequest records and the rest) and vLLM's worker; there ``write(request_ids,
    at_shutdown=False)`` each step, with the requests vLLM reported finished, ``flush()`` (its status, or None where
    the rank writes nothing), ``status()`` and ``close()``; ``dataset(directory)``, what flush_sink returns. ValueError
    naming the writer where it cannot be imported."""
    module_name, _, class_name = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        companion = " (the companion file tl_vllm_hooks_tools.py, from the project, beside this one)"
        raise ValueError(
            f"sink_writer {name!r} cannot be imported ({error}): a sink_dir is written by it"
            + (companion if module_name == "tl_vllm_hooks_tools" else "")
        ) from None


@dataclasses.dataclass(frozen=True)
class SinkRequest:
    """A finished request as the batched flavour's sink interface hands it over (_Batched.take_finished), once.

    request_id: the worker's (vLLM's) id. prompt_token_ids: None for prompt embeddings, or a request the hooks never
    saw start. arrival: how many requests this worker scheduled before it first ran (None where the hooks never saw
    it start).
    positions: int64 [rows], each kept row's token position in order; None where it keeps none, or was one of vLLM's
    warm-up requests.
    rows: for each of sink_sources(), the request's rows step by step, CPU tensors [step's rows, *row shape] (or
    [step's rows, columns[name]]) whose rows add up to len(positions); whole once take_finished's event has passed.
    columns: the first columns of a source the request keeps, where fewer (see request_args' top_k and features).
    error: why it has no rows, else None.
    files: the row files its rows are in: give them back with release() once they are written.
    """

    request_id: str
    prompt_token_ids: list[int] | None
    arrival: int | None
    positions: np.ndarray | None
    rows: dict[str, list[torch.Tensor]]
    columns: dict[str, int]
    error: str | None
    files: list[_RowFile | None]


# ---------------------------------------------------------------------------
# The batched flavour's steps. Every step, decode steps of hundreds of requests included, runs this on the host between
# forwards, so a step's work is array operations over its requests, cached while its requests are the last step's
# (_RequestTable, _EditPlan), and Python per request only where one starts, ends or keeps rows.
# ---------------------------------------------------------------------------


class _Batched(_HookState):
    """Many requests per generate. Before each forward the host writes which edit-table row each token row uses
    (``row_edit_index``); after it, the rows each request keeps are gathered on the device and copied to host memory
    (on CUDA on a side stream, so the next forward overlaps the copy), per request. Edit tables: the engine-wide
    rows (always 2-D), one identity row, then ``max_num_seqs`` slots that requests with edits hold."""

    name = "batched"

    def __init__(self, *args: Any):
        super().__init__(*args)
        # Row r of the forward in flight uses row row_edit_index[k, r] of hook k's tables.
        rows = self.config.max_num_batched_tokens
        self.row_edit_index = torch.zeros(len(self.lanes), rows, dtype=torch.int64, device=self.device)
        self.row_edit_index_dirty = False
        self.table_rows = _global_rows(self.config) + 1 + self.max_num_seqs
        self.slots: dict[str, int] = {}  # request id -> slot holding its edits
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self.edit_plan: _EditPlan | None = None  # of the last step whose requests had edits
        self.running: dict[str, _RunningRequest] = {}
        self.arrivals = itertools.count()  # see _RunningRequest.arrival
        self.unread_said = 0  # unread requests when _say_unread last warned
        self.request_table = _RequestTable()
        self.scheduled: _Step | None = None  # the step being prepared
        self.step: _StepLayout | None = None  # of the step whose forward is in flight
        self.records: dict[str, _RequestRows] = {}
        # The ids of the requests read_batched handed over, the last _READ_KEPT, each as vLLM's and as the user's
        # (without vLLM's suffix), so that a second read of one says so.
        self.read_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.incomplete: dict[str, str] = {}  # request id -> why its rows cannot be read
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.shared = _SharedRows(self.copy_stream is not None, self._wait_for_copies)
        # The config's logit lens on this rank's hooks: each kept row's top k logits, float32 and int64 [rows, k],
        # written as the step's kept rows go to host memory (_rows_to_host).
        lens = {name: k for name, k in self.config.logit_lens.items() if name in self.placed}
        if lens and self.readout[0] is None:
            raise ValueError(
                f"logit_lens: {sorted(lens)} run on a pipeline stage without the model's final norm and unembedding; "
                "read those rows and unembed them, or run one pipeline stage"
            )
        for name, k in lens.items():
            if k > self.hf_config.vocab_size:
                raise ValueError(f"logit_lens[{name!r}]: k {k} is more than the {self.hf_config.vocab_size} logits")
        self.logit_buffers = {
            name: (torch.zeros(rows, k, dtype=torch.float32, device=self.device),
                   torch.zeros(rows, k, dtype=torch.int64, device=self.device))
            for name, k in lens.items()
        }
        self.warmed_up = False  # Model Runner V2's warm-up requests (_warmup_{i}_) are never read

    def row_index(self, hook_index: int) -> torch.Tensor:
        return self.row_edit_index[hook_index]

    def attach(self, worker: Any) -> None:
        super().attach(worker)
        if self.config.sink_dir is not None:
            self.sink = _sink_writer(self.config.sink_writer)(self, worker)
        self.shared.begin(sum(self._region_sizes(self.config.max_num_batched_tokens)))  # the largest step

    def forget_warm_up(self) -> None:
        super().forget_warm_up()
        self.warmed_up = True
        self.running.clear()
        self.request_table = _RequestTable()
        self.slots.clear()
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self.edit_plan = None
        self.reset_batched()

    def close(self) -> None:
        super().close()
        if self.sink is not None:
            # The requests vLLM had not reported finished (a shutdown right after a request's last token, before the
            # step that would report it, or one that cuts requests short): their rows as held, each entry saying so.
            self.sink.write(self.held_request_ids(), at_shutdown=True)
            self.sink.close()
        self._wait_for_copies()
        self.shared.close()

    def reset_batched(self) -> None:
        """Drop every row not yet read, and the row files nothing maps (one is made ahead again, empty)."""
        self._wait_for_copies()
        for record in self.records.values():
            self.release(record.files)
        self.records.clear()
        self.incomplete.clear()
        self.unread_said = 0
        self.shared.trim()

    def _wait_for_copies(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # the copies to host still in flight

    def _copies_queued(self) -> Any:
        """A CUDA event that completes once the copies to host queued so far are done (None on the CPU, where each
        step's rows are in host memory when the step ends): a thread that waits on it leaves the steps running."""
        return None if self.copy_stream is None else self.copy_stream.record_event()

    @property
    def unread_requests(self) -> int:
        return len(self.records)

    def _say_unread(self) -> None:
        """Warn (the first rank, in its log) that requests started while earlier ones' rows wait unread: at the first
        such start, then each time their number doubles. Rows no read takes stay in host memory until reset_batched,
        and a request without options keeps every one of its rows."""
        if len(self.records) < 2 * self.unread_said or self.ranks.tensor_rank or self.ranks.stage:
            return
        self.unread_said = len(self.records)
        rows = sum(chunk.end - chunk.start for record in self.records.values() for chunk in record.chunks)
        row_bytes = sum(source.buffer[0].nbytes for source in self.sources)
        logger.warning(
            "tl_vllm_hooks: %d requests that finished earlier hold %.1f MiB of rows that no read took (status(llm)'s "
            "unread_requests): read them with read_batched(llm, ids), or free them with reset_batched(llm); a request "
            "without options keeps every row, request_args(config, capture='none') none",
            len(self.records), rows * row_bytes / 2**20,
        )

    # The sink's interface, all a sink (tl_vllm_hooks_tools.RankSink) reads of this flavour: config, writer_name,
    # sink_sources(), shards(), take_finished (SinkRequest records), held_request_ids and release.

    @property
    def writer_name(self) -> str:
        """This rank's name among a sink's writers: ``pp{pipeline stage}-tp{tensor-parallel rank}``."""
        return f"pp{self.ranks.stage}-tp{self.ranks.tensor_rank}"

    def sink_sources(self) -> dict[str, tuple[int, ...]]:
        """{source name: row shape} of what this rank hands over (see sent_sources), in order."""
        return {source.name: tuple(source.row_shape) for source in self.sent_sources}

    def take_finished(self, request_ids: list[str]) -> tuple[list[SinkRequest], Any]:
        """These finished requests, each handed over once (its rows forgotten here), and a CUDA event by which the
        copies of their rows to host memory are done (None on the CPU)."""
        copied = self._copies_queued() if request_ids else None
        finished = []
        for request_id in request_ids:
            error, record = self.incomplete.pop(request_id, None), self.records.pop(request_id, None)
            request = self.running.get(request_id)
            prompt = None if request is None or request.prompt_token_ids is None else list(request.prompt_token_ids)
            files = record.files if record is not None else []
            if not self.warmed_up:
                record = error = None
            arrival = None if request is None else request.arrival
            kept = record is not None and error is None
            rows = {source.name: record.rows(source.name) for source in self.sent_sources} if kept else {}
            positions, columns = (record.positions, record.columns) if kept else (None, {})
            finished.append(SinkRequest(request_id, prompt, arrival, positions, rows, columns, error, files))
        return finished, copied

    def held_request_ids(self) -> list[str]:
        """Every request whose rows (or why it has none) are held here, not yet read or handed over."""
        return sorted(set(self.records) | set(self.incomplete))

    def release(self, files: list[_RowFile | None]) -> None:
        """Give back row files whose rows are written: later steps may fill them again."""
        for file in files:
            self.shared.drop(file)

    # Steps, in the order _wrap_steps calls them.

    def schedule(self, step: _Step) -> None:
        """Read the step's new requests' options; the step's first positions are read once it is prepared."""
        if self.sink is not None:
            self.sink.write(step.finished)
        for request_id in step.finished:
            self.running.pop(request_id, None)
            self.request_table.remove(request_id)
            slot = self.slots.pop(request_id, None)
            if slot is not None:
                self.free_slots.append(slot)
        if step.new and not self.running and self.records:
            self._say_unread()
        for request_id, prompt_len, prompt_token_ids, extra_args, _first_position in step.new:
            options, problem = _worker_options(extra_args, self)
            if problem is not None:
                self.incomplete[request_id] = problem
            earlier = self.running.get(request_id)  # (a request resumed after preemption keeps its arrival)
            arrival = earlier.arrival if earlier is not None else next(self.arrivals)
            self.running[request_id] = _RunningRequest(options, prompt_len, prompt_token_ids, arrival)
            self.request_table.add(request_id, options.kept_range(prompt_len), bool(options.slot_tables))
            if options.keeps_any(0, _NO_LAST_POSITION, prompt_len):
                self.records.setdefault(request_id, self._record(self.running[request_id]))  # read_batched knows it now
        self.scheduled = step

    def prepared(self) -> None:
        """After the step is prepared, before its forward: route each row to its edit."""
        if self.scheduled is None:  # preparation outside execute_model
            return
        starts, request_ids = _step_segments(self.runner)
        if not request_ids:
            return
        first = self.scheduled.first_positions(request_ids)
        if first.min() < 0:
            # Every request of a step is in its scheduler output; if one is not, its rows cannot be placed: say so
            # when read rather than guess.
            for i in np.flatnonzero(first < 0):
                self.incomplete[request_ids[i]] = "a step ran it without its scheduler output entry"
            return
        default = _default_options(self.prefix_caching).kept_range(0)
        self.step = _StepLayout(starts, first, self.request_table.of_step(request_ids, default))
        if not self.step.keeps_no_row:
            self.capture_flags.zero_()  # this step's forward writes its rows (else they stay as they were, unread)
        row_positions, global_rows = self.step.row_positions, _global_rows(self.config)
        edited = self.step.requests.edited
        if global_rows == 1 and not edited.size:
            # Every row uses the engine-wide row 0: write the index only if a request's edit changed it since.
            if self.row_edit_index_dirty:
                self.row_edit_index.zero_()
                self.row_edit_index_dirty = False
            return
        self.row_edit_index_dirty = True
        plan = self._edit_plan(self.step.requests)
        index = np.minimum(row_positions, global_rows - 1)[None, :].repeat(len(self.lanes), 0)
        if self.step.one_row_each:  # (row i is request i's)
            rows, owner = edited, np.arange(edited.size)
        else:
            counts = self.step.counts[edited]
            owner = np.repeat(np.arange(edited.size), counts)
            rows = np.repeat(starts[edited] - (np.cumsum(counts) - counts), counts) + np.arange(owner.size)
        every = plan.every[owner]  # [edited rows, lanes]: the lane's edit at every position
        for k in np.flatnonzero(every.any(axis=0)):
            index[k, rows[every[:, k]]] = plan.slot_rows[owner[every[:, k]]]
        for i, k, positions in plan.listed:  # (lanes edited at a list of positions)
            request_rows = slice(starts[edited[i]], starts[edited[i] + 1])
            hit = np.isin(row_positions[request_rows], positions)
            index[k, request_rows] = np.where(hit, plan.slot_rows[i], global_rows)  # else the identity row
        _copy_to_device(index, self.row_edit_index[:, : starts[-1]])

    def _edit_plan(self, requests: _StepRequests) -> _EditPlan:
        """The edit-table rows of a step's requests with edits (requests.edited), each in the slot holding them
        (new ones written there with one copy a table, see _SlotWrites), and which lanes each edits: the last plan
        again while the step's requests are the last step's (a decode step's usually), so that a step's host work
        is a few array operations whatever its number of edited requests."""
        if self.edit_plan is not None and self.edit_plan.requests is requests:
            return self.edit_plan
        first_slot_row = _global_rows(self.config) + 1  # past the engine-wide rows and identity
        writes, in_step = _SlotWrites(), None
        slot_rows = np.empty(requests.edited.size, dtype=np.int64)
        every = np.zeros((requests.edited.size, len(self.lanes)), dtype=bool)
        listed = []
        for n, i in enumerate(requests.edited.tolist()):
            request_id = requests.request_ids[i]
            edits = self.running[request_id].options.slot_tables
            slot = self.slots.get(request_id)
            if slot is None:
                if not self.free_slots:
                    # A step holds at most max_num_seqs requests, so some slot belongs to a request outside this
                    # step (preempted, or finished without vLLM saying so yet).
                    in_step = in_step or set(requests.request_ids)
                    holder = next(r for r in self.slots if r not in in_step)
                    self.free_slots.append(self.slots.pop(holder))
                slot = self.slots[request_id] = self.free_slots.pop()
                for name, (rows, _positions) in edits.items():
                    if name in self.targets:  # (else on another pipeline stage)
                        writes.add(first_slot_row + slot, self.targets[name].slot_writes(rows))
            slot_rows[n] = first_slot_row + slot
            for k, name in enumerate(self.lanes):
                if name in edits and edits[name][1] is None:
                    every[n, k] = True
                elif name in edits:
                    listed.append((n, k, edits[name][1]))
        writes.write()
        self.edit_plan = _EditPlan(requests, slot_rows, every, listed)
        return self.edit_plan

    def executed(self) -> None:
        """After the forward: the kept rows to host memory, per request, with numpy over the
        step's rows and Python only for requests that kept rows or did not follow on."""
        step = self.step
        if step is None:
            return
        next_position, first = self.request_table.next_position, step.first_positions
        expected = next_position[step.entries]
        if step.keeps_no_row:  # their positions move on, and nothing else happens unless one did not follow on
            next_position[step.entries] = first + 1
            for i in np.flatnonzero(first != expected).tolist():
                self._did_not_follow_on(step.request_ids[i], int(expected[i]), int(first[i]))
            return
        kept = self._kept_rows(step)
        kept_rows = np.flatnonzero(kept)
        file, host_rows = self._rows_to_host(kept_rows) if kept_rows.size else (None, {})
        if step.one_row_each:  # row i is request i's: no sums over segments
            kept_per_request = kept.astype(np.int64)
            next_position[step.entries] = first + 1
            noted = np.flatnonzero(kept | (first != expected))
        else:
            running = step.counts > 0  # (reduceat would read one row for an empty segment)
            kept_per_request = np.zeros(len(step.counts), dtype=np.int64)
            if running.any():
                kept_per_request[running] = np.add.reduceat(kept.astype(np.int64), step.starts[:-1][running])
            next_position[step.entries[running]] = (first + step.counts)[running]
            noted = np.flatnonzero(running & ((kept_per_request > 0) | (first != expected)))
        if not noted.size:
            return
        # Per request noted (each one of a decode step keeping every row), as Python numbers: its kept rows are
        # kept_rows[start:start + count], whose positions are a view of the step's; the file is held once a chunk.
        offsets = (np.cumsum(kept_per_request) - kept_per_request)[noted].tolist()
        positions, request_ids, records, appended = step.row_positions[kept_rows], step.request_ids, self.records, 0
        for i, start, count, follows_from, first_position in zip(
            noted.tolist(), offsets, kept_per_request[noted].tolist(), expected[noted].tolist(), first[noted].tolist()
        ):
            if first_position != follows_from:
                self._did_not_follow_on(request_ids[i], follows_from, first_position)
            if count:
                record = records.get(request_ids[i])
                if record is None:  # its first rows (or reset_batched dropped its record meanwhile)
                    record = records[request_ids[i]] = self._record(self.running.get(request_ids[i]))
                record.chunks.append(_RowChunk(host_rows, start, start + count, positions[start : start + count], file))
                appended += 1
        self.shared.hold(file, appended)

    def finish(self) -> None:
        self.scheduled = None
        self.step = None

    def _kept_rows(self, step: _StepLayout) -> np.ndarray:
        """Boolean mask over the step's rows: which ones their request keeps."""
        first, last, positions = step.requests.kept_first, step.requests.kept_last, step.row_positions
        if not step.one_row_each:
            first, last = np.repeat(first, step.counts), np.repeat(last, step.counts)
        kept = (positions >= first) & (positions <= last)
        for i in step.requests.listed:  # requests keeping a list of positions
            rows, request = slice(step.starts[i], step.starts[i + 1]), self.running[step.request_ids[i]]
            kept[rows] = request.options.keeps(positions[rows], request.prompt_len)
        return kept

    def _rows_to_host(self, kept_rows: np.ndarray) -> tuple[_RowFile | None, dict[str, torch.Tensor]]:
        """(their row file, {hook: [len(kept_rows), width]}): the kept rows of every hook, in one region of host
        memory. On the CPU they are gathered straight into it; on CUDA gathered on the compute stream (the next
        forward rewrites the buffers), then copied on a side stream, which only a read waits for."""
        num_rows = kept_rows.size
        sizes = self._region_sizes(num_rows)
        file, region = self.shared.region(sum(sizes))
        index = None
        if num_rows != kept_rows[-1] + 1:  # not rows 0..n-1
            index = torch.empty(num_rows, dtype=torch.int64, device=self.device)
            _copy_to_device(kept_rows, index)
        if self.logit_buffers:
            self._logit_lens(index, num_rows)
        host_rows, gathered, offset = {}, {}, 0
        for (name, buffer, _shape), size in zip(self.sources, sizes):
            host = region[offset : offset + size].view(buffer.dtype)[: num_rows * buffer.shape[1]]
            host_rows[name], offset = host.view(num_rows, buffer.shape[1]), offset + size
            if self.copy_stream is None and index is None:
                host_rows[name].copy_(buffer[:num_rows])
            elif self.copy_stream is None:
                torch.index_select(buffer, 0, index, out=host_rows[name])
            else:
                gathered[name] = buffer[:num_rows].clone() if index is None else buffer.index_select(0, index)
        if gathered:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for name, rows in gathered.items():
                    host_rows[name].copy_(rows, non_blocking=True)
                    rows.record_stream(self.copy_stream)
        return file, host_rows

    def _logit_lens(self, index: torch.Tensor | None, num_rows: int) -> None:
        """The config's logit lens of the step's kept rows (index, on the device; None: rows 0..num_rows-1): the top k
        of each one's logits (top_logits, as unembed's), into the logit buffers at those rows; a tensor-parallel rank
        the unembedding's join leaves without them writes none."""
        with torch.inference_mode():
            for name, (values, indices) in self.logit_buffers.items():
                buffer = self.placed[name].buffer
                rows = buffer[:num_rows] if index is None else buffer.index_select(0, index)
                best = self.top_logits(rows.to(self.edit_dtype), True, values.shape[1])
                if best is None:
                    continue
                if index is None:
                    values[:num_rows], indices[:num_rows] = best
                else:
                    values.index_copy_(0, index, best[0])
                    indices.index_copy_(0, index, best[1])

    def _region_sizes(self, num_rows: int) -> list[int]:
        """The bytes each source's num_rows rows take in a step's region of host memory, each 64-byte aligned."""
        return [-(-num_rows * source.buffer[0].nbytes // 64) * 64 for source in self.sources]

    def _did_not_follow_on(self, request_id: str, expected: int, first_position: int) -> None:
        """A request's rows of this step ran from first_position, not from expected, where they would have started
        had they followed on its last ones: recomputed (before) or served from the prefix cache (after)."""
        if first_position < expected:
            # Preempted and recomputed from first_position: drop what it kept past that point, so no row appears
            # twice.
            record, chunks = self.records.get(request_id, _RequestRows({})), []
            for held in record.chunks:
                keep = int(np.searchsorted(held.positions, first_position))
                if keep:
                    chunks.append(dataclasses.replace(held, end=held.start + keep, positions=held.positions[:keep]))
                else:
                    self.shared.drop(held.file)
            record.chunks = chunks
        elif first_position > expected:
            request = self.running.get(request_id)
            if request is None or request.options.keeps_any(expected, first_position, request.prompt_len):
                self.incomplete[request_id] = _skipped_rows_problem(expected, first_position)

    def _record(self, request: _RunningRequest | None) -> _RequestRows:
        """A new record of a request's rows: of its SAEs' chosen features, none unless it chose some."""
        options = request.options if request else _default_options(self.prefix_caching)
        chosen = {name: 0 for name, *_ in self.sources if name.endswith(".chosen")}
        return _RequestRows({**chosen, **options.columns}, request)

    def read_batched(self, request_ids: list[str], driver_host: str) -> dict[str, Any]:
        """``{"shards", "hooks": [[name, row shape, dtype], ...] (see sources), "attention": {name: dtype}, "files",
        "regions", "rows": {user id: message}}``, the requests' rows then freed (each id must match one captured
        request, or nothing is read). For a driver on this host, a request's message holds ``"pieces"``, where its
        rows are in the row ``files`` (tokens; see _map_row_file and _rows_in): [region, first row, rows] of the
        ``regions`` of the steps that kept them, each [file, then per source the element offset of its row 0], so a
        read of many requests of a row each costs a few numbers per request; else ``"encoded"``, {name: encoded
        rows}; ``"columns"``, where it keeps fewer features; ``"asked"``, where it kept more rows than it asked for.
        Of the sent_sources; the ``"attention"`` hooks' rows are not sent but rebuilt here (see _rebuilt_attention)
        and are the message's ``"attention"``."""
        attention = self.attention()
        reply = {"shards": self.shards(), "hooks": [], "attention": {}, "files": [], "regions": [], "rows": {}}
        if self.config.sink_dir is not None:
            raise RuntimeError(
                f"read_batched: this engine writes captured rows to its sink_dir {self.config.sink_dir}: "
                "call flush_sink(llm), which returns them as a CaptureDataset"
            )
        if not self.hook_names:  # a pipeline rank that holds none of the hooks
            return reply
        sources = [source for source in self.sent_sources if source.name not in attention]
        matches = _match_request_ids(request_ids, self.held_request_ids(), self.read_ids)
        for user_id, worker_id in matches.items():
            if worker_id in self.incomplete:
                raise RuntimeError(f"read_batched: request {user_id!r}: {self.incomplete[worker_id]}")
        self._wait_for_copies()
        reply["hooks"] = [[name, list(shape), _dtype_name(buffer.dtype)] for name, buffer, shape in sources]
        reply["attention"] = {s.name: _dtype_name(s.buffer.dtype) for s in self.sent_sources if s.name in attention}
        same_host, files, regions = driver_host == socket.gethostname(), {}, {}  # regions: id(step rows) -> index
        records = {user_id: self.records.pop(worker_id) for user_id, worker_id in matches.items()}
        for worker_id in matches.values():
            self.read_ids.update(dict.fromkeys((worker_id, user_request_id(worker_id))))
            while len(self.read_ids) > 2 * _READ_KEPT:
                self.read_ids.popitem(last=False)
        rebuilt, rebuilt_files = self._rebuilt_attention(records, attention, same_host, files)
        for user_id, record in records.items():
            message = reply["rows"][user_id] = {"columns": record.columns} if record.columns else {}
            if attention:
                message["attention"] = rebuilt[user_id]
            asked = record.asked()
            if asked is not None:
                message["asked"] = asked
            missing = record.missing()
            if missing:
                message["missing"] = missing
            if same_host and None not in record.files:
                pieces = message["pieces"] = []
                for chunk in record.chunks:
                    region = regions.get(id(chunk.step_rows))
                    if region is None:  # the step's rows: their file, and where each source's row 0 is in it
                        base, views = chunk.file.pages.data_ptr(), [chunk.step_rows[name] for name, *_ in sources]
                        region = regions[id(chunk.step_rows)] = len(reply["regions"])
                        reply["regions"].append([
                            files.setdefault(chunk.file, len(files)),
                            *((v.data_ptr() - base) // v.element_size() for v in views),
                        ])
                    pieces.append([region, chunk.start, chunk.end - chunk.start])
            else:
                encoded = message["encoded"] = {}
                num_rows = sum(chunk.end - chunk.start for chunk in record.chunks)
                for name, buffer, row_shape in sources:
                    shape, kept = [num_rows, *row_shape], record.rows(name)
                    rows = torch.cat(kept).view(shape) if kept else torch.empty(shape, dtype=buffer.dtype)
                    encoded[name] = encode_tensor(rows)
        reply["files"] = self.shared.lend(list(files))
        for record in records.values():
            self.release(record.files)
        for file in rebuilt_files:
            self.shared.drop(file)
        return reply

    def _rebuilt_attention(
        self,
        records: dict[str, _RequestRows],
        attention: dict[str, dict[str, Any]],
        same_host: bool,
        files: dict[_RowFile, int],
    ) -> tuple[dict[str, dict[str, Any]], list[_RowFile]]:
        """({user id: {name: matrices}}, the row files holding them): each attention hook's matrices of each request
        (see _attention_rows), rebuilt on this worker's device from the rows it kept, requests of the same rows and
        queries together, at most _ATTENTION_CHUNK_BYTES of float32 scores at once. For a driver on this host each
        is [file, element offset, shape] in a region of a row file (its index in ``files``, which it is added to;
        the files are held until lent, then dropped by the caller), else encoded."""
        rebuilt: dict[str, dict[str, Any]] = {user_id: {} for user_id in records}
        if not attention:
            return rebuilt, []
        alike: dict[tuple, list[str]] = {}  # (rows, the queries asked) -> the requests
        for user_id, record in records.items():
            asked = record.asked()
            num_rows = sum(chunk.end - chunk.start for chunk in record.chunks)
            alike.setdefault((num_rows, None if asked is None else tuple(asked)), []).append(user_id)
        shapes = {source.name: (source.row_shape, source.buffer.dtype) for source in self.sent_sources}
        held: list[_RowFile] = []
        with torch.inference_mode():
            for (num_rows, asked), user_ids in alike.items():
                queries = num_rows if asked is None else len(asked)
                for name, facts in attention.items():
                    (row_shape, dtype), heads = shapes[name], len(facts["chosen"] or range(facts["heads"]))
                    each = max(1, 4 * heads * queries * num_rows)  # float32 scores of one request
                    step = max(1, min(_ATTENTION_CHUNK_BYTES, _SHARED_FILE_BYTES[1] * 4 // dtype.itemsize) // each)
                    for first in range(0, len(user_ids), step):
                        chunk = user_ids[first : first + step]
                        rows = torch.empty(len(chunk), num_rows, *row_shape, dtype=dtype, device=self.device)
                        for i, user_id in enumerate(chunk):
                            at = 0
                            for kept in records[user_id].rows(name):
                                rows[i, at : at + len(kept)].copy_(kept.view(-1, *row_shape), non_blocking=True)
                                at += len(kept)
                        matrices = _attention_rows(name, rows, facts, None if asked is None else list(asked))
                        placed = same_host and self.shared.usable
                        file, pages = self.shared.region(matrices.nbytes, step=False) if placed else (None, None)
                        if file is None:
                            for user_id, one in zip(chunk, matrices.cpu()):
                                rebuilt[user_id][name] = encode_tensor(one)
                            continue
                        self.shared.hold(file)
                        held.append(file)
                        host = pages.view(dtype).view(matrices.shape)
                        host.copy_(matrices)
                        index, base = files.setdefault(file, len(files)), file.pages.data_ptr()
                        for user_id, one in zip(chunk, host):
                            rebuilt[user_id][name] = [index, (one.data_ptr() - base) // dtype.itemsize, list(one.shape)]
        return rebuilt, held

    def flush_sink(self) -> dict[str, Any] | None:
        if self.sink is None:
            raise RuntimeError("flush_sink: this engine has no sink: configure(..., sink_dir=directory)")
        status = self.sink.flush()
        return None if status is None else {**status, "sink_writer": self.config.sink_writer}


_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # what vLLM adds to a user's request id


def user_request_id(request_id: str) -> str:
    """The user's id of a worker's request id: without the ``-{8 hex}`` suffix vLLM adds (unless told not to)."""
    return _VLLM_SUFFIX.sub("", request_id)
_READ_KEPT = 1 << 16  # requests whose ids a worker keeps once read (see _Batched.read_ids)


def _match_request_ids(user_ids: list[str], worker_ids: list[str], read: dict[str, None]) -> dict[str, str]:
    """Join the user's ids to the worker's, which may carry a ``-{8 hex}`` suffix; KeyError for an id that matches
    none (saying so if it is among the ``read`` ids) or several. Messages name ids as the user gives them, vLLM's
    only where they alone tell two requests apart."""
    by_user_id: dict[str, list[str]] = {}
    for worker_id in worker_ids:
        by_user_id.setdefault(worker_id, []).append(worker_id)
        if user_request_id(worker_id) != worker_id:
            by_user_id.setdefault(user_request_id(worker_id), []).append(worker_id)
    matches = {}
    for user_id in user_ids:
        found = by_user_id.get(user_id, [])
        if not found and user_id in read:
            raise KeyError(f"read_batched: id {user_id!r}: already read: a request's rows are handed over once")
        if len(found) > 1:
            raise KeyError(
                f"read_batched: id {user_id!r} matches several captured requests, the id given again before their "
                f"rows were read: read each by vLLM's id, one of {found}"
            )
        if not found:
            unread = sorted(set(map(user_request_id, worker_ids)))
            raise KeyError(
                f"read_batched: id {user_id!r} matches no captured request; unread: {unread[:10]}"
                + (f" and {len(unread) - 10} more" if len(unread) > 10 else "")
                + " (a request with capture='none' keeps no rows, and reset_batched drops unread ones)"
            )
        matches[user_id] = found[0]
    return matches


class _EditPlan(typing.NamedTuple):
    """Where a step's requests with edits (its _StepRequests' edited, in order) find them: slot_rows, int64 [edited],
    each one's row of the edit tables; every, bool [edited, lanes], the lanes it edits at every position; listed, (its
    index among them, lane, its positions) for each lane it edits at a list of positions."""

    requests: _StepRequests
    slot_rows: np.ndarray
    every: np.ndarray
    listed: list[tuple[int, int, np.ndarray]]


class _SlotWrites:
    """A step's new slot rows, written with one index_copy_ per table from one host tensor: a copy per request and
    table would make the host wait on the stream each time (a CPU tensor not pinned), 512 waits in a step that starts
    256 requests' edits."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}  # id -> table, rows, values

    def add(self, row: int, writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for table, value in writes:
            _table, rows, values = self.tables.setdefault(id(table), (table, [], []))
            rows.append(row)
            values.append(value.expand(table.shape[1:]))

    def write(self) -> None:
        for table, rows, values in self.tables.values():
            source = torch.stack(values).to(table.dtype)
            index = torch.tensor(rows, dtype=torch.int64)
            if table.device.type == "cuda":  # queued, not waited on; pinned memory outlives the copy
                source, index = source.pin_memory(), index.pin_memory()
            table.index_copy_(0, index.to(table.device, non_blocking=True), source.to(table.device, non_blocking=True))


def _copy_to_device(array: np.ndarray, target: torch.Tensor) -> None:
    source = torch.from_numpy(array)
    if target.device.type == "cuda":
        source = source.pin_memory()  # the copy is queued; pinned memory outlives it
    target.copy_(source, non_blocking=True)


# ---------------------------------------------------------------------------
# Transport. vLLM's RPC carries msgpack values, not tensors, and this module never asks for pickle: a tensor travels
# as dtype name, shape and its raw bytes, so every dtype (bfloat16 included) round-trips bit for bit. Batched rows
# travel in row files instead, both ends of which are here (below).
# ---------------------------------------------------------------------------

_WIRE_DTYPES = CAPTURE_DTYPES + ("int64", "int32", "bool")


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype": str, "shape": list[int], "data": bytes}``, exact for every dtype."""
    tensor = tensor.detach().to("cpu").contiguous()
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "data": data}


def decode_tensor(message: dict[str, Any]) -> torch.Tensor:
    """Inverse of ``encode_tensor``: a CPU tensor of the encoded dtype and shape."""
    if not isinstance(message, dict) or set(message) != {"dtype", "shape", "data"}:
        raise ValueError(f"decode_tensor: expected keys dtype, shape, data; got {message!r:.200}")
    if message["dtype"] not in _WIRE_DTYPES:
        raise ValueError(f"decode_tensor: dtype {message['dtype']!r} is not one of {_WIRE_DTYPES}")
    dtype, shape = getattr(torch, message["dtype"]), [int(size) for size in message["shape"]]
    data = bytes(message["data"])
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"decode_tensor: {len(data)} bytes for a {message['dtype']} tensor of shape {shape}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


# Batched rows, which can be gigabytes, reach a driver on the worker's host without a copy on the way: each step's
# kept rows go from the device straight into pages of a file in /dev/shm (shared memory) that the worker keeps mapped
# (on CUDA also pinned, so that the copy runs beside the next forward); a read hands over file names and byte
# offsets, and the driver maps the files. Pages are never rewritten while a driver may map them: each read hands a
# file over under a token (``path#number``), and once no tensor holds the driver's mapping the driver creates a file
# of that name, by which the worker knows it may fill the file again. A worker removes its files when its hooks go
# (and at exit), and the next engine to install hooks removes those of processes that died. Making and pinning a file
# takes longer than a step's forward, so files are made ahead on a thread of its own, each holding the largest step
# the engine can run (every kept hook's rows at max_num_batched_tokens): the first when the hooks go in, the next once
# the file being filled has less room left than that, and one again after the idle files are removed. A step makes a
# file itself only where that step is larger than a quarter of /dev/shm's free room when the hooks went in (the most
# one file is made to hold ahead).

_SHARED_DIR = "/dev/shm"
_SHARED_PREFIX = "tl_vllm_hooks-"
_SHARED_FILE_BYTES = (16 << 20, 256 << 20)  # a worker's first row file, and the most one grows to (doubling)
_SHARED_FILE_ROUNDING = 1 << 20  # a file's bytes, a multiple of this
_shared_file_numbers = itertools.count()


def _sweep_shared_files(own: bool = False) -> None:
    """Unlink the row files of processes that are gone (and, with ``own``, this one's)."""
    for path in glob.glob(os.path.join(_SHARED_DIR, _SHARED_PREFIX + "*")):
        pid = os.path.basename(path)[len(_SHARED_PREFIX) :].partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            gone = own and int(pid) == os.getpid()
        except ProcessLookupError:
            gone = True
        except PermissionError:  # another user's, alive
            gone = False
        if gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclasses.dataclass(eq=False)
class _RowFile:
    """One row file as its worker holds it: its pages (uint8, mapped), the bytes filled, the chunks of rows in it not
    yet read (or written by a sink's writer thread), and the driver mappings of it not yet given back."""

    path: str
    pages: torch.Tensor
    used: int = 0
    held: int = 0
    lent: set[str] = dataclasses.field(default_factory=set)  # a token per read that handed the file to a driver


class _SharedRows:
    """A batched worker's row files: the one being filled, and the others until nothing holds them. Without a
    usable /dev/shm (none, or full) a step's rows go to ordinary host memory (pinned on CUDA) and reads encode them."""

    def __init__(self, pin: bool, wait: Any):
        self.pin, self.wait = pin, wait  # wait(): for the copies into pinned pages still in flight
        self.device = torch.cuda.current_device() if pin else None  # the device the pages are pinned for
        self.files: dict[str, _RowFile] = {}
        self.filling: _RowFile | None = None
        self.usable = os.path.isdir(_SHARED_DIR)
        self.created = 0  # files made so far
        self.made_in_step = 0  # of those, the files a step made itself
        self.step_bytes = 0  # the largest step a file made ahead holds (see begin)
        self.largest = 0  # the most bytes one step took
        self.maker: concurrent.futures.ThreadPoolExecutor | None = None  # makes the next file, off the steps
        self.next_file: list[concurrent.futures.Future] = []  # the file being made ahead (at most one)
        # An engine shut down without removing its hooks still leaves no file once its worker's state is collected.
        weakref.finalize(self, _remove_row_files, self.files, pin, self.next_file)

    def begin(self, step_bytes: int) -> None:
        """Make the first file ahead, for steps of up to step_bytes (the most one step's rows can take), at most a
        quarter of /dev/shm's free room."""
        if self.usable and step_bytes:
            room = os.statvfs(_SHARED_DIR)
            self.step_bytes = min(step_bytes, room.f_bavail * room.f_frsize // 4)
            self._make_ahead()

    def region(self, nbytes: int, step: bool = True) -> tuple[_RowFile | None, torch.Tensor]:
        """(its file, uint8 [nbytes]) of host memory for one step's rows (or, not ``step``, a read's attention
        matrices, which files made ahead are not sized for), 64-byte aligned."""
        if step:
            self.largest = max(self.largest, nbytes)
        file = self.filling
        if self.usable and (file is None or file.used + nbytes > file.pages.numel()):
            file = self.filling = self._refill(nbytes, step)
        if file is None:
            return None, torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        start, file.used = file.used, file.used + -(-nbytes // 64) * 64
        if file.used + self._step_room() > file.pages.numel():  # the next step may not fit
            self._make_ahead()
        return file, file.pages[start : start + nbytes]

    def _make_ahead(self) -> None:
        """Begin making the next file on the maker's thread, unless one is being made."""
        if not self.next_file:
            self.maker = self.maker or concurrent.futures.ThreadPoolExecutor(1, "tl_vllm_hooks-row-files")
            self.next_file.append(self.maker.submit(_make_row_file, self._begun_file_size(), self.device))

    def _begun_file_size(self) -> int:
        """A new file's bytes, counted as made: room for the largest step (begin's, or a larger one seen), and, while
        files are few, the next of the sizes doubling from _SHARED_FILE_BYTES' first to its most."""
        growing = min(_SHARED_FILE_BYTES[0] << self.created, _SHARED_FILE_BYTES[1])
        self.created += 1
        return max(-(-self._step_room() // _SHARED_FILE_ROUNDING) * _SHARED_FILE_ROUNDING, growing)

    def _step_room(self) -> int:
        """The bytes a file keeps free for the next step: begin's largest step, or a larger one seen."""
        return max(self.step_bytes, self.largest)

    def _refill(self, nbytes: int, step: bool) -> _RowFile | None:
        """A file with room for nbytes: an idle one emptied, else the one made ahead, else a new one made now (None
        if /dev/shm cannot hold it), counted in made_in_step for a ``step``; idle files too small for it are
        removed."""
        for file in (idle := self._idle_files()):
            if file.pages.numel() >= nbytes:
                file.used = 0
                return file
        for file in idle:
            self._remove(file)
        made_ahead = self._adopt(self.next_file.pop()) if self.next_file else None
        if made_ahead is not None and made_ahead.pages.numel() >= nbytes:
            return made_ahead
        if made_ahead is not None:
            self._remove(made_ahead)
        if not self.usable:
            return None
        self.made_in_step += step
        size = max(self._begun_file_size(), -(-nbytes // _SHARED_FILE_ROUNDING) * _SHARED_FILE_ROUNDING)
        return self._adopt(_make_row_file, size, self.device)

    def _adopt(self, make: Any, *args: Any) -> _RowFile | None:
        """The file ``make(*args)`` (or a made-ahead file's Future) gives, now held; None, and no file from now on,
        if /dev/shm could not hold it."""
        try:
            file = make.result() if isinstance(make, concurrent.futures.Future) else make(*args)
        except OSError as error:
            self.usable = False
            logger.warning("tl_vllm_hooks: %s; batched rows now reach the driver through vLLM's RPC", error)
            return None
        self.files[file.path] = file
        return file

    def status(self) -> dict[str, int]:
        """``{"files", "bytes", "created", "made_in_step"}``: the row files held now (the one made ahead among them,
        once made: this waits for it) and their size; how many were made (or begun) so far, and how many of those a
        step made itself."""
        concurrent.futures.wait(self.next_file)
        files = [*self.files.values(), *(f.result() for f in self.next_file if not f.exception())]
        return {"files": len(files), "bytes": sum(f.pages.numel() for f in files), "created": self.created,
                "made_in_step": self.made_in_step}

    def hold(self, file: _RowFile | None, chunks: int = 1) -> None:
        """``chunks`` chunks of rows in ``file`` are kept until read."""
        if file is not None:
            file.held += chunks

    def drop(self, file: _RowFile | None) -> None:
        """A chunk of rows in ``file`` is read, written or forgotten."""
        if file is not None:
            file.held -= 1

    def lend(self, files: list[_RowFile]) -> list[str]:
        """A token for each file a read hands to a driver (``path#number``), lent until a file of that name exists."""
        tokens = [f"{file.path}#{next(_shared_file_numbers)}" for file in files]
        for file, token in zip(files, tokens):
            file.lent.add(token)
        return tokens

    def _idle_files(self) -> list[_RowFile]:
        """The files nothing holds, none being filled from now on, once every lent file whose driver mapping is gone
        (its token's file exists, made by the driver) is taken back."""
        self.filling = None
        for file in self.files.values():
            for token in [token for token in file.lent if os.path.exists(token)]:
                os.unlink(token)
                file.lent.discard(token)
        return [file for file in self.files.values() if not file.held and not file.lent]

    def trim(self) -> None:
        """Remove every file nothing holds (kept until then, to be filled again); one is made ahead again."""
        for file in self._idle_files():
            self._remove(file)
        if self.usable and self.step_bytes:
            self._make_ahead()

    def close(self) -> None:
        self.filling = None
        if self.next_file:
            self._adopt(self.next_file.pop())
        for file in list(self.files.values()):
            self._remove(file)
        if self.maker is not None:
            self.maker.shutdown()

    def _remove(self, file: _RowFile) -> None:
        if self.pin:
            self.wait()
        _remove_row_files({file.path: self.files.pop(file.path)}, self.pin)


def _make_row_file(size: int, device: int | None) -> _RowFile:
    """A new row file of ``size`` bytes in /dev/shm, mapped, and pinned for CUDA device ``device`` (None: not pinned);
    OSError naming it if /dev/shm cannot hold it. Runs on the thread making files ahead, too."""
    path = os.path.join(_SHARED_DIR, f"{_SHARED_PREFIX}{os.getpid()}-{next(_shared_file_numbers)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not later with SIGBUS on a page
        pages = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    except OSError as error:
        os.unlink(path)
        raise OSError(f"{path}: {error}") from None
    finally:
        os.close(fd)
    if device is not None:
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), size, 0)
    return _RowFile(path, pages)


def _remove_row_files(files: dict[str, _RowFile], pin: bool, made_ahead: list = ()) -> None:
    """Unpin and unlink these row files (and the one being made ahead, once made) and their tokens (a driver may still
    map one: its memory goes with that)."""
    for future in made_ahead:
        with contextlib.suppress(Exception):
            file = future.result()
            files[file.path] = file
    for file in list(files.values()):
        if pin:
            torch.cuda.cudart().cudaHostUnregister(file.pages.data_ptr())
        for path in [file.path, *file.lent]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    files.clear()


def _map_row_file(token: str) -> torch.Tensor:
    """The row file a read handed over (``path#number``) as a 1-D uint8 tensor, mapped copy-on-write; once no tensor
    holds the mapping, a file named ``token`` tells the worker it may fill the file again."""
    path = token.rpartition("#")[0]
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    weakref.finalize(mapped, _give_back_row_file, path, token)
    return torch.from_numpy(mapped)


def _give_back_row_file(path: str, token: str) -> None:
    if os.path.exists(path):  # (else its worker removed it)
        with contextlib.suppress(OSError):
            os.close(os.open(token, os.O_CREAT | os.O_WRONLY, 0o600))


def _row_layouts(hooks: list[list]) -> list[tuple[str, list[int], list[int], torch.dtype]]:
    """(name, row shape, strides of [rows, *row shape], contiguous, dtype) of each source a read's reply lists as
    [name, row shape, dtype]; worked out once per reply, for every request's rows."""
    return [
        (name, row_shape, [math.prod(row_shape[i:]) for i in range(len(row_shape) + 1)], getattr(torch, dtype))
        for name, row_shape, dtype in hooks
    ]


def _rows_in(
    mapped: dict[torch.dtype, list[torch.Tensor]],
    layouts: list[tuple[str, list[int], list[int], torch.dtype]],
    regions: list[list[int]],
    messages: dict[str, dict[str, Any]],
    attention: dict[str, str],
) -> dict[str, dict[str, torch.Tensor]]:
    """``{request id: {name: [rows, *row shape]}}`` from a read's messages: encoded, or their pieces in the row files
    (mapped: each file viewed as each dtype), one per step that kept rows: [region, first row, rows] of ``regions``,
    [file, then per source, in ``layouts`` order (see _row_layouts), the element offset of its row 0]; a view of the
    file where a source's rows are one piece, else joined; of a source the request keeps fewer columns of, those (a
    view); where it kept more rows than it asked for, the rows asked for. The ``attention`` hooks' ({name: dtype})
    matrices the worker rebuilt: encoded, or [file, element offset, shape] (a view). Pieces that follow one another
    in a region (a step's requests' rows do) are one view, split: a call per run of pieces rather than per piece, as
    a read of many requests of a row or a few costs per view made."""
    placed = {request_id: message["pieces"] for request_id, message in messages.items() if "pieces" in message}
    pieces = np.array([piece for request in placed.values() for piece in request], dtype=np.int64).reshape(-1, 3)
    order = np.lexsort((pieces[:, 1], pieces[:, 0]))  # by region, then first row
    region, first, count = pieces[order].T
    follows = (region[1:] == region[:-1]) & (first[1:] == first[:-1] + count[:-1])
    run_starts = np.flatnonzero(np.concatenate([[True], ~follows])).tolist() if len(order) else []
    runs = [  # (region, first row, each piece's rows, which pieces)
        (int(region[a]), int(first[a]), count[a:b].tolist(), order[a:b].tolist())
        for a, b in zip(run_starts, [*run_starts[1:], len(order)])
    ]
    views = []  # per source, each piece's view, in pieces' order
    for k, (_name, row_shape, strides, dtype) in enumerate(layouts):
        files, source_views = mapped[dtype], [None] * len(order)
        for run_region, run_first, run_counts, run_pieces in runs:
            file, row_0 = regions[run_region][0], regions[run_region][1 + k]
            run = files[file].as_strided([sum(run_counts), *row_shape], strides, row_0 + run_first * strides[0])
            for piece, view in zip(run_pieces, run.split(run_counts)):
                source_views[piece] = view
        views.append(source_views)
    read, start = {}, 0
    for request_id, message in messages.items():
        if "encoded" in message:
            rows = {name: decode_tensor(encoded) for name, encoded in message["encoded"].items()}
        else:
            rows, end = {}, start + len(placed[request_id])
            for (name, row_shape, _strides, dtype), source_views in zip(layouts, views):
                if end - start == 1:
                    rows[name] = source_views[start]
                elif end > start:
                    rows[name] = torch.cat(source_views[start:end])
                else:
                    rows[name] = torch.empty([0, *row_shape], dtype=dtype)
            start = end
        for name, columns in message.get("columns", {}).items():
            rows[name] = rows[name][:, :columns]
        if "asked" in message:
            rows = {name: r[message["asked"]] for name, r in rows.items()}
        for name, matrices in message.get("attention", {}).items():
            if isinstance(matrices, dict):
                rows[name] = decode_tensor(matrices)
            else:
                file, offset, shape = matrices
                strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
                rows[name] = mapped[getattr(torch, attention[name])][file].as_strided(shape, strides, offset)
        read[request_id] = rows
    return read


# ---------------------------------------------------------------------------
# Worker calls. Mixed into vLLM's worker by worker_extension_cls and reached through llm.collective_rpc("tl_call");
# arguments and results are msgpack values.
# ---------------------------------------------------------------------------

_USER_ERRORS = (ValueError, KeyError, RuntimeError)
# fmt: off
_WORKER_CALLS = (  # _HookState's methods the driver helpers call, each by its helper's name
    "status", "set_edits", "open_capture", "read_captures", "read_fire_counts", "reset_fire_counts", "read_batched",
    "flush_sink", "reset_batched", "unembed",
)
# fmt: on


class _WorkerExtension:
    """``WorkerExtension``: what vLLM mixes into each worker, for the driver helpers."""

    def tl_call(self, method: str, *args: Any) -> dict[str, Any]:
        """Run ``method`` (one of _WORKER_CALLS, or ``remove_hooks``) on this worker's hooks: ``{"result": value}``,
        or ``{"error": [exception type, message]}`` for a caller's mistake, so that the driver raises it with its
        own type (raised here, it would reach the driver as vLLM's generic RuntimeError)."""
        state = getattr(self, "_tl_hooks", None)
        try:
            if method == "remove_hooks":
                return {"result": _uninstall(self)}
            if state is None:
                raise RuntimeError(
                    "tl_vllm_hooks: this engine has no hooks: build it with "
                    "LLM(model, **tl_vllm_hooks.configure(...).llm_kwargs), and keep TL_VLLM_HOOKS_DISABLE unset"
                )
            if method not in _WORKER_CALLS:
                raise ValueError(f"tl_call: {method!r} is not one of {list(_WORKER_CALLS)} or 'remove_hooks'")
            if not hasattr(state, method):  # the other flavour's read
                other = "batched" if state.name == "one-prompt" else "one-prompt"
                raise RuntimeError(
                    f"{method}: this engine has {state.name} hooks; configure(enable_batching={other == 'batched'}) "
                    f"gives {other} ones"
                )
            return {"result": getattr(state, method)(*args)}
        except _USER_ERRORS as error:
            return {"error": [type(error).__name__, str(error.args[0]) if error.args else ""]}


def __getattr__(name: str) -> Any:
    if name == "WorkerExtension":
        # How a vLLM worker loads its worker_extension_cls, before it loads the model. A copied-in file has no entry
        # point to register it: it registers here.
        register()
        return _WorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# Driver helpers: a user's script calls these with its engine, an offline LLM or an AsyncLLM (whose collective_rpc
# is a coroutine). Each is written once, as a generator that yields (worker method, args) and is sent the workers'
# results; @_driver_helper runs it at once on an LLM, or returns an awaitable that runs it on an AsyncLLM. Results
# come back as torch tensors keyed by hook name (ActivationRows, which also take TransformerLens's shorthand keys);
# join_ranks joins what tensor-parallel ranks send; unembed asks the workers for logits of rows.
# ---------------------------------------------------------------------------


def _driver_helper(steps: Any) -> Any:
    """``helper(engine, *args)``: runs the generator ``steps(engine, *args)`` on the engine and returns what it
    returns (on an AsyncLLM, an awaitable of it); a worker's error is raised with its own type."""

    @functools.wraps(steps)
    def helper(engine: Any, *args: Any, **options: Any) -> Any:
        extension = _worker_extension_of(engine)
        if extension != WORKER_EXTENSION:
            raise RuntimeError(
                f"tl_vllm_hooks: the engine's worker_extension_cls is {extension!r}; build it with "
                "LLM(model, **config.llm_kwargs)"
            )
        running = steps(engine, *args, **options)

        def advance(replies: list[dict[str, Any]] | None) -> tuple[str, tuple]:
            for reply in replies or ():
                if "error" in reply:
                    kind, message = reply["error"]
                    raise {e.__name__: e for e in _USER_ERRORS}[kind](message)
            return running.send(None if replies is None else [reply["result"] for reply in replies])

        if inspect.iscoroutinefunction(engine.collective_rpc):

            async def run_async() -> Any:
                try:
                    method, rpc_args = advance(None)
                    while True:
                        method, rpc_args = advance(await engine.collective_rpc("tl_call", args=(method, *rpc_args)))
                except StopIteration as done:
                    return done.value

            return run_async()
        try:
            method, rpc_args = advance(None)
            while True:
                method, rpc_args = advance(engine.collective_rpc("tl_call", args=(method, *rpc_args)))
        except StopIteration as done:
            return done.value

    return helper


@_driver_helper
def status(engine: Any) -> dict[str, Any]:
    """The hooks as the engine's workers hold them (every helper here takes an ``LLM``, or an ``AsyncLLM`` and then
    returns an awaitable): ``{"version", "module": the workers' copy, "config": CaptureConfig, "hooks": names
    installed on some rank in forward order, "absent": names on no rank, "unread_requests": batched requests with
    rows not yet read (the most of any rank), "ranks": workers, "sink": None, or per writing rank its
    ``{"directory", "shards", "requests" (whole on disk), "lost", "error", "busy_seconds"}``, "row_files": None, or
    per batched rank ``{"files", "bytes", "created"}`` of the files in /dev/shm its rows reach the driver through}``."""
    ranks = yield "status", ()
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
        "row_files": [rank["row_files"] for rank in ranks if rank["row_files"] is not None] or None,
    }


def join_ranks(per_rank: list[tuple[dict[str, int], dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """One tensor per hook from each tensor-parallel rank's (shards, {hook_name: [rows, *row shape]}), shards giving
    where the rank's part of each split hook starts in a row's first dimension (a sink header's ``shards``): a
    replicated hook whole (the first rank's), a split one (attn_z, mlp_post) joined in order along that dimension."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for shards, rows in per_rank:
        for name, tensor in rows.items():
            parts.setdefault(name, {}).setdefault(shards.get(name, -1), tensor)
    return {
        name: by_start[-1] if -1 in by_start else torch.cat([by_start[start] for start in sorted(by_start)], dim=1)
        for name, by_start in parts.items()
    }


@_driver_helper
def open_capture(engine: Any) -> None:
    """Arm the one-prompt hooks: the next forward's rows are kept until the next open."""
    yield "open_capture", ()


@_driver_helper
def read_captures(engine: Any, num_rows: int) -> dict[str, torch.Tensor]:
    """``{hook_name: [num_rows, *row shape]}`` CPU tensors (config dtype) of the armed forward, an ActivationRows,
    rows as SITES says, whole under tensor parallelism. num_rows: the prompt's tokens; the
    prompt must fit one forward (``<= max_num_batched_tokens``)."""
    replies = yield "read_captures", (num_rows,)
    rows = join_ranks([(r["shards"], {n: decode_tensor(m) for n, m in r["rows"].items()}) for r in replies])
    return ActivationRows(rows, _model_config(engine).hf_text_config.num_hidden_layers)


def _act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """The hook name TransformerLens 4.3's ``transformer_lens.utilities.get_act_name`` gives: ``("pattern", 3)`` ->
    blocks.3.attn.hook_pattern, ``("normalized", 2, "ln1")`` -> blocks.2.ln1.hook_normalized, ``"k6"`` ->
    blocks.6.attn.hook_k, a full name as it is; its rules, written out here so that the core imports no
    TransformerLens."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)
    if match is not None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3)
    name = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
            "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}.get(name, name)  # fmt: skip
    if name in ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"):
        layer_type = "attn"
    elif name in ("pre", "post", "mid", "pre_linear"):
        layer_type = "mlp"
    else:
        layer_type = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}.get(
            layer_type, layer_type
        )
    full = (f"blocks.{layer}." if layer is not None else "") + (f"{layer_type}." if layer_type else "") + f"hook_{name}"
    return f"ln_final.{full}" if name in ("scale", "normalized") and layer is None else full


class ActivationRows(dict):
    """One request's rows, ``{hook name: tensor}`` as read (read_captures, and each request's of read_batched), also
    indexed as TransformerLens's ``ActivationCache`` is: ``rows["pattern", 3]``, ``rows["resid_post", -1]`` (layers
    from the end, of ``n_layers``), ``rows["z", 2]``, ``rows["normalized", 1, "ln2"]``, ``rows["k6"]``, as
    ``transformer_lens.utilities.get_act_name`` spells them. Tensors are ``[rows, ...]``, without TransformerLens's
    batch dimension. KeyError names the hooks held where one was not kept."""

    def __init__(self, rows: dict[str, torch.Tensor], n_layers: int | None = None):
        super().__init__(rows)
        self.n_layers = n_layers

    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, str) and dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        name, layer, layer_type = (*((key,) if isinstance(key, str) else tuple(key)), None, None)[:3]
        if layer is not None and layer < 0:
            if self.n_layers is None:
                raise KeyError(f"{key!r}: a layer from the end needs n_layers, which these rows do not hold")
            layer += self.n_layers
        full = _act_name(name, layer, layer_type)
        if not dict.__contains__(self, full):
            raise KeyError(f"{key!r} is {full}, which was not kept; held: {list(self)[:12]}")
        return dict.__getitem__(self, full)

    def _last_layer(self, layer: int | None, caller: str) -> int:
        """``layer``, None and -1 meaning every layer (n_layers)."""
        if layer is not None and layer != -1:
            return layer
        if self.n_layers is None:
            raise ValueError(f"{caller}: every layer needs n_layers, which these rows do not hold: pass layer")
        return self.n_layers

    def accumulated_resid(
        self, layer: int | None = None, incl_mid: bool = False, mlp_input: bool = False, return_labels: bool = False
    ) -> Any:
        """TransformerLens's ``ActivationCache.accumulated_resid`` (without its apply_ln and pos_slice: see
        ``logit_lens`` and ``unembed``): the residual stream before each layer up to ``layer`` (None or -1: every
        layer, then the last one's output, ``final_post``), each layer's middle too with ``incl_mid``, ``layer``'s
        with ``mlp_input``; ``[components, rows, d_model]``, and the labels (``0_pre``, ``0_mid``, ``final_post``)
        with ``return_labels``."""
        layer = self._last_layer(layer, "accumulated_resid")
        components, labels = [], []
        for at in range(layer + 1):
            if at == self.n_layers:
                components.append(self["resid_post", at - 1])
                labels.append("final_post")
                continue
            components.append(self["resid_pre", at])
            labels.append(f"{at}_pre")
            if (incl_mid and at < layer) or (mlp_input and at == layer):
                components.append(self["resid_mid", at])
                labels.append(f"{at}_mid")
        stack = torch.stack(components)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self, layer: int | None = None, mlp_input: bool = False, mode: str = "all", incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> Any:  # fmt: skip
        """TransformerLens's ``ActivationCache.decompose_resid`` (without its apply_ln and pos_slice): what writes
        the residual stream before ``layer`` (None or -1: every layer), the embeddings (hook_embed, hook_pos_embed,
        where kept) then each layer's attention and MLP outputs (``mode`` "all", "attn" or "mlp"), the layer's own
        attention output too with ``mlp_input``; ``[components, rows, d_model]``, and labels with
        ``return_labels``."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"decompose_resid: mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._last_layer(layer, "decompose_resid")
        names = [(n, label) for n, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")) if n in self]
        components = [self[n] for n, _label in names] if incl_embeds else []
        labels = [label for _n, label in names] if incl_embeds else []
        for at in range(layer + mlp_input):
            for part in ("attn_out", "mlp_out"):
                if mode in ("all", part[:-4]) and (at < layer or part == "attn_out"):
                    components.append(self[part, at])
                    labels.append(f"{at}_{part}")
        stack = torch.stack(components)
        return (stack, labels) if return_labels else stack


_UNEMBED_CALL_BYTES = 64 << 20  # the most logits one worker call of unembed hands back


def _unembedded(engine: Any, rows: torch.Tensor, top_k: Any, apply_ln: Any, caller: str) -> Any:
    """unembed's steps (see _driver_helper): rows checked against the model (ValueError naming the problem before
    any worker runs), then sent to the workers in calls of at most _UNEMBED_CALL_BYTES of logits."""
    model_config = _model_config(engine)
    d_model, d_vocab = model_config.get_hidden_size(), model_config.get_vocab_size()
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point() or rows.dim() == 0:
        raise ValueError(f"{caller}: rows must be a float tensor [..., d_model], got {rows!r:.100}")
    if rows.shape[-1] != d_model:
        raise ValueError(f"{caller}: rows of {rows.shape[-1]}, but this model's residual stream is {d_model} wide")
    if not torch.isfinite(rows).all():
        raise ValueError(f"{caller}: rows hold NaN or infinite values")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= d_vocab:
        raise ValueError(f"{caller}: top_k must be an int from 0 (whole rows) to d_vocab ({d_vocab}), got {top_k!r}")
    if not isinstance(apply_ln, bool):
        raise ValueError(f"{caller}: apply_ln must be True or False, got {apply_ln!r}")
    flat = rows.detach().reshape(-1, d_model)
    per_call = max(1, _UNEMBED_CALL_BYTES // (4 * (2 * top_k or d_vocab)))
    parts = []
    for start in range(0, len(flat), per_call):
        replies = yield "unembed", (encode_tensor(flat[start : start + per_call]), apply_ln, top_k)
        parts.append({key: decode_tensor(m) for key, m in next(r for r in replies if r is not None).items()})
    shape = (*rows.shape[:-1], top_k or d_vocab)
    if not top_k:
        return torch.cat([part["logits"] for part in parts]).reshape(shape) if parts else torch.empty(shape)
    values = torch.cat([part["values"] for part in parts]) if parts else torch.empty(shape)
    indices = torch.cat([part["indices"] for part in parts]) if parts else torch.empty(shape, dtype=torch.int64)
    return torch.return_types.topk((values.reshape(shape), indices.reshape(shape)))


@_driver_helper
def unembed(engine: Any, rows: torch.Tensor, top_k: int = 0, apply_ln: bool = True) -> Any:
    """The model's logits for rows of its residual stream, ``[..., d_model]`` (any float dtype; cast to the model's):
    each row through the final norm, with statistics of its own (``apply_ln``; pass False for rows already
    normalized, weight included), then the unembedding, as the model's own readout computes them in vLLM's workers
    (gathered across tensor-parallel ranks, the family's final softcap or scale applied): TransformerLens's
    ``hook_unembed`` (``unembed.hook_out``) for the last layer's hook_resid_post rows, and its logit lens
    (``ActivationCache.logit_lens``, ``apply_ln_to_stack(recompute_ln=True)``) for any. Returns float32 ``[...,
    d_vocab]``, or with ``top_k`` ``torch.return_types.topk`` of values (float32) and indices (int64) ``[..., top_k]``,
    highest first; only those cross the RPC, in calls of at most 64 MiB."""
    return (yield from _unembedded(engine, rows, top_k, apply_ln, "unembed"))


@_driver_helper
def logit_lens(engine: Any, rows: dict[str, torch.Tensor], top_k: int = 0) -> dict[str, Any]:
    """``{hook_name: logits}`` for each residual-stream hook (hook_resid_pre, hook_resid_mid, hook_resid_post) in
    ``rows`` (one request's, as read_captures or read_batched give them), each as ``unembed`` gives them (final norm
    applied), in one go: TransformerLens's logit lens at every kept layer and position."""
    names = [name for name in rows if (parse_hook_name(name) or ("",))[0] in _RESIDUAL_SITES]
    if not names:
        raise ValueError(
            f"logit_lens: rows hold no residual-stream hook ({', '.join(_RESIDUAL_SITES)}), only {list(rows)[:8]}"
        )
    if len({rows[name].shape for name in names}) > 1:
        raise ValueError(f"logit_lens: {names} hold rows of different shapes: pass one request's rows")
    logits = yield from _unembedded(engine, torch.stack([rows[name] for name in names]), top_k, True, "logit_lens")
    if top_k:
        return {name: torch.return_types.topk((logits.values[n], logits.indices[n])) for n, name in enumerate(names)}
    return dict(zip(names, logits))


def _edits_to_wire(edits: Any) -> dict[str, Any]:
    """Edits for JSON and collective_rpc alike: a float tensor or numpy value in its wire form (see
    _values_to_wire, exact), another tensor (positions, features) as a list."""
    if not isinstance(edits, dict):
        raise ValueError(f"edits: expected a dict {{hook_name: edit}}, got {edits!r:.200}")

    def plain(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            return _values_to_wire(value) if value.is_floating_point() and value.dim() else value.tolist()
        return value

    return {name: {k: plain(v) for k, v in e.items()} if isinstance(e, dict) else e for name, e in edits.items()}


@_driver_helper
def set_edits(engine: Any, edits: dict[str, dict[str, Any]]) -> None:
    """Replace every engine-wide edit (hooks not named go back to identity) from the next forward on: ``{hook_name:
    {"op": op, "value": v, "positions": [p, ...]}}``, op one of ``suppress`` (no value), ``scale``, ``add``,
    ``set``; v a finite number or a float tensor of the row's shape (or flat); positions (optional) need
    ``enable_position_interventions=True``. A hook's SAE features (``{hook_name}{SAE_FEATURES}``) take
    ``{"op", "features": [f, ...], "value": a number or one per feature, "positions"}`` and change the hook's rows by
    (new_f - old_f) * W_dec[f]. ValueError before any rank changes; refused with prefix caching on (edit per request
    there)."""
    yield "set_edits", (_edits_to_wire(edits),)


@_driver_helper
def reset_edits(engine: Any) -> None:
    """Every hook back to identity."""
    yield "set_edits", ({},)


def request_args(
    config: CaptureConfig,
    capture: str | list[int] = "all",
    edits: dict[str, dict[str, Any]] | None = None,
    top_k: dict[str, int] | None = None,
    features: dict[str, list[int]] | None = None,
) -> dict[str, str]:
    """One request's options in the batched flavour, ``{"tl_vllm_hooks": JSON text}``, for
    ``SamplingParams(extra_args=...)`` (merged with any of your own) or a server's ``extra_body={"vllm_xargs":
    ...}``.

    config: the engine's config (what ``configure`` returned).
    capture: the request's rows ``read_batched`` (or the sink) gets: ``"all"`` (prompt and generated tokens, as
        without options), ``"prompt"``, ``"last_prompt_token"``, ``"none"``, or a list of token positions. Rows not
        kept never leave the device. On an engine reading attention (attn_scores, pattern), whose keys are every
        position up to each query, rows are kept from position 0 to the last asked for, and a read hands over those
        asked for (an attention matrix's queries), at most ATTENTION_READ_BYTES of attention matrices.
    edits: as in ``set_edits``, at any positions, for this request's rows only; a hook (or its features) edited
        here ignores the engine-wide edit on it for this request.
    top_k: ``{features name: k}``: keep only each row's k top features of that SAE (k <= sae_top_k, the default).
    features: ``{features name: [f, ...]}``: read these features of that SAE densely, as ``{features name}.chosen``
        (at most sae_chosen_features).

    Checked here (ValueError naming the problem) and again where vLLM takes the request (a server answers HTTP 400
    with the same message). Where prefix caching was turned on (``llm_kwargs`` and ``serve_args`` turn it off), a
    request without options keeps no rows and may be served from the cache; one keeping prompt rows before its last
    skips reading it, and one with edits shares blocks only with requests making the same edits.
    """
    if not isinstance(config, CaptureConfig):
        raise ValueError(f"request_args: config must be the CaptureConfig of the engine, got {config!r:.100}")
    options: dict[str, Any] = {"capture": list(capture) if isinstance(capture, tuple) else capture}
    if edits:
        options["edits"] = _edits_to_wire(edits)
    if top_k:
        options["top_k"] = top_k
    if features:
        options["features"] = features
    _parse_options(options, config)
    return {_REQUEST_KEY: json.dumps(options)}


@_driver_helper
def read_batched(engine: Any, request_ids: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{request_id: {hook_name: [rows, *row shape]}}`` (each an ActivationRows) CPU tensors (config dtype) of the
    requests (``RequestOutput.request_id``), then freed. Rows, in position order, are those
    ``request_args(capture=...)`` kept: by default every token that ran through the model
    for it, its prompt then each generated token but the last; shaped as in read_captures."""
    if isinstance(request_ids, str) or not all(isinstance(r, str) for r in request_ids):
        raise ValueError(f"read_batched: request_ids must be a list of str, got {request_ids!r}")
    per_rank = []
    for rank, reply in enumerate((yield "read_batched", (list(request_ids), socket.gethostname()))):
        short = {request_id: m["missing"] for request_id, m in reply["rows"].items() if "missing" in m and not rank}
        if short:
            warnings.warn(
                f"read_batched: {len(short)} requests hold no rows of positions their capture listed, their sequence "
                "having ended before them (a stop token, or max_tokens): "
                + "; ".join(f"{request_id!r}: {positions[:10]}" for request_id, positions in list(short.items())[:5])
                + "; list positions below each request's length",
                stacklevel=4,  # the user's call: this generator, advance, helper, the caller
            )
        encoded = [m["encoded"] for m in reply["rows"].values() if "encoded" in m]
        if any(e["shape"][0] for by_hook in encoded for e in by_hook.values()):
            warnings.warn(
                "read_batched: rows come through vLLM's RPC, which is slow: a worker runs on another host "
                "than this driver, or its host has no /dev/shm with room for them",
                stacklevel=4,  # the user's call: this generator, advance, helper, the caller
            )
        layouts, files = _row_layouts(reply["hooks"]), [_map_row_file(token) for token in reply["files"]]
        dtypes = {layout[3] for layout in layouts} | {getattr(torch, d) for d in reply["attention"].values()}
        mapped = {dtype: [file.view(dtype) for file in files] for dtype in dtypes}
        rows = _rows_in(mapped, layouts, reply["regions"], reply["rows"], reply["attention"])
        per_rank.append((reply["shards"], rows))
    n_layers = _model_config(engine).hf_text_config.num_hidden_layers
    if len(per_rank) == 1:  # nothing to join
        return {request_id: ActivationRows(rows, n_layers) for request_id, rows in per_rank[0][1].items()}
    read = {request_id for _shards, rows in per_rank for request_id in rows}
    return {r: ActivationRows(join_ranks([(s, rows.get(r, {})) for s, rows in per_rank]), n_layers) for r in read}


@_driver_helper
def flush_sink(engine: Any) -> Any:
    """Write every request that ran to the engine's ``sink_dir``, close the open shards, and return the directory's
    dataset as its sink writer reads it (the companion's: a ``CaptureDataset``). Call it once ``generate`` has
    returned (vLLM tells its workers that a request finished only at their next step). RuntimeError if a write failed
    (disk full, directory removed), naming the file and the requests not written; the shards the manifests list stay
    whole and readable."""
    if _has_unfinished_requests(engine):
        raise RuntimeError("flush_sink: requests are still running; call it once generate has returned")
    writers = [reply for reply in (yield "flush_sink", ()) if reply is not None]
    failures = [f"{writer['error']}; {writer['lost']} requests not written" for writer in writers if writer["error"]]
    if failures:
        raise RuntimeError("flush_sink: " + " | ".join(failures))
    return _sink_writer(writers[0]["sink_writer"]).dataset(writers[0]["directory"])


@_driver_helper
def reset_batched(engine: Any) -> None:
    """Drop every batched row not yet read (and the workers' row files nothing maps; each batched worker makes one
    empty file ahead again, for the next step)."""
    yield "reset_batched", ()


@_driver_helper
def read_fire_counts(engine: Any) -> dict[str, int]:
    """How often each hook ran since the last reset (the first rank holding it)."""
    counts: dict[str, int] = {}
    for rank in (yield "read_fire_counts", ()):
        for name, count in rank.items():
            counts.setdefault(name, count)
    return counts


@_driver_helper
def reset_fire_counts(engine: Any) -> None:
    """Zero every hook's fire count."""
    yield "reset_fire_counts", ()


@_driver_helper
def remove_hooks(engine: Any) -> None:
    """Remove every hook from every worker (a compiled graph keeps what it traced)."""
    yield "remove_hooks", ()
