"""Does an engine compute the rows of the batched flavour's GPU checks right?

A developer's probe, for a GPU, and the reproducer of vLLM problems. The workload is one of
TestCudaBatched's checks (--workload): the 40-request check (prompts of 1, 3, ..., 79
tokens), BATCH (9, 300 and 57 tokens, 5 generated) or the prompts of MIXED_REQUESTS; the
test's engine arguments (max_num_seqs=8, 128 tokens a step, so steps of every size and
mix). Each engine generates it --generates times; every generated token's logprobs (top 20)
are set against transformers' on the prompt and the tokens generated before it (the test's
model, weights rounded to bf16); a request more than 0.3 off anywhere (bf16 rounding gives
<= ~0.08) has a wrong row, and the run ends with a tally per engine kind. Kinds: plain vLLM
(the module disabled), the batched flavour as the test builds it (also with the
request_args capture modes in --modes, cycled, and the captured rows' errors per hook), and
the compiled flavour (hooks in the graph, no work per step).
    python3 scripts/probe_first_rows.py --out DIR [--kinds plain,hooked] [--engines 3]
        [--generates 2] [--modes last_prompt_token,none,prompt] [--workload many]
        [--cudagraph-mode FULL] [--runner v2]
        [--compilation-config '{"inductor_compile_config": {"combo_kernels": false}}']
Measured with it on the H200 (vLLM 0.24), plain vLLM and the batched flavour alike: with
Model Runner V2 and cudagraph_mode FULL, request 1 of the 40 (3 tokens) wrong in some
generates (1.088 off instead of 0.023); with V1 and FULL, later generated tokens of BATCH
and MIXED_REQUESTS 4-7 off in every generate; V1 and V2 with FULL_AND_PIECEWISE never
(README, Limits). (On a CPU, ``--runner v1 --cudagraph-mode NONE`` runs it end to end.)
Plan for about a minute per engine, and on a fresh machine ~100-200 s more for the first:
Model Runner V2's warm-up compiles its sampler's Triton kernels (measured on the H200),
later engines reuse them.
"""
import argparse
import collections
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


_KINDS = {  # engine kind -> configure() keywords, or None for plain vLLM
    "plain": None,
    "hooked": dict(enable_batching=True, enable_position_interventions=True),  # as the test's engines
    "compiled": dict(),  # the compiled flavour: hooks in the graph, no per-step host work
}
_WRONG = 0.3  # a logprob error above this is a wrong row (bf16 rounding gives <= ~0.08 here)


def _child(kind, model_dir, compilation_config, generates, modes, workload):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import test_tl_vllm_hooks as tests
    import tl_vllm_hooks as tl

    hf_model = tests.bf16_reference_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    specs = tl.capture_specs(AutoConfig.from_pretrained(model_dir), sites=tests.ALL_SITES)
    hook_paths = {name: path for name, (path, _width) in specs.items()}
    prompts, max_tokens = _workload(tests, workload)
    # Transformers' results per token sequence, each made on first need: the hooks' rows
    # only for requests whose rows were captured (plain engines capture none).
    log_probabilities, hook_rows = {}, {}

    def reference_log_probabilities(sequence):
        if sequence not in log_probabilities:
            with torch.no_grad():
                logits = hf_model(torch.tensor([sequence])).logits[0].double()
            log_probabilities[sequence] = torch.log_softmax(logits, dim=-1)
        return log_probabilities[sequence]

    def reference_rows(sequence):
        if sequence not in hook_rows:
            hook_rows[sequence] = tests.reference(hf_model, list(sequence), hook_paths)
        return hook_rows[sequence]

    arguments = dict(tests.engine_arguments("bfloat16"), compilation_config=compilation_config)
    config = None
    if _KINDS[kind] is not None:
        config = tl.configure(specs, tests.MAX_TOKENS_PER_FORWARD, torch.bfloat16, **_KINDS[kind])
        arguments["worker_extension_cls"] = tl.WORKER_EXTENSION
    batched = config is not None and config.enable_batching
    started = time.perf_counter()
    llm = LLM(model_dir, **arguments)
    tl.clear_config()
    print(f"{_MARKER_PROGRESS}engine built in {time.perf_counter() - started:.0f} s", flush=True)
    passes = []
    for index in range(generates):
        mode = modes[index % len(modes)] if batched else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=_TOP,
                                extra_args=tl.request_args(config, mode) if batched else None)
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        captured = tl.read_batched(llm, [o.request_id for o in outputs]) if batched and mode != "none" else {}
        requests = []
        for r, (prompt, output) in enumerate(zip(prompts, outputs)):
            generated = list(output.outputs[0].token_ids)
            sequence = tuple(prompt) + tuple(generated[:-1])  # the rows that ran through the model
            logprobs = reference_log_probabilities(sequence)
            # The error of each generated token's top logprobs; token j comes from row len(prompt) - 1 + j.
            token_errors = [
                max(abs(lp.logprob - float(logprobs[len(prompt) - 1 + j, token])) for token, lp in top.items())
                for j, top in enumerate(output.outputs[0].logprobs)
            ]
            hooks = {}
            if output.request_id in captured:
                kept = tests.kept_rows(mode, len(prompt), len(sequence))
                rows = reference_rows(sequence)
                hooks = {name: tests.relative_error(captured[output.request_id][name].float(), rows[name][kept])
                         for name in rows}
            requests.append({"prompt_len": len(prompt), "logprob_error": max(token_errors),
                             "token_errors": token_errors, "hook_errors": hooks})
        wrong = [r for r, request in enumerate(requests) if request["logprob_error"] > _WRONG]
        print(f"{_MARKER_PROGRESS}generate {index} ({mode}) took {seconds:.1f} s, wrong requests {wrong}", flush=True)
        passes.append({"capture": mode, "requests": requests})
    print(_MARKER + json.dumps({"kind": kind, "passes": passes}), flush=True)


