"""The GPU checks (scripts/gpu_checks.sh runs them; skipped without CUDA): CUDA graphs, Model Runner V2 and V1, both
flavours, the families vLLM's CPU cannot run, SAEs, Ray, and tensor and pipeline parallelism on two GPUs, against
transformers' modules at the places TRANSFORMERS_TAPS names.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
from conftest import (  # the shared engines, oracles and helpers
    BF16_TOLERANCE, CUDA, CUDA_EAGER, CUDA_RUNNER_V1, EDIT, MIXED_REQUESTS, PROMPT, PerRow, TOLERANCE, TWO_GPUS,
    assert_matches, assert_routing_ties, bf16_reference, capture, check_batched, check_every_site_edit,
    check_every_site_edit_per_request, check_mixed_requests, check_per_request, check_sink_requests, engine,
    engine_routes, features, generate, manifest_lines, relative_error, report, row_errors, transformers_sites,
    write_sae,
)


RUNNERS = {"v2": (("VLLM_USE_V2_MODEL_RUNNER", "1"),), "v1": (("VLLM_USE_V2_MODEL_RUNNER", "0"),)}
# 40 prompts of 1, 3, ..., 79 tokens: with max_num_seqs=8 and 128 tokens a step, one generate
# makes steps of every size and mix.
MANY_PROMPTS = [[(31 * i + 7 * r) % 512 for i in range(1 + 2 * r)] for r in range(40)]
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.fixture(scope="module")
def one_gpu_rows(models):
    """PROMPT's rows, unedited and with EDIT, from a one-GPU engine (batched, graphs on)."""
    with engine(models["llama"], in_process=False, eager=False, batching=True, dtype="bfloat16") as llm:
        return {key: prompt_rows(llm, "batched", edits) for key, edits in (("plain", None), ("edited", EDIT))}


def prompt_rows(llm, flavour, edits):
    """PROMPT's rows, with `edits`, read as a user reads them (all ranks joined)."""
    if flavour == "one-prompt":
        tlh.set_edits(llm, edits or {})
        try:
            return capture(llm, PROMPT)
        finally:
            tlh.reset_edits(llm)
    (output,) = generate(llm, [PROMPT], extra_args=[tlh.request_args(llm.config, "prompt", edits)])
    return tlh.read_batched(llm, [output.request_id])[output.request_id]


@CUDA
class TestCudaGraphs:
    """One-prompt flavour under FULL and PIECEWISE CUDA graphs, Model Runner V2 and V1."""

    @pytest.fixture(
        scope="class",
        params=[("v2", "FULL"), ("v2", "PIECEWISE"), ("v1", "FULL"), ("v1", "PIECEWISE")],
        ids="-".join,
    )
    def llm(self, request, models):
        runner, mode = request.param
        with engine(
            models["llama"],
            sites=transformers_sites("llama"),
            in_process=False,
            eager=False,
            dtype="bfloat16",
            environment=RUNNERS[runner],
            compilation_config={"cudagraph_mode": mode},
        ) as llm:
            llm.reference_model = bf16_reference(models["llama"])
            yield llm

    def test_every_site_matches_transformers(self, llm, request):
        captured = capture(llm, PROMPT)
        expected = llm.reference_model.reference(PROMPT, llm.hook_names)
        report(request.node.name, assert_matches(captured, expected, request.node.name, BF16_TOLERANCE))

    def test_edits_match_and_reset_is_bit_exact(self, llm):
        before = capture(llm, PROMPT)
        edits = {
            "blocks.0.hook_mlp_out": {"op": "add", "value": torch.linspace(-1.0, 1.0, 128)},
            "blocks.1.hook_resid_post": {"op": "scale", "value": 0.5, "positions": [2, 30]},
        }
        tlh.set_edits(llm, edits)
        try:
            edited = capture(llm, PROMPT)
        finally:
            tlh.reset_edits(llm)
        expected = llm.reference_model.reference(PROMPT, llm.hook_names, edits)
        assert_matches(edited, expected, "edited", BF16_TOLERANCE)
        after = capture(llm, PROMPT)
        for name in before:
            assert torch.equal(after[name], before[name]), f"{name} differs after reset"

    def test_each_hook_fires_once_per_forward(self, llm):
        tlh.reset_fire_counts(llm)
        generate(llm, [PROMPT], max_tokens=6)
        assert set(tlh.read_fire_counts(llm).values()) == {6}


