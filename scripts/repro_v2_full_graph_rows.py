"""Standalone reproducer, for a vLLM bug report: Model Runner V2 with cudagraph_mode=FULL
computes some rows of mixed prefill batches wrong (vLLM 0.24.0, H200, bf16).

Needs only torch, transformers and vLLM (no tl_vllm_hooks). A random 3-layer Llama
(width 128, 2 query heads and 1 KV head, vocabulary 512; made here with a fixed seed), 40
prompts of 1, 3, ..., 79 tokens, max_num_seqs=8 and 128 tokens a step so that steps mix
prefill chunks of many requests. Each generate's first-token logprobs (top 20) are set
against transformers on the same weights (rounded to bf16, as vLLM loads them, computed in
fp32); bf16 rounding keeps every request within ~0.07, so a request more than 0.3 off is
a wrong row. Prints the wrong requests of each generate and how many generates had one.
    python3 repro_v2_full_graph_rows.py [--cudagraph-mode FULL] [--runner v2] [--generates 24]
        [--num-prompts 40] [--compilation-config '{"cudagraph_capture_sizes": [16, 32, 64, 128]}']
On the H200 with tl_vllm_hooks' copy of this workload (scripts/probe_first_rows.py --kinds
plain), request 1 (3 tokens) came out 1.088 off in 10 of 24 generates with V2 and FULL, and
never with V2 and FULL_AND_PIECEWISE or with V1 and FULL. (On a CPU, ``--runner v1
--cudagraph-mode NONE`` runs it end to end.)
A likely cause, read in vLLM 0.24's source, not yet tested on a GPU: V2 captures the FULL
graphs of mixed batches of up to 8 tokens with one token per request, so with a maximum
query length of 1, for which FlashAttention 3 drops the causal mask (head size 64); a step
holding request 0's first decode and request 1's 3-token prompt (4 tokens: the engine steps
as soon as the first requests arrive, so how many share a step varies from run to run)
replays that graph, and request 1's first rows see its later tokens. --num-prompts 2 should
then fail every time, and capture sizes above 8 only should never fail.
"""
import argparse
import json
import os
import tempfile

_WRONG = 0.3
_TOP = 20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cudagraph-mode", default="FULL")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--generates", type=int, default=24)
    parser.add_argument("--num-prompts", type=int, default=40, help="the first N of the 40 prompts")
    parser.add_argument("--compilation-config", default="{}", help="JSON, merged under cudagraph_mode")
    args = parser.parse_args()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, for vLLM's CPU build; ignored on GPUs
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [[(31 * i + 7 * r) % 512 for i in range(1 + 2 * r)] for r in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
        )
        hf_model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
        hf_model.save_pretrained(model_dir)
        with torch.no_grad():
            for parameter in hf_model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
            expected = [torch.log_softmax(hf_model(torch.tensor([p])).logits[0, -1].double(), -1) for p in prompts]
        llm = LLM(model_dir, dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=8,
                  enable_prefix_caching=False, skip_tokenizer_init=True, gpu_memory_utilization=0.05, seed=0,
                  compilation_config=dict(json.loads(args.compilation_config), cudagraph_mode=args.cudagraph_mode))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=_TOP)
        generates_with_a_wrong_row = 0
        for index in range(args.generates):
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            errors = [
                max(abs(lp.logprob - float(logprobs[token])) for token, lp in output.outputs[0].logprobs[0].items())
                for output, logprobs in zip(outputs, expected)
            ]
            wrong = {r: round(error, 3) for r, error in enumerate(errors) if error > _WRONG}
            generates_with_a_wrong_row += bool(wrong)
            print(f"generate {index}: largest error {max(errors):.3f}; wrong requests (index: error) {wrong}", flush=True)
        print(f"{args.runner} {args.cudagraph_mode}: a wrong row in {generates_with_a_wrong_row} of "
              f"{args.generates} generates", flush=True)


if __name__ == "__main__":
    main()
