"""How long the batched flavour's host work takes per step, in an in-process engine.

A developer's probe (CPU or GPU). Builds a tiny random Llama and an in-process engine with
the batched flavour (every layer's residual stream), runs the benchmark's workload shape
(256 prompts of 128 tokens, 64 generated each, 16384 tokens a step: 2 prefill and ~64
decode steps), and times the module's per-step functions by wrapping them: reading the
scheduler output, routing rows to edits before the forward, and collecting kept rows after
it. On a GPU that work overlaps the previous step's forward only while it is shorter; the
totals say how much of a generate it could cost.
    python3 scripts/probe_step_host_time.py [--capture prompt] [--rounds 3]
"""
import argparse
import collections
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
_TIMED = ("_note_requests", "_begin_step", "_kept_rows", "_rows_to_host", "_collect_step")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--capture", default="prompt", help="request_args capture mode of every request")
    parser.add_argument("--rounds", type=int, default=3, help="timed generates, after one warm-up")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, where the wrappers are
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import bench_tl_vllm_hooks as bench
    import tl_vllm_hooks as tl

    seconds = collections.defaultdict(list)
    for name in _TIMED:  # the module calls them by their global names
        def timed(*a, _function=getattr(tl, name), _name=name, **k):
            start = time.perf_counter()
            try:
                return _function(*a, **k)
            finally:
                seconds[_name].append(time.perf_counter() - start)
        setattr(tl, name, timed)

    with tempfile.TemporaryDirectory() as model:
        tl.tiny_model(model)
        hf_config = AutoConfig.from_pretrained(model)
        config = tl.configure(tl.capture_specs(hf_config, sites=("resid_post",)), dtype=torch.float32,
                              max_num_batched_tokens=16384, enable_batching=True)
        llm = LLM(model, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
                  max_num_batched_tokens=16384, max_num_seqs=256, worker_extension_cls=tl.WORKER_EXTENSION,
                  gpu_memory_utilization=bench._memory_fraction())
        tl.clear_config()
        rng = random.Random(0)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(hf_config.vocab_size) for _ in range(128)])
                   for _ in range(256)]
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0, detokenize=False,
                                extra_args=tl.request_args(config, capture=args.capture))
        for round_index in range(args.rounds + 1):
            seconds.clear()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if args.capture != "none":
                tl.read_batched(llm, [o.request_id for o in outputs])
            if round_index == 0:
                continue  # warm-up
            parts = ", ".join(
                f"{name} {sum(times) * 1e3:.1f} ms (median {sorted(times)[len(times) // 2] * 1e6:.0f} us)"
                for name, times in seconds.items()
            )
            print(f"generate {elapsed:.3f} s, {len(seconds['_collect_step'])} steps; {parts}", flush=True)


if __name__ == "__main__":
    main()
