"""The tests' shared engines, oracles and helpers, and their order: tests of tl_vllm_hooks against real vLLM and
independent references.

What a hook name means is TransformerLens's: every captured number is compared
with TransformerLens 4.3's TransformerBridge on the same weights
(run_with_hooks, with the same edits). Models are tiny and random, made by the
companion's tiny_model, with random norm weights and biases, so that a tensor
taken on the wrong side of a norm's weight cannot pass. Tolerance
(family_tolerance): relative L2 error <= 1e-5 per hook in fp32; looser from one
hook on where vLLM computes a family otherwise (LOOSER_FROM), and per row where
vLLM's CPU runs a family in bf16 alone (BF16_ALONE_ON_CPU, against the bridge in
fp32 on the bf16-rounded weights). vLLM's CPU kernels (oneDNN matmuls, its own
norms and attention) sum in another order than transformers, which leaves
~1e-7..3e-6 after three layers of width 128; any semantic error (a missing
residual, a tensor before or after a norm, a row off by one, an edit applied
twice) shows up at >= 1e-2, and a test holds each class of tolerance to it (a
hook on the wrong side of a norm's weight fails every one).

The GPU classes run where TransformerLens is not installed: they compare with
transformers' modules at the places TRANSFORMERS_TAPS names, and a CPU test
checks that those places give exactly TransformerLens's tensors, edits included.

Engines are expensive (20-60 s to boot), so each class shares one. The tests are one file per area (test_families.py,
test_flavours.py, test_edits.py, test_attention_and_logits.py, test_saes.py, test_sink.py, test_serving.py,
test_bad_input.py, test_gpu.py; the companion's in test_tl_vllm_hooks_tools.py).

The test order: the tests within each class (and a module's tests outside classes) are shuffled by a seed, drawn at
random unless TL_VLLM_HOOKS_TEST_SEED=N gives it, so that a test that passes only after another has set up what it
reads shows itself; the seed is printed at the start and the end, and TL_VLLM_HOOKS_TEST_SEED=N repeats the order.
Modules and classes keep their order (the engines they share and the two CI workers' balance follow it), and pytest's
own grouping of tests by a shared parametrized engine runs after the shuffle. The seed is drawn once, where pytest
starts, and reaches pytest-xdist's workers through the environment, so every worker collects the same order.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
import tl_vllm_hooks_tools as tools

_SEED = "TL_VLLM_HOOKS_TEST_SEED"


def pytest_configure(config):
    os.environ.setdefault(_SEED, str(random.SystemRandom().randrange(1_000_000)))


def _said() -> str:
    return f"test order: shuffled within each class, seed {os.environ[_SEED]} ({_SEED}={os.environ[_SEED]} repeats it)"


def pytest_sessionstart(session):  # (pytest's header is not printed under -q; xdist's workers have no terminal)
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None and not hasattr(session.config, "workerinput"):
        terminal.write_line(_said())


@pytest.hookimpl(tryfirst=True)  # before pytest groups the tests by their parametrized class- and module-scoped engines
def pytest_collection_modifyitems(items):
    shuffle = random.Random(int(os.environ[_SEED])).shuffle
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((item.module.__name__ if item.module else "", item.cls and item.cls.__name__), []).append(item)
    for group in groups.values():
        shuffle(group)
    items[:] = [item for group in groups.values() for item in group]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_said())


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _share_of_the_cores() -> None:
    """Under pytest-xdist, give this worker its own share of the cores: torch's threads here (TransformerLens and the
    in-process engines), OMP_NUM_THREADS for the commands the tests start, and VLLM_CPU_OMP_THREADS_BIND for the
    separate-process engines (whose default binds every engine to the same core). OpenMP threads spin while they
    wait, so two workers' engines that share cores take 2.6-3x as long (measured, BENCHMARKS.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if workers < 2 or len(cores) < workers:
        return
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    share = cores[worker * len(cores) // workers : (worker + 1) * len(cores) // workers]
    torch.set_num_threads(len(share))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(share)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, share)))


_share_of_the_cores()

TOLERANCE = 1e-5
NO_ENGINE = pytest.mark.no_engine  # the inner loop's tier: pytest -m no_engine
MAX_TOKENS_PER_FORWARD = 128
HERE = Path(__file__).resolve().parent
# Every family the module claims: one per record, read from the records (never typed here). A multimodal checkpoint's
# (its text model under a text_prefix) runs in test_tl_vllm_hooks_vision.py, in an environment where torchvision
# imports (test_multimodal_checkpoints_in_the_vision_environment).
FAMILIES = tuple(name for name, record in tlh.FAMILIES.items() if not record.text_classes)
MULTIMODAL = tuple(name for name, record in tlh.FAMILIES.items() if record.text_classes)


# Text families whose engines run in test_tl_vllm_hooks_vision.py's environment, vLLM's module of their class
# importing torchvision (vLLM's Qwen 3.5 imports its Qwen3-VL module, which imports transformers' image processors),
# their checks without an engine here (test_the_vision_environments_text_families_are_those_vllm_needs_it_for).
VISION_TEXT_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# Families vLLM's CPU cannot run (their records' gpu_only says why: Mamba-1's scan has no CPU kernel). Their engines
# here run that scan in torch (scan_in_torch); a GPU runs vLLM's kernels (scripts/gpu_families.py).
CUDA_ONLY = tuple(name for name in FAMILIES if tlh.FAMILIES[name].gpu_only)
ENGINE_FAMILIES = tuple(family for family in FAMILIES if family not in VISION_TEXT_FAMILIES)


def tap_kinds(family: str) -> set:
    """What the one-prompt flavour's row logic meets in a family: each site's tap on every layer, less its module
    path (kind, inputs, norm, columns, multiplier, bias, routing), and where the text model sits in vLLM's tree."""
    record = tlh.FAMILIES[family]
    text = tools.tiny_config(family).get_text_config()
    kinds = {("text_prefix", record.text_prefix)}
    for layer in [None, *range(text.num_hidden_layers)]:
        placed = tlh._layer_sites(record, text, layer)
        kinds |= {(site, dataclasses.replace(here.tap, module="")) for site, here in placed.items()}
    return kinds


def covering_families() -> tuple[str, ...]:
    """The families, fewest first found (greedy), whose records together hold every tap kind of every record."""
    kinds = {family: tap_kinds(family) for family in tlh.FAMILIES}
    chosen, covered = [], set()
    while uncovered := {family: len(found - covered) for family, found in kinds.items() if found - covered}:
        chosen.append(max(uncovered, key=uncovered.get))
        covered |= kinds[chosen[-1]]
    return tuple(family for family in tlh.FAMILIES if family in chosen)


# The one-prompt flavour runs on every text family; a multimodal checkpoint's text model, whose engines are the
# heaviest, only where its record brings a tap kind the others lack (the flavour's hooks are the batched flavour's,
# which TestFamilies runs on every family: what differs is which rows each tap reads and writes).
ONE_PROMPT_FAMILIES = FAMILIES + tuple(family for family in covering_families() if family in MULTIMODAL)
ONE_PROMPT_ENGINE_FAMILIES = tuple(family for family in ONE_PROMPT_FAMILIES if family in ENGINE_FAMILIES)
# The sites the flavour, sink and serving tests hook on every layer (the first release's).
CLASSIC_SITES = (
    "embed", "pos_embed", "resid_pre", "attn_z", "attn_out", "resid_mid", "mlp_post", "mlp_out", "resid_post",
    "final_norm",
)
SITE_OF = {re.compile("^" + re.escape(name).replace(r"\{i\}", r"\d+") + "$"): site for site, name in tlh.SITES.items()}


def site_of(hook_name: str) -> str | None:
    """The site of a TransformerLens hook name of tlh.SITES, else None."""
    return next((site for pattern, site in SITE_OF.items() if pattern.match(hook_name)), None)


# Attention scores and patterns, [n_heads, queries, keys], rebuilt when read from the query and key vLLM's attention
# receives (whose kernels never hold them); their keys a query does not see are the dtype's minimum.
ATTENTION = ("attn.hook_attn_scores", "attn.hook_pattern")
# Read, never edited (the module refuses edits of them): the router's choice (vLLM's fused mixture of experts routes
# inside its kernel), and the attention matrices (its kernels never read them).
READ_ONLY = ("hook_expert_weights", "hook_expert_indices", *ATTENTION)  # (mlp.* and moe.*)
LATENT_READ_ONLY = ("attn.hook_k", "attn.hook_v")  # and these under multi-head latent attention (vLLM never holds them)


def latent_attention(record) -> bool:
    """Whether the family's record has multi-head latent attention (DeepSeek's)."""
    return bool(record.attention and record.attention.latent)


def read_only(name: str, family: str) -> bool:
    """Whether the module refuses edits of the hook on the family."""
    return name.endswith(READ_ONLY) or latent_attention(tlh.FAMILIES[family]) and name.endswith(LATENT_READ_ONLY)


UNSEEN = -1e30  # below: a key the query does not see
# Multi-head latent attention (a record's attention.latent): TransformerLens 4.3's bridge fires hook_q, hook_k and
# hook_v heads first, [batch, heads, pos, d_head], compared here position by position; and it splits hook_z, the
# output projection's input [batch, pos, n_heads * v_head_dim], into heads of qk_rope_head_dim, not v_head_dim (its
# exemption for latent attention in conversion_dims reads an attribute set in forward alone), compared here as the
# module's [n_heads, v_head_dim], the same numbers in the same order.
HEADS_FIRST = ("attn.hook_q", "attn.hook_k", "attn.hook_v")


def latent_rows(config) -> dict[str, tuple[int, ...]]:
    """Under multi-head latent attention, the row shapes of hook_z and of the attention matrices' kept rows (each
    head's query and key), from the transformers config."""
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    return {"attn.hook_z": (config.num_attention_heads, config.v_head_dim),
            **dict.fromkeys(ATTENTION, (2 * config.num_attention_heads, qk))}


# A query-key dot product's relative error is not bounded by its inputs' where it cancels (query 0 sees one key: in
# bf16, Mixtral's score there, near 0, came 32 % off). Under a row bound (PerRow, the bf16 checks) each row of
# attention scores is measured against the larger of its norm and the request's mean row norm; a wrong scale, softcap
# or mask moves rows by about their typical norm.

# Families whose rows differ from TransformerLens's by more than TOLERANCE from some hook on, hooks
# or not, each bound from the spread measured here (every hook before keeps TOLERANCE; BLOOM's and Apertus's
# activations, where vLLM computes otherwise, the reference computes as vLLM does: as_vllm_computes):
# - Gemma 4: attention with scale 1 over normalized q and k makes a sharp softmax, which carries the
#   two engines' different summation orders further: up to 1.2e-5 at later layers under edits.
LOOSER_FROM = {
    "gemma4": (3e-5, "blocks.0.attn.hook_z"),
}


# The hooks whose rows in a bf16 engine precede every bf16 operation (unedited: an edit computes in bf16): held to
# TOLERANCE there too (unedited_tolerance).
BEFORE_ANY_BF16_OPERATION = ("hook_embed", "blocks.0.hook_resid_pre")


def unedited_tolerance(family: str):
    """family_tolerance, but TOLERANCE for the rows of a bf16 family's BEFORE_ANY_BF16_OPERATION hooks: the
    embedding's rows are the bf16 weights themselves, which the reference holds exactly."""
    tolerance = family_tolerance(family)
    if not tools._TINY_MODELS[family].bfloat16:
        return tolerance
    return lambda name: TOLERANCE if name in BEFORE_ANY_BF16_OPERATION else tolerance(name)


def family_tolerance(family: str):
    """TOLERANCE, BF16_ALONE_ON_CPU for a family vLLM's CPU runs in bf16 alone, or for the families of LOOSER_FROM a
    function of the hook name."""
    if tools._TINY_MODELS[family].bfloat16:
        return lambda name: LINEAR_ATTENTION_OUT if name.endswith(".linear_attn.hook_out") else BF16_ALONE_ON_CPU
    if family not in LOOSER_FROM:
        return TOLERANCE
    looser, first = LOOSER_FROM[family]
    order = {name: n for n, name in enumerate(tlh.SITES.values())}

    def tolerance(name):
        if forward_position(name, order) < forward_position(first, order):
            return TOLERANCE
        return looser

    return tolerance


# vLLM's CPU has no Mamba-1 scan (selective_scan_fwd): a CUDA_ONLY family's engines here run vLLM's selective_scan_fn
# and selective_state_update as the torch loops below (fp32, transformers' slow path's recurrence), in an engine in
# this process, and give every RowParallelLinear a contiguous input (the mixer's out_proj needs it: vLLM concatenates
# a mixed step's decode and prefill scan outputs, and its CPU GEMM needs the last dimension contiguous). Every hooked tensor is still vLLM's: the mixer's input, its
# in_proj's and out_proj's outputs, the stream. Measured 2026-12-06: greedy tokens equal transformers' on the tiny
# Jamba, Mamba and Falcon Mamba, over chunked prefill and mixed steps.
def _scan_steps(state, u, delta, A, B, C, D, z, delta_bias, softplus):
    """Mamba-1's recurrence: state [dim, d_state] (fp32); u, delta, z [dim, tokens]; B, C [d_state, tokens]. Returns
    (the state after the last token, y [dim, tokens] fp32)."""
    ys = []
    for t in range(u.shape[-1]):
        dt = delta[:, t].float() + (0 if delta_bias is None else delta_bias.float())
        dt = torch.nn.functional.softplus(dt) if softplus else dt
        x = u[:, t].float()
        state = torch.exp(dt[:, None] * A.float()) * state + dt[:, None] * B[:, t].float()[None] * x[:, None]
        y = (state * C[:, t].float()[None]).sum(-1) + (0 if D is None else D.float() * x)
        ys.append(y if z is None else y * torch.nn.functional.silu(z[:, t].float()))
    return state, torch.stack(ys, -1)


