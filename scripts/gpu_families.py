"""New families on a GPU, against TransformerLens: capture there, compare here.

    python3 scripts/gpu_families.py models DIR [--families qwen3,gemma3,mixtral]   # on the CPU machine
    python3 scripts/gpu_families.py capture DIR OUT                               # on the GPU (vLLM, no TransformerLens)
    python3 scripts/gpu_families.py compare DIR OUT [--per-hook]                  # on the CPU machine (TransformerLens)

`models` saves tiny random fp32 models (tiny_model) to DIR, so that both machines use the
same weights. `capture` runs each in bf16 (`--dtype float32`: fp32) under CUDA graphs (vLLM's default
FULL_AND_PIECEWISE; Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER=0; eager and V1 for the
families the GPU tests run so, CUDA_EAGER and CUDA_RUNNER_V1), both flavours,
every site of every layer: the batched flavour serves one generate of a 9-, a 300-
(chunked, 256 tokens a forward) and a 57-token prompt unedited and one request per site of layer 1 with an edit
there; the one-prompt flavour captures one prompt unedited and under each edit alone. It
writes every request's rows and token ids to OUT (safetensors, JSON). `compare` runs
TransformerLens 4.3's bridge in fp32 on the weights rounded to bf16, as vLLM loads them (as saved, after an fp32
capture), with the same edits, and prints the worst row's relative L2 error per family and flavour; it
exits 1 where a row is past --tolerance (the CUDA tests' per-row bound for bf16 against fp32), where a hook's rows
are not all there, where the hooks captured are not those the bridge runs (less the record's refused sites), and
for a family of DIR, or a flavour, that wrote no rows.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import tl_vllm_hooks as tlh  # noqa: E402
import tl_vllm_hooks_tools as tools  # noqa: E402
from hook_errors import placed  # noqa: E402  (this folder is on sys.path when run as a script)
# The tests' prompts, their edit oracle and their TransformerLens reference, not copies.
from conftest import (  # noqa: E402
    BATCH, BF16_TOLERANCE, CUDA_EAGER, CUDA_RUNNER_V1, PROMPT, ROUTER_LOGITS, ROUTER_TIE, Model, comparable,
    hook_row_errors, router_logits, site_edits,
)


def every_placed_site(hf_config):
    """capture_specs of every site the module's table places for the model, every layer, in forward order."""
    return tlh.capture_specs(hf_config, sites=tuple(site for site in tlh.SITES if placed(hf_config, site)))


def edit_to_json(edit):
    value = edit.get("value")
    return {**edit, "value": value.tolist()} if isinstance(value, torch.Tensor) else dict(edit)


def edit_from_json(edit):
    value = edit.get("value")
    return {**edit, "value": torch.tensor(value)} if isinstance(value, list) else {k: v for k, v in edit.items() if v is not None}


def make_models(directory, families):
    for family in families:
        tools.tiny_model(os.path.join(directory, family), family)
        print(f"saved {family}", flush=True)


def capture(directory, out, eager, flavours, dtype):
    """Each family in directory (capture_family), the others still where one fails; 1 if any failed."""
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.makedirs(out, exist_ok=True)
    failed = []
    for family in sorted(os.listdir(directory)):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0" if family in CUDA_RUNNER_V1 else runner  # (read as engines start)
        try:
            capture_family(directory, out, eager or family in CUDA_EAGER, family, flavours, dtype)
        except Exception as error:  # (the others still run: device time is scarce)
            print(f"{family}: FAILED: {type(error).__name__}: {error}", flush=True)
            failed.append(family)
    return 1 if failed else 0