@CUDA
class TestCudaBatched:
    """The batched flavour under CUDA graphs (vLLM's default FULL_AND_PIECEWISE with both
    runners, PIECEWISE) and eager.

    Not cudagraph_mode FULL: there plain vLLM 0.24 itself computes rows of these checks
    wrong (README, Limits): with Model Runner V2 a prompt row of the 40-request check in
    some generates, with V1 generated tokens' rows of the other two checks in every one.
    """

    @pytest.fixture(
        scope="class",
        params=[("v2", "FULL_AND_PIECEWISE"), ("v1", "FULL_AND_PIECEWISE"), ("v1", "PIECEWISE"), ("v2", "eager")],
        ids="-".join,
    )
    def llm(self, request, models):
        runner, mode = request.param
        graphs = {} if mode == "eager" else {"compilation_config": {"cudagraph_mode": mode}}
        with engine(
            models["llama"],
            sites=transformers_sites("llama"),
            in_process=False,
            eager=mode == "eager",
            batching=True,
            dtype="bfloat16",
            environment=RUNNERS[runner],
            **graphs,
        ) as llm:
            llm.reference_model = bf16_reference(models["llama"])
            yield llm

    def test_each_request_matches_transformers(self, llm, request):
        report(request.node.name, check_batched(llm, llm.reference_model, max_tokens=5, tolerance=BF16_TOLERANCE))

    def test_per_request_options_match_transformer_lens(self, llm):
        engine_edits = {"blocks.0.hook_mlp_out": {"op": "scale", "value": -2.0}}
        check_mixed_requests(llm, llm.reference_model, engine_edits, tolerance=BF16_TOLERANCE)

    def test_last_prompt_token_of_many_requests(self, llm):
        # 40 requests of 1..79 tokens in one generate: batches of every size,
        # padded for CUDA graphs; each request keeps exactly its last prompt row.
        requests = [(prompt, "last_prompt_token", None) for prompt in MANY_PROMPTS]
        unread = tlh.status(llm)["unread_requests"]
        check_per_request(llm, llm.reference_model, requests, max_tokens=4, tolerance=BF16_TOLERANCE)
        assert tlh.status(llm)["unread_requests"] == unread, "each request's rows read once, and freed"


@CUDA
def test_cuda_sink_writes_what_transformers_computes(models, tmp_path):
    """The sink under vLLM's default CUDA graphs and Model Runner V2: rows copied to pinned
    memory on a side stream reach the disk whole, for mixed options and 40 short requests."""
    sink_dir = tmp_path / "dataset"
    with engine(
        models["llama"], sites=transformers_sites("llama"), in_process=False, eager=False, batching=True,
        dtype="bfloat16", environment=RUNNERS["v2"], sink_dir=str(sink_dir), shard_bytes=256 << 10,
    ) as llm:
        llm.sink_dir = sink_dir
        reference = bf16_reference(models["llama"])
        requests = MIXED_REQUESTS + [(prompt, "last_prompt_token", None) for prompt in MANY_PROMPTS]
        outputs, dataset = check_sink_requests(llm, reference, requests, tolerance=BF16_TOLERANCE)
        written = {re.sub(r"-[0-9a-f]{8}$", "", request_id) for request_id in dataset}
        expected = {output.request_id for output, (_p, capture, _e) in zip(outputs, requests) if capture != "none"}
        assert written == expected, f"only in the dataset: {sorted(written - expected)[:10]}"
        assert len(manifest_lines(sink_dir)) > 2


