"""Developer probe: what 256 requests' options cost on the host, each adding a vector of its own at one hook (the
steering sweep's k256 at the 1B shape: 2,048 bf16 values a request): building them in the driver (request_args) and
parsing them where vLLM takes a request and again in its worker (each process parses a text once, whatever number of
requests share it).

    python3 scripts/probe_request_options.py                 # 256 requests, width 2048, bf16, 9 rounds
    python3 scripts/probe_request_options.py --width 4096    # an 8B model's width

No engine: the config an engine would get, and the parse its front end and workers run. It prints each round's
milliseconds and the median of each. To compare two commits, run it from a worktree of each, alternately: it imports
the module beside it.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tl_vllm_hooks as tlh  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    hook = "blocks.8.hook_resid_post"
    config = tlh.configure({hook: (args.width,)}, 8192, torch.bfloat16, enable_batching=True)
    payload = config.to_json()
    built, parsed = [], []
    for round_index in range(args.rounds):
        vectors = (0.05 * torch.randn(args.requests, args.width)).to(torch.bfloat16)  # new texts every round
        start = time.perf_counter()
        options = [tlh.request_args(config, "none", {hook: {"op": "add", "value": v}}) for v in vectors]
        middle = time.perf_counter()
        for extra_args in options:
            tlh._request_options(extra_args, payload)  # (the engine's own parse: the front end's, then a worker's)
        end = time.perf_counter()
        built.append(1e3 * (middle - start))
        parsed.append(1e3 * (end - middle))
        print(f"round {round_index}: built {built[-1]:.1f} ms, parsed {parsed[-1]:.1f} ms")
    print(f"median of {args.rounds} rounds, {args.requests} requests of width {args.width}: built "
          f"{statistics.median(built):.1f} ms, parsed {statistics.median(parsed):.1f} ms (once; an engine parses "
          "each text in its front end and in each worker)")
