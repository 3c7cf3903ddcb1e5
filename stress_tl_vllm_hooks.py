"""Long run of the batched flavour: resident memory must stay flat as results are read.

    python stress_tl_vllm_hooks.py [--requests 2000] [--batch 100] [--plain]

Sends --requests prompts to a tiny random Llama (compiled engine) in batches, with
per-request options in rotation (every row, prompt rows, the last prompt token, none;
every third request with its own edit), reads (and so frees) each batch's rows, and
prints the resident memory of the driver and of vLLM's processes after each batch, and
the row files the workers hold in /dev/shm (rows on their way to the driver);
the last lines compare the first and the second quarter with the last.
--plain runs the same without hooks, for vLLM's own growth.
"""

import argparse
import os
import statistics
import tempfile

import torch
from transformers import AutoConfig
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as children:
            for child in children.read().split():
                found += [int(child), *_children(int(child))]
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--plain", action="store_true", help="no hooks: vLLM's own baseline")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = tempfile.mkdtemp(prefix="tiny_llama_")
    tools.tiny_model(model)
    config = None
    engine_args = dict(max_num_batched_tokens=1024, enable_prefix_caching=False)
    if not args.plain:
        config = tlh.configure(
            tlh.capture_specs(AutoConfig.from_pretrained(model), sites=("resid_post", "mlp_out")),
            max_num_batched_tokens=1024, dtype=torch.float32, enable_batching=True)
        engine_args = config.llm_kwargs
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.1, **engine_args)
    captures = ("all", "prompt", "last_prompt_token", "none")
    edit = {"blocks.0.hook_mlp_out": {"op": "scale", "value": 0.5, "positions": [3, 20]}}

    def params(r: int) -> SamplingParams:
        options = None if config is None else tlh.request_args(config, captures[r % 4], edit if r % 3 == 0 else None)
        return SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True, extra_args=options)

    driver, samples, shared = os.getpid(), [], ""
    for start in range(0, args.requests, args.batch):
        requests = range(start, start + args.batch)
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + r) % 512 for i in range(16 + r % 48)]) for r in requests]
        outputs = llm.generate(prompts, [params(r) for r in requests], use_tqdm=False)
        if not args.plain:
            kept = [o.request_id for o, r in zip(outputs, requests) if captures[r % 4] != "none"]
            captured = tlh.read_batched(llm, kept)
            assert len(captured) == len(kept)
            state = tlh.status(llm)
            assert state["unread_requests"] == 0
            files = state["row_files"] or [{"files": 0, "bytes": 0, "created": 0}]
            shared = (f", row files {sum(f['files'] for f in files)} ({sum(f['bytes'] for f in files) / 2**20:.0f} MiB,"
                      f" {sum(f['created'] for f in files)} made)")
        engine = sum(_rss_mib(pid) for pid in _children(driver))
        samples.append((_rss_mib(driver), engine))
        print(f"{start + args.batch:5d} requests: driver {samples[-1][0]:7.1f} MiB, vLLM processes {engine:7.1f} MiB{shared}",
              flush=True)
    quarter = max(1, len(samples) // 4)
    first, second, last = (
        [statistics.mean(column) for column in zip(*part)]
        for part in (samples[:quarter], samples[quarter : 2 * quarter], samples[-quarter:])
    )
    print(f"first quarter: driver {first[0]:.1f} MiB, vLLM {first[1]:.1f} MiB; "
          f"last quarter: driver {last[0]:.1f} MiB, vLLM {last[1]:.1f} MiB; "
          f"growth {last[0] - first[0]:+.1f} / {last[1] - first[1]:+.1f} MiB")
    # The allocators of both sides grow their pools over the first requests;
    # a leak keeps growing after that.
    print(f"second to last quarter: growth {last[0] - second[0]:+.1f} / {last[1] - second[1]:+.1f} MiB")