@CUDA
class TestCudaSAEs:
    """SAE and transcoder features and a feature edit of each per request under vLLM's default CUDA graphs and Model
    Runner V2, bf16. The GPU machine has no sae-lens: features are SAELens's formula (which the CPU tests check
    against sae-lens) on transformers' rows, and a feature edit is applied inside transformers' forward."""

    def test_features_and_a_feature_edit_match_transformers(self, models, tmp_path, request):
        from safetensors.torch import load_file

        hook, tc, out = "blocks.1.hook_resid_post", "blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out"
        saes = {hook: write_sae(tmp_path / "sae", hook, d_sae=256),
                tc: write_sae(tmp_path / "tc", tc, d_sae=256, architecture="jumprelu_skip_transcoder")}
        edits = {hook: {features(hook): {"op": "set", "features": [3, 17], "value": [4.0, 0.0]}},
                 tc: {features(tc): {"op": "scale", "features": [5, 9], "value": 3.0, "positions": [2, 4, 6]}}}
        w = {name: load_file(str(Path(d) / "sae_weights.safetensors")) for name, d in saes.items()}
        reference, k = bf16_reference(models["llama"]), 16

        def activations(name, rows):  # SAELens's encode: b_dec off the input for the SAE, not the transcoder
            pre = (rows.float() - (w[name]["b_dec"] if name == hook else 0)) @ w[name]["W_enc"] + w[name]["b_enc"]
            return pre.relu() * (pre > w[name]["threshold"]) if name == tc else pre.relu()

        def feature_edit(name):
            """{hook: function of its rows} for transformers' forward: the edit's change, (new - old) @ W_dec, added
            to the rows the SAE writes, old the features of the rows it reads in the same forward."""
            (edit,) = edits[name].values()
            read = {}

            def change(rows):
                old = activations(name, read.get("rows", rows))[:, edit["features"]]
                value = torch.tensor(edit["value"], dtype=torch.float32).expand_as(old)
                delta = ((value if edit["op"] == "set" else old * value) - old) @ w[name]["W_dec"][edit["features"]]
                if "positions" in edit:
                    delta[[p for p in range(len(rows)) if p not in edit["positions"]]] = 0.0
                return rows + delta

            if name == hook:
                return {hook: change}
            return {tc: lambda rows: read.setdefault("rows", rows), out: change}

        with engine(
            models["llama"], sites=transformers_sites("llama"), in_process=False, eager=False,
            batching=True, dtype="bfloat16", environment=RUNNERS["v2"], saes=saes, sae_top_k=k,
        ) as llm:
            extra = [None, tlh.request_args(llm.config, edits=edits[hook]), None,
                     tlh.request_args(llm.config, edits=edits[tc])] * 2
            prompts = [p for p in MANY_PROMPTS[8:12] for _twice in range(2)]
            outputs = generate(llm, prompts, 1, extra)
            read = tlh.read_batched(llm, [o.request_id for o in outputs])
            names = llm.hook_names
        worst, swapped, slots = 0.0, 0, 0
        for i, (output, prompt) in enumerate(zip(outputs, prompts)):
            rows = read[output.request_id]
            plain = reference.reference(prompt, names)
            if i % 2:  # every hook of the edited request, against transformers' forward with the feature edit
                name, changed = (hook, hook) if i % 4 == 1 else (tc, out)
                expected = reference.reference(prompt, names, feature_edit(name))
                worst = max(worst, assert_matches({n: rows[n] for n in names}, expected, f"request {i}", BF16_TOLERANCE))
                moved = float(row_errors(expected[changed], plain[changed]).max())
                assert moved > 2 * BF16_TOLERANCE, f"{name}: the edit moves no row past the tolerance ({moved:.1e})"
                continue
            worst = max(worst, assert_matches({n: rows[n] for n in names}, plain, f"request {i}", BF16_TOLERANCE))
            for name in saes:  # the engine's top k against the formula on transformers' rows
                values, indices = rows[features(name) + ".values"].float(), rows[features(name) + ".indices"].long()
                dense = activations(name, plain[name])
                top = dense.topk(k)
                assert_matches({"values": values}, {"values": top.values}, f"request {i} {name}", BF16_TOLERANCE)
                assert_matches({"named": values}, {"named": dense.gather(1, indices)}, f"request {i} {name}",
                               BF16_TOLERANCE)
                # The same values at other indices are near-ties that bf16 rows order otherwise: count them.
                swapped += sum(len(set(a.tolist()) - set(b.tolist())) for a, b in zip(indices, top.indices))
                slots += indices.numel()
        print(f"\n{request.node.name}: worst relative error {worst:.2e} (whole hook), worst row "
              f"{PerRow.worst_row:.2e}; top-{k} indices not the reference's in {swapped} of {slots}")
        assert swapped <= 0.05 * slots, f"{swapped} of {slots} top-{k} indices differ: more than near-ties"


