"""Per-request options in one generate: one request steered, one kept to its last token.

    python examples/per_request.py [--model DIR]

Without --model it builds a tiny random Llama. Three copies of one prompt run in
one batch: the first unedited with every row kept, the second with a vector added
to the residual stream after block 0 at prompt positions 10-19, the third unedited
keeping only its last prompt token. The engine is compiled: the per-request routing
happens outside the graph.
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

if __name__ == "__main__":  # vLLM spawns its workers
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)

    hf_config = AutoConfig.from_pretrained(model)
    config = tlh.configure(tlh.capture_specs(hf_config, sites=("resid_post",)), enable_batching=True)
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.1, **config.llm_kwargs)

    direction = torch.randn(hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
    steer = {"blocks.0.hook_resid_post": {"op": "add", "value": 8.0 * direction, "positions": list(range(10, 20))}}
    options = [None, tlh.request_args(config, "all", steer), tlh.request_args(config, "last_prompt_token")]
    prompt = TokensPrompt(prompt_token_ids=[(5 * i + 3) % hf_config.vocab_size for i in range(30)])
    outputs = llm.generate(
        [prompt] * 3,
        [SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, extra_args=o) for o in options],
        use_tqdm=False,
    )
    captured = tlh.read_batched(llm, [o.request_id for o in outputs])
    plain, steered, last = (captured[o.request_id]["blocks.1.hook_resid_post"] for o in outputs)
    for label, output, rows in zip(("unedited", "steered", "last token"), outputs, (plain, steered, last)):
        print(f"{label:11s} rows {tuple(rows.shape)}, tokens {list(output.outputs[0].token_ids)}")
    moved = (steered[:30] - plain[:30]).norm(dim=-1)
    print(f"steered vs unedited, block 1 residual: positions 0-9 moved {moved[:10].max():.2e}, "
          f"10-19 moved {moved[10:20].min():.2f} or more")
    same = torch.allclose(last[0], plain[29], rtol=1e-5, atol=1e-6)
    print(f"last-token row matches the unedited request's row 29: {same}")
