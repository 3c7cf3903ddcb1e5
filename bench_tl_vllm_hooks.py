"""Throughput and peak memory of vLLM with tl_vllm_hooks, side by side with plain vLLM.

    python bench_tl_vllm_hooks.py --out bench.json   # GPU: random bf16 Llama-3.2-1B shape
    python bench_tl_vllm_hooks.py --tiny             # CPU smoke run, about 5 minutes
    python bench_tl_vllm_hooks.py --rounds 3                 # three engines per case, interleaved
    python bench_tl_vllm_hooks.py --cases plain,b --tensor-parallel-size 2
    python bench_tl_vllm_hooks.py --cases plain,b --repeats 1 --compiled-code code/  # then diff -r
    python bench_tl_vllm_hooks.py --cases plain,b,f --side-by-side   # one process, generates alternate
    python bench_tl_vllm_hooks.py --cases plain,b,tl-b,f,tl-e --side-by-side   # beside TransformerLens's plugin
    python bench_tl_vllm_hooks.py --compilation-config '{"inductor_compile_config": {"combo_kernels": false}}'
    python bench_tl_vllm_hooks.py --tiny --cases plain,f --hidden-size 512 --num-layers 4 \
        --num-prompts 64 --prompt-len 256 --max-tokens 1 --repeats 3   # CPU: rows into the driver (GB/s)
    python bench_tl_vllm_hooks.py --harvest --cases plain,h4,h16,h4s,h16s,sae65 --rounds 2   # prefill only, 1,024
    python bench_tl_vllm_hooks.py --tiny --harvest --cases plain,h4,h4s --num-layers 8      # the same on a CPU
    python bench_tl_vllm_hooks.py --cases plain,f,g --side-by-side --profile prof/  # where a step's time goes
    python bench_tl_vllm_hooks.py --tiny --cases plain,b,f --plot ratios.png   # the ratio table as a picture too

Each case builds a fresh engine in a fresh subprocess (this file with ``--run-cases``),
which prints one JSON line behind ``_MARKER`` (vLLM logs to stdout too). Every case runs
with ``VLLM_DISABLE_COMPILE_CACHE=1``, so no case is served another's compiled graph, or,
with ``--compiled-code DIR``, with a compile cache of its own in ``DIR/<case>/round<N>``,
which keeps the code inductor generated (Python wrappers holding the Triton or C++
kernels) to compare a hooked case's kernels with plain vLLM's.

Throughput differs more between two engines of one case than between timed runs of one
engine, so ``--rounds`` builds several engines per case (cases interleaved, every other
round reversed) and reports the median engine. Beside it stands the fastest timed run of
any engine of the case: on a host whose other load only ever slows a run down, that is the
steadier estimate of what the case itself costs; on a GPU each timed run also records the
median SM clock during it (NVML), to tell a slowed GPU from a busy host. A timed run ends
when every GPU stream is idle, so rows the batched cases still copy to host memory count
against them.

On a host whose speed drifts over a minute or more, engines timed one after another can
land in different states. ``--side-by-side`` builds every case's engine in one process (the
device's memory split between them) and times one generate per engine per round, cases
alternating, so each round compares the cases under the same conditions; it reports no peak
memory (one process holds every engine).

The cases tl-b and tl-e run TransformerLens 4.3's own vLLM plugin on the same model and
prompts: its four files (``--peer-plugin DIR``, by default the installed transformer_lens's
``model_bridge/sources/vllm``) are copied into a package of their own beside an entry point,
so that neither the rest of transformer_lens nor its installed entry point is loaded
(``VLLM_PLUGINS`` names the two plugins the cases use).

On a GPU every engine gets the KV cache its workload needs, in bytes (every prompt at once, the same for every
case, so all schedule alike), rather than a fraction of the device: engines started one after another, side by side
too, each take what they need and no more, whatever the overhead of the others.

The harvest cases (h4, h16 and their sinks, with ``--harvest``) also report prompt tokens a second, with rows in
hand, against plain's and against the device-to-host bound: a token's row bytes over the GPU's copy rate into pinned
memory, measured in the same run.

Peak memory covers the whole case, start-up included. On a GPU the worker runs in the
case's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``torch.cuda.max_memory_allocated``
is read there; vLLM fills ``gpu_memory_utilization`` with KV cache, so what the hooks take
shows up mostly as fewer KV blocks, not a higher peak. On the CPU the cases keep vLLM's
separate processes (in-process, vLLM 0.32's CPU backend stalls 1-2 s at random inside a
generate) and report the process tree's peak RSS.

``--profile DIR`` runs one more generate per engine, after its timed ones, under torch.profiler, with the engine in
the case's process: ``DIR/round<N>/<case>.txt`` lists the kernels by device time (CPU time on a CPU), the copies, the
allocator's and the synchronising calls, and the caching allocator's retries (a cudaMalloc that failed, the cache
freed, device-wide, and tried again) during that generate, and on a GPU each stream's busy time and copies to host
and the host's five longest waits with what each stream ran meanwhile (a small copy the engine waits for, queued
behind the rows' copies, shows there); ``<case>.trace.json.gz`` is its timeline (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_MARKER = "@@BENCH_TL_VLLM_HOOKS@@ "
_PROGRESS = "@@BENCH_TL_VLLM_HOOKS_ROUND@@ "  # a child's line the parent passes on at once
_IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # in a case's process: engine and worker here

CASES = {
    "plain": "plain vLLM, compiled",
    "a": "module registered (entry point), nothing configured",
    "b": "compiled capture: resid_post, every layer",
    "c": "compiled capture: resid_post + attn_out + mlp_out",
    "d": "(b) + identity edit on blocks.0.hook_resid_post",
    "e": "batched eager capture of resid_post, read_batched",
    "f": "batched, compiled: resid_post of prompt tokens, every request",
    "g": "(f) keeping only each request's last prompt token",
    "s": "(f) written to a sink directory on local disk (flush_sink)",
    "plain-eager": "plain vLLM, enforce_eager=True",
    "tl-b": "TransformerLens 4.3's own plugin, compiled: resid_post, every layer (its one-prompt capture)",
    "tl-e": "TransformerLens 4.3's own plugin, batched (eager): resid_post, every row of every request",
    "f1": "(f) at the middle layer only (the SAE cases' dense rows)",
    "p1": "(f1) as attn.hook_pattern, every head: each token's query and key kept, the patterns rebuilt in the "
          "worker when read",
    "u20": "(f) at the last layer alone, then each prompt token's top 20 logits (unembed in the workers, top_k=20)",
    "u20s": "(u20) with the top 20 made in the step (configure's logit_lens), read beside the rows",
    "l16": "the logit lens: (f) with every layer's top 20 logits made in the step (logit_lens on each hook)",
    "sae16": "batched, compiled: a 16,384-feature SAE at the middle layer's resid_post, top 64 of every prompt token",
    "sae65": "(sae16) with 65,536 features",
    "h4": "harvest: batched, compiled, resid_post of every prompt token at 4 layers, rows read (use --harvest)",
    "h16": "(h4) at 16 layers",
    "h4s": "(h4) written to a sink directory on local disk (flush_sink)",
    "h16s": "(h16) written to a sink directory on local disk",
    "k0": "per-request steering sweep: batched, compiled, blocks.M.hook_resid_post (M the middle layer), no row kept, "
          "no edit",
    "k1": "(k0), each request adding one vector with request_args, the same for all",
    "k16": "(k1) with 16 distinct vectors over the requests",
    "k256": "(k1) with a distinct vector each",
    "kpos": "(k0), each request scaling the rows of every 16th prompt position by 0.5 with request_args",
}
# Per-request steering: case -> distinct vectors added (None: kpos' scale at chosen positions)
_STEERING = {"k0": 0, "k1": 1, "k16": 16, "k256": 256, "kpos": None}
_SITES = {"b": ("resid_post",), "c": ("resid_post", "attn_out", "mlp_out"), "d": ("resid_post",), "e": ("resid_post",),
          "f": ("resid_post",), "g": ("resid_post",), "s": ("resid_post",), "f1": ("resid_post",),
          "p1": ("pattern",), "u20": ("resid_post",), "u20s": ("resid_post",), "l16": ("resid_post",), "h4": ("resid_post",), "h16": ("resid_post",), "h4s": ("resid_post",), "h16s": ("resid_post",),
          **dict.fromkeys(_STEERING, ("resid_post",))}
_BATCHED = {"e": "all", "f": "prompt", "g": "last_prompt_token", "s": "prompt", "f1": "prompt", "p1": "prompt", "u20": "prompt", "u20s": "prompt", "l16": "prompt",
            "sae16": "prompt",
            "sae65": "prompt", "h4": "prompt", "h16": "prompt", "h4s": "prompt", "h16s": "prompt",
            **dict.fromkeys(_STEERING, "none")}  # request_args' capture
_LAYER_COUNT = {"f1": 1, "p1": 1, "h4": 4, "h16": 16, "h4s": 4, "h16s": 16, **dict.fromkeys(_STEERING, 1)}  # case ->
# layers hooked (the others: every one)
_SINK = ("s", "h4s", "h16s")  # cases that write their rows to a sink directory
_UNEMBED = {"u20": 20}  # case -> logits kept per token (unembed's top_k) of the last layer's rows
_LOGIT_LENS = {"u20s": 20, "l16": 20}  # case -> logits kept per token and hook, made in the step (logit_lens)
_SAES = {"sae16": 16384, "sae65": 65536}  # case -> features of its SAE (random, standard), features only, no rows
_SAE_TOP_K = 64
_EAGER = ("e", "plain-eager", "tl-e")
_PLAIN = ("plain", "plain-eager")
_PEER = ("tl-b", "tl-e")  # TransformerLens's plugin, its four files loaded as the package tl_peer_plugin
_PEER_FILES = ("plugin.py", "internals.py", "worker_extension.py", "intervention_specs.py")
_SAME_TOKENS_AS_PLAIN = ("a", "b", "c", "d", "f", "g", "s", "tl-b", "f1", "u20", "u20s", "l16", "sae16", "sae65",
                        *(c for c in _LAYER_COUNT if c not in _STEERING), "k0")  # identity

# Llama-3.2-1B's shape, and a tiny one whose head_dim (64) vLLM's CPU attention accepts.
_FULL_MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256, dtype="bfloat16")
_TINY_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=256, vocab_size=512, dtype="float32")
# 16384 batched tokens is vLLM's own default for the LLM class on large GPUs, fixed here so
# that every case schedules alike and the capture buffers match the engine.
_WORKLOAD_FIELDS = ("num_prompts", "prompt_len", "max_tokens", "max_num_batched_tokens", "repeats",
                    "tensor_parallel_size")
_FULL_WORKLOAD = (256, 128, 64, 16384, 10, 1)  # 10 timed generates per engine: ~5 s beside ~40 s of start-up
_TINY_WORKLOAD = (128, 32, 32, 2048, 1, 1)
# The activation stores' workload (SAELens's, dictionary-learning's): prefill only over long documents.
_HARVEST_WORKLOAD = (64, 1024, 1, 16384, 10, 1)
_TINY_HARVEST_WORKLOAD = (16, 256, 1, 2048, 3, 1)


def _case_layers(name: str, num_layers: int) -> list[int] | None:
    """The layers a case hooks: None for every layer; the middle one for one layer; else evenly spaced, first and
    last included."""
    if name in _UNEMBED or name == "u20s":
        return [num_layers - 1]
    count = _LAYER_COUNT.get(name)
    if count is None or count >= num_layers:
        return None
    if count == 1:
        return [num_layers // 2]
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


def _kv_cache_bytes(hf_config, args: argparse.Namespace) -> int:
    """KV cache for every prompt and its generated tokens at once (the workload's whole batch), plus a step of
    slack: every case gets the same, so every case schedules alike, and several engines fit on one GPU by bytes."""
    import torch

    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * torch.finfo(
        getattr(torch, str(hf_config.dtype).removeprefix("torch."))).bits // 8
    tokens = args.num_prompts * (args.prompt_len + args.max_tokens) + args.max_num_batched_tokens
    return int(tokens * per_token * 1.1) + (256 << 20)


def _make_model(path: str, shape: dict) -> None:
    """A random Llama saved with save_pretrained; nothing is fetched from a hub."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in shape.items() if k != "dtype"},
                         tie_word_embeddings=True, max_position_embeddings=4096)
    torch.set_default_dtype(getattr(torch, shape["dtype"]))  # no fp32 copy of 1B weights
    try:
        LlamaForCausalLM(config).save_pretrained(path)
    finally:
        torch.set_default_dtype(torch.float32)