@CUDA
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (the test extra)")
class TestCudaRay:
    """Ray's executor at tensor parallel 1 (vLLM's CPU build refuses Ray): the config reaches Ray's actor through
    config.llm_kwargs alone (no TL_VLLM_HOOKS_CONFIG), and rows, an edit included, equal the multiprocessing
    executor's bit for bit (the same GPU, kernels and graphs) and transformers within BF16_TOLERANCE."""

    @pytest.mark.parametrize("batching", [False, True], ids=["one-prompt", "batched"])
    def test_rays_rows_equal_the_multiprocessing_executors(self, models, batching, request):
        assert "TL_VLLM_HOOKS_CONFIG" not in os.environ
        reference = bf16_reference(models["llama"])
        edit = {"blocks.1.hook_resid_post": {"op": "scale", "value": 0.5, "positions": [2, 5]}}
        rows = {}
        for backend in ("mp", "ray"):
            with engine(
                models["llama"], sites=transformers_sites("llama"), in_process=False, eager=False,
                batching=batching, dtype="bfloat16", environment=RUNNERS["v2"], distributed_executor_backend=backend,
            ) as llm:
                if batching:
                    prompts = MANY_PROMPTS[4:10]
                    extra = [None, tlh.request_args(llm.config, edits=edit)] * 3
                    outputs = generate(llm, prompts, 3, extra)
                    read = tlh.read_batched(llm, [o.request_id for o in outputs])
                    rows[backend] = [read[o.request_id] for o in outputs]
                    worst = check_batched(llm, reference, max_tokens=3, tolerance=BF16_TOLERANCE)
                else:
                    rows[backend] = [capture(llm, PROMPT)]
                    tlh.set_edits(llm, edit)
                    try:
                        rows[backend].append(capture(llm, PROMPT))
                    finally:
                        tlh.reset_edits(llm)
                    expected = reference.reference(PROMPT, llm.hook_names, edit)
                    worst = assert_matches(rows[backend][1], expected, f"{backend}, edited", BF16_TOLERANCE)
                report(f"{request.node.name} {backend}", worst)
        for i, (by_mp, by_ray) in enumerate(zip(rows["mp"], rows["ray"], strict=True)):
            assert by_mp.keys() == by_ray.keys() and by_mp, f"request {i}: hooks {sorted(by_ray)}"
            for name in by_mp:
                assert torch.equal(by_mp[name], by_ray[name]), f"request {i}, {name}: Ray's rows differ"


@CUDA
class TestCudaFamilies:
    """Families beside Llama on the GPU (a Mamba-2 hybrid and a short-convolution one among them): both flavours,
    Model Runner V2 and vLLM's default FULL_AND_PIECEWISE graphs (but CUDA_EAGER's eager, CUDA_RUNNER_V1's on V1),
    where vLLM's fused add+norm kernels work in place; every site the bridge runs for the family (TRANSFORMERS_TAPS
    places each, a CPU test checks),
    unedited and under an edit at each site, against transformers on the bf16-rounded weights, row by row.
    Mixtral's expert indices in the router's order, highest first; where the engine routes
    otherwise at a near-tie, the reference follows it (bounded and reported: ROUTER_TIE).

    Not Gemma 4 (TestFamilies checks it in fp32): its tiny model's MoE block routes on logits
    that bf16 moves past near-ties, and neither TransformerLens nor the module reads that
    routing, so the reference cannot follow it (on vLLM 0.32's CPU in bf16, the token whose
    router logits at layer 0 are 1e-5 apart gave a hook_mlp_out at cosine 0.51 to fp32
    transformers'). vLLM 0.24, the GPU
    machine's, does not start Gemma 4 either (per-layer head sizes)."""

    @pytest.fixture(scope="class", params=[
        pytest.param((family, flavour), id=f"{family}-{flavour}")
        for family in ("gemma2", "mixtral", "falcon_h1", "lfm2") for flavour in ("one-prompt", "batched")])
    def llm(self, request, models):
        family, flavour = request.param
        runner = "v1" if family in CUDA_RUNNER_V1 else "v2"
        with engine(models[family], sites=transformers_sites(family), in_process=False, eager=family in CUDA_EAGER,
                    batching=flavour == "batched", dtype="bfloat16", environment=RUNNERS[runner]) as llm:
            llm.model, llm.reference_model = models[family], bf16_reference(models[family])
            yield llm

    def test_every_hook_matches_transformers(self, llm, request):
        if llm.config.enable_batching:
            worst = check_batched(llm, llm.reference_model, max_tokens=5, tolerance=BF16_TOLERANCE)
        else:
            captured = capture(llm, PROMPT)
            routes = engine_routes(llm.reference_model, captured, list(range(len(PROMPT))), len(PROMPT))
            expected = llm.reference_model.reference(PROMPT, llm.hook_names, **routes)
            worst = assert_matches(captured, expected, request.node.name, BF16_TOLERANCE)
        report(request.node.name, worst)
        print(assert_routing_ties(llm.reference_model, request.node.name))

    def test_an_edit_at_each_site_matches_transformers(self, llm, request):
        if llm.config.enable_batching:
            check_every_site_edit_per_request(llm, llm.model, llm.reference_model, BF16_TOLERANCE)
        else:
            check_every_site_edit(llm, llm.model, capture(llm, PROMPT), llm.reference_model, BF16_TOLERANCE)
        print(assert_routing_ties(llm.reference_model, request.node.name))


