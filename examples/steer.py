"""Steer generation by adding a vector to the residual stream, with graphs compiled.

    python examples/steer.py [--model DIR] [--layer 0] [--strength 8.0]

Generates greedily three times: unedited, with the vector added at every
position of one layer's residual stream, and after reset_edits (which must give
back the unedited tokens).
"""

import argparse
import os
import tempfile

import torch
from transformers import AutoConfig
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--strength", type=float, default=8.0)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)
    hf_config = AutoConfig.from_pretrained(model)

    config = tlh.configure(tlh.capture_specs(hf_config, sites=("resid_post",), layers=[args.layer]))
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.1, **config.llm_kwargs)

    prompt = TokensPrompt(prompt_token_ids=[11, 42, 7, 99, 3, 250, 18])
    params = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False)

    def tokens():
        return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    direction = torch.nn.functional.normalize(torch.randn(hf_config.hidden_size, generator=torch.Generator().manual_seed(0)), dim=0)
    plain = tokens()
    tlh.set_edits(llm, {f"blocks.{args.layer}.hook_resid_post": {"op": "add", "value": args.strength * direction}})
    steered = tokens()
    tlh.reset_edits(llm)
    after_reset = tokens()
    print(f"unedited:    {plain}")
    print(f"steered:     {steered}")
    print(f"after reset: {after_reset}")
    if after_reset != plain:
        raise SystemExit("reset_edits did not give back the unedited tokens")