class _SmClockSamples:
    """SM clock of the first visible GPU (MHz, through NVML) every 20 ms while in a with block.

    On the H200 host one engine's timed runs take either ~0.42 s or ~0.68 s; the clock
    during each run says whether the GPU itself ran slower (power or thermal limits).
    """

    def __init__(self, on_gpu: bool):
        import torch

        self.samples: list[int] = []
        self.readable = on_gpu
        if on_gpu:
            try:
                torch.cuda.clock_rate()
            except Exception:  # NVML absent (no nvidia-ml-py) or not permitted on this host
                self.readable = False

    def __enter__(self) -> "_SmClockSamples":
        import threading

        self.samples, self._stop = [], threading.Event()
        if self.readable:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import torch

        while not self._stop.wait(0.02):
            self.samples.append(torch.cuda.clock_rate())

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self.readable:
            self._thread.join()

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def _sae_hook(hf_config) -> str:
    return f"blocks.{hf_config.num_hidden_layers // 2}.hook_resid_post"


def _sae_dir(args: argparse.Namespace, d_sae: int) -> str:
    return f"{args.model}-sae{d_sae}"


def _make_sae(directory: str, hf_config, d_sae: int) -> None:
    """A random standard SAE in SAELens's format at the middle layer's resid_post, about 1 in 16 features firing."""
    import torch
    from safetensors.torch import save_file

    d_in = hf_config.hidden_size
    generator = torch.Generator().manual_seed(d_sae)
    os.makedirs(directory, exist_ok=True)
    save_file({"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5,
               "W_dec": torch.randn(d_sae, d_in, generator=generator) / d_sae ** 0.5,
               "b_enc": torch.full((d_sae,), -1.5), "b_dec": torch.zeros(d_in)},
              os.path.join(directory, "sae_weights.safetensors"))
    with open(os.path.join(directory, "cfg.json"), "w") as file:
        json.dump({"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "apply_b_dec_to_input": True,
                   "normalize_activations": "none", "metadata": {"hook_name": _sae_hook(hf_config)}}, file)


def _memory_fraction() -> float:
    """gpu_memory_utilization for an engine that has the device to itself; on the CPU, where
    vLLM reads it as a fraction of RAM, a small one."""
    import torch

    return 0.9 if torch.cuda.is_available() else 0.1


