"""Where the batched flavour's time goes: one engine, capture modes and ways of copying rows to host.

A developer's probe, for a GPU (--tiny runs it on a CPU). One child process runs plain vLLM,
another the batched flavour (compiled, every layer's residual stream), both in-process
engines built as the benchmark builds them (its _Engine), with its workload. The hooked
engine alternates, generate by generate, between keeping nothing, the last prompt token, and
every prompt row, the last with the module's copy to host and with variants that replace it
for the comparison (rows kept on the device; the copy issued after vLLM's sample_tokens, in
chunks; the copy issued after vLLM's own output copy of the step's tokens has finished, whole
or in chunks). Alternating inside one engine puts every
variant through the same host conditions and the same compiled graph: every variant's greedy
tokens are compared with the engine's first generate, so a copy that disturbed the forward
would show as a variant whose tokens differ. With --profile it then profiles one generate of
some variants (torch.profiler, Chrome traces). Seconds include waiting for the copies.
    python3 scripts/probe_batched_copies.py --out DIR [--tiny] [--rounds 6] [--profile]
"""
import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _workload(model, tiny):
    """The benchmark's workload on this model, as _Engine reads it from its arguments."""
    import bench_tl_vllm_hooks as bench

    fields = dict(zip(bench._WORKLOAD_FIELDS, bench._TINY_WORKLOAD if tiny else bench._FULL_WORKLOAD))
    return argparse.Namespace(model=model, compilation_config=None, **fields)


