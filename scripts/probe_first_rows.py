"""Does plain vLLM compute the rows that the batched flavour's 40-request check finds wrong?

A developer's probe, for a GPU. TestCudaBatched's 40-request check (prompts of 1, 3, ..., 79
tokens, each request keeping its last prompt row) has failed on some Model Runner V2 engines
with FULL CUDA graphs, always on the 1-token prompt, from layer 1's attention on, with the
same numbers every time it fails; other engines pass. This runs that workload in fresh
engines, plain vLLM and hooked ones alternating, twice per engine (first and second generate),
and sets each request's first generated token's logprobs against transformers (the test's
model, weights rounded to bf16). If plain engines show the same requests off, vLLM computes
those rows so; the hooks only report them. Hooked engines also report the captured rows'
errors per hook, as the test does.
    python3 scripts/probe_first_rows.py --out DIR [--engines 3] [--cudagraph-mode FULL] [--runner v2]
        [--compilation-config '{"inductor_compile_config": {"combo_kernels": false}}']
(On a CPU, ``--runner v1 --cudagraph-mode NONE`` runs it end to end.) Plan for about a minute
per engine, and on a fresh machine ~100 s more for the first: Model Runner V2's warm-up after
graph capture compiles its sampler's Triton kernels (measured on the H200), later engines
reuse them.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
_MARKER = "@@FIRST_ROWS@@ "
_MARKER_PROGRESS = "@@FIRST_ROWS_PROGRESS@@ "  # where a child got to, for a run stopped part-way
_TOP = 20  # logprobs per generated token compared with transformers'


def _child(kind, model_dir, compilation_config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import test_tl_vllm_hooks as tests
    import tl_vllm_hooks as tl

    hf_model = tests.bf16_reference_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    specs = tl.capture_specs(AutoConfig.from_pretrained(model_dir), sites=tests.ALL_SITES)
    hook_paths = {name: path for name, (path, _width) in specs.items()}
    arguments = dict(tests.engine_arguments("bfloat16"), compilation_config=compilation_config)
    extra_args = None
    if kind == "hooked":
        config = tl.configure(specs, tests.MAX_TOKENS_PER_FORWARD, torch.bfloat16, enable_batching=True,
                              enable_position_interventions=True)
        arguments["worker_extension_cls"] = tl.WORKER_EXTENSION
        extra_args = tl.request_args(config, "last_prompt_token")
    started = time.perf_counter()
    llm = LLM(model_dir, **arguments)
    tl.clear_config()
    print(f"{_MARKER_PROGRESS}engine built in {time.perf_counter() - started:.0f} s", flush=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=_TOP,
                            extra_args=extra_args)
    passes = []
    for _ in range(2):
        started = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in tests.MANY_PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        print(f"{_MARKER_PROGRESS}generate {len(passes)} took {time.perf_counter() - started:.1f} s", flush=True)
        captured = tl.read_batched(llm, [o.request_id for o in outputs]) if kind == "hooked" else {}
        requests = []
        for prompt, output in zip(tests.MANY_PROMPTS, outputs):
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt])).logits[0, -1]
            expected = torch.log_softmax(logits.double(), dim=-1)
            first = output.outputs[0].logprobs[0]
            logprob_error = max(abs(lp.logprob - float(expected[token])) for token, lp in first.items())
            hooks = {}
            if output.request_id in captured:
                rows = tests.reference(hf_model, prompt, hook_paths)
                hooks = {name: tests.relative_error(captured[output.request_id][name].float(), rows[name][-1:])
                         for name in rows}
            requests.append({"prompt_len": len(prompt), "logprob_error": logprob_error, "hook_errors": hooks})
        passes.append(requests)
    print(_MARKER + json.dumps({"kind": kind, "passes": passes}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--engines", type=int, default=3, help="fresh engines of each kind, plain and hooked alternating")
    parser.add_argument("--cudagraph-mode", default="FULL")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2", help="vLLM's model runner")
    parser.add_argument("--compilation-config", default="{}", help="JSON, vLLM's compilation_config besides the mode")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, json.loads(args.compilation_config))
        return
    if not args.out:
        parser.error("--out DIR is required")
    import test_tl_vllm_hooks as tests

    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1" if args.runner == "v2" else "0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    results = []
    with tempfile.TemporaryDirectory() as root:
        model = os.path.join(root, "llama")
        tests._make_model("llama", model)
        for index in range(args.engines):
            for kind in ("plain", "hooked") if index % 2 == 0 else ("hooked", "plain"):
                log_path = os.path.join(args.out, f"first-rows-{kind}-{index}.log")
                child_env = dict(env, TL_VLLM_HOOKS_DISABLE="1") if kind == "plain" else env
                with open(log_path, "w") as log:
                    compilation_config = dict(json.loads(args.compilation_config), cudagraph_mode=args.cudagraph_mode)
                    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, "--model", model,
                                    "--compilation-config", json.dumps(compilation_config)],
                                   env=child_env, stdout=log, stderr=subprocess.STDOUT)
                with open(log_path) as log:
                    found = [json.loads(line[len(_MARKER):]) for line in log if line.startswith(_MARKER)]
                result = found[0] if found else {"kind": kind, "passes": None}
                result["engine"] = index
                results.append(result)
                if not found:
                    print(f"{kind} engine {index}: no result, see {log_path}", flush=True)
                    continue
                for pass_index, requests in enumerate(result["passes"]):
                    worst = sorted(range(len(requests)), key=lambda r: -requests[r]["logprob_error"])[:3]
                    text = ", ".join(
                        f"request {r} ({requests[r]['prompt_len']} tokens) {requests[r]['logprob_error']:.3f}"
                        + (f" [captured rows: worst hook {max(requests[r]['hook_errors'].values()):.2e}]"
                           if requests[r]["hook_errors"] else "")
                        for r in worst
                    )
                    print(f"{kind} engine {index} generate {pass_index}: largest logprob errors: {text}", flush=True)
    with open(os.path.join(args.out, "first-rows.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
