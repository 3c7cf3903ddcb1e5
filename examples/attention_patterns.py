"""Draw a prompt's attention patterns with circuitsvis: an HTML page per layer's heads.

    pip install circuitsvis   # optional: the module never needs it; check with --dry-run that it keeps your torch
    python examples/attention_patterns.py [--model DIR] [--layer 1] [--out attention.html]

Without --model it builds a tiny random Llama, whose heads attend at random; a trained
model's show their structure (induction heads: a stripe one below the diagonal on repeated
text, which is what the prompt here repeats). rows["pattern", layer] is TransformerLens's
blocks.{layer}.attn.hook_pattern, [heads, queries, keys] float32, rebuilt when read from each
token's query and key; circuitsvis's attention view takes it as it is, with the prompt's
tokens. The page holds circuitsvis's JavaScript, so it opens in a browser offline.
"""

import argparse
import os
import sys
import tempfile

try:
    import circuitsvis.attention
except ImportError:
    sys.exit("attention_patterns.py draws with circuitsvis, which is not installed here: pip install circuitsvis")

import torch
from transformers import AutoConfig, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

if __name__ == "__main__":  # vLLM spawns its workers
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    parser.add_argument("--layer", type=int, default=1, help="the layer whose heads to draw")
    parser.add_argument("--out", default="attention.html", help="the HTML file to write")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)

    hf_config = AutoConfig.from_pretrained(model)
    specs = tlh.capture_specs(hf_config, sites=("pattern",), layers=[args.layer])
    config = tlh.configure(specs)  # the one-prompt flavour: the rows of the forward after open_capture
    llm = LLM(model, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, **config.llm_kwargs)

    half = torch.randint(1, hf_config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    prompt = half.repeat(2).tolist()  # 12 random tokens, twice
    tlh.open_capture(llm)
    llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=1), use_tqdm=False)
    rows = tlh.read_captures(llm, len(prompt))
    pattern = rows["pattern", args.layer]  # [heads, queries, keys]
    tokens = AutoTokenizer.from_pretrained(model).convert_ids_to_tokens(prompt)
    html = circuitsvis.attention.attention_patterns(tokens=tokens, attention=pattern)
    with open(args.out, "w", encoding="utf-8") as file:
        file.write(html.local_src)  # (str(html) loads the JavaScript from a CDN instead)
    print(f"blocks.{args.layer}.attn.hook_pattern: {list(pattern.shape)} (heads, queries, keys); rows sum to "
          f"{pattern.sum(-1).mean():.3f}")
    print(f"wrote {os.path.abspath(args.out)}: open it in a browser")