def _greedy_tokens(outputs: list) -> list[list[int]]:
    """Each request's generated token ids, from llm.generate's outputs."""
    return [list(o.outputs[0].token_ids) for o in outputs]


class _Engine:
    """One case's engine and workload in this process: timed generates and the case's result."""

    def __init__(self, name: str, args: argparse.Namespace, gpu_memory_utilization: float):
        import random

        import torch
        from transformers import AutoConfig
        from vllm import LLM, SamplingParams, envs
        from vllm.inputs import TokensPrompt
        from vllm.v1.worker.gpu_worker import Worker

        import tl_vllm_hooks as tl

        hf_config = AutoConfig.from_pretrained(args.model)
        # transformers 5 says dtype, older releases torch_dtype; a torch.dtype or its name.
        dtype = getattr(torch, str(getattr(hf_config, "dtype", None) or hf_config.torch_dtype).removeprefix("torch."))
        self.name, self.args, self.tl = name, args, tl
        self.on_gpu = torch.cuda.is_available()
        rng = random.Random(0)  # the same prompts in every case
        self.prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(hf_config.vocab_size)
                                                       for _ in range(args.prompt_len)])
                        for _ in range(args.num_prompts)]
        engine_args = dict(model=args.model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
                           seed=0, max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=name in _EAGER,
                           tensor_parallel_size=args.tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization)
        if self.on_gpu:  # by bytes: the KV cache the workload needs (start-up asks only for the small fraction free)
            engine_args.update(kv_cache_memory_bytes=_kv_cache_bytes(hf_config, args), gpu_memory_utilization=0.05)
        if args.compilation_config:
            engine_args["compilation_config"] = json.loads(args.compilation_config)
        self.sites = _SITES.get(name)
        self.config = None
        extra_args = None
        self.sink_dir = os.path.join(args.sink_dir, f"{name}-{os.getpid()}") if name in _SINK else None
        self.shards_seen, self.busy_seconds = set(), 0.0  # case s: shards of earlier generates, writer time
        if name in _PEER:
            import tl_peer_plugin.plugin as peer

            peer.register()  # idempotent; vLLM's plugin loader ran it already where it loads plugins
            peer.configure({f"blocks.{i}.hook_resid_post": (f"model.layers.{i}", hf_config.hidden_size)
                            for i in range(hf_config.num_hidden_layers)},
                           args.max_num_batched_tokens, dtype, enable_batching=name == "tl-e")
            engine_args["worker_extension_cls"] = "tl_peer_plugin.worker_extension.TLWorkerExtension"
        if self.sites or name in _SAES:
            if name in _SAES:
                specs, saes = {}, {_sae_hook(hf_config): _sae_dir(args, _SAES[name])}
            else:
                layers = _case_layers(name, hf_config.num_hidden_layers)
                specs, saes = tl.capture_specs(hf_config, sites=self.sites, layers=layers), {}
            config = self.config = tl.configure(specs, dtype=dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                                                enable_batching=name in _BATCHED, sink_dir=self.sink_dir, saes=saes,
                                                sae_top_k=_SAE_TOP_K,
                                                logit_lens=dict.fromkeys(specs, _LOGIT_LENS[name]) if name in _LOGIT_LENS
                                                else {})
            engine_args.update(config.llm_kwargs)
            if name in _BATCHED:
                extra_args = tl.request_args(config, capture=_BATCHED[name])
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0,
                                     detokenize=False, extra_args=extra_args)
        self.options_seconds = None
        if name in _STEERING:
            self.params = self._steering_params(name, hf_config, dtype)
        # TransformerLens's batched flavour reads the V1 model runner's input_batch, which vLLM 0.24's default
        # runner (V2) has not; its engine core starts with V1's (an environment variable it reads at start).
        # An engine core started in this process freezes vLLM's environment reads (envs.enable_envs_cache): reset
        # before tl-e's engine, or it reads the earlier engine's runner, and after it, or later engines read V1.
        runner = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if name == "tl-e" else {}
        saved = {key: os.environ.get(key) for key in runner}
        os.environ.update(runner)
        if runner:
            envs.disable_envs_cache()
        try:
            self.llm = LLM(**engine_args)
        finally:
            if name in _PEER:
                peer.clear_config()  # its channel is an environment variable: no later engine inherits it
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
            if runner:
                envs.disable_envs_cache()
        # register() had run in this process (configure() or vLLM's plugin loader): False for plain.
        self.load_model_wrapped = hasattr(Worker.load_model, "__wrapped__")
        if name == "d":
            tl.set_edits(self.llm, {"blocks.0.hook_resid_post": {"op": "scale", "value": 1.0}})
        self.clock = _SmClockSamples(self.on_gpu)

    def _steering_params(self, name: str, hf_config, dtype) -> list:
        """One SamplingParams per prompt, each with its request's options (see _STEERING), built as a user's driver
        builds them (request_args), twice: self.options_seconds holds each build's seconds, the first paying what a
        process pays once (torch's first calls), the second what each later batch pays."""
        import torch
        from vllm import SamplingParams

        (hook,) = self.config.capture_specs
        distinct = _STEERING[name]
        vectors = torch.randn(max(distinct or 1, 1), hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
        vectors = (vectors * 0.05).to(dtype)
        positions = list(range(0, self.args.prompt_len, 16))
        self.options_seconds = []
        for _build in range(2):
            start = time.perf_counter()
            if distinct is None:
                edits = [{hook: {"op": "scale", "value": 0.5, "positions": positions}}] * len(self.prompts)
            else:
                edits = [{hook: {"op": "add", "value": vectors[i % distinct]}} if distinct else None
                         for i in range(len(self.prompts))]
            options = [self.tl.request_args(self.config, "none", edit) for edit in edits]
            self.options_seconds.append(time.perf_counter() - start)
        return [SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False,
                               extra_args=extra) for extra in options]

    def generate(self) -> tuple:
        """(outputs, generate seconds, read seconds (None without hooks), what was read,
        median SM clock in MHz, bytes read, seconds the sink's writer spent writing them)."""
        import torch

        tl, llm, name, args = self.tl, self.llm, self.name, self.args
        read_bytes = busy = None
        if self.sites and name not in _BATCHED:
            tl.open_capture(llm)  # arm the capture gate, as a user reading captures would
        elif name in _PEER:  # as its driver does before a capture
            llm.collective_rpc("tl_reset_capture_flags" if name == "tl-b" else "tl_reset_accumulators")
        with self.clock:
            start = time.perf_counter()
            outputs = llm.generate(self.prompts, self.params, use_tqdm=False)
            if self.on_gpu and args.tensor_parallel_size == 1 and _IN_PROCESS:
                torch.cuda.synchronize()  # every stream: captured rows still on their way to host memory too
            elapsed, start = time.perf_counter() - start, time.perf_counter()
        if name in _SINK:
            dataset = tl.flush_sink(llm)  # every row on disk, fsync'ed
            read_s = time.perf_counter() - start
            (writer,) = tl.status(llm)["sink"]
            shards = [os.path.join(self.sink_dir, f) for f in set(os.listdir(self.sink_dir)) - self.shards_seen
                      if f.startswith("shard-")]
            self.shards_seen.update(os.path.basename(shard) for shard in shards)
            sizes = [os.path.getsize(shard) for shard in shards]
            read_bytes = sum(sizes)
            for shard, size in zip(shards, sizes):  # measured: made a hole of the same size (the manifests still
                os.truncate(shard, 0)  # hold), so many generates do not fill the disk (h16s: 4.3 GB a generate;
                os.truncate(shard, size)  # on 2026-12-06 a 64 GiB disk filled in its second round)
            busy, self.busy_seconds = writer["busy_seconds"] - self.busy_seconds, writer["busy_seconds"]
            check = (f"{len(dataset)} requests so far; this generate's {read_bytes / 1e6:.0f} MB in {len(shards)} "
                     f"shards, on disk {read_s:.3f} s after generate returned; the writer thread busy {busy:.3f} s: "
                     f"{read_bytes / busy / 1e9:.2f} GB/s")
        elif name in _STEERING:  # no row kept
            read_s = None
            check = (f"options of {len(self.prompts)} requests built in {self.options_seconds[0] * 1e3:.1f} ms, then "
                     f"{self.options_seconds[1] * 1e3:.1f} ms")
        elif name in _BATCHED:
            captured = tl.read_batched(llm, [o.request_id for o in outputs])  # also frees the rows
            if name in _UNEMBED:  # the rows in hand are the logits
                rows = torch.cat([tensor for request in captured.values() for tensor in request.values()])
                best = tl.unembed(llm, rows, top_k=_UNEMBED[name])
                captured = {"logits": {"values": best.values, "indices": best.indices}}
            read_s = time.perf_counter() - start
            read_bytes, check = _rows_read(captured, read_s)
            del captured
            (files,) = tl.status(llm)["row_files"] or [None]  # given back at the next read
            check += f"; row files {files}"
        elif name == "tl-e":
            from tl_peer_plugin.worker_extension import decode_tensor

            (payloads,) = llm.collective_rpc("tl_read_batched_captures")
            captured = {request: {hook: decode_tensor(p) for hook, p in hooks.items()}
                        for request, hooks in payloads.items()}
            read_s = time.perf_counter() - start
            read_bytes, check = _rows_read(captured, read_s)
            del payloads, captured
        elif name == "tl-b":
            from tl_peer_plugin.worker_extension import decode_tensor

            (payloads,) = llm.collective_rpc("tl_read_captures", args=([args.prompt_len],))
            captured = {hook: decode_tensor(p) for hook, p in payloads.items()}
            read_s = time.perf_counter() - start
            finite = all(bool(t.isfinite().all()) for t in captured.values())
            check = f"{len(captured)} hooks x {args.prompt_len} rows, finite={finite}"
        elif self.sites:
            captured = tl.read_captures(llm, args.prompt_len)
            read_s = time.perf_counter() - start
            finite = all(bool(t.isfinite().all()) for t in captured.values())
            check = f"{len(captured)} hooks x {args.prompt_len} rows, finite={finite}"
        else:
            read_s, check = None, None
        return outputs, elapsed, read_s, check, self.clock.median(), read_bytes, busy

    def result(self, runs: list[tuple], alone: bool) -> dict:
        """The case's result from its timed runs (generate()'s tuples); alone: the only engine in
        this process, so that the process's peak memory is the case's."""
        import torch
        import vllm

        outputs, _, read_s, check, _, read_bytes, busy = runs[-1]
        seconds = statistics.median(run[1] for run in runs)
        tokens = _greedy_tokens(outputs)
        # Greedy decoding on one engine repeats itself exactly unless something races.
        same_each_run = all(_greedy_tokens(run[0]) == tokens for run in runs)
        generated, rss = sum(map(len, tokens)), _peak_rss_tree() if alone else None
        # With tensor parallelism the workers are other processes: no peak readable here.
        gpu_peak = (torch.cuda.max_memory_allocated()
                    if self.on_gpu and alone and self.args.tensor_parallel_size == 1 and _IN_PROCESS else None)
        return {
            "case": self.name, "device": torch.cuda.get_device_name() if self.on_gpu else _cpu_name(),
            "vllm": vllm.__version__, "torch": torch.__version__,
            "generated_tokens": generated, "seconds": seconds, "seconds_each": [run[1] for run in runs],
            "tokens_per_s": generated / seconds,
            "prompt_tokens_per_s": self.args.num_prompts * self.args.prompt_len / seconds,
            "tokens_per_s_fastest": generated / min(run[1] for run in runs),
            "sm_clock_mhz_each": [run[4] for run in runs],  # None without a readable NVML
            "peak_bytes": gpu_peak if self.on_gpu else rss,
            "peak_gpu_bytes": gpu_peak, "peak_rss_bytes": rss,
            "kv_blocks": self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "read_s": read_s, "options_build_s": self.options_seconds, "capture_check": check, "read_bytes": read_bytes, "writer_busy_s": busy,
            # Rows in the user's hands (in memory, or on disk for the sink cases): generate, then read.
            "in_hand_seconds_each": [_in_hand_seconds(run) for run in runs],
            "in_process": _IN_PROCESS,
            "load_model_wrapped": self.load_model_wrapped,
            # Forwards each hook saw in our generates; 0 would mean a hook never ran.
            "min_hook_fires": min(self.tl.read_fire_counts(self.llm).values()) if self.sites else None,
            "tokens": tokens, "same_tokens_each_run": same_each_run,
        }


