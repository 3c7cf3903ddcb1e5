"""A parity reproducer: vLLM's activations against transformers on the same weights.

    python examples/parity.py [--model DIR] [--tolerance 1e-4]

Captures every layer's residual stream, attention and MLP output of one prompt
in a compiled engine, runs the same prompt through transformers with forward
hooks on a Llama-style model's modules that hold those tensors (the decoder
layer, its self_attn and mlp), prints a table, and exits 1 past the tolerance:
ready to paste into a bug report.
"""

import argparse
import os
import sys
import tempfile

import torch
import vllm
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="relative L2 error")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    specs = tlh.capture_specs(hf_model.config, sites=("resid_post", "attn_out", "mlp_out"))

    config = tlh.configure(specs)
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.1, **config.llm_kwargs)

    token_ids = [(13 * i + 5) % hf_model.config.vocab_size for i in range(32)]
    tlh.open_capture(llm)
    llm.generate(TokensPrompt(prompt_token_ids=token_ids), SamplingParams(max_tokens=1, detokenize=False),
                 use_tqdm=False)
    captured = tlh.read_captures(llm, len(token_ids))

    # transformers' modules holding each hook's tensor in a Llama-style model.
    hf_paths = {
        name: name.replace("blocks.", "model.layers.").replace(".hook_resid_post", "")
        .replace(".hook_attn_out", ".self_attn").replace(".hook_mlp_out", ".mlp")
        for name in specs
    }
    expected = {}
    modules = dict(hf_model.named_modules())
    handles = [
        modules[path].register_forward_hook(
            lambda _m, _i, out, name=name: expected.__setitem__(name, (out[0] if isinstance(out, tuple) else out)[0])
        )
        for name, path in hf_paths.items()
    ]
    with torch.no_grad():
        hf_model(torch.tensor([token_ids]))
    for handle in handles:
        handle.remove()

    print(f"vLLM {vllm.__version__} vs transformers, {model}, {len(token_ids)} tokens, fp32")
    worst = 0.0
    for name in specs:
        error = float((captured[name] - expected[name]).norm() / expected[name].norm())
        worst = max(worst, error)
        print(f"{name:28} rel L2 err {error:.2e}")
    print(f"worst {worst:.2e} (tolerance {args.tolerance:g})")
    sys.exit(0 if worst <= args.tolerance else 1)