def _selective_scan_in_torch(u, ssm_states, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             query_start_loc=None, cache_indices=None, has_initial_state=None, **_):
    """vLLM's selective_scan_fn over a prefill batch ([dim, tokens], requests by query_start_loc), without prefix
    caching: each request's state read where has_initial_state says, written back; the output written into z."""
    B, C, out = B.reshape(-1, B.shape[-1]), C.reshape(-1, C.shape[-1]), torch.empty_like(u)
    for request in range(len(query_start_loc) - 1):
        start, end, slot = int(query_start_loc[request]), int(query_start_loc[request + 1]), int(cache_indices[request])
        initial = has_initial_state is not None and bool(has_initial_state[request])
        state = ssm_states[slot].float() if initial else u.new_zeros(ssm_states.shape[1:], dtype=torch.float32)
        state, out[:, start:end] = _scan_steps(state, u[:, start:end], delta[:, start:end], A, B[:, start:end],
                                               C[:, start:end], D, None if z is None else z[:, start:end], delta_bias,
                                               delta_softplus)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return (delta if z is None else z).copy_(out)


def _selective_state_update_in_torch(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                                     state_batch_indices=None, dst_state_batch_indices=None, out=None, **_):
    """vLLM's selective_state_update for Mamba-1's decode: one token a request (x, dt, z [requests, dim]; B, C
    [requests, d_state])."""
    for request in range(x.shape[0]):
        new, y = _scan_steps(state[int(state_batch_indices[request])].float(), x[request][:, None],
                             dt[request][:, None], A, B[request][:, None], C[request][:, None], D,
                             None if z is None else z[request][:, None], dt_bias, dt_softplus)
        state[int(dst_state_batch_indices[request])] = new.to(state.dtype)
        out[request] = y[:, 0].to(out.dtype)
    return out


@contextlib.contextmanager
def scan_in_torch(family: str):
    """For the block's length, a CUDA_ONLY family's engines started in this process on the CPU run the Mamba-1 scan in
    torch (see above); nothing for the others, or on a GPU."""
    if family not in CUDA_ONLY or torch.cuda.is_available():
        yield
        return
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.mamba import mamba_mixer

    linear_forward = RowParallelLinear.forward
    saved = mamba_mixer.selective_scan_fn, mamba_mixer.selective_state_update, linear_forward

    def contiguous_forward(self, input_, *args, **kwargs):
        return linear_forward(self, input_.contiguous(), *args, **kwargs)

    mamba_mixer.selective_scan_fn = _selective_scan_in_torch
    mamba_mixer.selective_state_update = _selective_state_update_in_torch
    RowParallelLinear.forward = contiguous_forward
    try:
        yield
    finally:
        mamba_mixer.selective_scan_fn, mamba_mixer.selective_state_update, RowParallelLinear.forward = saved


def family_engine_arguments(family: str) -> dict:
    """The engine arguments a family's tests start it with, beside engine()'s own."""
    record, arguments = tlh.FAMILIES[family], {}
    if family == "llama4":  # vLLM computes its NoPE-layer attention temperature only past 32k tokens, or when asked
        arguments.update(override_generation_config={"attn_temperature_tuning": True})
    if tools._TINY_MODELS[family].bfloat16:  # vLLM's CPU runs it in bf16 alone, on bf16's values (see _TinyModel)
        arguments.update(dtype="bfloat16")
    if record.attention and record.attention.rotary_3d:  # vLLM's rotary in torch, not its CPU kernel, which mis-rotates 3-D q and k
        arguments.update(compilation_config={"custom_ops": ["-rotary_embedding"]})
    if latent_attention(record) and AMX_MLA:  # (see test_latent_keys_on_vllms_amx_mla_backend_are_refused)
        arguments.update(attention_config={"backend": "CPU_MLA"})
    if latent_attention(record):  # vLLM's CPU turns chunked prefill off for it, and schedules up to 2048 tokens a step
        arguments.update(rows=LATENT_ROWS)
    return arguments


LATENT_ROWS = 2048
# vLLM's CPU picks its AMX_MLA backend for latent attention where the CPU has AMX tiles, and that backend releases
# kv_b_proj's weight, which the latent keys and values are projected up by: the module refuses those hooks there.
AMX_MLA = not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported()


# --- models and the references -----------------------------------------------------------


def apply_edit(rows: torch.Tensor, edit: dict) -> torch.Tensor:
    """rows ([positions, *row shape]) with the edit applied by plain tensor indexing,
    independently of the module's scale/bias tables."""
    rows = rows.clone()
    positions = edit.get("positions")
    where = slice(None) if positions is None else [p for p in positions if p < len(rows)]
    value = edit.get("value", 0.0)
    value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    value = value.to(rows.dtype).reshape(rows.shape[1:] if value.numel() > 1 else ())
    if edit["op"] == "suppress":
        rows[where] = 0.0
    elif edit["op"] == "scale":
        rows[where] = rows[where] * value
    elif edit["op"] == "add":
        rows[where] = rows[where] + value
    else:
        rows[where] = value.expand_as(rows[where])
    return rows


def forward_position(hook_name: str, order: dict) -> tuple:
    """Where a forward reaches a hook: the embeddings, each layer's sites in tlh.SITES order, the final norm."""
    layer = re.match(r"blocks\.(\d+)\.", hook_name)
    template = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", hook_name)
    final = hook_name.startswith("ln_final.")
    return (final, -1 if layer is None else int(layer.group(1)), order[template])


def as_vllm_computes(family: str, hf_model: torch.nn.Module) -> None:
    """Make the reference compute what vLLM computes where the two differ by an activation or a window alone, not by
    a hook's meaning: BLOOM's GELU exact, as vLLM's (transformers' BloomGelu is the tanh approximation, 2-4e-4
    apart), Apertus's xIELU with its parameters in bf16, as vLLM's XIELU keeps them whatever the engine's dtype (up
    to 3e-3 apart in fp32), and Cohere 2's sliding window one token wider, as vLLM's."""
    if family == "cohere2":  # (the masks read the config; each attention keeps its own copy)
        hf_model.config.sliding_window += 1
        for module in hf_model.modules():
            if isinstance(getattr(module, "sliding_window", None), int) and module is not hf_model:
                module.sliding_window += 1
    for module in list(hf_model.modules()):
        if family == "bloom" and hasattr(module, "gelu_impl"):
            module.gelu_impl = torch.nn.GELU().train(module.training)
        if family == "apertus" and type(module).__name__ == "XIELUActivation":
            module.to(torch.bfloat16)