def _rows_read(captured: dict[str, dict], read_s: float) -> tuple[int, str]:
    """(bytes, a line saying what) of a batched read: {request: {hook: rows}} in read_s seconds."""
    rows = sorted({t.shape[0] for hooks in captured.values() for t in hooks.values()})
    read_bytes = sum(t.numel() * t.element_size() for hooks in captured.values() for t in hooks.values())
    tokens = sum(next(iter(hooks.values())).shape[0] for hooks in captured.values())
    return read_bytes, (f"{len(captured)} requests x {len(next(iter(captured.values())))} hooks, rows {rows}, "
                        f"{read_bytes / tokens:.0f} B a token, "
                        f"read {read_bytes / 1e6:.0f} MB at {read_bytes / read_s / 1e9:.2f} GB/s")


def _say_run(label: str, run: tuple) -> None:
    """One timed generate as it ends (generate()'s tuple), through the parent at once."""
    read = "" if run[2] is None else f", read or flush {run[2]:.3f} s"
    # (a batched case's check ends with its row files: a round whose "made_in_step" grew made one inside a step)
    check = "" if run[3] is None else f"; {run[3]}"
    print(f"{_PROGRESS}[{label}] generate {run[1]:.3f} s{read}{check}", flush=True)


def _in_hand_seconds(run: tuple) -> float:
    """Seconds from a generate's start to its rows in hand (generate()'s tuple): with the read, where it read rows."""
    return run[1] + (run[2] if run[5] is not None else 0.0)


def _say_paired(round_index: int, runs: dict[str, list[tuple]]) -> None:
    """The paired ratios over the rounds done so far, by the summary's rule (the median of plain's seconds over the
    case's, round by round): a run stopped by a time limit still says them."""
    plain = [run[1] for run in runs["plain"]]
    said = []
    for name, case_runs in runs.items():
        if name == "plain":
            continue
        said.append(f"{name} {statistics.median(p / run[1] for p, run in zip(plain, case_runs)):.3f}")
        if case_runs[-1][5] is not None:  # it read rows
            in_hand = statistics.median(p / _in_hand_seconds(run) for p, run in zip(plain, case_runs))
            said[-1] += f" (rows in hand {in_hand:.3f})"
    print(f"{_PROGRESS}[paired, rounds 0-{round_index}] {', '.join(said)}", flush=True)


