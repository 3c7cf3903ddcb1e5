"""Developer probe: how long ``read_batched`` takes to hand over many requests' rows, the part of "rows in hand"
that comes after generate (BENCHMARKS: about 10 ms for 256 requests x 16 hooks on an H100's host at commit 8a8c043,
whatever their bytes).

    python3 scripts/probe_read_time.py                          # 256 requests, 15 hooks, each request's last prompt row
    python3 scripts/probe_read_time.py --capture prompt         # every prompt row (32 a request)
    python3 scripts/probe_read_time.py --capture prompt --sites pattern   # every layer's attention patterns

An in-process engine on a tiny random Llama (fp32, eager; CPU or GPU), one prompt step per generate; it prints the
median and fastest of the timed reads (the first two are left out). To compare two commits, run it from a worktree
of each, alternately: it imports the module beside it.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tl_vllm_hooks as tlh  # noqa: E402
import tl_vllm_hooks_tools as tools  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", default="last_prompt_token", help="each request's capture (request_args)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--reads", type=int, default=12)
    parser.add_argument("--sites", default="resid_pre,resid_mid,resid_post,attn_out,mlp_out", help="comma list")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: no RPC between two processes
    from vllm import LLM, SamplingParams

    path = os.path.join("/tmp", "probe-read-time-model")
    model = tools.tiny_model(path)
    specs = tlh.capture_specs(model.config, sites=tuple(args.sites.split(",")))
    config = tlh.configure(specs, enable_batching=True)
    llm = LLM(path, dtype="float32", max_num_seqs=args.requests, gpu_memory_utilization=0.2, enforce_eager=True,
              **config.llm_kwargs)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 100, 32).tolist()} for _ in range(args.requests)]
    params = SamplingParams(max_tokens=1, extra_args=tlh.request_args(config, args.capture))
    seconds = []
    for _ in range(args.reads):
        request_ids = [output.request_id for output in llm.generate(prompts, params, use_tqdm=False)]
        start = time.perf_counter()
        tlh.read_batched(llm, request_ids)
        seconds.append(time.perf_counter() - start)
    print(f"read_batched of {args.requests} requests x {len(specs)} hooks (capture={args.capture!r}): median "
          f"{np.median(seconds[2:]) * 1e3:.2f} ms, fastest {min(seconds[2:]) * 1e3:.2f} ms ({args.reads - 2} reads)")