class _Copies:
    """Stands in for tl._rows_to_host: gather as it does, then keep the rows on the device
    (no_d2h), or queue the copy and issue it after vLLM's sample_tokens (deferred), all of
    it or chunk_bytes at a time with one chunk in flight; after_output does the same but
    the copy stream first waits for vLLM's output copy stream, so vLLM's copy of the step's
    sampled tokens (which the engine waits for) never queues behind the rows."""

    def __init__(self, state, mode, chunk_bytes=None):
        import torch

        self.torch, self.state, self.mode, self.chunk_bytes = torch, state, mode, chunk_bytes
        self.pending = collections.deque()
        self.last_event = None

    def rows_to_host(self, state, kept_rows):
        torch = self.torch
        buffers = state.capture_buffers
        if kept_rows.size == kept_rows[-1] + 1:
            gathered = {name: buffer[: kept_rows.size].clone() for name, buffer in buffers.items()}
        else:
            index = torch.from_numpy(kept_rows).to(state.device)
            gathered = {name: buffer.index_select(0, index) for name, buffer in buffers.items()}
        if self.mode == "no_d2h":
            return gathered
        host_rows = {}
        for name, rows in gathered.items():
            host = host_rows[name] = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            if self.chunk_bytes:
                step = max(1, self.chunk_bytes // (rows.shape[1] * rows.element_size()))
                for start in range(0, rows.shape[0], step):
                    self.pending.append((host[start:start + step], rows[start:start + step]))
            else:
                self.pending.append((host, rows))
        return host_rows

    def issue(self, budget=None):
        torch, state = self.torch, self.state
        if not self.pending:
            return
        if state.copy_stream is None:  # a CPU engine
            while self.pending:
                host, rows = self.pending.popleft()
                host.copy_(rows)
            return
        if budget is not None and self.last_event is not None and not self.last_event.query():
            return
        state.copy_stream.wait_stream(torch.cuda.current_stream(state.device))
        if self.mode == "after_output":
            runner = state.runner
            output_stream = getattr(runner, "async_output_copy_stream", None) or getattr(runner, "output_copy_stream", None)
            if output_stream is not None:
                state.copy_stream.wait_stream(output_stream)
        sent = 0
        with torch.cuda.stream(state.copy_stream):
            while self.pending and (budget is None or sent < budget):
                host, rows = self.pending.popleft()
                host.copy_(rows, non_blocking=True)
                rows.record_stream(state.copy_stream)
                sent += rows.numel() * rows.element_size()
            self.last_event = torch.cuda.Event()
            self.last_event.record(state.copy_stream)

    def after_sample(self):
        self.issue(self.chunk_bytes)


def _child(kind, model, out, rounds, tiny, profiled):
    import copy

    import torch

    import bench_tl_vllm_hooks as bench
    import tl_vllm_hooks as tl

    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # Case (f) of the benchmark: batched, compiled, every layer's residual stream.
    engine = bench._Engine("plain" if kind == "plain" else "f", _workload(model, tiny), bench._memory_fraction())
    llm = engine.llm
    results = collections.defaultdict(list)

    def params(capture):
        if capture is None:
            return engine.params
        sampling = copy.copy(engine.params)
        sampling.extra_args = tl.request_args(engine.config, capture=capture)
        return sampling

    if kind == "plain":
        variants = {"plain": (None, None)}
    else:
        state = llm.collective_rpc(lambda worker: getattr(worker, "worker", worker)._tl_hooks)[0]
        runner = state.runner
        original_rows_to_host = tl._rows_to_host
        original_sample = runner.sample_tokens
        current = {"copies": None}

        def sample_tokens(*args, **kwargs):
            result = original_sample(*args, **kwargs)
            if current["copies"] is not None:
                current["copies"].after_sample()
            return result

        runner.sample_tokens = sample_tokens
        variants = {
            "none": ("none", None),
            "g_current": ("last_prompt_token", None),
            "f_current": ("prompt", None),
            "f_no_d2h": ("prompt", ("no_d2h", None)),
            "f_chunk128": ("prompt", ("deferred", 128 << 20)),
            "f_out_all": ("prompt", ("after_output", None)),
            "f_out_chunk64": ("prompt", ("after_output", 64 << 20)),
            "f_out_chunk16": ("prompt", ("after_output", 16 << 20)),
        }

    def run(name):
        capture, copy_mode = variants[name]
        if kind == "hooked":
            if copy_mode is None:
                tl._rows_to_host, current["copies"] = original_rows_to_host, None
            else:
                copies = current["copies"] = _Copies(state, *copy_mode)
                tl._rows_to_host = copies.rows_to_host
        sampling = params(capture)
        _sync()
        start = time.perf_counter()
        outputs = llm.generate(engine.prompts, sampling, use_tqdm=False)
        generated = time.perf_counter() - start
        if kind == "hooked" and current["copies"] is not None:
            with torch.inference_mode():  # the host rows were made in vLLM's inference mode
                current["copies"].issue()
        _sync()
        total = time.perf_counter() - start
        if kind == "hooked":
            tl.reset_batched(llm)
        return generated, total, outputs

    names = list(variants)
    reference = None  # the engine's first generate
    same_tokens = collections.defaultdict(list)  # variant -> sequences equal to reference, per run
    for round_index in range(rounds + 1):  # round 0 warms up, untimed
        for name in names if round_index % 2 == 0 else reversed(names):
            generated, total, outputs = run(name)
            reference = reference or bench._greedy_tokens(outputs)
            same_tokens[name].append(sum(a == b for a, b in zip(bench._greedy_tokens(outputs), reference)))
            if round_index:
                results[name].append((generated, total))
    summary = {}
    for name, runs in results.items():
        totals = [t for _, t in runs]
        summary[name] = {"median_total_s": statistics.median(totals), "fastest_total_s": min(totals),
                         "median_generate_s": statistics.median(g for g, _ in runs), "runs": runs,
                         "sequences_equal_to_first_generate": same_tokens[name]}
    from torch.profiler import ProfilerActivity, profile

    for name in (["plain"] if kind == "plain" else ["none", "g_current", "f_current"]) if profiled else []:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
            run(name)
        path = os.path.join(out, f"trace-{name}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        table += "\n" + prof.key_averages().table(sort_by="self_device_time_total", row_limit=20)
        print(f"==== profile {name}\n{table}", flush=True)
    print("@@PROBE@@ " + json.dumps({"kind": kind, "variants": summary, "first_tokens": reference}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="the benchmark's tiny fp32 model and workload")
    parser.add_argument("--rounds", type=int, default=6, help="timed generates of each variant")
    parser.add_argument("--profile", action="store_true", help="then profile one generate of some variants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        _child(args.child, args.model, args.out, args.rounds, args.tiny, args.profile)
        return
    import bench_tl_vllm_hooks as bench

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    summary, first_tokens = {}, {}
    with tempfile.TemporaryDirectory() as root:
        model = os.path.join(root, "model")
        bench._make_model(model, bench._TINY_MODEL if args.tiny else bench._FULL_MODEL)
        for kind in ("plain", "hooked"):
            child_env = dict(env, TL_VLLM_HOOKS_DISABLE="1") if kind == "plain" else env
            log_path = os.path.join(args.out, f"probe-{kind}.log")
            with open(log_path, "w") as log:
                command = [sys.executable, os.path.abspath(__file__), "--child", kind, "--model", model,
                           "--out", args.out, f"--rounds={args.rounds}"]
                command += (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])
                subprocess.run(command, env=child_env, stdout=log, stderr=subprocess.STDOUT)
            with open(log_path) as log:
                for line in log:
                    if line.startswith("@@PROBE@@ "):
                        child = json.loads(line[len("@@PROBE@@ "):])
                        summary.update(child["variants"])
                        first_tokens[child["kind"]] = child["first_tokens"]
    plain = summary.get("plain", {}).get("median_total_s")
    for name, r in summary.items():
        ratio = plain / r["median_total_s"] if plain else float("nan")
        fastest = summary["plain"]["fastest_total_s"] / r["fastest_total_s"] if plain else float("nan")
        print(f"{name:12s} median {r['median_total_s']:.3f} s (generate {r['median_generate_s']:.3f}) "
              f"fastest {r['fastest_total_s']:.3f} s  vs plain: median {ratio:.3f} fastest {fastest:.3f}  "
              f"sequences equal to its engine's first generate, each generate: {r['sequences_equal_to_first_generate']}")
    if len(first_tokens) == 2:
        same = sum(a == b for a, b in zip(first_tokens["plain"], first_tokens["hooked"]))
        print(f"hooked engine's first generate against plain's: {same} of {len(first_tokens['plain'])} sequences equal")
        summary["hooked_sequences_equal_to_plain"] = same
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