def _run_case(name: str, args: argparse.Namespace) -> dict:
    """Build one engine, warm up, time ``repeats`` generates; the result the parent parses."""
    engine = _Engine(name, args, _memory_fraction())
    engine.generate()  # warm-up: first-request paths, caches, lazily compiled kernels
    runs = []
    for round_index in range(args.repeats):
        runs.append(engine.generate())
        _say_run(f"{name} run {round_index}", runs[-1])
    result = engine.result(runs, alone=True)
    if args.profile:
        _profile_generate(engine, args.profile)
    return result


# What a profile summary lists beside the kernels: calls whose name holds one of these.
_PROFILED_CALLS = ("Memcpy", "cudaMalloc", "cudaFree", "cudaHostRegister", "Synchronize", "cudaStreamWaitEvent",
                   "aten::copy_", "aten::index_copy_")


def _profile_generate(engine: _Engine, directory: str) -> None:
    """One more generate of the engine under torch.profiler: its summary in directory/<case>.txt and its timeline
    in directory/<case>.trace.json.gz (see the module's docstring)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    activities, device = ([ProfilerActivity.CPU, ProfilerActivity.CUDA], "cuda") if engine.on_gpu else (
        [ProfilerActivity.CPU], "cpu")
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0) if engine.on_gpu else None
    with profile(activities=activities) as profiler:
        run = engine.generate()
    retries = "n/a (CPU)" if retries_before is None else torch.cuda.memory_stats()["num_alloc_retries"] - retries_before
    events = profiler.key_averages()
    calls = [e for e in events if any(part in e.key for part in _PROFILED_CALLS)]
    lines = [f"{engine.name}: one generate of {run[1]:.3f} s under the profiler; caching allocator retries during "
             f"it: {retries}",
             "", f"calls ({', '.join(_PROFILED_CALLS)}): count, CPU ms total, device ms total"]
    lines += [f"  {e.key}: {e.count}, {e.cpu_time_total / 1e3:.1f}, {e.device_time_total / 1e3:.1f}" for e in calls]
    lines += ["", events.table(sort_by=f"self_{device}_time_total", row_limit=40, max_name_column_width=90)]
    trace = os.path.join(directory, f"{engine.name}.trace.json")
    profiler.export_chrome_trace(trace)
    if engine.on_gpu:
        with open(trace) as timeline:
            lines += ["", *_device_timeline(json.load(timeline)["traceEvents"])]
    with open(os.path.join(directory, f"{engine.name}.txt"), "w") as summary:
        summary.write("\n".join(lines) + "\n")
    with open(trace, "rb") as source, gzip.open(trace + ".gz", "wb") as packed:
        shutil.copyfileobj(source, packed)
    os.remove(trace)
    print(f"{_PROGRESS}[{engine.name}] profiled: {run[1]:.3f} s, allocator retries {retries}, "
          f"{os.path.join(directory, engine.name)}.txt", flush=True)


def _device_timeline(events: list[dict]) -> list[str]:
    """From a CUDA profile's trace events: each stream's busy time (kernels, copies and sets, their union) and its
    copies to host, and the host's five longest waits (synchronize calls) with what each stream ran meanwhile, so
    that a wait for a small copy queued behind large ones shows without opening the timeline."""
    spans = [e for e in events if e.get("ph") == "X"]
    device = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device:
        return ["no device activity in the trace"]
    start = min(e["ts"] for e in spans)

    def busy(intervals: list[tuple[float, float]]) -> float:  # ms of their union
        total, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            total, end = total + max(0.0, b - max(a, end)), max(end, b)
        return total / 1e3

    streams: dict = {}
    for e in device:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    lines = [f"device timeline: {(max(e['ts'] + e['dur'] for e in spans) - start) / 1e3:.1f} ms traced",
             "  stream: busy ms; copies to host: count, MB, ms"]
    for stream, work in sorted(streams.items(), key=lambda item: -len(item[1])):
        to_host = [e for e in work if "DtoH" in e["name"]]
        lines.append(f"  {stream}: {busy([(e['ts'], e['ts'] + e['dur']) for e in work]):.1f}; {len(to_host)}, "
                     f"{sum(e['args'].get('bytes', 0) for e in to_host) / 1e6:.1f}, "
                     f"{sum(e['dur'] for e in to_host) / 1e3:.1f}")
    waits = sorted((e for e in spans if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]),
                   key=lambda e: -e["dur"])[:5]
    lines.append("  the host's longest waits: start ms, ms, call; what each stream ran during it (busy ms, copies to "
                 "host in MB)")
    for wait in waits:
        a, b = wait["ts"], wait["ts"] + wait["dur"]
        during = []
        for stream, work in streams.items():
            inside = [e for e in work if e["ts"] < b and e["ts"] + e["dur"] > a]
            if inside:
                mb = sum(e["args"].get("bytes", 0) for e in inside if "DtoH" in e["name"]) / 1e6
                clipped = [(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in inside]
                during.append(f"stream {stream} {busy(clipped):.1f} ms" + (f", {mb:.1f} MB to host" if mb else ""))
        lines.append(f"    {(a - start) / 1e3:.1f}, {wait['dur'] / 1e3:.2f}, {wait['name']}: {'; '.join(during)}")
    return lines


def _run_side_by_side(cases: list[str], args: argparse.Namespace) -> list[dict]:
    """Every case's engine in this one process, sharing the device; then ``repeats`` rounds of one
    timed generate per engine, odd rounds in reverse order. Whatever slows the host for a while
    slows the cases of those rounds alike, so round by round the ratios stay comparable.

    Plain engines are built first, with the plugin off; then register() (case (a)); then each
    configured case. One process's peak memory covers every engine: none is reported."""
    import tl_vllm_hooks as tl

    order = sorted(cases, key=lambda name: (name not in _PLAIN, name != "a"))
    share = _memory_fraction() / len(cases)
    engines = {}
    for name in order:
        if name in _PLAIN:
            os.environ["TL_VLLM_HOOKS_DISABLE"] = "1"
        else:
            os.environ.pop("TL_VLLM_HOOKS_DISABLE", None)
            tl.register()
        engines[name] = _Engine(name, args, share)
        engines[name].generate()  # warm-up
    runs: dict[str, list[tuple]] = {name: [] for name in cases}
    for round_index in range(args.repeats):
        for name in cases if round_index % 2 == 0 else cases[::-1]:
            runs[name].append(engines[name].generate())
            _say_run(f"{name} round {round_index}", runs[name][-1])
        if "plain" in runs:
            _say_paired(round_index, runs)
    results = []
    for name in cases:
        result = engines[name].result(runs[name], alone=False)
        result["side_by_side"] = True
        results.append(result)
    for name in cases if args.profile else ():
        _profile_generate(engines[name], args.profile)
    return results