@pytest.mark.parametrize("flavour", ["one-prompt", "batched"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_layout_matches_one_device(layout, flavour, models, request):
    if torch.cuda.is_available() and not TWO_GPUS:
        pytest.skip("needs two CUDA GPUs")
    if not TWO_GPUS and layout == "pp2":
        pytest.skip("pipeline parallelism fails in vLLM's CPU backend itself; runs on two GPUs")
    if not TWO_GPUS and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two CPU workers need two cores")
    # On the CPU each worker's OpenMP threads get one core of their own, and the one-prompt
    # flavour's graph is traced by Dynamo and run without inductor's C++ code (VLLM_CPU_CI_ENV:
    # ~100 s less a run; inductor's code runs in TestOnePrompt and TestBatched).
    dtype, tolerance, environment = (
        ("bfloat16", BF16_TOLERANCE, ()) if TWO_GPUS
        else ("float32", TOLERANCE, (("VLLM_CPU_OMP_THREADS_BIND", "0|1"), ("VLLM_CPU_CI_ENV", "1")))
    )
    reference_model = bf16_reference(models["llama"]) if TWO_GPUS else models["llama"]
    one_gpu = request.getfixturevalue("one_gpu_rows") if TWO_GPUS else None
    # Graphs on, except the batched flavour on the CPU: there the one-prompt flavour is the
    # check of hooks traced under tensor parallelism, and TestBatched compiles the batched
    # flavour on one device.
    with engine(
        models["llama"],
        in_process=False,
        eager=flavour == "batched" and not TWO_GPUS,
        batching=flavour == "batched",
        dtype=dtype,
        environment=environment,
        **LAYOUTS[layout],
    ) as llm:
        statuses = [reply["result"] for reply in llm.collective_rpc("tl_call", args=("status",))]  # per rank
        hooks = [set(status["hooks"]) for status in statuses]
        assert len(statuses) == 2 and tlh.status(llm)["absent"] == []
        if layout == "tp2":
            assert hooks[0] == hooks[1] == set(llm.hook_names)
            split = {name for name in llm.hook_names if name.endswith(("attn.hook_z", "mlp.hook_post"))}
            # Each rank holds one of the two heads, and half of the MLP's units.
            assert [status["shards"] for status in statuses] == [
                {name: 0 for name in split},
                {name: 1 if name.endswith("hook_z") else 128 for name in split},
            ]
        else:  # each hook on exactly one rank; the other rank lists it as absent
            assert hooks[0] | hooks[1] == set(llm.hook_names) and not hooks[0] & hooks[1]
            assert set(statuses[1]["absent"]) == hooks[0] and set(statuses[0]["absent"]) == hooks[1]
        for key, edits in (("plain", None), ("edited", EDIT)):
            rows = prompt_rows(llm, flavour, edits)
            context = f"{layout} {flavour} {key}"
            # An edit applied once per rank, or to a partial sum, or a split hook's
            # parts put together in the wrong order, is >= 1e-1 off.
            expected = reference_model.reference(PROMPT, llm.hook_names, edits)
            worst = assert_matches(rows, expected, f"{context} vs the reference", tolerance)
            message = f"\n{context}: worst relative error vs the reference {worst:.2e}"
            if one_gpu is not None:
                worst = assert_matches(rows, one_gpu[key], f"{context} vs one GPU", tolerance)
                message += f", vs one GPU {worst:.2e}"
            if layout == "tp2" and flavour == "one-prompt":  # each rank's part of what was read
                replies = [reply["result"] for reply in llm.collective_rpc("tl_call", args=("read_captures", len(PROMPT)))]
                for name in llm.hook_names:
                    parts = [tlh.decode_tensor(reply["rows"][name]) for reply in replies]
                    whole = torch.cat(parts, dim=1) if name in split else parts[0]
                    assert torch.equal(whole, rows[name]), name
                    if name not in split:  # replicated: the ranks agree
                        assert relative_error(parts[1], parts[0]) <= tolerance, name
            print(message)
        tlh.reset_fire_counts(llm)
        generate(llm, [PROMPT], max_tokens=4)
        if flavour == "batched":
            tlh.reset_batched(llm)
        for status, reply in zip(statuses, llm.collective_rpc("tl_call", args=("read_fire_counts",))):
            counts = reply["result"]
            assert set(counts) == set(status["hooks"]) and set(counts.values()) == {4}, counts
