"""Developer probe: the batched flavour's host work per step, the part of a decode step that the hooks add on the
host (vLLM 0.24's decode steps of many requests are bound by the host: BENCHMARKS, "Decode steps wait on the host").

    python3 scripts/probe_step_host_time.py                      # no engine: hand-made steps of 256 requests
    python3 scripts/probe_step_host_time.py --engine             # an in-process engine on a tiny model (CPU or GPU)
    ... --capture all                                            # what each request keeps (default: prompt)

It times the flavour's per-step calls (the scheduler output read, schedule, prepared, executed, finish) and prints
the median over the decode steps. It reaches into the module's private per-step calls, so it is retired once its
figures are recorded (see docs/batched-copy-probes.md for how to run it from git history).
"""

import argparse
import collections
import os
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tl_vllm_hooks as tlh  # noqa: E402

STEP_CALLS = ("schedule", "prepared", "executed", "finish")


def without_engine(capture: str, num_requests: int, decode_steps: int, rounds: int = 3) -> dict[str, np.ndarray]:
    """Seconds of schedule + prepared + executed + finish per decode step, on a flavour built from stand-ins: one
    8-wide hook, num_requests prompts of 32 tokens in one prefill step, then decode steps of one row each."""
    rows, width, prompt = 16384, 8, 32
    config = tlh.CaptureConfig({"h": ("model.layers.0", width)}, rows, enable_batching=True)
    extra_args = tlh.request_args(config, capture)
    ids = [f"{i}-{i:08x}" for i in range(num_requests)]
    for _ in range(rounds):  # the last round's times
        engine = tlh._EngineFacts(torch.nn.Linear(1, 1), types.SimpleNamespace(get_text_config=lambda: None), rows,
                                  num_requests, False, torch.device("cpu"), torch.float32, None, False)
        hook = types.SimpleNamespace(buffer=torch.zeros(rows, width), width=width, row_shape=(width,), keeps_rows=True,
                                     sae=None)
        state = tlh._Batched(config, engine, {"h": hook}, [])
        state.warmed_up = True
        batch = types.SimpleNamespace(req_ids=ids)
        state.runner = types.SimpleNamespace(input_batch=batch, query_start_loc=types.SimpleNamespace(np=None))
        times = []
        for k in range(decode_steps + 1):
            counts = [prompt if k == 0 else 1] * num_requests
            state.runner.query_start_loc.np = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            new = [tlh._NewRequest(r, prompt, list(range(prompt)), extra_args, 0) for r in ids] if k == 0 else []
            first = {} if k == 0 else {r: prompt + k - 1 for r in ids}
            start = time.perf_counter()
            state.schedule(tlh._Step(set(), new, first, sum(counts)))
            state.prepared(), state.executed(), state.finish()
            times.append(time.perf_counter() - start)
        state.close()
    return {"step": np.array(times[1:])}


def with_engine(capture: str, num_requests: int, decode_steps: int) -> dict[str, np.ndarray]:
    """Seconds of each per-step call in an in-process engine (a tiny random Llama, fp32, eager), over the decode
    steps of the second of two generates."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's worker in this process, to time its calls
    from vllm import LLM, SamplingParams

    times = collections.defaultdict(list)

    def timed(owner, name):
        call = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - start)

        setattr(owner, name, wrapper)

    for name in STEP_CALLS:
        timed(tlh._Batched, name)
    timed(tlh, "_scheduled")
    path = os.path.join("/tmp", "probe-step-host-time-model")
    model = tlh.tiny_model(path)
    config = tlh.configure(tlh.capture_specs(model.config, sites=("resid_post",)), enable_batching=True)
    llm = LLM(path, dtype="float32", max_num_seqs=num_requests, gpu_memory_utilization=0.2,
              enforce_eager=True, **config.llm_kwargs)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 100, 32).tolist()} for _ in range(num_requests)]
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, extra_args=tlh.request_args(config, capture))
    for _ in range(2):  # the second generate's steps
        times.clear()
        llm.generate(prompts, params, use_tqdm=False)
    return {name: np.array(times[name][-decode_steps:]) for name in ("_scheduled", *STEP_CALLS)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="store_true", help="time an in-process engine's steps")
    parser.add_argument("--capture", default="prompt", help="each request's capture (request_args)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()
    run = with_engine if args.engine else without_engine
    for name, seconds in run(args.capture, args.requests, args.decode_steps).items():
        print(f"{name}: median {np.median(seconds) * 1e6:.1f} us a decode step ({len(seconds)} steps, "
              f"{args.requests} requests, capture={args.capture!r})")
