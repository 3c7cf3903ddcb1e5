"""Activation patching as one batched generate: TransformerLens's residual-stream sweep, one request per (layer, position).

    python examples/activation_patching.py [--model DIR] [--prompt-len N] [--no-compare]

Without --model it builds a tiny random Llama. A clean prompt and a corrupted one (the
same tokens but the first and the middle one) run once with their rows kept. Then each
(layer, position) is one request: the corrupted prompt with the clean run's row `set`
into blocks.{layer}.hook_resid_pre at that position alone (request_args' per-request
edits), keeping only the last layer's output at the last prompt token, whose logits
(unembed) give the patching metric: the logit difference between the clean run's top
token and the corrupted run's. Every request of the sweep runs in one generate.

It then runs TransformerLens 4.3's own get_act_patch_resid_pre (one run_with_hooks per
patch) on the same weights and prints the largest difference between the two sweeps
(--no-compare skips it, where transformer_lens is not installed), and the sweep's time
beside the same requests unedited in the same engine (the plain forwards it replaces).
"""

import argparse
import os
import tempfile
import time

import torch
from transformers import AutoConfig
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

TOLERANCE = 1e-4  # fp32 on a CPU agrees with TransformerLens to ~1e-6 relative; a logit difference is O(1)


def generate(llm, prompts, options):
    """(outputs, seconds) of one generate of one token per prompt, each with its options."""
    params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=o) for o in options]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def transformer_lens_sweep(model, clean, corrupted, answer, wrong):
    """TransformerLens's own residual-stream patching on the same weights: [layers, positions] logit differences."""
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(model, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        _logits, clean_cache = bridge.run_with_cache(torch.tensor([clean]))
        return patching.get_act_patch_resid_pre(
            bridge, torch.tensor([corrupted]), clean_cache, lambda logits: logits[0, -1, answer] - logits[0, -1, wrong]
        )


if __name__ == "__main__":  # vLLM spawns its workers
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    parser.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (positions patched)")
    parser.add_argument("--no-compare", action="store_true", help="skip TransformerLens's own sweep")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or tempfile.mkdtemp(prefix="tiny_llama_")
    if not args.model:
        tools.tiny_model(model)

    hf_config = AutoConfig.from_pretrained(model)
    text_config = hf_config.get_text_config()
    layers, n = text_config.num_hidden_layers, args.prompt_len
    last = f"blocks.{layers - 1}.hook_resid_post"
    specs = {**tlh.capture_specs(hf_config, sites=("resid_pre",)),
             **tlh.capture_specs(hf_config, sites=("resid_post",), layers=[layers - 1])}
    config = tlh.configure(specs, enable_batching=True)
    sweep = layers * n
    llm = LLM(model, dtype="auto" if args.model else "float32", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, max_num_seqs=min(sweep, 1024), **config.llm_kwargs)

    clean = [(7 * i + 3) % text_config.vocab_size for i in range(n)]
    corrupted = list(clean)
    for p in (0, n // 2):
        corrupted[p] = (corrupted[p] + 1) % text_config.vocab_size
    outputs, _ = generate(llm, [clean, corrupted], [tlh.request_args(config, "prompt")] * 2)
    clean_rows, corrupted_rows = (tlh.read_batched(llm, [o.request_id])[o.request_id] for o in outputs)
    top = tlh.unembed(llm, torch.stack([clean_rows[last][-1], corrupted_rows[last][-1]]), top_k=2).indices
    answer = int(top[0, 0])
    wrong = int(top[1, 0]) if int(top[1, 0]) != answer else int(top[0, 1])

    cells = [(layer, p) for layer in range(layers) for p in range(n)]
    edits = [{f"blocks.{layer}.hook_resid_pre": {
        "op": "set", "value": clean_rows[f"blocks.{layer}.hook_resid_pre"][p], "positions": [p]}} for layer, p in cells]
    options = [tlh.request_args(config, "last_prompt_token", edit) for edit in edits]
    unedited = [tlh.request_args(config, "none")] * sweep
    times = {"sweep": [], "unedited": []}
    for _turn in range(2):  # alternating, each timed twice: the faster of each
        _outputs, seconds = generate(llm, [corrupted] * sweep, unedited)
        times["unedited"].append(seconds)
        outputs, seconds = generate(llm, [corrupted] * sweep, options)
        times["sweep"].append(seconds)
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
    logits = tlh.unembed(llm, torch.cat([read[o.request_id][last] for o in outputs]))
    ours = (logits[:, answer] - logits[:, wrong]).reshape(layers, n)
    print(f"{sweep} patched requests ({layers} layers x {n} positions) in one generate: {min(times['sweep']):.3f} s; "
          f"the same requests unedited: {min(times['unedited']):.3f} s")
    print(f"logit difference (token {answer} - token {wrong}) by layer (rows) and position (columns):")
    print(ours)
    if not args.no_compare:
        start = time.perf_counter()
        expected = transformer_lens_sweep(model, clean, corrupted, answer, wrong)
        seconds = time.perf_counter() - start
        worst = (ours - expected).abs().max().item()
        verdict = "within" if worst <= TOLERANCE * max(1.0, expected.abs().max().item()) else "PAST"
        print(f"TransformerLens's get_act_patch_resid_pre ({seconds:.1f} s): largest difference {worst:.2e} "
              f"({verdict} {TOLERANCE:g} of the largest effect)")
        raise SystemExit(verdict != "within")