def _peak_rss_tree() -> int:
    """Sum of peak RSS (VmHWM) over this process and its live descendants (vLLM's engine
    core and worker): an upper bound on the tree's peak, as they need not peak together."""
    import psutil

    total = 0
    for proc in [psutil.Process()] + psutil.Process().children(recursive=True):
        with open(f"/proc/{proc.pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return total


def _plugin_dir(root: str) -> str:
    """A folder declaring ``tl_vllm_hooks:register`` as a ``vllm.general_plugins`` entry point,
    as a pip install would; on PYTHONPATH, vLLM calls it in every process it starts."""
    from tl_vllm_hooks_tools import _write_entry_point

    os.makedirs(root)
    return _write_entry_point(root, "tl_vllm_hooks_bench", "tl_vllm_hooks", "tl_vllm_hooks:register")


def _peer_plugin(root: str, source: str | None) -> str:
    """TransformerLens's plugin as the package ``tl_peer_plugin`` in ``root`` (its four files from
    ``source``, by default the installed transformer_lens's), with the entry point vLLM loads."""
    import importlib.util
    import shutil

    if source is None:
        found = importlib.util.find_spec("transformer_lens")  # finds the folder, imports nothing
        if found is None:
            raise SystemExit("tl-b, tl-e: transformer_lens is not installed here; give --peer-plugin DIR, a folder "
                             f"holding its model_bridge/sources/vllm files {', '.join(_PEER_FILES)}")
        source = os.path.join(found.submodule_search_locations[0], "model_bridge", "sources", "vllm")
    missing = [f for f in _PEER_FILES if not os.path.isfile(os.path.join(source, f))]
    if missing:
        raise SystemExit(f"--peer-plugin {source}: {', '.join(missing)} missing; it needs {', '.join(_PEER_FILES)}")
    package = os.path.join(root, "tl_peer_plugin")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    for file in _PEER_FILES:
        shutil.copy(os.path.join(source, file), package)
    from tl_vllm_hooks_tools import _write_entry_point

    _write_entry_point(root, "tl_peer_plugin", "tl_peer_plugin", "tl_peer_plugin.plugin:register")
    return source


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'CPU'} ({os.cpu_count()} cores)"


def _engine_in_process(args: argparse.Namespace) -> bool:
    """Whether a case's engine and worker run in the case's process (its CUDA peak readable, and profiled there): on
    one GPU unless --separate-processes, and under --profile; else vLLM's separate processes."""
    return bool(args.profile) or args.on_gpu and args.tensor_parallel_size == 1 and not args.separate_processes


def _spawn_cases(names: list[str], round_index: int, args: argparse.Namespace) -> list[dict]:
    """Run one case (or, side by side, several) in a fresh interpreter; a result per case, or
    errors with the log's tail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_VLLM_HOOKS_")}  # each case sets its own
    single = names[0] if len(names) == 1 else None  # side by side, the child sets up each case itself
    if args.compiled_code:
        env["VLLM_CACHE_ROOT"] = os.path.join(os.path.abspath(args.compiled_code), single, f"round{round_index}")
    else:
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if single in _PLAIN:  # a pip-installed copy of the plugin loads into every vLLM process: off
        env["TL_VLLM_HOOKS_DISABLE"] = "1"
    if _engine_in_process(args):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not args.on_gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it CPU start-up fails or crawls
    peers = set(names) & set(_PEER)
    if single == "a" or peers:  # "a": registered in every vLLM process, configured nowhere
        paths = [args.plugin_dir, os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if peers:  # not transformer_lens's own entry point too: its hooks would go in twice
        env["VLLM_PLUGINS"] = "tl_vllm_hooks,tl_peer_plugin"
    command = [sys.executable, os.path.abspath(__file__), "--run-cases", ",".join(names), "--model", args.model,
               "--sink-dir", args.sink_dir]
    command += [f"--{field.replace('_', '-')}={getattr(args, field)}" for field in _WORKLOAD_FIELDS]
    if args.compilation_config:
        command += ["--compilation-config", args.compilation_config]
    if args.profile:
        command += ["--profile", os.path.join(os.path.abspath(args.profile), f"round{round_index}")]
    output = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # each round as it ends, so that a run cut short still says what it measured
            output.append(line)
            if line.startswith(_PROGRESS):
                print(line[len(_PROGRESS):].rstrip(), flush=True)
    if args.out:  # the child's whole log beside the results, vLLM's included
        with open(f"{args.out}.{'-'.join(names)}.round{round_index}.log", "w") as log:
            log.writelines(output)
    lines = [line for line in output if line.startswith(_MARKER)]
    if proc.returncode == 0 and len(lines) == 1:
        return json.loads(lines[0][len(_MARKER):])
    tail = "".join(output[-25:])
    error = f"exit code {proc.returncode}, {len(lines)} result lines; log tail:\n{tail}"
    return [{"case": name, "error": error} for name in names]


def _summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """One result per case: the median engine by tok/s, with every engine's tok/s beside it and
    the fastest timed run of any engine, ratios to plain's, and whether greedy tokens equal plain's. The median
    engine's greedy tokens stay in the result, so that engines of different runs can be compared too.
    Side by side, each generate is also set against plain's generate of the same turn in the same
    process: the median of those ratios is ``paired_ratio``."""
    plain_seconds = {r["round"]: r["seconds_each"] for r in runs.get("plain", []) if "error" not in r}
    results = {}
    for name, case_runs in runs.items():
        good = sorted((r for r in case_runs if "error" not in r), key=lambda r: r["tokens_per_s"])
        if not good:
            results[name] = case_runs[0]
            continue
        result = dict(good[(len(good) - 1) // 2])
        result["tokens_per_s_each_engine"] = [r["tokens_per_s"] for r in case_runs if "error" not in r]
        result["tokens_per_s_fastest"] = max(r["tokens_per_s_fastest"] for r in good)  # over every engine
        result["failed_engines"] = [r["error"] for r in case_runs if "error" in r]
        result["all_tokens"] = [r["tokens"] for r in good]
        paired = [plain_s / case_s for r in good if r.get("side_by_side") and r["round"] in plain_seconds
                  for plain_s, case_s in zip(plain_seconds[r["round"]], r["seconds_each"])]
        result["paired_ratio"] = statistics.median(paired) if paired else None
        in_hand = [plain_s / case_s for r in good if r.get("side_by_side") and r["round"] in plain_seconds
                   for plain_s, case_s in zip(plain_seconds[r["round"]], r["in_hand_seconds_each"])]
        result["paired_in_hand_ratio"] = statistics.median(in_hand) if in_hand else None
        results[name] = result
    plain = results.get("plain", {})
    plain_tokens = plain.get("all_tokens", [None])[0]
    for r in results.values():
        if "error" in r:
            continue
        all_tokens = r.pop("all_tokens")
        same = None if plain_tokens is None else [
            sum(a == b for a, b in zip(tokens, plain_tokens)) for tokens in all_tokens
        ]
        r.update(
            tokens_per_s_ratio=r["tokens_per_s"] / plain["tokens_per_s"] if plain_tokens else None,
            fastest_ratio=r["tokens_per_s_fastest"] / plain["tokens_per_s_fastest"] if plain_tokens else None,
            in_hand_ratio=(plain["seconds"] / statistics.median(r["in_hand_seconds_each"])) if plain_tokens else None,
            peak_ratio=r["peak_bytes"] / plain["peak_bytes"] if r["peak_bytes"] and plain.get("peak_bytes") else None,
            same_tokens_as_plain=None if same is None else all(n == len(plain_tokens) for n in same),
            sequences_equal_to_plain=same,
        )
    return results


def _token_groups(runs: dict[str, list[dict]]) -> dict[str, str]:
    """Every engine ("case round N") against every other: engines with the same greedy tokens
    (those of their last timed run) share a letter, in order of first appearance, so "A A B A"
    shows at a glance which engines agree, across cases and within one."""
    groups: dict[str, str] = {}
    seen: list[list] = []
    for name, case_runs in runs.items():
        for r in case_runs:
            if "error" in r:
                continue
            if r["tokens"] not in seen:
                seen.append(r["tokens"])
            varied = "" if r["same_tokens_each_run"] else " (its timed runs differed)"
            groups[f"{name} round {r['round']}"] = chr(ord("A") + seen.index(r["tokens"])) + varied
    return groups


def _table(results: dict[str, dict]) -> str:
    def fmt(value, spec=""):
        return "n/a" if value is None else format(value, spec)

    rows = ["| case | what | tok/s (median engine) | each engine | ratio | fastest run | ratio | paired ratio "
            "| peak mem (GiB) | ratio | KV blocks | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | {CASES[name]} | failed: {r['error'].splitlines()[0]} | | | | | | | | | |")
            continue
        same = fmt(r["same_tokens_as_plain"]) + ("" if name in _SAME_TOKENS_AS_PLAIN else " (not required)")
        each = ", ".join(f"{t:.0f}" for t in r["tokens_per_s_each_engine"])
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30
        rows.append(f"| {name} | {CASES[name]} | {r['tokens_per_s']:.0f} | {each} | "
                    f"{fmt(r['tokens_per_s_ratio'], '.3f')} | {r['tokens_per_s_fastest']:.0f} | "
                    f"{fmt(r['fastest_ratio'], '.3f')} | {fmt(r['paired_ratio'], '.3f')} | {fmt(peak, '.2f')} "
                    f"| {fmt(r['peak_ratio'], '.3f')} "
                    f"| {r['kv_blocks']} | {same} |")
    return "\n".join(rows)


_PLOTTED_RATIOS = {  # _table's ratios to plain's, as _plot_ratios draws them
    "tokens_per_s_ratio": "tok/s (median engine)",
    "fastest_ratio": "fastest run",
    "paired_ratio": "paired",
    "peak_ratio": "peak memory",
}


def _plot_ratios(results: dict[str, dict], path: str, title: str) -> None:
    """_table's ratios to plain's as a picture, to the PNG ``path``: per case (plain left out), a bar per ratio it
    has (_PLOTTED_RATIOS; n/a ones left out), each labelled with its value, and plain's 1.0 dashed. Needs
    matplotlib, imported here."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    cases = [name for name, r in results.items() if name != "plain" and "error" not in r]
    figure, axes = pyplot.subplots(figsize=(max(6.0, 1.2 * len(cases) + 2), 4.5))
    width = 0.8 / len(_PLOTTED_RATIOS)
    for number, (key, label) in enumerate(_PLOTTED_RATIOS.items()):
        shift = (number - (len(_PLOTTED_RATIOS) - 1) / 2) * width
        drawn = [(x + shift, results[name][key]) for x, name in enumerate(cases) if results[name].get(key) is not None]
        if drawn:
            bars = axes.bar([x for x, _ratio in drawn], [ratio for _x, ratio in drawn], width, label=label)
            axes.bar_label(bars, fmt="%.2f", fontsize=6)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label="plain vLLM")
    axes.set_xticks(range(len(cases)), cases)
    axes.set_xlabel("case (the table's 'what' says what each runs)")
    axes.set_ylabel("ratio to plain vLLM")
    axes.set_title(title, fontsize=8)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    print(f"wrote {path}")