def capture_family(directory, out, eager, family, flavours, dtype):
    """One family's rows in the flavours named, unedited and under an edit at each site of layer 1, to out; the
    engine in dtype ("bfloat16" or "float32")."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path, record = os.path.join(directory, family), tlh.FAMILIES[family]
    hf_config = AutoConfig.from_pretrained(path)
    specs = every_placed_site(hf_config)
    edits = site_edits(specs, family)
    specs = {**specs, **router_logits(family, hf_config)}  # (where the bridge runs no expert hooks)
    records = []
    for flavour in flavours:
        config = tlh.configure(specs, 256, getattr(torch, dtype), enable_batching=flavour == "batched",
                               enable_position_interventions=True)
        # (vLLM 0.24 builds a multimodal checkpoint's processor from its tokenizer: kept there. On an H100 it prefills
        # Gated DeltaNet layers with FlashInfer's kernel, compiled at the first forward: Qwen3-Next's engine had not
        # started 6 minutes later on 2026-12-06; its Triton kernel needs no compiler)
        linear_attention = {"gdn_prefill_backend": "triton"} if record.linear_attention else {}
        llm = LLM(path, dtype=dtype, max_model_len=1024, max_num_seqs=8,
                  skip_tokenizer_init=not record.text_classes, gpu_memory_utilization=0.05,
                  kv_cache_memory_bytes=1 << 30, seed=0, enforce_eager=eager,
                  **linear_attention, **config.llm_kwargs)  # (the KV cache in bytes: no memory profile; shares the GPU)
        rows = {}
        if flavour == "batched":
            requests = [(p, None) for p in BATCH] + [
                ([(3 * i + 5 * n) % 512 for i in range(32)], {hook: edit}) for n, (hook, edit) in enumerate(edits.items())
            ]
            params = [SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True,
                                     extra_args=tlh.request_args(config, "all", e)) for _p, e in requests]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _e in requests], params, use_tqdm=False)
            read = tlh.read_batched(llm, [o.request_id for o in outputs])
            for k, (output, (prompt, edit)) in enumerate(zip(outputs, requests)):
                sequence = list(prompt) + list(output.outputs[0].token_ids)[:-1]
                part = "batched-edited" if edit else "batched-unedited"  # files of 16 MiB at most come back
                records.append({"file": part, "key": k, "tokens": sequence,
                                "edits": {h: edit_to_json(e) for h, e in (edit or {}).items()}})
                rows.setdefault(part, {}).update(
                    {f"{k}/{name}": t.contiguous() for name, t in read[output.request_id].items()}
                )
        else:
            for k, (hook, edit) in enumerate([(None, None), *edits.items()]):
                tlh.set_edits(llm, {hook: edit} if hook else {})
                tlh.open_capture(llm)
                llm.generate(TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=1, temperature=0.0,
                             detokenize=False), use_tqdm=False)
                read = tlh.read_captures(llm, len(PROMPT))
                records.append({"file": "one-prompt", "key": k, "tokens": PROMPT,
                                "edits": {hook: edit_to_json(edit)} if hook else {}})
                rows.setdefault("one-prompt", {}).update({f"{k}/{name}": t.contiguous() for name, t in read.items()})
            tlh.reset_edits(llm)
        for part, tensors in rows.items():
            save_file(tensors, os.path.join(out, f"{family}-{part}.safetensors"))
        with open(os.path.join(out, f"{family}.json"), "w") as file:  # each flavour's as it ends: a cut run keeps it
            runner = "V1" if os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" else "V2"
            json.dump({"records": records, "versions": tools.versions(), "device": torch.cuda.get_device_name(),
                       "eager": eager, "dtype": dtype, "model_runner": runner, "flavours": flavours}, file)
        llm.llm_engine.engine_core.shutdown()
        del llm
        print(f"{family} {flavour}: {sum(map(len, rows.values()))} tensors", flush=True)


def compare(directory, out, tolerance, per_hook):
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    failed = False
    captured = {name[: -len(".json")] for name in os.listdir(out) if name.endswith(".json")}
    for family in sorted(set(os.listdir(directory)) - captured):  # (its capture crashed, or never ran)
        print(f"{family}: FAILED: no rows in {out}: its capture wrote no {family}.json", flush=True)
        failed = True
    for family in sorted(captured):
        meta = json.load(open(os.path.join(out, f"{family}.json")))
        hf = AutoModelForCausalLM.from_pretrained(os.path.join(directory, family), attn_implementation="eager").float().eval()
        dtype = meta.get("dtype", "bfloat16")
        if dtype == "bfloat16":  # the weights as vLLM loaded them
            with torch.no_grad():
                for parameter in hf.parameters():
                    parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
        model = Model(family, Path(directory) / family, hf_model=hf)
        # the whole checkpoint's config, as capture read it (a multimodal one's text model holds only its part)
        forward_order = list(every_placed_site(AutoConfig.from_pretrained(os.path.join(directory, family))))
        parts = {record["file"] for record in meta["records"]}
        ran = {"one-prompt" if part == "one-prompt" else "batched" for part in parts}
        for flavour in sorted(set(meta.get("flavours", ran)) - ran):
            print(f"{family} {flavour}: FAILED: asked for, and no rows of it came back", flush=True)
            failed = True
        rows = {part: load_file(os.path.join(out, f"{family}-{part}.safetensors")) for part in parts}
        oracle = set(model.expected)  # every hook the bridge runs on the family, less those its record refuses
        worst, hook_rows = {}, {}  # hook_rows: (flavour, hook) -> every request's row errors
        for record in meta["records"]:
            flavour, key, tokens = record["file"], record["key"], record["tokens"]
            edits = {h: edit_from_json(e) for h, e in record["edits"].items()}
            names = [n.split("/", 1)[1] for n in rows[flavour] if n.startswith(f"{key}/")]
            logits = [n for n in names if n.startswith(ROUTER_LOGITS)]
            names = sorted(set(names) - set(logits), key=forward_order.index)  # as vLLM runs hooks sharing a tensor
            if set(names) != oracle:
                print(f"{family} {flavour} request {key}: FAILED: hooks captured but not the bridge's: "
                      f"{sorted(set(names) - oracle)[:5]}; the bridge's, not captured: {sorted(oracle - set(names))[:5]}",
                      flush=True)
                failed = True
            routes = {
                int(n.split(".")[1]): (rows[flavour][f"{key}/{n}"].long(), rows[flavour][f"{key}/{n[: -len('indices')]}weights"])
                for n in names
                if n.endswith("mlp.hook_expert_indices")
            }
            routes.update({int(n.removeprefix(ROUTER_LOGITS)): rows[flavour][f"{key}/{n}"].float() for n in logits})
            expected = model.reference(tokens, names, edits, routes)
            for hook in [name for name in names if name in oracle]:
                actual = rows[flavour][f"{key}/{hook}"]
                if actual.shape != expected[hook].shape:  # (rows missing, or more than the request ran)
                    print(f"{family} {flavour} request {key} {hook}: FAILED: shape {list(actual.shape)}, the bridge's "
                          f"{list(expected[hook].shape)} ({len(tokens)} tokens)", flush=True)
                    failed = True
                    continue
                row_errors = hook_row_errors(hook, *comparable(hook, actual, expected[hook]))
                hook_rows.setdefault((flavour, hook), []).append(row_errors.flatten())
                error = float(row_errors.max())
                if error >= worst.get(flavour, (0.0, ""))[0]:
                    worst[flavour] = (error, hook)
        if per_hook:  # in forward order: where the error starts and how it grows
            for (flavour, hook), errors in hook_rows.items():
                errors = torch.cat(errors)
                print(f"{family} {flavour} {hook}: worst row {float(errors.max()):.2e}, median row "
                      f"{float(errors.median()):.2e}", flush=True)
        for flavour, (error, hook) in worst.items():
            verdict = "ok" if error <= tolerance else "FAILED"
            failed |= error > tolerance
            graphs = "eager" if meta.get("eager") else "CUDA graphs"
            how = f"{dtype}, {graphs}, Model Runner {meta.get('model_runner', '?')}"
            print(f"{family} {flavour} ({meta['device']}, vLLM {meta['versions']['vllm']}, {how}): "
                  f"worst row's relative error {error:.2e} at {hook}: {verdict}", flush=True)
        routing = model.routing
        if routing["choices"]:
            far = routing["gap"] > ROUTER_TIE
            failed |= far
            print(f"{family} routing: {routing['followed']} of {routing['choices']} token-layer choices differ from "
                  f"TransformerLens's and were followed, the widest at a router-logit gap of {routing['gap']:.2e}"
                  f" ({'FAILED: wider than' if far else 'a near-tie, within'} {ROUTER_TIE})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("models", "capture", "compare"))
    parser.add_argument("directory")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--families", default="qwen3,gemma3,mixtral")
    parser.add_argument("--tolerance", type=float, default=float(BF16_TOLERANCE))
    parser.add_argument("--eager", action="store_true", help="capture: no torch.compile or CUDA graphs")
    parser.add_argument("--flavours", default="batched,one-prompt", help="capture: these flavours, comma-separated")
    parser.add_argument("--per-hook", action="store_true", help="compare: each hook's worst and median row")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="capture: the engine's")
    args = parser.parse_args()
    if args.command == "models":
        make_models(args.directory, args.families.split(","))
    elif args.command == "capture":
        flavours = args.flavours.split(",")
        if set(flavours) - {"batched", "one-prompt"}:
            parser.error(f"--flavours {args.flavours}: name batched, one-prompt or both")
        sys.exit(capture(args.directory, args.out, args.eager, flavours, args.dtype))
    else:
        sys.exit(compare(args.directory, args.out, args.tolerance, args.per_hook))