class Model:
    """A tiny random model saved to disk, its transformers module, and TransformerLens
    4.3's bridge on a copy of it (booted on first use; the bridge rewires the module
    it is given)."""

    def __init__(self, family: str, path: Path, hf_model=None):
        """hf_model: the transformers model saved at path (default: the family's tiny model, built there)."""
        self.family, self.path = family, path
        self.hf = tools.tiny_model(str(path), family) if hf_model is None else hf_model
        self.routing = {"choices": 0, "followed": 0, "gap": 0.0}  # (see reference's routes)
        # An engine in this process running vLLM's Transformers backend decorates
        # transformers' model classes for torch.compile; these instances (and the
        # bridge's copy) predate it and run transformers' own forward.
        for module in self.hf.modules():
            module.do_not_compile = True
        self._bridge = None
        self._expected = None

    @property
    def bridge(self):
        import transformer_lens.model_bridge.sources.transformers.helpers as sources
        from transformer_lens.model_bridge import TransformerBridge

        # The bridge pip-installs torchvision where a multimodal checkpoint's processor needs it: never here (where
        # torchvision does not import, the processor is left out, which the text model's hooks do not need).
        sources._ensure_torchvision = torchvision_imports
        if self._bridge is None:
            self._bridge = TransformerBridge.boot_transformers(
                str(self.path), hf_model=copy.deepcopy(self.hf), dtype=torch.float32, device="cpu"
            )
            as_vllm_computes(self.family, self._bridge.original_model)
        return self._bridge

    @property
    def expected(self) -> dict[str, tuple[int, ...]]:
        """{hook name: row shape} of every hook of tlh.SITES that TransformerLens's bridge runs in a forward of this
        model, on every layer, in forward order, less the sites its record refuses (each with its reason). The test's
        own account of what the module must place, from the bridge alone."""
        if self._expected is None:
            with torch.no_grad():
                _logits, cache = self.bridge.run_with_cache(torch.tensor([PROMPT[:8]]))
            refused, latent = tlh.FAMILIES[self.family].refused, latent_attention(tlh.FAMILIES[self.family])
            found = {}
            for name, tensor in cache.items():
                site = site_of(name)
                if site is not None and site not in refused:
                    rows = tensor if tensor.shape[0] == 8 else tensor[0]  # (a router's and OPT's ln2 drop the batch)
                    found[name] = tuple(rows.shape[1:])
                    if latent and name.endswith(HEADS_FIRST):
                        found[name] = tuple(rows.transpose(0, 1).shape[1:])
                    elif latent and name.endswith(tuple(latent_rows(self.hf.config))):
                        found[name] = latent_rows(self.hf.config)[name.split(".", 2)[2]]
                    elif name.endswith(ATTENTION):  # each token's query and key heads, [heads + kv heads, d_head]
                        layer = name.split(".")[1]
                        keys = cache[f"blocks.{layer}.attn.hook_k"].shape[-2]
                        found[name] = (tensor.shape[1] + keys, cache[f"blocks.{layer}.attn.hook_z"].shape[-1])
            order = {name: n for n, name in enumerate(tlh.SITES.values())}
            self._expected = dict(sorted(found.items(), key=lambda item: forward_position(item[0], order)))
        return self._expected

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites of ``expected``, in tlh.SITES order."""
        present = {site_of(name) for name in self.expected}
        return tuple(site for site in tlh.SITES if site in present)

    @property
    def classic_sites(self) -> tuple[str, ...]:
        if importlib.util.find_spec("transformer_lens") is None:  # (the GPU machine): those transformers' taps place
            return tuple(site for site in CLASSIC_SITES if site in TRANSFORMERS_TAPS.get(self.family, {}))
        return tuple(site for site in self.sites if site in CLASSIC_SITES)

    def reference(self, token_ids, names, edits=None, routes=None, **inputs):
        """{hook_name: [len(token_ids), *row shape]} from TransformerLens's run_with_hooks,
        each edit applied at its hook and carried downstream as TransformerLens carries it;
        inputs: the forward's other inputs (a multimodal checkpoint's pixel_values).

        routes: {layer: (indices [len(token_ids), top_k], weights [len(token_ids), experts])}, a
        bf16 engine's routing (scripts/gpu_families.py). Where TransformerLens chooses other
        experts, or the same in another order, it follows the engine's, weights included;
        ``routing`` counts those tokens and keeps the widest router-logit gap between the experts
        swapped, rank by rank, which must be a near-tie (bf16 rounding), never a disagreement."""
        bridge = self.bridge
        edits = edits or {}
        captured = {}
        following = self.following(routes)
        latent = latent_attention(tlh.FAMILIES[self.family])

        def make_hook(name):
            def hook(tensor, hook):
                flat = tensor.dim() == 2 and tensor.shape[0] == len(token_ids)  # OPT's MLP drops the batch
                rows = tensor if flat else tensor[0]
                heads_first, z = latent and name.endswith(HEADS_FIRST), latent and name.endswith("attn.hook_z")
                shape = rows.shape
                if heads_first or z:  # (see HEADS_FIRST)
                    rows = rows.transpose(0, 1) if heads_first else rows.reshape(len(rows), *latent_rows(
                        self.hf.config)["attn.hook_z"])
                if name in edits:  # an edit, or a function of the rows (an SAE feature edit)
                    rows = edits[name](rows) if callable(edits[name]) else apply_edit(rows, edits[name])
                captured[name] = rows.clone()
                rows = rows.transpose(0, 1) if heads_first else rows.reshape(shape)
                return rows if flat else rows[None]

            return hook

        hooked = list(dict.fromkeys([*names, *edits]))  # an edited hook runs whether or not its rows are asked for
        with torch.no_grad(), self.routers_following(routes):
            bridge.run_with_hooks(torch.tensor([token_ids]), fwd_hooks=following + [(n, make_hook(n)) for n in hooked],
                                  **inputs)
        return {name: captured[name] for name in names}

    def following(self, routes: dict | None) -> list:
        """The hooks that make the routers follow routes of the engine's choice ({layer: (indices, weights)}, see
        reference), for run_with_hooks or the bridge's hooks(); routes of its logits, under routers_following."""
        return [hook for layer, route in (routes or {}).items() if not torch.is_tensor(route)
                for hook in self._follow(layer, *route)]

    @contextlib.contextmanager
    def routers_following(self, routes: dict | None):
        """For the block's length, transformers' routers inside the bridge follow routes of the engine's router logits
        ({layer: logits [tokens, experts]}, NaN where the engine kept none; see engine_routes), where the bridge runs
        no expert hooks (DeepSeek's, whose router chooses inside its own forward): by the family's rule (see choice)
        from its logits and from the engine's; where the experts differ, the router returns the engine's experts,
        weighed from the engine's logits."""
        handles = []
        for layer, route in (routes or {}).items():
            if torch.is_tensor(route):
                mlp = self.bridge.blocks[layer].mlp
                router, follow = ((mlp.router, self._follow_router_logits) if hasattr(mlp, "router")
                                  else (mlp.gate, self._follow_logits))
                handles.append(router.original_component.register_forward_hook(follow(route)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _follow_router_logits(self, engine_logits: torch.Tensor):
        """For a router whose block takes the top k of the softmax of its logits (Jamba's, a plain linear layer):
        where the engine's logits choose other experts, the router returns the engine's logits."""
        top_k = self.hf.config.get_text_config().num_experts_per_tok

        def follow(_router, _inputs, logits):
            count = min(len(logits), len(engine_logits))
            engine_rows = engine_logits[:count].to(logits.device)
            kept = ~engine_rows.isnan().any(-1)
            own = logits[:count].float().topk(top_k, dim=-1).indices
            engine = engine_rows.nan_to_num().topk(top_k, dim=-1).indices
            where = kept & (own.sort(-1).values != engine.sort(-1).values).any(-1)
            record_followed(self.routing, logits[:count].float(), own, engine, where, kept)
            logits = logits.clone()
            logits[:count][where] = engine_rows[where].to(logits.dtype)
            return logits

        return follow

    def _follow_logits(self, engine_logits: torch.Tensor):
        config = self.hf.config

        def weighed(router, logits):
            """The router's scores [tokens, experts]: V3's sigmoid, V2's softmax."""
            biased = hasattr(router, "e_score_correction_bias")
            return logits.float().sigmoid() if biased else logits.float().softmax(-1)

        def choice(router, logits):
            """(the scores chosen by [tokens, experts], the chosen experts [tokens, top_k]), by the router's rule: V3's
            sigmoid plus its correction bias within the best groups (each scored by its two best), V2's softmax."""
            scores = weighed(router, logits) + getattr(router, "e_score_correction_bias", torch.zeros(())).float()
            grouped = scores.view(len(scores), config.n_group, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
            kept = torch.zeros_like(grouped[..., 0]).scatter(1, best, 1.0).bool().repeat_interleave(grouped.shape[-1], 1)
            return scores, scores.masked_fill(~kept, float("-inf")).topk(config.num_experts_per_tok, dim=-1).indices

        def follow(router, _inputs, output):
            logits, weights, indices = output
            count = min(len(logits), len(engine_logits))
            engine_rows = engine_logits[:count].to(logits.device)
            kept = ~engine_rows.isnan().any(-1)
            scores = choice(router, logits[:count])[0]
            engine = choice(router, engine_rows.nan_to_num())[1]
            own = indices[:count]
            where = kept & (own.sort(-1).values != engine.sort(-1).values).any(-1)
            record_followed(self.routing, scores, own, engine, where, kept, config.n_group)
            engine_weights = weighed(router, engine_rows.nan_to_num()).gather(1, engine)
            if config.norm_topk_prob:
                engine_weights = engine_weights / (engine_weights.sum(-1, keepdim=True) + 1e-20)
            weights, indices = weights.clone(), indices.clone()
            weights[:count][where] = (engine_weights[where] * config.routed_scaling_factor).to(weights.dtype)
            indices[:count][where] = engine[where].to(indices.dtype)
            return logits, weights, indices

        return follow

    def _follow(self, layer: int, indices: torch.Tensor, weights: torch.Tensor) -> list:
        """run_with_hooks' hooks that make layer's router follow the engine's choice (see reference). The bridge's
        router fires its logits, then its weights scattered over the experts (whose top k it routes by, once edited),
        then its indices. Where the router chooses by sigmoid scores plus a correction bias (GLM's), its experts are
        ranked, and their gaps measured, by that choice score, as the engine orders its indices."""
        seen = {}
        router = getattr(self.hf.get_decoder().layers[layer].mlp, "gate", None)
        bias = getattr(router, "e_score_correction_bias", None)

        def logits(tensor, hook):
            rows = tensor.reshape(-1, tensor.shape[-1]).float()
            seen["choice"] = rows if bias is None else rows.sigmoid() + bias.float()

        def follow_weights(tensor, hook):
            rows = tensor.reshape(-1, tensor.shape[-1])
            mine = rows.topk(indices.shape[-1], dim=-1).indices[: len(indices)]
            choice = seen["choice"][: len(mine)]
            mine = mine.gather(1, choice.gather(1, mine).argsort(dim=-1, descending=True))  # by choice, highest first
            engine = indices.to(mine.device)
            where = seen["where"] = (mine != engine).any(-1) & (engine >= 0).all(-1)  # (-1: a row the engine kept not)
            groups = getattr(self.hf.config, "n_group", None) or 1 if bias is not None else 1
            record_followed(self.routing, choice[: len(where)], mine, engine, where, torch.ones_like(where), groups)
            rows = rows.clone()
            rows[: len(where)][where] = weights[where].to(rows.dtype)
            return rows.view_as(tensor)

        def follow_indices(tensor, hook):
            rows = tensor.reshape(-1, tensor.shape[-1])
            # (transformers' top k of GLM's router is unsorted, torch.topk(sorted=False): put in choice order)
            rows = rows.gather(1, seen["choice"][: len(rows)].gather(1, rows.long()).argsort(dim=-1, descending=True))
            rows[: len(seen["where"])][seen["where"]] = indices[seen["where"]].to(rows.dtype)
            return rows.view_as(tensor)

        return [(f"blocks.{layer}.mlp.gate.hook_out", logits),
                (f"blocks.{layer}.mlp.hook_expert_weights", follow_weights),
                (f"blocks.{layer}.mlp.hook_expert_indices", follow_indices)]


def torchvision_imports() -> bool:
    """Whether torchvision imports here (never installing it)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a build whose ops do not load (see scripts/vision_env.sh)
        return False
    return True


def needs_torchvision(family: str) -> bool:
    """Whether a multimodal record's tiny checkpoint needs torchvision to be built (a class of its processor does) or
    TransformerLens's bridge to boot on it (its adapter requires it), from transformers' and TransformerLens's own
    declarations."""
    import transformers
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    record = tlh.FAMILIES[family]
    if "torchvision" in (getattr(SUPPORTED_ARCHITECTURES[record.architecture], "required_libraries", None) or []):
        return True
    processor = tools._TINY_MODELS[family].processor
    recipes, names = [processor] if processor else [], []
    while recipes:
        name, settings = recipes.pop()
        names.append(name)
        recipes += [v for v in settings.values() if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict)]
    for name in names:
        try:
            declared = getattr(getattr(transformers, name), "_backends", None) or ()
        except (ImportError, ModuleNotFoundError):  # (transformers' lazy module: a class whose module needs it)
            return True
        if "torchvision" in declared:
            return True
    return False


class Models(dict):
    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        self[family] = Model(family, self.root / family)
        return self[family]


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{family: Model}, each built on first use."""
    return Models(tmp_path_factory.mktemp("models"))


# Where TransformerLens's tensors are among transformers' own modules: {site: (module path, kind)}, kind one of
# - "output" / "input": the module's output, or its input (hidden_states or the first argument); with "_heads",
#   as [pos, heads, head_dim]; "input_gate", its second argument (a gated norm's gate);
# - "rotary": the query or key (the site says which) after apply_rotary_pos_emb in that attention module;
# - "router": a mixture of experts' router (see TransformersReference);
# - "attention": the input and output of the softmax in that attention module's eager attention, [1, heads, query,
#   key] (the scores, masked entries at the dtype's minimum, and the pattern);
# - "scale" / "normalized": a norm's sqrt(mean(x²) + eps) ([pos, 1]) and its input divided by it, before the weight
#   (plus 1 for Gemma's) and bias (TransformerLens's convention); an edit of the scale reaches the normalized rows, an
#   edit of either the norm's output.
# A CPU test checks that these places give exactly TransformerLens's tensors, edits included, on every site the
# bridge runs for the family: the GPU classes, where TransformerLens is not installed, compare with them.
_DECODER = {
    "embed": ("model.embed_tokens", "output"),
    "resid_pre": ("model.layers.{i}", "input"),
    "ln1_scale": ("model.layers.{i}.input_layernorm", "scale"),
    "ln1": ("model.layers.{i}.input_layernorm", "normalized"),
    **{f"attn_{part}": (f"model.layers.{{i}}.self_attn.{part}_proj", "output_heads") for part in "qkv"},
    **{f"attn_rot_{part}": ("model.layers.{i}.self_attn", "rotary") for part in "qk"},
    **dict.fromkeys(("attn_scores", "pattern"), ("model.layers.{i}.self_attn", "attention")),
    "attn_z": ("model.layers.{i}.self_attn.o_proj", "input_heads"),
    "attn_out": ("model.layers.{i}.self_attn", "output"),
    "resid_mid": ("model.layers.{i}.post_attention_layernorm", "input"),
    "ln2_scale": ("model.layers.{i}.post_attention_layernorm", "scale"),
    "ln2": ("model.layers.{i}.post_attention_layernorm", "normalized"),
    "mlp_in": ("model.layers.{i}.mlp", "input"),
    "mlp_pre": ("model.layers.{i}.mlp.gate_proj", "output"),
    "mlp_pre_linear": ("model.layers.{i}.mlp.up_proj", "output"),
    "mlp_post": ("model.layers.{i}.mlp.down_proj", "input"),
    "mlp_out": ("model.layers.{i}.mlp", "output"),
    "resid_post": ("model.layers.{i}", "output"),
    "final_norm_scale": ("model.norm", "scale"),
    "final_norm": ("model.norm", "normalized"),
}
TRANSFORMERS_TAPS = {
    "llama": _DECODER,
    "gemma2": {
        **_DECODER,
        "attn_out": ("model.layers.{i}.post_attention_layernorm", "output"),
        "resid_mid": ("model.layers.{i}.pre_feedforward_layernorm", "input"),
        "ln2_scale": ("model.layers.{i}.pre_feedforward_layernorm", "scale"),
        "ln2": ("model.layers.{i}.pre_feedforward_layernorm", "normalized"),
        "mlp_out": ("model.layers.{i}.post_feedforward_layernorm", "output"),
    },
    # Mixtral: TransformerLens's hook_pre and hook_post of a mixture of experts are its block's input and output; the
    # router's top-k weights (scattered over every expert) and indices, highest first, are the router's.
    "mixtral": {
        **{site: place for site, place in _DECODER.items() if site not in ("mlp_pre", "mlp_pre_linear", "mlp_post")},
        "mlp_pre": ("model.layers.{i}.mlp", "input"),
        "expert_weights": ("model.layers.{i}.mlp.gate", "router"),
        "expert_indices": ("model.layers.{i}.mlp.gate", "router"),
        "mlp_post": ("model.layers.{i}.mlp", "output"),
    },
    # Falcon-H1: a Mamba-2 mixer beside the attention, its gated norm called as norm(y, gate), and the MLP a
    # feed_forward; the multipliers sit between the modules, as TransformerLens's tensors are theirs.
    "falcon_h1": {
        **{site: place for site, place in _DECODER.items()
           if site.startswith(("embed", "resid_pre", "ln1", "attn_", "pattern"))},
        "mamba_in": ("model.layers.{i}.mamba", "input"),  # (transformers' mixer multiplies it by ssm_in_multiplier)
        "mamba_in_proj": ("model.layers.{i}.mamba.in_proj", "output"),
        "mamba_norm_in": ("model.layers.{i}.mamba.norm", "input"),
        "mamba_norm_gate": ("model.layers.{i}.mamba.norm", "input_gate"),
        "mamba_norm": ("model.layers.{i}.mamba.out_proj", "input"),
        "mamba_out": ("model.layers.{i}.mamba", "output"),
        "resid_mid": ("model.layers.{i}.pre_ff_layernorm", "input"),
        "ln2_scale": ("model.layers.{i}.pre_ff_layernorm", "scale"),
        "ln2": ("model.layers.{i}.pre_ff_layernorm", "normalized"),
        **{site: (path.replace(".mlp", ".feed_forward"), kind) for site, (path, kind) in _DECODER.items()
           if site.startswith("mlp_")},
        "resid_post": ("model.layers.{i}", "output"),
        "final_norm_scale": ("model.final_layernorm", "scale"),
        "final_norm": ("model.final_layernorm", "normalized"),
    },
    # LFM2: short-convolution layers (transformers' convolves with the conv's weight, never calling it; its output is
    # the output projection's) beside attention whose output projection is out_proj; the MLP's w1, w3 and w2.
    "lfm2": {
        **{site: place for site, place in _DECODER.items() if site.startswith(("embed", "resid_", "attn_", "pattern"))},
        **{site: (path.replace("input_layernorm", "operator_norm").replace("post_attention_layernorm", "ffn_norm")
                  .replace("model.norm", "model.embedding_norm"), kind)
           for site, (path, kind) in _DECODER.items() if site.startswith(("ln1", "ln2", "resid_mid", "final_norm"))},
        "attn_z": ("model.layers.{i}.self_attn.out_proj", "input_heads"),
        "conv_in": ("model.layers.{i}.conv", "input"),
        "conv_in_proj": ("model.layers.{i}.conv.in_proj", "output"),
        "conv_gated": ("model.layers.{i}.conv.out_proj", "input"),
        "conv_out": ("model.layers.{i}.conv", "output"),
        "mlp_in": ("model.layers.{i}.feed_forward", "input"),
        "mlp_pre": ("model.layers.{i}.feed_forward.w1", "output"),
        "mlp_pre_linear": ("model.layers.{i}.feed_forward.w3", "output"),
        "mlp_post": ("model.layers.{i}.feed_forward.w2", "input"),
        "mlp_out": ("model.layers.{i}.feed_forward", "output"),
    },
}


def record_followed(routing: dict, logits, own, engine, differs, counted, groups: int = 1) -> None:
    """Both references' account of following an engine's routing: choices seen (counted, bool [tokens]: the tokens
    the engine routed), choices followed (differs, bool [tokens]), and the widest router-logit gap between their own
    experts and the engine's, rank by rank (own and engine: int [tokens, top_k]; logits [tokens, experts], or the
    scores the router chooses by). Tokens whose logits are the same (an edit that sets or zeroes a layer's stream
    makes every token's so) are one choice, made and followed once: choices and followed count distinct logits.
    groups: where the router chooses among the best of that many groups of experts, each scored by its two best
    (GLM's), a token whose experts come from other groups is measured by the gap between those groups' scores, which
    decided it."""
    routing["choices"] += len(torch.unique(logits[counted], dim=0))
    routing["followed"] += len(torch.unique(logits[differs], dim=0))
    if differs.any():
        scores, own, engine = logits[differs], own[differs], engine[differs]
        gap = (scores.gather(1, own) - scores.gather(1, engine)).abs().amax(-1)
        if groups > 1:
            size = scores.shape[1] // groups
            group_scores = scores.view(len(scores), groups, size).topk(2, dim=-1).values.sum(-1)
            own_groups, engine_groups = ((experts // size).sort(-1).values for experts in (own, engine))
            other = (own_groups != engine_groups).any(-1)
            group_gap = (group_scores.gather(1, own_groups) - group_scores.gather(1, engine_groups)).abs().amax(-1)
            gap = torch.where(other, group_gap, gap)
        routing["gap"] = max(routing["gap"], float(gap.max()))


def transformers_sites(family: str) -> tuple[str, ...]:
    """The sites TRANSFORMERS_TAPS places for a family, in tlh.SITES order: what the GPU classes hook (the CPU test
    checks they are every site the bridge runs)."""
    return tuple(site for site in tlh.SITES if site in TRANSFORMERS_TAPS[family])


class TransformersReference:
    """The hooks read with forward hooks on transformers' modules, at TRANSFORMERS_TAPS; edits as in
    Model.reference (an edit dict, or a function of the rows).

    A mixture of experts routes on router logits that bf16 rounding moves by ~1e-2: where two experts' logits are
    that close, the engine may choose the other one. Given the engine's expert indices (``routes``), the reference
    follows them at the tokens where its own choice or order differs, and ``routing`` records how many it followed
    and the widest logit gap between the experts it swapped, which the tests bound by ROUTER_TIE."""

    def __init__(self, family: str, hf_model):
        self.family, self.hf = family, hf_model
        self.routing = {"choices": 0, "followed": 0, "gap": 0.0}

    def reference(self, token_ids, names, edits=None, routes=None):
        """routes: {hook_expert_indices name: the engine's indices, [len(token_ids), top_k], -1 where not kept}."""
        edits, routes = edits or {}, routes or {}
        modules = dict(self.hf.named_modules())

        def head_dim(path):  # the attention module's, the nearest module up the path that has one
            return getattr(modules[path], "head_dim", None) or head_dim(path.rpartition(".")[0])

        order = {site: n for n, site in enumerate(tlh.SITES)}
        hooked = list(dict.fromkeys([*names, *edits]))  # an edited hook runs whether or not its rows are asked for
        captured, handles = {}, []

        def take(name, tensor, row_shape=(-1,)):
            """tensor: [1, pos, ...]; returns it with the edit applied to its rows."""
            rows = tensor[0].reshape(tensor.shape[1], *row_shape)
            if name in edits:
                rows = edits[name](rows) if callable(edits[name]) else apply_edit(rows, edits[name])
            captured[name] = rows.clone()
            return rows.reshape(tensor.shape)

        def take_all(names, tensor, shape):  # hooks that share a tensor, in forward order
            for name in names:
                tensor = take(name, tensor, shape)
            return tensor

        by_place = {}  # (module path, kind) -> {site: hook name}, sites in forward order
        for name in sorted(hooked, key=lambda name: order[site_of(name)]):
            site = site_of(name)
            layer = re.match(r"blocks\.(\d+)\.", name)
            path, kind = TRANSFORMERS_TAPS[self.family][site]
            kind = "norm" if kind in ("scale", "normalized") else kind  # (one hook rebuilds the norm from both)
            by_place.setdefault((path.format(i=layer and layer.group(1)), kind), {})[site] = name
        for (path, kind), sites in by_place.items():
            module, tapped = modules[path], list(sites.values())
            shape = (-1, head_dim(path)) if kind.endswith("_heads") else (-1,)
            if kind.startswith("output"):

                def hook(_module, _inputs, output, tapped=tapped, shape=shape):
                    if isinstance(output, tuple):
                        return (take_all(tapped, output[0], shape), *output[1:])
                    return take_all(tapped, output, shape)

                handles.append(module.register_forward_hook(hook))
            elif kind == "input_gate":

                def pre_hook(_module, args, kwargs, tapped=tapped, shape=shape):
                    if "gate" in kwargs:
                        return args, {**kwargs, "gate": take_all(tapped, kwargs["gate"], shape)}
                    return (args[0], take_all(tapped, args[1], shape), *args[2:]), kwargs

                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            elif kind.startswith("input"):

                def pre_hook(_module, args, kwargs, tapped=tapped, shape=shape):
                    if "hidden_states" in kwargs:
                        return args, {**kwargs, "hidden_states": take_all(tapped, kwargs["hidden_states"], shape)}
                    return (take_all(tapped, args[0], shape), *args[1:]), kwargs

                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            elif kind == "router":
                indices_name = next(name for name in tapped if name.endswith("hook_expert_indices"))
                handles.append(module.register_forward_hook(self._router_hook(sites, captured, routes.get(indices_name))))
            elif kind == "rotary":
                handles.append(self._rotary(module, sites, take, head_dim(path)))
            elif kind == "attention":
                handles.append(self._attention(module, sites, captured))
            else:
                handles.append(module.register_forward_hook(self._norm_hook(sites, take)))
        implementation = self.hf.config._attn_implementation
        if any(kind == "attention" for _path, kind in by_place):
            self.hf.set_attn_implementation("eager")  # (which holds the attention matrices)
        try:
            with torch.no_grad():
                self.hf(torch.tensor([token_ids]))
        finally:
            for handle in reversed(handles):  # (the rotary patches nest)
                handle.remove()
            self.hf.set_attn_implementation(implementation)
        return {name: captured[name] for name in names}

    def _router_hook(self, sites, captured, engine_indices):
        """transformers' router output (logits [pos, experts], top-k weights and indices [pos, top_k]), read as
        TransformerLens reads it (the weights scattered over every expert, zero elsewhere), following the engine's
        indices where they differ (Mixtral's weights: the softmax at the chosen experts, renormalized)."""

        def hook(_module, _inputs, output):
            logits, weights, indices = output
            if engine_indices is not None:
                known = (engine_indices >= 0).all(-1)
                differs = known & (engine_indices != indices).any(-1)
                record_followed(self.routing, logits, indices, engine_indices.to(indices.dtype), differs, known)
                if differs.any():
                    chosen = engine_indices[differs].to(indices.dtype)
                    probabilities = logits[differs].float().softmax(-1).gather(1, chosen)
                    indices, weights = indices.clone(), weights.clone()
                    indices[differs], weights[differs] = chosen, (probabilities / probabilities.sum(-1, keepdim=True)).to(weights.dtype)
            for site, name in sites.items():
                if site == "expert_indices":
                    captured[name] = indices.clone()
                else:
                    captured[name] = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, indices, weights)
            return logits, weights, indices

        return hook

    def _norm_hook(self, sites, take):
        """The norm's output rebuilt from its hooked scale and normalized rows (one hook for both sites)."""
        scale_name = next((name for site, name in sites.items() if site.endswith("scale")), None)
        normalized_name = next((name for site, name in sites.items() if not site.endswith("scale")), None)

        def hook(module, inputs, output):
            x = inputs[0].float()
            if isinstance(module, torch.nn.LayerNorm):
                x = x - x.mean(-1, keepdim=True)
            eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon")
            scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
            scale = take(scale_name, scale, (1,)) if scale_name else scale
            normalized = x / scale
            normalized = take(normalized_name, normalized) if normalized_name else normalized
            weight = module.weight.float() + (1.0 if self.family == "gemma2" else 0.0)
            bias = getattr(module, "bias", None)
            return (normalized * weight + (0.0 if bias is None else bias.float())).to(output.dtype)

        return hook

    @staticmethod
    def _attention(attention, sites, captured):
        """Reads the scores and pattern at the softmax of the attention module's eager attention, for the forward of
        this module only; returns a handle that undoes it."""
        softmax, inside = torch.nn.functional.softmax, []

        def observed(scores, *args, **kwargs):
            pattern = softmax(scores, *args, **kwargs)
            if inside:
                for site, name in sites.items():
                    captured[name] = (scores if site == "attn_scores" else pattern)[0].clone()
            return pattern

        torch.nn.functional.softmax = observed
        entered = attention.register_forward_pre_hook(lambda _module, _args: inside.append(True))
        left = attention.register_forward_hook(lambda _module, _args, _output: inside.clear())

        class Handle:
            def remove(self):
                torch.nn.functional.softmax = softmax
                entered.remove()
                left.remove()

        return Handle()

    @staticmethod
    def _rotary(attention, sites, take, head_dim):
        """Hooks the query and key after the attention module's apply_rotary_pos_emb ([1, heads, pos, head_dim]
        there), for the forward of this module only; returns a handle that undoes it."""
        source = sys.modules[type(attention).__module__]
        original = source.apply_rotary_pos_emb
        inside = []

        def rotated(query, key, *args, **kwargs):
            query, key = original(query, key, *args, **kwargs)
            if inside:
                tapped = {"attn_rot_q": query, "attn_rot_k": key}
                for site, name in sites.items():
                    tapped[site] = take(name, tapped[site].transpose(1, 2), (-1, head_dim)).transpose(1, 2)
                query, key = tapped["attn_rot_q"], tapped["attn_rot_k"]
            return query, key

        def enter(_module, _args):
            inside.append(True)

        def leave(_module, _args, _output):
            inside.clear()

        source.apply_rotary_pos_emb = rotated
        entered, left = attention.register_forward_pre_hook(enter), attention.register_forward_hook(leave)

        class Handle:
            def remove(self):
                source.apply_rotary_pos_emb = original
                entered.remove()
                left.remove()

        return Handle()


def engine_routes(reference, rows: dict, kept: list[int], length: int) -> dict:
    """reference.reference's routes where it follows a bf16 engine's routing: the engine's expert indices of a request
    (rows: its rows at the positions kept, of a sequence of length tokens), -1 at the others. A TransformersReference's
    ({hook: indices}), and the bridge's on a family vLLM's CPU runs in bf16 alone ({layer: (indices, weights)}, or
    {layer: the router's logits} where the bridge runs no expert hooks, from the rows router_logits kept, which are
    taken out of rows); {} for the bridge on the others, which agree with it in fp32 at every token."""
    routes = {}
    bf16_bridge = isinstance(reference, Model) and tools._TINY_MODELS[reference.family].bfloat16
    for name in [name for name in rows if name.startswith(ROUTER_LOGITS)]:  # (taken out of rows: see router_logits)
        logits = torch.full((length, rows[name].shape[-1]), float("nan"))
        logits[kept] = rows.pop(name).float()
        routes[int(name.removeprefix(ROUTER_LOGITS))] = logits
    for name, tensor in rows.items():
        if name.endswith("mlp.hook_expert_indices") and (bf16_bridge or isinstance(reference, TransformersReference)):
            indices = torch.full((length, tensor.shape[-1]), -1, dtype=torch.long)
            indices[kept] = tensor.long()
            if bf16_bridge:
                chosen = rows[name.replace("indices", "weights")]
                weights = torch.zeros(length, chosen.shape[-1])
                weights[kept] = chosen.float()
                routes[int(name.split(".")[1])] = (indices, weights)
            else:
                routes[name] = indices
    return {"routes": routes} if routes else {}


def fresh_routing(reference) -> None:
    """Zero the reference's account of routings followed, so that the check starting now is held to its own."""
    reference.routing = {"choices": 0, "followed": 0, "gap": 0.0}


def routing_held_to_ties(reference, context: str) -> None:
    """assert_routing_ties where the reference has followed an engine's routing, over what the check (since its
    fresh_routing) ran; then zeroed."""
    try:
        if reference.routing["choices"]:
            assert_routing_ties(reference, context)
    finally:
        fresh_routing(reference)


# The widest router-logit gap at which the engine may choose other experts than transformers, and the share of
# token-layer choices it may do so at: bf16 compute moves the tiny models' router logits (~N(0, 1)) by up to ~5e-2
# (Mixtral on vLLM 0.32's CPU in bf16: 19 of 1,134 routings followed, the widest at a gap of 4.6e-2; TestFamilies' and
# TestFamiliesOnePromptFlavour's Qwen3-Next, 69 of 7,354 at 3.2e-2, and Qwen 3.5 MoE, 90 of 11,031 at 4.8e-2; on an
# H100 under CUDA graphs, Mixtral's unedited rows 18 of 1,134 at 4.9e-2 and DeepSeek V3's edited ones 14 of 2,035 at
# 4.3e-3). A choice is counted once per distinct router logits (record_followed): an edit that sets a layer's stream
# gives every token the same, and Mixtral's one-prompt edits on that H100 followed 190 of 2,640 when each such token
# counted apart.
ROUTER_TIE, ROUTER_TIE_SHARE = 1e-1, 0.05


def router_tie(family: str) -> float:
    """ROUTER_TIE, or for a Gated DeltaNet family ROUTER_TIE_AFTER_LINEAR_ATTENTION (its bf16 spread reaches the
    routers it feeds)."""
    return ROUTER_TIE_AFTER_LINEAR_ATTENTION if tlh.FAMILIES[family].linear_attention else ROUTER_TIE


def assert_routing_ties(reference: TransformersReference, context: str) -> str:
    """The routing the reference followed was at near-ties only, and rarely; returns the report."""
    routing = reference.routing
    said = (f"{routing['followed']} of {routing['choices']} token-layer routings followed the engine's, the widest "
            f"at a router-logit gap of {routing['gap']:.2e}")
    tie = router_tie(reference.family)
    assert routing["gap"] <= tie, f"{context}: {said}, wider than a near-tie ({tie})"
    assert routing["followed"] <= ROUTER_TIE_SHARE * routing["choices"], f"{context}: {said}: too many"
    return said


def bf16_reference(model: Model) -> TransformersReference:
    """transformers in fp32 on the weights rounded to bf16, as vLLM loads them in bf16."""
    rounded = copy.deepcopy(model.hf)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    return TransformersReference(model.family, rounded)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||; the plain norm of the difference where expected is 0."""
    difference = float((actual.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    return difference / scale if scale else difference


def _mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """How two activations differ, row by row: a scaled copy of the right row (norm ratio off,
    cosine 1) reads differently from another row's values (cosine far from 1)."""
    rows = []
    for i, (a, e) in enumerate(zip(actual.double().reshape(len(actual), -1), expected.double().reshape(len(expected), -1))):
        error = relative_error(a, e)
        cosine = float(torch.nn.functional.cosine_similarity(a, e, dim=0))
        rows.append((error, f"row {i}: error {error:.2e}, norm ratio {float(a.norm() / e.norm()):.3f}, cosine {cosine:.3f}"))
    return "; ".join(text for _error, text in sorted(rows, reverse=True)[:3])


class PerRow(float):
    """A tolerance that each row (one position's [*row shape]) meets alone, where a relative error over a whole
    [rows, ...] tensor would average one wrong row of many away. worst_row: the worst row error it has been held to
    in this process (for the GPU tests' report)."""

    worst_row = 0.0


# Rows held under a PerRow bound relative to their own norm, floored where that norm can be near 0:
# - linear attention's output, at the mean row's norm: the delta rule leaves it ~1/50 of a typical row's norm at some
#   positions (Qwen 3.5's tiny model: the first position's row 1/50 of the median row's, its bf16 error below the
#   median row's; 2026-12-05);
# - attention scores, each query's row, at a quarter of what a row seeing as many keys holds typically (the hook's rms
#   score over the keys seen, times the root of the row's count of them): a first query sees one key a head, and an
#   edit can bring its few scores near 0, where bf16's error, which scales with the query's and key's lengths, does not
#   shrink (DeepSeek V3's layer-1 first query under the composed edits of its layer 1: 0.58 of its own norm, cosine
#   0.999). Unedited, a query's scores in bf16 against fp32 lie within 9.4e-2 of their own norm (the bridge in bf16
#   against fp32, 200 tokens, every layer of Llama, DeepSeek V3, GLM-4.7-Flash, Qwen3-Next, Gemma 2 and Mixtral's
#   first two; GLM's layer-1 first query the worst; 2026-12-07); the mean row's norm held a first query ~sqrt(positions
#   / 2) times more loosely.
TYPICAL_ROWS = ("linear_attn.hook_out",)
KEY_COUNT_ROWS = ("attn.hook_attn_scores",)
KEY_COUNT_FLOOR = 0.25


def row_errors(actual: torch.Tensor, expected: torch.Tensor, floor: str = "") -> torch.Tensor:
    """relative_error of each row ([rows], float64), relative to its norm, or to the larger of that and a floor:
    "typical", the mean row's norm; "keys", KEY_COUNT_FLOOR times the rms of the nonzero entries (the keys seen:
    comparable zeroes the others) times the root of the row's count of them."""
    a, e = actual.double().reshape(len(actual), -1), expected.double().reshape(len(expected), -1)
    scale = e.norm(dim=1)
    if floor == "typical":
        scale = scale.clamp_min(float(scale.mean()))
    elif floor == "keys":
        seen = (e != 0).sum(dim=1)
        rms = float(e.norm() / max(int(seen.sum()), 1) ** 0.5)
        scale = torch.maximum(scale, KEY_COUNT_FLOOR * rms * seen.double().sqrt())
    difference = (a - e).norm(dim=1)
    return torch.where(scale > 0, difference / scale.clamp_min(1e-300), difference)


def comparable(name: str, actual: torch.Tensor, expected: torch.Tensor, context: str = "") -> tuple:
    """One hook's (actual, expected) as its rows are compared: attention's a row per query, the keys it does not see
    compared as such (asserted alike), not by value."""
    if not name.endswith(ATTENTION):
        return actual, expected
    unseen = expected < UNSEEN
    assert torch.equal(actual < UNSEEN, unseen), f"{context} {name}: other keys unseen"
    return tuple(t.masked_fill(unseen, 0).transpose(0, 1) for t in (actual, expected))


def hook_row_errors(name: str, actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """row_errors of one hook's comparable rows as the PerRow tolerances hold them (see TYPICAL_ROWS)."""
    floor = "keys" if name.endswith(KEY_COUNT_ROWS) else "typical" if name.endswith(TYPICAL_ROWS) else ""
    return row_errors(actual, expected, floor)


def assert_matches(actual: dict, expected: dict, context: str = "", tolerance=TOLERANCE) -> float:
    """The worst relative error of a whole hook's rows over the hooks; fails naming every hook beyond tolerance (a
    PerRow tolerance: every hook with a row beyond it)."""
    assert set(actual) == set(expected), f"{context}: hooks {sorted(actual)} != {sorted(expected)}"
    errors, checked = {}, {}
    limit = tolerance if callable(tolerance) else lambda _name: tolerance  # (see family_tolerance)
    actual, expected = dict(actual), dict(expected)
    for name in expected:
        assert actual[name].shape == expected[name].shape, (
            f"{context} {name}: shape {tuple(actual[name].shape)} != {tuple(expected[name].shape)}"
        )
        assert expected[name].is_floating_point() or actual[name].dtype == expected[name].dtype, (
            f"{context} {name}: {actual[name].dtype}, where the reference's are {expected[name].dtype}"
        )
        actual[name], expected[name] = comparable(name, actual[name], expected[name], context)
        errors[name] = relative_error(actual[name], expected[name])
        checked[name] = errors[name]
        if isinstance(limit(name), PerRow) and len(expected[name]):
            checked[name] = float(hook_row_errors(name, actual[name], expected[name]).max())
            PerRow.worst_row = max(PerRow.worst_row, checked[name])
    failed = [name for name, error in checked.items() if error > limit(name)]
    assert not failed, f"{context}: relative error past tolerance in " + " | ".join(
        f"{name} {checked[name]:.2e} > {limit(name):.0e} (worst rows: {_mismatch(actual[name], expected[name])})"
        for name in failed
    )
    return max(errors.values(), default=0.0)


# --- engines -----------------------------------------------------------------


ROUTER_LOGITS = "router_logits."


def router_logits(family: str, hf_config) -> dict:
    """For a family whose bridge runs no expert hooks and whose engines run in bf16, on vLLM's CPU (DeepSeek V3's) or
    on a GPU for a CUDA_ONLY family (Jamba's; its fp32 engines here keep them too and follow none): each MoE layer's
    router logits, as raw module specs ({ROUTER_LOGITS + layer: (module path, experts)}), kept beside the hooks so that
    the reference can follow the engine's routing (engine_routes takes them out of the rows it reads)."""
    record, config = tlh.FAMILIES[family], hf_config.get_text_config()
    bf16 = tools._TINY_MODELS[family].bfloat16 or family in CUDA_ONLY
    if not (bf16 and record.moe and not record.moe.router):
        return {}
    router = ROUTER_MODULES.get(family, ".gate")
    experts = getattr(config, "n_routed_experts", None) or tlh._num_experts(config)
    return {f"{ROUTER_LOGITS}{i}": (record.layer.format(i=i) + record.moe.block + router, experts)
            for i in range(config.num_hidden_layers) if tlh._moe_layer(record, config, i)}


ROUTER_MODULES = {"jamba": ".router"}  # where vLLM's router is not the block's .gate


def engine_arguments(dtype="float32"):
    """The LLM arguments of every test engine beside the config's llm_kwargs: few requests
    a step (with MAX_TOKENS_PER_FORWARD tokens, prompts are chunked and steps mix requests).
    On a GPU the KV cache is given in bytes: vLLM then skips its memory profile, which counts
    what other processes allocate on the device, so test classes can share one GPU at once."""
    cuda = {"kv_cache_memory_bytes": 1 << 30} if torch.cuda.is_available() else {}
    return dict(
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.05,
        seed=0,
        **cuda,
    )


@contextlib.contextmanager
def environment_restored(**variables):
    """Set environment variables (and make vLLM read them again) for the block's length."""
    from vllm import envs

    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        envs.disable_envs_cache()


@contextlib.contextmanager
def engine(
    model,
    *,
    sites=None,
    in_process,
    eager,
    batching=False,
    positions=True,
    dtype="float32",
    environment=(),
    sink_dir=None,
    shard_bytes=1 << 30,
    sink_writer="tl_vllm_hooks_tools:RankSink",
    saes=None,
    sae_top_k=64,
    sae_chosen_features=0,
    attention_heads=None,
    logit_lens=None,
    rows=MAX_TOKENS_PER_FORWARD,
    earlier_rotary=False,
    **llm_kwargs,
):
    """An LLM with hooks on every layer's `sites` (default: all the family has); shut down
    on exit, and the environment as it was. In this process, it builds its own rotary modules unless earlier_rotary:
    vLLM's get_rope otherwise hands it those an earlier test's engine built, with that engine's custom_ops."""
    from vllm import LLM
    from vllm.model_executor.layers import rotary_embedding

    specs = tlh.capture_specs(model.hf.config, sites=sites or model.classic_sites)
    config = tlh.configure(
        {**specs, **router_logits(model.family, model.hf.config)},
        rows,
        getattr(torch, dtype),
        enable_batching=batching,
        enable_position_interventions=positions,
        sink_dir=sink_dir,
        shard_bytes=shard_bytes,
        sink_writer=sink_writer,
        saes=saes or {},
        sae_top_k=sae_top_k,
        sae_chosen_features=sae_chosen_features,
        attention_heads=attention_heads or {},
        logit_lens=logit_lens or {},
    )
    layout = "0" if in_process else "1"
    if in_process and not earlier_rotary:
        rotary_embedding._ROPE_DICT.clear()
    with environment_restored(VLLM_ENABLE_V1_MULTIPROCESSING=layout, **dict(environment)):
        arguments = {**engine_arguments(dtype), "enforce_eager": eager, **config.llm_kwargs, **llm_kwargs}
        # vLLM's start-up collects the whole heap three times (0.6 s each beside TransformerLens and ~900k objects);
        # frozen, those collections skip it. vLLM's shutdown unfreezes it again.
        gc.freeze()
        try:
            llm = LLM(str(model.path), **arguments)
        except Exception:
            if in_process:  # a refused start leaves vLLM's parallel groups of its model to the next engine here
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            raise
        llm.hook_names = list(specs)
        llm.config = config
        try:
            yield llm
        finally:
            shutdown(llm, in_process)


def shutdown(llm, in_process):
    import psutil

    core = llm.llm_engine.engine_core
    resources = getattr(core, "resources", None)  # (separate processes only)
    engine_processes = []
    for process in getattr(getattr(resources, "engine_manager", None), "processes", ()):
        with contextlib.suppress(psutil.NoSuchProcess):
            engine_processes += [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    try:
        core.shutdown()
    except psutil.NoSuchProcess:
        # vLLM's kill_process_tree names each process before it kills it, and gives up at the first that exited
        # meanwhile (seen once in CI, tensor parallel 2 on the CPU): kill what is left of the engine's, and close
        # the sockets that the shutdown did not reach.
        for process in engine_processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        resources()
    del llm
    if in_process:  # (which collects the garbage, the engine included)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    else:
        gc.collect()


def generate(llm, prompts, max_tokens=1, extra_args=None):
    """Greedy outputs of `prompts`; extra_args: one SamplingParams.extra_args per prompt, or None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, extra_args=extra)
        for extra in extra_args or [None] * len(prompts)
    ]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def capture(llm, prompt, max_tokens=1):
    tlh.open_capture(llm)
    generate(llm, [prompt], max_tokens)
    return tlh.read_captures(llm, len(prompt))


PROMPT = [(7 * i + 3) % 512 for i in range(40)]


# --- every site of every family ---------------------------------------------------------


def hook_shapes(llm) -> dict[str, tuple[int, ...]]:
    return {name: llm.config.row_shape(name) for name in llm.hook_names}


LAYER = re.compile(r"^blocks\.(\d+)\.(.*)$")


def layer_kinds(specs: dict[str, tuple[int, ...]], family: str) -> dict[tuple, int]:
    """{a kind of layer: the first layer of it} among the layers ``specs`` hooks: a kind is the sites a layer has
    (dense or mixture-of-experts, attention or a mixer), its attention's type where the config names one per layer
    (sliding or global, linear), and whether it attends with an earlier layer's keys and values (KV sharing)."""
    config = tools.tiny_config(family).get_text_config()
    types = getattr(config, "layer_types", None) or []
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    sites: dict[int, set[str]] = {}
    for name in specs:
        found = LAYER.match(name)
        if found:
            sites.setdefault(int(found.group(1)), set()).add(found.group(2))
    kinds: dict[tuple, int] = {}
    for layer in sorted(sites):
        kind = (frozenset(sites[layer]), types[layer] if layer < len(types) else None,
                layer >= config.num_hidden_layers - shared)
        kinds.setdefault(kind, layer)
    return kinds


def edited_layers(specs: dict[str, tuple[int, ...]], family: str) -> set[int]:
    """The layers whose sites the edit checks edit: the first of each kind (layer_kinds), so the first layer that
    has each site, and each site again on every other kind of layer that has it."""
    return set(layer_kinds(specs, family).values())


def site_edits(specs: dict[str, tuple[int, ...]], family: str) -> dict[str, dict]:
    """One edit at each editable site of ``specs`` ({hook name: row shape} of the family), on each of
    edited_layers for layer sites. The ops cycle, so every op meets several kinds of tap; vector values take the
    row's shape ([n_heads, d_head] at attn_z: heads 0 and 1 differently)."""
    layers = edited_layers(specs, family)
    specs = {
        name: shape
        for name, shape in specs.items()
        if (not LAYER.match(name) or int(LAYER.match(name).group(1)) in layers) and not read_only(name, family)
    }
    edits = {}
    for n, (name, shape) in enumerate(specs.items()):
        vector = torch.linspace(-1.0, 1.0, int(torch.Size(shape).numel())).reshape(shape)
        if name.endswith("hook_scale"):  # a norm's divisor: kept well away from 0, where normalizing blows up
            vector = torch.full(shape, 1.5)
        edits[name] = [
            {"op": "scale" if name.endswith("hook_scale") else "suppress", "value": 2.0},
            {"op": "scale", "value": 0.5},
            {"op": "add", "value": vector},
            {"op": "set", "value": vector},
            {"op": "scale", "value": vector + 1.5, "positions": [2, 30]},
        ][n % 5]
        if edits[name]["op"] == "suppress":
            del edits[name]["value"]
    return edits


def check_every_site_edit(llm, model: Model, baseline: dict, reference=None, tolerance=TOLERANCE) -> None:
    """One-prompt flavour: each site's edit, alone, against the reference (default
    TransformerLens) with the same edit; the edited hook's own rows must move."""
    fresh_routing(reference or model)
    for hook, edit in site_edits(hook_shapes(llm), model.family).items():
        tlh.set_edits(llm, {hook: edit})
        try:
            edited = capture(llm, PROMPT)
        finally:
            tlh.reset_edits(llm)
        reference = reference or model
        routes = engine_routes(reference, edited, list(range(len(PROMPT))), len(PROMPT))
        expected = reference.reference(PROMPT, llm.hook_names, {hook: edit}, **routes)
        assert_matches(edited, expected, f"edit {edit['op']} at {hook}", tolerance)
        assert relative_error(edited[hook], baseline[hook]) > 1e-3, f"the edit at {hook} changed nothing"
    routing_held_to_ties(reference or model, "the edits")


def check_every_site_edit_per_request(llm, model: Model, reference=None, tolerance=TOLERANCE) -> float:
    """Batched flavour: one generate, one request per site carrying that site's edit, and a
    300-token prompt (chunked prefill) editing the last site."""
    edits = site_edits(hook_shapes(llm), model.family)
    requests = [([(3 * i + 5 * n) % 512 for i in range(12 + 7 * n)], "all", {hook: edit})
                for n, (hook, edit) in enumerate(edits.items())]
    requests.append((BATCH[1], "all", dict([list(edits.items())[-1]])))
    _outputs, worst = check_per_request(llm, reference or model, requests, tolerance=tolerance)
    return worst


# --- the other families ------------------------------------------------------------------
# Llama runs every check above. Every family runs TestFamilies' checks in the batched flavour, and each of
# ONE_PROMPT_FAMILIES TestFamiliesOnePromptFlavour's in the one-prompt flavour too (the multimodal ones in
# test_tl_vllm_hooks_vision.py).


# TestFamilies' engines run eager in this process (a CPU compile costs ~70 s an engine),
# except: torch.compiled (inductor) for Qwen3, whose graph carries every tap kind the new
# sites brought beside Llama's (which TestOnePrompt and TestBatched compile): heads of a
# fused qkv projection, Attention's inputs, ln2 after hook_resid_mid on one norm, the attention
# matrices' query and key; traced by Dynamo and run without inductor's C++ code (VLLM_CPU_CI_ENV, as the
# examples: ~95 s less) for SmolLM3, on vLLM's Transformers backend, whose Attention forward the
# hooks wrap (vLLM calls it past module hooks: what Dynamo traces); and in vLLM's separate processes, the
# default layout, for OLMo 2 (vLLM's Transformers backend).
COMPILED_FAMILIES = ("qwen3", "smollm3")
TRACED_ONLY_FAMILIES = ("smollm3",)
SEPARATE_FAMILIES = ("olmo2",)


@pytest.fixture(scope="class", params=ENGINE_FAMILIES)
def family_llm(request, models):
    family = request.param
    model = models[family]
    in_process, eager = family not in SEPARATE_FAMILIES, family not in COMPILED_FAMILIES
    traced_only = (("VLLM_CPU_CI_ENV", "1"),) if family in TRACED_ONLY_FAMILIES else ()
    with scan_in_torch(family), engine(model, sites=model.sites, in_process=in_process, eager=eager, batching=True,
                environment=traced_only, **family_engine_arguments(family)) as llm:
        llm.model = model
        llm.tolerance, llm.unedited_tolerance = family_tolerance(family), unedited_tolerance(family)
        yield llm


def check_logit_lens(llm, model: Model, prompt: list[int], tolerance) -> None:
    """unembed and logit_lens on one request's rows, whole and top 5, against the bridge on the same prompt: its
    logit lens (ActivationCache.logit_lens, every position, resid_mid entries too where the family has them) at every
    residual-stream hook it stacks, and its hook_unembed (unembed.hook_out) from the last layer's hook_resid_post."""
    from transformer_lens.tools.analysis.logit_lens import hybrid_block_types, logit_lens

    fresh_routing(model)
    output = generate(llm, [prompt])[0]
    rows = tlh.read_batched(llm, [output.request_id])[output.request_id]
    routes = engine_routes(model, rows, list(range(len(prompt))), len(prompt)).get("routes")
    with torch.no_grad(), model.bridge.hooks(fwd_hooks=model.following(routes)), model.routers_following(routes):
        logits, cache = model.bridge.run_with_cache(torch.tensor([prompt]))
        # (the bridge stacks no resid_mid where it calls blocks hybrid: Falcon-H1's attention beside a Mamba mixer)
        lens = logit_lens(cache, positions=None, incl_mid="resid_mid" in model.sites and not hybrid_block_types(
            model.bridge))
    routing_held_to_ties(model, "the logit lens")
    last = model.bridge.cfg.n_layers - 1
    label_names = {f"{layer}_{part}": f"blocks.{layer}.hook_resid_{part}" for layer in range(last + 1)
                   for part in ("pre", "mid")} | {"final_post": f"blocks.{last}.hook_resid_post"}
    expected = {label_names[label]: values[0] for label, values in zip(lens.labels, lens.values)}
    found = tlh.logit_lens(llm, rows)
    assert set(expected) <= set(found), f"the bridge's lens stacks {sorted(expected)}, read: {sorted(found)}"
    worst = assert_matches({name: found[name] for name in expected}, expected, f"{model.family} logit lens", tolerance)
    final = f"blocks.{last}.hook_resid_post"
    unembedded = {final: tlh.unembed(llm, rows[final])}
    worst_unembed = assert_matches(unembedded, {final: logits[0]}, f"{model.family} hook_unembed", tolerance)
    best = tlh.unembed(llm, rows[final], top_k=5)  # the top 5 values, and tokens whose logits are those values
    assert_matches({final: best.values}, {final: logits[0].topk(5).values}, f"{model.family} top 5", tolerance)
    assert_matches({final: best.values}, {final: logits[0].gather(-1, best.indices)}, f"{model.family} top 5", tolerance)
    print(f"\n{model.family}: logit lens over {len(expected)} entries {worst:.2e}, hook_unembed {worst_unembed:.2e}, "
          f"d_vocab {logits.shape[-1]}")
    check_shorthand(rows, cache, model, tolerance)


SHORTHAND = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "rot_q", "rot_k", "z",
             "attn", "pattern", "attn_scores", "attn_logits", "pre", "post", "pre_linear", "mlp_pre", "mlp_post",
             ("normalized", "ln1"), ("scale", "ln2"), ("in", "mlp"), ("expert_indices", "m"))


def check_shorthand(rows, cache, model: Model, tolerance) -> None:
    """A request's ActivationRows against TransformerLens: each shorthand key (every layer, from the end too) names the
    hook transformer_lens.utilities.get_act_name names; accumulated_resid and decompose_resid equal the bridge cache's
    own on the same prompt."""
    from transformer_lens.utilities import get_act_name

    n_layers = model.bridge.cfg.n_layers
    keys = [(short,) for short in ("embed", "pos_embed", "scale", "normalized", "k1", "pre2", "scale1ln2")]
    keys += [(short, layer) if isinstance(short, str) else (short[0], layer, short[1])
             for short in SHORTHAND for layer in (*range(n_layers), -1)]
    resolved = 0
    for key in keys:
        positive = key if len(key) < 2 or key[1] is None or key[1] >= 0 else (key[0], key[1] + n_layers, *key[2:])
        name = get_act_name(*positive)
        if name in rows:
            assert rows[key] is rows[name], f"{key} -> {name}"
            resolved += 1
        else:
            with pytest.raises(KeyError, match="not kept"):
                rows[key]
    assert resolved >= 3 * n_layers, f"only {resolved} shorthand keys named kept hooks"
    pairs = [("accumulated_resid", {}), ("accumulated_resid", {"layer": 2})]
    if "resid_mid" in model.sites:  # (not on a parallel family's)
        pairs += [("accumulated_resid", {"incl_mid": True}), ("accumulated_resid", {"layer": 1, "mlp_input": True})]
    every_layer = all(f"blocks.{layer}.hook_{part}_out" in rows for layer in range(n_layers)
                      for part in ("attn", "mlp"))
    if "embed" in model.sites and every_layer:  # (not where some layers have no attention: Qwen 3.5's linear ones)
        pairs += [("decompose_resid", {}), ("decompose_resid", {"layer": 2, "mlp_input": True, "mode": "attn"})]
    for method, options in pairs:
        ours, labels = getattr(rows, method)(return_labels=True, **options)
        theirs, their_labels = getattr(cache, method)(return_labels=True, **options)
        assert labels == their_labels, f"{method}{options}: {labels} != {their_labels}"
        last = f"blocks.{n_layers - 1}.hook_resid_post"  # (a family's bound past its first layer)
        assert_matches({last: ours.transpose(0, 1)}, {last: theirs[:, 0].transpose(0, 1)}, f"{method}{options}",
                       tolerance)


@pytest.fixture(scope="class", params=ONE_PROMPT_ENGINE_FAMILIES)
def one_prompt_flavour_llm(request, models):
    model = models[request.param]
    with scan_in_torch(request.param), engine(model, sites=model.sites, in_process=True, eager=True,
                                               **family_engine_arguments(request.param)) as llm:
        llm.model = model
        llm.tolerance = family_tolerance(request.param)
        yield llm


# The multimodal records checked here too, where their tiny checkpoint is built and the bridge boots without
# torchvision; test_tl_vllm_hooks_vision.py checks every one.
PLACED_HERE = tuple(
    family for family in MULTIMODAL
    if importlib.util.find_spec("transformer_lens") and (torchvision_imports() or not needs_torchvision(family))
)


# --- command line and examples -----------------------------------------------------------


def run_command(arguments, cwd, timeout=300, **env):
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    environment.update(PYTHONPATH=str(HERE), **env)
    return subprocess.run(
        [sys.executable, *arguments], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def stub_vllm(monkeypatch):
    """A vllm module whose LLM records what it was given and fails as a failing engine start would: the commands'
    paths up to their engine, without one. Returns the list of LLM calls' arguments."""
    calls = []

    def start(model, **arguments):
        calls.append({"model": model, "model_is_there": os.path.isdir(model), **arguments})
        raise ValueError("the stub vLLM starts no engine")

    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.LLM, vllm.SamplingParams, inputs.TokensPrompt = start, dict, dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(tlh, "register", lambda: None)  # (configure patches vLLM's classes: none here)
    return calls


# --- batched flavour -------------------------------------------------------------

BATCH = [
    [(5 * i + 1) % 512 for i in range(9)],
    [(11 * i + 2) % 512 for i in range(300)],  # > MAX_TOKENS_PER_FORWARD: chunked prefill
    [(3 * i + 7) % 512 for i in range(57)],
]


def check_batched(llm, model, edits=None, max_tokens=3, tolerance=TOLERANCE, prompts=BATCH):
    """Every request's rows (its prompt, then every generated token but the last, which
    never runs through the model) equal its run through `model`'s reference (TransformerLens,
    or transformers on the GPU); edits: engine-wide, set for this call. Returns the worst
    relative error."""
    _outputs, worst = check_per_request(llm, model, [(p, None, None) for p in prompts], edits, max_tokens, tolerance)
    return worst


def kept_rows(capture, prompt_len: int, num_rows: int) -> list[int]:
    """The rows a request's capture option keeps, written out independently."""
    if capture == "all":
        return list(range(num_rows))
    if capture == "prompt":
        return list(range(prompt_len))
    if capture == "last_prompt_token":
        return [prompt_len - 1]
    return sorted({p for p in capture if p < num_rows})


def take_rows(tensors: dict, rows: list[int]) -> dict:
    """{name: tensor[rows]} (an attention matrix's queries at those positions), the index made a tensor
    once: a list index is parsed again for every tensor, which cost seconds over a family's hooks and requests."""
    index = torch.tensor(rows, dtype=torch.long)
    keys = max(rows) + 1 if rows else 0  # an attention matrix's: up to its last query
    return {
        name: tensor[:, index, :keys] if name.endswith(ATTENTION) else tensor[index]
        for name, tensor in tensors.items()
    }


def chosen_heads(config, tensors: dict) -> dict:
    """tensors, with an attention matrix the config's attention_heads chooses heads of at those heads, in order."""
    return {name: tensor[list(config.attention_heads[name])] if name in config.attention_heads else tensor
            for name, tensor in tensors.items()}


def check_per_request(
    llm, model, requests, engine_edits=None, max_tokens=3, tolerance=TOLERANCE
):
    """requests: [(prompt, capture or None, edits or None)], one generate call, with
    engine_edits set engine-wide for it.

    Each request's kept rows must equal its own reference run with its own
    edits, which replace the engine-wide edit on the hooks they name, within
    tolerance.
    Returns the outputs and the worst relative error.
    """
    fresh_routing(model)
    options = [
        None if capture is None and edits is None else tlh.request_args(llm.config, capture or "all", edits)
        for _prompt, capture, edits in requests
    ]
    tlh.set_edits(llm, engine_edits or {})
    try:
        outputs = generate(llm, [prompt for prompt, _c, _e in requests], max_tokens, options)
    finally:
        tlh.reset_edits(llm)
    read = [o.request_id for o, (_p, c, _e) in zip(outputs, requests) if c != "none"]
    captured = tlh.read_batched(llm, read)
    assert sorted(captured) == sorted(read)
    worst = 0.0
    for output, (prompt, capture, edits) in zip(outputs, requests):
        if capture == "none":
            with pytest.raises(KeyError, match="no captured request"):
                tlh.read_batched(llm, [output.request_id])
            continue
        sequence = list(prompt) + list(output.outputs[0].token_ids)[:-1]
        rows = kept_rows(capture or "all", len(prompt), len(sequence))
        routes = engine_routes(model, captured[output.request_id], rows, len(sequence))
        expected = model.reference(sequence, llm.hook_names, {**(engine_edits or {}), **(edits or {})}, **routes)
        expected = chosen_heads(llm.config, take_rows(expected, rows))
        error = assert_matches(captured[output.request_id], expected, f"{output.request_id} {capture}", tolerance)
        worst = max(worst, error)
    routing_held_to_ties(model, "the requests")
    return outputs, worst


# Mixed per-request options in one batch: lengths 9, 300 (chunked prefill over
# three steps; its edit at position 200 lands in the second chunk), 57, 20, 30,
# 200, 170, 9 and 15 tokens, 3 generated tokens each.
MIXED_REQUESTS = [
    (BATCH[0], None, None),
    (BATCH[1], "prompt", {"blocks.1.hook_resid_post": {"op": "scale", "value": 0.5, "positions": [5, 200]}}),
    (BATCH[2], "last_prompt_token", {"blocks.0.hook_mlp_out": {"op": "suppress"}}),
    (
        [(13 * i + 5) % 512 for i in range(20)],
        "all",
        {
            "blocks.2.hook_attn_out": {"op": "add", "value": torch.linspace(-1.0, 1.0, 128)},
            # Position 21 is the second generated token's row: a decode step.
            "ln_final.hook_normalized": {"op": "set", "value": 0.25, "positions": [21]},
        },
    ),
    ([(19 * i + 4) % 512 for i in range(30)], [0, 3, 25, 31], None),
    # Chunked prefill where the first chunks keep nothing.
    ([(29 * i + 8) % 512 for i in range(200)], "last_prompt_token", None),
    ([(37 * i + 9) % 512 for i in range(170)], [150, 171], None),
    (BATCH[0], [8, 10], None),  # its last prompt token, and its second generated token's row
    ([(23 * i + 6) % 512 for i in range(15)], "none", {"ln_final.hook_normalized": {"op": "suppress"}}),
]


def check_mixed_requests(llm, model, engine_edits=None, tolerance=TOLERANCE):
    outputs, _worst = check_per_request(llm, model, MIXED_REQUESTS, engine_edits, tolerance=tolerance)
    suppressed = list(outputs[-1].outputs[0].token_ids)
    assert suppressed == [0, 0, 0], "a suppressed final norm gives all-zero logits: token 0"
    plain = list(generate(llm, [MIXED_REQUESTS[-1][0]], max_tokens=3)[0].outputs[0].token_ids)
    tlh.reset_batched(llm)
    assert plain != suppressed, "the edit of the last request must not outlive it"


def manifest_lines(directory: Path) -> list[dict]:
    """Every whole line of the directory's one manifest, read here with json alone."""
    (path,) = directory.glob("manifest-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_sink_requests(llm, model, requests, max_tokens=3, tolerance=TOLERANCE):
    """requests as in check_per_request, generated, flushed to the engine's sink and read
    back twice, with the module's CaptureDataset and with the safetensors library from
    what the manifest says; both must equal each request's own TransformerLens run
    (within tolerance). Returns (outputs, dataset)."""
    from safetensors import safe_open

    options = [tlh.request_args(llm.config, capture or "all", edits) for _prompt, capture, edits in requests]
    outputs = generate(llm, [prompt for prompt, _c, _e in requests], max_tokens, options)
    dataset = tlh.flush_sink(llm)
    entries = {
        request_id: (line["shard"], entry)
        for line in manifest_lines(llm.sink_dir)[1:]
        for request_id, entry in line["requests"].items()
    }
    for output, (prompt, capture, edits) in zip(outputs, requests):
        if capture == "none":
            assert output.request_id not in dataset
            continue
        sequence = list(prompt) + list(output.outputs[0].token_ids)[:-1]
        rows = kept_rows(capture or "all", len(prompt), len(sequence))
        expected = take_rows(model.reference(sequence, llm.hook_names, edits), rows)
        entry = dataset.entry(output.request_id)
        assert entry["prompt_token_ids"] == list(prompt)
        assert [p for start, stop in entry["positions"] for p in range(start, stop)] == rows
        assert_matches(dataset[output.request_id], expected, f"{output.request_id} {capture} (CaptureDataset)", tolerance)
        (worker_id,) = [r for r in entries if re.fullmatch(re.escape(output.request_id) + "(-[0-9a-f]{8})?", r)]
        shard, manifest_entry = entries[worker_id]
        with safe_open(str(llm.sink_dir / shard), framework="pt") as archive:
            stored = {name: archive.get_tensor(key) for name, key in manifest_entry["tensors"].items()}
        assert_matches(stored, expected, f"{output.request_id} {capture} (safetensors)", tolerance)
    return outputs, dataset


def shard_writer(config, model="m", versions=None, shard_bytes=1):
    """The ShardWriter a batched engine's first worker makes for config's sink_dir, without the engine."""
    header = {
        **tools.sink_header(config), "writer": "pp0-tp0", "model": model, "versions": versions or {"vllm": "v"},
        "writes": list(config.capture_specs), "shards": {},
    }
    return tools.ShardWriter(config.sink_dir, "pp0-tp0", header, shard_bytes=shard_bytes)


def write_request(writer, config, request_id, rows):
    """One finished request of len(rows) prompt tokens, the same rows at each of config's hooks."""
    entry = {"prompt_token_ids": list(range(len(rows))), "positions": [[0, len(rows)]]}
    writer.write(request_id, entry, [(name, list(rows.shape), [rows]) for name in config.capture_specs])


# --- SAEs: features and feature edits inside the graph, against sae-lens ------------------

# The SAEs the tests load: hook -> (architecture, d_sae, topk's k), each a random one of sae-lens's own classes,
# saved by sae-lens. blocks.0.hook_mlp_out is not among the engines' capture specs: its features are kept, its
# rows not.
SAE_KINDS = {
    "blocks.0.hook_mlp_out": ("jumprelu", 384, None),
    "blocks.1.hook_resid_post": ("standard", 256, None),
    "blocks.2.attn.hook_z": ("topk", 256, 12),
    # Transcoders: Gemma Scope 2's kind (JumpReLU, with the affine skip) and a plain one, each reading its layer's
    # MLP input and writing its hook_mlp_out.
    "blocks.1.mlp.hook_in": ("jumprelu_skip_transcoder", 256, None),
    "blocks.2.mlp.hook_in": ("transcoder", 192, None),
}
TRANSCODES = {f"blocks.{layer}.mlp.hook_in": f"blocks.{layer}.hook_mlp_out" for layer in range(3)}  # what each writes
SAE_TOP_K = 16  # fewer than the standard and jumprelu SAEs fire here (a third of their features); more than topk's 12
SAE_PROMPTS = [PROMPT[:23], PROMPT[5:36], PROMPT[11:19]]


def features(hook: str) -> str:
    return hook + tlh.SAE_FEATURES


@pytest.fixture(scope="session")
def sae_lens_python():
    """The python of an environment of its own holding sae-lens 6.54, which needs transformer-lens < 4 (this one
    has 4.3): $TL_VLLM_HOOKS_SAE_PYTHON (CI builds it first), else what scripts/sae_env.sh builds (once, ~1 min)."""
    python = os.environ.get("TL_VLLM_HOOKS_SAE_PYTHON")
    if not python:
        built = subprocess.run(["bash", str(HERE / "scripts" / "sae_env.sh")], capture_output=True, text=True,
                               env={**os.environ, "PYTHON": sys.executable})
        assert built.returncode == 0, f"scripts/sae_env.sh failed:\n{built.stderr[-3000:]}"
        python = built.stdout.split()[-1]
    return python


class SAEOracle:
    """The SAEs of ``kinds`` (SAE_KINDS on the Llama's hooks) on the model's hooks, made and saved by sae-lens, and
    what sae-lens's own ``SAE.load_from_disk(...).encode`` makes of TransformerLens's rows there for each prompt of
    SAE_PROMPTS, run in sae-lens's environment (scripts/sae_oracle.py) through safetensors files: made_by_sae_lens
    runs the jobs of one or more, then each reads what they wrote."""

    def __init__(self, model: Model, root: Path, kinds: dict = SAE_KINDS):
        from safetensors.torch import save_file

        self.model, self.kinds, self.directories = model, kinds, {hook: root / hook for hook in kinds}
        self.root = root
        unedited = [model.reference(prompt, list(kinds)) for prompt in SAE_PROMPTS]
        self.jobs = []
        for hook, (architecture, d_sae, k) in kinds.items():
            rows = {f"prompt{i}": rows[hook].reshape(len(rows[hook]), -1).contiguous() for i, rows in enumerate(unedited)}
            save_file(rows, str(root / f"{hook}.rows.safetensors"))
            scale = float(torch.cat(list(rows.values())).std())  # the SAE is scaled for rows of this spread
            self.jobs.append(
                ["make", "--architecture", architecture, "--d-in", "128", "--d-sae", str(d_sae), "--hook-name", hook,
                 "--input-scale", str(scale), "--seed", str(d_sae), "--out", str(self.directories[hook])]
                + (["--k", str(k)] if k else [])
                + (["--d-out", "128", "--hook-name-out", TRANSCODES[hook]] if hook in TRANSCODES else [])
            )
            self.jobs.append(["encode", "--sae", str(self.directories[hook]), "--acts",
                              str(root / f"{hook}.rows.safetensors"), "--out", str(root / f"{hook}.features.safetensors")])

    def read_what_sae_lens_wrote(self) -> None:
        from safetensors.torch import load_file

        self.features, self.W_dec = {}, {}
        for hook in self.kinds:
            encoded = load_file(str(self.root / f"{hook}.features.safetensors"))
            self.features[hook] = [encoded[f"prompt{i}"] for i in range(len(SAE_PROMPTS))]
            self.W_dec[hook] = load_file(str(self.directories[hook] / "sae_weights.safetensors"))["W_dec"]

    def saes(self) -> dict[str, str]:
        return {hook: str(directory) for hook, directory in self.directories.items()}

    def steered(self, prompt_index: int, hook: str, edit: dict) -> dict:
        """{the hook the SAE writes: its rows -> those rows with a feature edit applied as the module defines it,
        rows + (new_f - old_f) @ W_dec[f]} (old: sae-lens's features of the unedited rows, which an edit at this hook
        leaves as they are; a transcoder writes its layer's hook_mlp_out), for TransformerLens's run_with_hooks."""
        old_all = self.features[hook][prompt_index]
        chosen = edit["features"]
        value = torch.tensor(edit.get("value", 0.0), dtype=torch.float32).expand(len(chosen))

        def change(rows):
            old = old_all[:, chosen]
            new = {"set": value.expand_as(old), "add": old + value, "scale": old * value, "suppress": 0 * old}
            delta = (new[edit["op"]] - old) @ self.W_dec[hook][chosen]
            if "positions" in edit:
                delta[[p for p in range(len(rows)) if p not in edit["positions"]]] = 0.0
            return rows + delta.reshape(rows.shape)

        return {TRANSCODES.get(hook, hook): change}


def made_by_sae_lens(python: str, oracles: list[SAEOracle], root: Path) -> list[SAEOracle]:
    """Every oracle's jobs in one run of scripts/sae_oracle.py (importing sae-lens alone takes ~10 s), its job list
    in ``root``; then each oracle reads its features and decoders."""
    (root / "jobs.json").write_text(json.dumps([job for oracle in oracles for job in oracle.jobs]))
    ran = subprocess.run(
        [python, str(HERE / "scripts" / "sae_oracle.py"), "batch", "--jobs", str(root / "jobs.json")],
        capture_output=True, text=True,
    )
    assert ran.returncode == 0, f"sae_oracle.py failed:\n{ran.stderr[-3000:]}"
    for oracle in oracles:
        oracle.read_what_sae_lens_wrote()
    return oracles


# Latent attention's families and Qwen3-Next (bf16 alone on vLLM's CPU) route their tokens from the second layer on
# (Qwen3-Next's first layer a Gated DeltaNet before a dense MLP), and Qwen 3.5's dense model runs its first layer's
# Gated DeltaNet and MLP in bf16 alone too (test_tl_vllm_hooks_vision.py): SAEs on the first layer's MLP output and
# residual stream, and a transcoder on that MLP, which no routing decides (standard SAEs and a plain transcoder, whose
# features are continuous in the rows: a topk or jumprelu SAE's cut-off turns bf16's near-ties into features 0 in one
# and not the other).
FIRST_LAYER_SAES = ("blocks.0.hook_mlp_out", "blocks.0.hook_resid_post")
FIRST_LAYER_TRANSCODER = "blocks.0.mlp.hook_in"
FIRST_LAYER_SAE_KINDS = {**dict.fromkeys(FIRST_LAYER_SAES, ("standard", 256, None)),
                         FIRST_LAYER_TRANSCODER: ("transcoder", 192, None)}


def check_first_layer_saes(oracle: SAEOracle, tolerance, engine_arguments: dict) -> None:
    """SAEs on FIRST_LAYER_SAES of a family vLLM's CPU runs in bf16 alone, and a transcoder on that layer's MLP, as on
    any family's (the oracle's FIRST_LAYER_SAE_KINDS): each request's top features are sae-lens's encode of
    TransformerLens's rows (fp32, on the bf16-rounded weights: the family's per-row bound), and a feature edit of the
    MLP output's SAE (the second request) or of the transcoder (the fourth) moves the rows after it as run_with_hooks
    does with the decoder. Eager, in this process."""
    mlp_out, resid_post = FIRST_LAYER_SAES
    model, kinds = oracle.model, oracle.kinds
    edited = [None, mlp_out, None, FIRST_LAYER_TRANSCODER]  # the hook each request edits
    edits = [hook and {features(hook): {"op": "scale", "features": fired(oracle, hook, 3), "value": 4.0}}
             for hook in edited]
    prompts = [SAE_PROMPTS[i % len(SAE_PROMPTS)] for i in range(len(edits))]
    with engine(model, sites=("mlp_out", "resid_post"), in_process=True, eager=True, batching=True,
                saes=oracle.saes(), sae_top_k=SAE_TOP_K, **engine_arguments) as llm:
        extra = [edit and tlh.request_args(llm.config, edits=edit) for edit in edits]
        outputs = generate(llm, prompts, 1, extra)
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
    worst_features = worst_rows = 0.0
    moved = []  # the edited requests' largest row change at resid_post
    for i, (output, edit) in enumerate(zip(outputs, edits)):
        rows, prompt_index = read[output.request_id], i % len(SAE_PROMPTS)
        if edit is None:  # (an edit leaves its own SAE's features as they were, and moves the later ones')
            for hook in kinds:
                got = rows[features(hook) + ".indices"], rows[features(hook) + ".values"]
                worst_features = max(worst_features, assert_features(*got, oracle.features[hook][prompt_index],
                                     SAE_TOP_K, f"request {i} {hook}", tolerance, torch.bfloat16))
        steering = edit and oracle.steered(prompt_index, edited[i], edit[features(edited[i])])
        expected = model.reference(prompts[i], list(FIRST_LAYER_SAES), steering)
        worst_rows = max(worst_rows, assert_matches({n: rows[n] for n in FIRST_LAYER_SAES}, expected, f"request {i}",
                                                    tolerance))
        if edit is not None:
            plain = model.reference(prompts[i], [resid_post])[resid_post]
            moved.append(float(row_errors(rows[resid_post], plain).max()))
    bound = tolerance(resid_post) if callable(tolerance) else tolerance
    assert min(moved) > 2 * bound, f"an edit moves no row past the tolerance ({moved})"
    print(f"\n{model.family}: SAE and transcoder features worst {worst_features:.2e}, rows {worst_rows:.2e} (whole "
          f"hook; worst row so far {PerRow.worst_row:.2e}), the edits moved a row by {moved[0]:.2e} and {moved[1]:.2e}")


def fired(oracle: SAEOracle, hook: str, count: int) -> list[int]:
    """The ``count`` features of the hook's SAE that fire most on SAE_PROMPTS (sae-lens's encode), so that an edit of
    them changes something."""
    return torch.cat(oracle.features[hook]).sum(0).topk(count).indices.tolist()


def assert_features(indices, values, expected, k, context, tolerance=TOLERANCE, dtype=torch.float32):
    """A read's features (int32 indices and values in the capture dtype, [rows, k]) are sae-lens's k highest, highest
    first: the same values, at the features they name. A relative error as the rows' (a tolerance as assert_matches
    takes): features are relu(rows @ W_enc + b_enc)."""
    assert indices.dtype == torch.int32 and values.dtype == dtype, context
    values = values.float()
    assert indices.shape == values.shape == (len(expected), k), f"{context}: {tuple(indices.shape)}"
    assert bool((values[:, :-1] >= values[:, 1:]).all()), f"{context}: highest first"
    top, named = expected.topk(k, dim=-1).values, expected.gather(1, indices.long())
    return max(assert_matches({"values": values}, {"values": top}, context, tolerance),
               assert_matches({"the values of the features named": values}, {"the values of the features named": named},
                              context, tolerance))


@pytest.fixture(scope="session")  # (the SAE tests' and TestTensorParallel's)
def sae_oracle(sae_lens_python, models, tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    return made_by_sae_lens(sae_lens_python, [SAEOracle(models["llama"], root)], root)[0]


def write_sae(directory: Path, hook="blocks.0.hook_resid_post", d_in=128, d_sae=64, architecture="standard", **cfg):
    """A random SAE written by hand in SAELens's format, where sae-lens is not at hand (the checks that need no
    engine, the GPU machine); a transcoder's decodes to rows of cfg's d_out (default d_in)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(d_sae)
    transcoder = "transcoder" in architecture
    d_out = (cfg.setdefault("d_out", d_in) or d_in) if transcoder else d_in  # (d_out=None: a cfg.json without one)
    weights = {"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in**0.5,
               "W_dec": torch.randn(d_sae, d_out, generator=generator) / 4, "b_enc": torch.full((d_sae,), -0.5),
               "b_dec": 0.1 * torch.randn(d_out, generator=generator)}
    if "jumprelu" in architecture:
        weights["threshold"] = torch.full((d_sae,), 0.2)
    if "skip" in architecture:
        weights["W_skip"] = 0.01 * torch.randn(d_out, d_in, generator=generator)
    save_file(weights, str(directory / "sae_weights.safetensors"))
    config = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "apply_b_dec_to_input": not transcoder,
              "normalize_activations": "none", "metadata": {"hook_name": hook}, **cfg}
    (directory / "cfg.json").write_text(json.dumps(config))
    return str(directory)


# --- CUDA: CUDA graphs and both model runners (skipped without a GPU) ----------------
# bf16 tolerance: the reference is transformers in fp32 on the same bf16-rounded weights, so the error is vLLM's own
# bf16 arithmetic. One bf16 rounding is <= 2^-9 (2e-3) relative; three layers of rounded projections, rotary,
# attention, norms and residual adds compound it. Each row (one position of one hook) is held to the bound alone: a
# relative error over a whole request's rows would let one wrong row of hundreds pass. Measured:
# - on an H200 (2026-12-03, the ten classic sites of Llama and Gemma 2): worst whole hook 1.9e-2, worst row 2.4e-2;
# - on vLLM 0.32's CPU in bf16, these classes run with the CUDA skip lifted (2026-12-04, every site of Llama, Gemma 2
#   and Mixtral, SAE features, edits included): worst whole hook 2.1e-2, worst row 8.4e-2 (Mixtral's layer-2
#   mlp.hook_post under an edit at layer 1, at cosine 0.997; Llama's worst 4.5e-2); attention (2026-12-05, eager, the
#   batched checks of Llama, Gemma 2 and Mixtral): scores worst row 3.9e-2 (then against the mean row's norm; see TYPICAL_ROWS),
#   whole 2.2e-2; patterns worst row 8.2e-2 (Mixtral), whole 2.1e-2;
# - on an H200 (2026-12-05, every site of Gemma 2 with its attention matrices, both flavours, edits included; SAE
#   features and their edits): worst whole hook 1.7e-2, worst row 3.0e-2. Llama's and Mixtral's every site there are
#   yet to be measured;
# - on vLLM 0.32's CPU in bf16 with the CUDA skip lifted (2026-12-05, TestCudaFamilies' Falcon-H1, every site of its
#   attention, Mamba-2 mixer and MLP, both flavours, edits included): worst whole hook 1.9e-2, worst row 4.0e-2; and
#   TestCudaFamilies' LFM2 (every site of its short convolution, attention and MLP): 2.5e-2 and 5.6e-2.
# A semantic error (a row off by one, a missing residual, an edit missed or applied twice) is ~1 in the row it hits.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_TOLERANCE = PerRow(1e-1)
# Qwen 3.5's and Qwen3-Next's tiny models in bf16 on vLLM's CPU (their Gated DeltaNet runs in bf16 alone) against the
# bridge in fp32 on the same bf16 weights: Qwen 3.5's rows within 4.6e-2, but those of linear attention's output within
# 8.7e-2 (against the typical row, see TYPICAL_ROWS), where the bridge's own bf16 run is up to 5.9e-2 and 1.3e-1 off
# its fp32 run (2026-12-05, TestFamilies' requests, edits included): the delta rule carries bf16's rounding from token
# to token. Every row of the six records (multimodal ones' text models), both flavours, edits included: within 1.0e-1
# (Qwen 3.5 MoE's layer-2 mlp.hook_post; 2026-12-05). GLM-4.7-Flash's, DeepSeek V3's and V2's (multi-head latent
# attention, bf16 alone too; 2026-12-05, every site, both flavours, edits included): whole hooks within 2.1e-2, 2.7e-2
# and 3.4e-2, rows within 5.3e-2, 6.4e-2 and 1.0e-1 (V2's layer-2 hook_pattern), the reference following 66 and 62 of
# 7,354 and 85 of 6,966 routings at choice-score gaps up to 1.6e-2, 1.0e-2 and 7.3e-3. A semantic error is ~1 in the
# row it hits.
BF16_ALONE_ON_CPU = PerRow(1.5e-1)
# vLLM 0.32's CPU runs Gated DeltaNet's short convolution in its own kernel where the CPU has AVX-512 BF16, and
# otherwise in torch, rounding to bf16 between the convolution and its SiLU (its ops/cpu/gdn_attention.py). The tiny
# models' delta-rule output (rms 1e-5 to 2e-3 a head, transformers in fp32) lies below the gated norm's sqrt(eps) of
# 1e-3, so that norm scales it rather than normalizing it, and a row where query and key nearly cancel carries
# bf16's rounding of them in its length. Measured on an AMD EPYC with AVX2 alone (2026-12-05, the vision file's Qwen
# 3.5 checks, edits included): linear_attn.hook_out rows within 1.6e-1 of a typical row (Qwen 3.5 MoE's layer 2
# under the edit at blocks.1.hook_resid_pre: length 0.83 of the reference's, cosine 1.000), every other hook's within
# 1.3e-1, and the reference following routings at gaps up to 1.13e-1 (Qwen 3.5 MoE) where the kernel's run gives
# 8.7e-2 and 4.8e-2 (above and ROUTER_TIE).
# The same kernels with the bf16 models' norm weights and biases drawn 1 +- 0.5 (2026-12-07): Qwen3-Next's layer-2
# linear_attn.hook_out rows within 1.55e-1 of a typical row under the edits at each site (cosine 0.989 at the worst),
# every other hook's within BF16_ALONE_ON_CPU; a row on the wrong side of a norm's weight of 1 +- 0.5 is ~0.29 off
# (test_a_hook_on_the_wrong_side...), which the norms' hooks are held to 0.15 against. Qwen 3.5's (the vision file's,
# its edits at each site of each kind of layer): 2.15e-1 at layer 2's row 62, where the delta rule's output nearly
# cancels (that row 3.5 times the reference's length, reversed; a typical row's norm measures it). The routers after
# it follow the engine at gaps up to 1.7e-1 (Qwen3-Next, 192 of 16,325 choices, the edits at each site).
LINEAR_ATTENTION_OUT = PerRow(2.5e-1)
ROUTER_TIE_AFTER_LINEAR_ATTENTION = 2e-1


def report(name: str, worst: float) -> None:
    """The GPU tests' report line (scripts/gpu_checks.sh collects it)."""
    print(f"\n{name}: worst relative error {worst:.2e} (whole hook), worst row so far {PerRow.worst_row:.2e}")


# On vLLM 0.24's CUDA build (the GPU machine's), what the GPU tests and scripts/gpu_families.py run a family with:
# eager where the hooked engine stops at start under torch.compile at 128 tokens a forward (Dynamo specializes the
# token count to 128: docs/moe-compile-on-cuda.md; Mixtral and OLMoE, Qwen3-Next on 2026-12-05, Nemotron-H and Qwen 3.5
# MoE's multimodal checkpoint on 2026-12-06; Jamba on 2026-12-06, an H100, where Mamba and Falcon Mamba start
# compiled). The script's engines take 256 tokens a forward, where Qwen 3.5 MoE's started compiled in both flavours,
# its rows as close to the bridge's as its eager engine's (2026-12-07, an H100); Nemotron-H's and Jamba's batched
# engines started too, their one-prompt ones were not seen to the end: still eager here. Model Runner V1 where V2
# stops at start, plain vLLM too (its Mamba metadata's `assert seq_lens_cpu is not None` in the warm-up's dummy run;
# Falcon-H1 and LFM2 on 2026-12-05, an H100; Nemotron-H for its Mamba-2 layers, as Falcon-H1's: both flavours passed
# so on 2026-12-06; the Mamba-1 families so too, Mamba's and Falcon Mamba's captures on 2026-12-06).
CUDA_EAGER = ("mixtral", "olmoe", "qwen3_next", "nemotron_h", "jamba")
CUDA_RUNNER_V1 = ("falcon_h1", "lfm2", "nemotron_h", "jamba", "mamba", "falcon_mamba")


# --- tensor and pipeline parallel: two GPUs, or two CPU workers ----------------------
# On the CPU (vLLM 0.32) tensor parallelism runs; pipeline parallelism fails in
# plain vLLM there too (the second stage asserts on missing intermediate
# tensors), so PP=2 runs only on two GPUs.

TWO_GPUS = torch.cuda.device_count() >= 2
# An edit of a replicated hook and of both kinds of split ones: head 0 of layer 0's
# attention switched off and head 1 doubled, a ramp over layer 1's MLP units.
EDIT = {
    "blocks.1.hook_mlp_out": {"op": "add", "value": 1.0},
    "blocks.0.attn.hook_z": {"op": "scale", "value": torch.tensor([0.0, 2.0]).repeat_interleave(64).reshape(2, 64)},
    "blocks.1.mlp.hook_post": {"op": "add", "value": torch.linspace(-1.0, 1.0, 256)},
}


# --- serving: vllm serve, AsyncLLM, prefix caching ---------------------------------------

SERVED_SITES = ("resid_post", "mlp_out")
# The word-level tokenizer of tiny_model reads "t5 t9" as [5, 9]; this template adds nothing.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """`python3 -m tl_vllm_hooks_tools serve` on the tiny Llama, as a user starts it: the batched config built from its
    flags, vLLM's arguments passed on (eager, prefix caching turned on after serve_args), a loopback port; the real
    openai client for it, and the same config built here for request_args."""
    import urllib.request

    import openai

    model = models["llama"]
    root = tmp_path_factory.mktemp("served")
    config = tlh.configure(
        tlh.capture_specs(model.hf.config, sites=SERVED_SITES), MAX_TOKENS_PER_FORWARD, enable_batching=True,
        sink_dir=str(root / "sink"), shard_seconds=0.2,
    )
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    command = [
        sys.executable, "-m", "tl_vllm_hooks_tools", "serve", str(model.path), "--sites", ",".join(SERVED_SITES),
        "--max-num-batched-tokens", str(MAX_TOKENS_PER_FORWARD), "--sink-dir", str(root / "sink"),
        "--shard-seconds", "0.2", "--port", str(port),
        # vLLM's own arguments, passed on
        "--served-model-name", "tiny", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.05", "--seed", "0", "--enforce-eager", "--chat-template",
        str(root / "chat.jinja"), "--enable-prefix-caching",  # on, after serve_args
    ]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = [process.stdout.readline(), process.stdout.readline()]  # what starts, then that it serves
        if not said[1].startswith(f"serving http://127.0.0.1:{port}/v1 "):
            process.kill()
            pytest.fail(f"the serve command did not come up: {said!r}\n{process.communicate()[1][-4000:]}")
        assert said[0].startswith(f"serve: {model.path} with {len(config.capture_specs)} hooks (float32), rows to {root / 'sink'}"), said
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        log = re.search(r"; log (\S+)\)", said[1]).group(1)
        yield types.SimpleNamespace(client=client, config=config, model=model, sink_dir=str(root / "sink"), log=log)
    finally:
        process.terminate()  # the command stops vLLM's server, as on Ctrl-C
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            pytest.fail("the serve command left vLLM's server running")