def _rows_table(results: dict[str, dict], disk: dict | None) -> str:
    """The cases that hand rows over: how fast, and generate + rows in hand against plain's generate."""
    def fmt(value, spec=""):
        return "n/a" if value is None else format(value, spec)

    rows = ["| case | layout | rows per generate (MB) | read or flush (s, last run) | GB/s (read, or the sink's "
            "writer) | rows in hand: ratio to plain's generate | paired |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r or r.get("read_bytes") is None:
            continue
        layout = "in-process" if r["in_process"] else "separate processes"
        rows.append(f"| {name} | {layout} | {r['read_bytes'] / 1e6:.0f} | {r['read_s']:.3f} | "
                    f"{r['read_bytes'] / (r['writer_busy_s'] or r['read_s']) / 1e9:.2f} | "
                    f"{fmt(r['in_hand_ratio'], '.3f')} | "
                    f"{fmt(r['paired_in_hand_ratio'], '.3f')} |")
    if disk:
        rows.append(f"\ndisk under the sink: {disk['command']}: {disk['bytes'] / disk['seconds'] / 1e9:.2f} GB/s")
    return "\n".join(rows)


def _prefill_table(results: dict[str, dict], shape: dict, args: argparse.Namespace, copy: dict | None) -> str:
    """Prompt tokens a second, the harvest workload's measure: generate alone, and with the rows in hand (read, or
    on disk), against plain's and against the device-to-host bound (a token's row bytes / the copy rate)."""
    def fmt(value, spec=""):
        return "n/a" if value is None else format(value, spec)

    plain = results.get("plain", {})
    rows = ["| case | layers | row bytes a token | prompt tok/s | rows in hand: prompt tok/s | ratio to plain | "
            "device-to-host bound (tok/s) | share of the bound |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            continue
        layers = _case_layers(name, shape["num_hidden_layers"])
        count = shape["num_hidden_layers"] if layers is None else len(layers)
        every_prompt_row = _SITES.get(name) == ("resid_post",) and _BATCHED.get(name) == "prompt"
        row_bytes = count * shape["hidden_size"] * (2 if shape["dtype"] == "bfloat16" else 4) if every_prompt_row else 0
        in_hand = args.num_prompts * args.prompt_len / statistics.median(r["in_hand_seconds_each"])
        bound = copy["bytes_per_s"] / row_bytes if copy and row_bytes else None
        ratio = in_hand / plain["prompt_tokens_per_s"] if plain.get("prompt_tokens_per_s") else None
        rows.append(f"| {name} | {count if row_bytes else '-'} | {row_bytes or '-'} | {r['prompt_tokens_per_s']:.0f} "
                    f"| {in_hand:.0f} | {fmt(ratio, '.3f')} | {fmt(bound, '.0f')} "
                    f"| {fmt(bound and in_hand / bound, '.3f')} |")
    if copy:
        rows.append(f"\ndevice-to-host copy into pinned memory: {copy['bytes_per_s'] / 1e9:.1f} GB/s ({copy['how']})")
    return "\n".join(rows)


def _copy_rate() -> dict:
    """The GPU's device-to-host copy rate into pinned host memory, measured in a process of its own (best of 5
    copies of 1 GiB), so that no case's process holds the memory or the CUDA context it takes."""
    code = ("import time, torch\n"
            "x = torch.empty(1 << 29, dtype=torch.bfloat16, device='cuda'); y = torch.empty_like(x, device='cpu')"
            ".pin_memory()\nbest = 1e9\n"
            "for _ in range(6):\n"
            "    torch.cuda.synchronize(); t = time.perf_counter(); y.copy_(x, non_blocking=True); "
            "torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)\n"
            "print(x.numel() * 2 / best)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"bytes_per_s": float(done.stdout.split()[-1]), "how": "best of 6 copies of 1 GiB, bf16, one stream"}


def _disk_write_speed(directory: str) -> dict:
    """dd's write speed (2 GiB, flushed to disk) in the sink's directory, for case s to stand beside."""
    import re

    path = os.path.join(directory, "dd.bin")
    command = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", "count=32", "conv=fdatasync"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    os.unlink(path)
    copied = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", done.stderr, re.MULTILINE)
    return {"command": " ".join(command), "bytes": int(copied.group(1)), "seconds": float(copied.group(2))}


def _run_rounds(cases: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every case once per round, in fresh engines, one engine at a time; odd rounds run the
    cases in reverse, so drift over the run does not favour one case. (Engines run side by
    side on two GPUs of one host read 28k and 37k tok/s for the same case: never in parallel.)
    With --side-by-side, a round is one process holding every case's engine."""
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for round_index in range(args.rounds):
        ordered = cases if round_index % 2 == 0 else cases[::-1]
        for names in [ordered] if args.side_by_side else [[name] for name in ordered]:
            start = time.perf_counter()
            for r in _spawn_cases(names, round_index, args):
                r["round"] = round_index
                runs[r["case"]].append(r)
                status = "failed" if "error" in r else f"{r['tokens_per_s']:.0f} tok/s"
                print(f"[{r['case']} round {round_index}] {status}, took {time.perf_counter() - start:.0f} s",
                      file=sys.stderr, flush=True)
                # The whole result too, so a run stopped part-way still leaves its numbers in the log.
                print(f"[{r['case']}] {json.dumps({k: v for k, v in r.items() if k != 'tokens'})}",
                      file=sys.stderr, flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model and workload, for a CPU")
    parser.add_argument("--harvest", action="store_true",
                        help="the activation stores' workload: prefill only (max_tokens 1) over 1,024-token prompts "
                             "(256 with --tiny); set any of its fields with the flags below")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--max-tokens", type=int, help="generated tokens per prompt")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the engine's, and the capture buffers' rows")
    parser.add_argument("--repeats", type=int, help="timed generates after the warm-up; tok/s from their median")
    parser.add_argument("--tensor-parallel-size", type=int, help="GPUs per engine")
    parser.add_argument("--rounds", type=int, default=1, help="fresh engines per case; the median engine is reported")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="also draw the ratio table to this PNG (needs matplotlib)")
    parser.add_argument("--compiled-code", metavar="DIR", help="keep each engine's compile cache in DIR/<case>/round<N>")
    parser.add_argument("--compilation-config", metavar="JSON",
                        help="vLLM's compilation_config for every engine, e.g. "
                             "'{\"inductor_compile_config\": {\"combo_kernels\": false}}'")
    parser.add_argument("--side-by-side", action="store_true",
                        help="every case's engine in one process, sharing the device; generates alternate")
    parser.add_argument("--run-cases", help=argparse.SUPPRESS)
    parser.add_argument("--hidden-size", type=int, help="another model width (heads of 64, MLP twice as wide)")
    parser.add_argument("--num-layers", type=int, help="another number of layers")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--separate-processes", action="store_true",
                        help="on a GPU too, vLLM's default layout: engine and worker in processes of their own "
                             "(no GPU peak memory then)")
    parser.add_argument("--sink-dir", help="case s writes here (default: a temporary directory); also dd's file")
    parser.add_argument("--profile", metavar="DIR",
                        help="one more generate per engine under torch.profiler, in the case's process: a summary and "
                             "a timeline per engine in DIR/round<N>/")
    parser.add_argument("--peer-plugin", metavar="DIR",
                        help=f"tl-b, tl-e: the folder of TransformerLens's plugin ({', '.join(_PEER_FILES)}); "
                             "default: the installed transformer_lens's model_bridge/sources/vllm")
    args = parser.parse_args()
    workload = {(False, False): _FULL_WORKLOAD, (True, False): _TINY_WORKLOAD, (False, True): _HARVEST_WORKLOAD,
                (True, True): _TINY_HARVEST_WORKLOAD}[args.tiny, args.harvest]
    for field, default in zip(_WORKLOAD_FIELDS, workload):
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.run_cases:
        names = args.run_cases.split(",")
        results = [_run_case(names[0], args)] if len(names) == 1 else _run_side_by_side(names, args)
        print(_MARKER + json.dumps(results), flush=True)
        return

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {args.plot}: needs matplotlib, which is not installed here (pip install matplotlib)")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid: {list(CASES)}")
    if args.compilation_config:
        try:
            if not isinstance(json.loads(args.compilation_config), dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            parser.error(f"--compilation-config: {error}; give a JSON object of vLLM's CompilationConfig fields")
    if args.profile and (args.tensor_parallel_size != 1 or args.separate_processes):
        parser.error("--profile: the engine runs in the case's process, so --tensor-parallel-size 1 and no "
                     "--separate-processes")
    if args.side_by_side and (args.compiled_code or args.tensor_parallel_size != 1 or "plain" not in cases):
        parser.error("--side-by-side: needs 'plain' among --cases, one device per engine "
                     "(--tensor-parallel-size 1) and no --compiled-code (one process shares one cache)")
    import torch

    args.on_gpu = torch.cuda.is_available()
    shape = dict(_TINY_MODEL if args.tiny else _FULL_MODEL)
    if args.hidden_size:
        width = args.hidden_size
        shape.update(hidden_size=width, num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256),
                     intermediate_size=2 * width)
    if args.num_layers:
        shape.update(num_hidden_layers=args.num_layers)
    with tempfile.TemporaryDirectory(prefix="bench_tl_vllm_hooks_") as root:
        args.model, args.plugin_dir = os.path.join(root, "model"), _plugin_dir(os.path.join(root, "plugin"))
        peer_source = _peer_plugin(args.plugin_dir, args.peer_plugin) if set(cases) & set(_PEER) else None
        args.sink_dir = os.path.abspath(args.sink_dir or os.path.join(root, "sink"))
        os.makedirs(args.sink_dir, exist_ok=True)
        disk = _disk_write_speed(args.sink_dir) if set(cases) & set(_SINK) else None
        copy = _copy_rate() if args.on_gpu else None
        _make_model(args.model, shape)
        if set(cases) & set(_SAES):
            from transformers import AutoConfig

            for name in set(cases) & set(_SAES):
                _make_sae(_sae_dir(args, _SAES[name]), AutoConfig.from_pretrained(args.model), _SAES[name])
        runs = _run_rounds(cases, args)
        results, token_groups = _summarise(runs), _token_groups(runs)
    first = next((r for r in results.values() if "error" not in r), {})
    report = {key: first.get(key) for key in ("device", "vllm", "torch")}
    report.update(model=shape, workload={k: getattr(args, k) for k in _WORKLOAD_FIELDS},
                  rounds=args.rounds, side_by_side=args.side_by_side,
                  compilation_config=json.loads(args.compilation_config or "null"), cases=results, disk=disk,
                  separate_processes=not _engine_in_process(args),
                  token_groups=token_groups, peer_plugin=peer_source, copy=copy)
    print(f"\n{report['device']}, vLLM {report['vllm']}, torch {report['torch']}\n"
          f"model {shape}\nworkload {report['workload']}, {args.rounds} engine(s) per case"
          f"{', side by side' if args.side_by_side else ''}"
          f"{', compilation_config ' + args.compilation_config if args.compilation_config else ''}"
          f"\n\n{_table(results)}\n\n{_rows_table(results, disk)}\n\n{_prefill_table(results, shape, args, copy)}"
          f"\n\ngreedy tokens by engine (same letter, same tokens): "
          + ", ".join(f"{engine} {group}" for engine, group in token_groups.items()))
    for name, r in results.items():
        for error in ([r["error"]] if "error" in r else r.get("failed_engines", [])):
            print(f"\n[{name}] {error}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        _plot_ratios(results, args.plot, f"{report['device']}, vLLM {report['vllm']}: ratios to plain vLLM")
    sys.exit(1 if any("error" in r or r.get("failed_engines") for r in results.values()) else 0)


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    main()