def _workload(tests, name):
    """(prompts, max_tokens) of a check of TestCudaBatched."""
    if name == "many":  # test_last_prompt_token_of_many_requests
        return tests.MANY_PROMPTS, 4
    if name == "batch":  # test_each_request_matches_transformers
        return tests.BATCH, 5
    return [prompt for prompt, _capture, _edits in tests.MIXED_REQUESTS], 3  # the options check, options aside


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--kinds", default="plain,hooked", help=f"engine kinds, of {', '.join(_KINDS)}")
    parser.add_argument("--engines", type=int, default=3, help="fresh engines of each kind, the kinds' order reversed every other round")
    parser.add_argument("--generates", type=int, default=2, help="generates of the whole workload per engine")
    parser.add_argument("--modes", default="last_prompt_token",
                        help="batched kinds: request_args capture modes, one per generate, cycled")
    parser.add_argument("--workload", choices=("many", "batch", "mixed"), default="many",
                        help="prompts and max_tokens of a TestCudaBatched check: the 40 requests, BATCH, MIXED_REQUESTS")
    parser.add_argument("--cudagraph-mode", default="FULL")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2", help="vLLM's model runner")
    parser.add_argument("--compilation-config", default="{}", help="JSON, vLLM's compilation_config besides the mode")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.child:
        _child(args.child, args.model, json.loads(args.compilation_config), args.generates, modes, args.workload)
        return
    if not args.out:
        parser.error("--out DIR is required")
    kinds = args.kinds.split(",")
    unknown = [kind for kind in kinds if kind not in _KINDS]
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; valid: {', '.join(_KINDS)}")
    import test_tl_vllm_hooks as tests

    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1" if args.runner == "v2" else "0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    compilation_config = dict(json.loads(args.compilation_config), cudagraph_mode=args.cudagraph_mode)
    results = []
    with tempfile.TemporaryDirectory() as root:
        model = os.path.join(root, "llama")
        tests._make_model("llama", model)
        for index in range(args.engines):
            for kind in kinds if index % 2 == 0 else kinds[::-1]:
                log_path = os.path.join(args.out, f"first-rows-{kind}-{index}.log")
                child_env = dict(env, TL_VLLM_HOOKS_DISABLE="1") if kind == "plain" else env
                with open(log_path, "w") as log:
                    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, "--model", model,
                                    "--compilation-config", json.dumps(compilation_config),
                                    "--generates", str(args.generates), "--modes", args.modes,
                                    "--workload", args.workload],
                                   env=child_env, stdout=log, stderr=subprocess.STDOUT)
                with open(log_path) as log:
                    found = [json.loads(line[len(_MARKER):]) for line in log if line.startswith(_MARKER)]
                result = found[0] if found else {"kind": kind, "passes": None}
                result["engine"] = index
                results.append(result)
                if not found:
                    print(f"{kind} engine {index}: no result, see {log_path}", flush=True)
                    continue
                for pass_index, one_pass in enumerate(result["passes"]):
                    requests = one_pass["requests"]
                    worst = sorted(range(len(requests)), key=lambda r: -requests[r]["logprob_error"])[:3]
                    text = ", ".join(
                        f"request {r} ({requests[r]['prompt_len']} tokens) {requests[r]['logprob_error']:.3f}"
                        f" (generated token {requests[r]['token_errors'].index(requests[r]['logprob_error'])})"
                        + (f" [captured rows: worst hook {max(requests[r]['hook_errors'].values()):.2e}]"
                           if requests[r]["hook_errors"] else "")
                        for r in worst
                    )
                    print(f"{kind} engine {index} generate {pass_index} ({one_pass['capture']}): "
                          f"largest logprob errors: {text}", flush=True)
    with open(os.path.join(args.out, "first-rows.json"), "w") as f:
        json.dump(results, f, indent=1)
    tally = collections.defaultdict(lambda: [0, 0])  # (kind, capture) -> [generates with a wrong row, generates]
    for result in results:
        for one_pass in result["passes"] or []:
            count = tally[result["kind"], one_pass["capture"]]
            count[0] += any(r["logprob_error"] > _WRONG for r in one_pass["requests"])
            count[1] += 1
    for (kind, capture), (wrong, total) in tally.items():
        print(f"{kind}{f' ({capture})' if capture else ''}: a wrong row in {wrong} of {total} generates", flush=True)


if __name__ == "__main__":
    main()
