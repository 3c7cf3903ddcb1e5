"""Capture the residual stream of a batch of prompts, one tensor per request and layer.

    python examples/capture_batch.py [--model DIR]

Without --model it builds a tiny random Llama. The batched flavour runs compiled
or eager (eager here: it starts faster on a CPU); each request comes back whole,
however vLLM chunked or batched it. examples/per_request.py gives requests their
own edits and keeps only some rows.
"""

import argparse
import os
import tempfile

from transformers import AutoConfig
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

if __name__ == "__main__":  # vLLM spawns its workers
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)

    config = tlh.configure(tlh.capture_specs(AutoConfig.from_pretrained(model), sites=("resid_post",)),
                           enable_batching=True)
    llm = LLM(model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, gpu_memory_utilization=0.1,
              **config.llm_kwargs)

    prompts = [list(range(1, 1 + length)) for length in (5, 40, 200)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
    captured = tlh.read_batched(llm, [o.request_id for o in outputs])
    for output in outputs:
        rows = captured[output.request_id]
        # Rows: the prompt, then each generated token but the last.
        print(f"request {output.request_id}: {len(output.prompt_token_ids)} prompt tokens")
        for name, tensor in rows.items():
            print(f"  {name}: {tuple(tensor.shape)}, last-token norm {tensor[-1].norm():.3f}")
