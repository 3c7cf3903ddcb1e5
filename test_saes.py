"""SAEs and transcoders in SAELens's format, read and edited inside the graph, against sae-lens on the same weights
and inputs (in a venv of its own: scripts/sae_env.sh), on Llama and on the families whose hooks differ most.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
from conftest import (  # the shared engines, oracles and helpers
    FIRST_LAYER_SAE_KINDS, NO_ENGINE, SAE_KINDS, SAE_PROMPTS, SAE_TOP_K, TOLERANCE, TRANSCODES, SAEOracle,
    assert_features, assert_matches, capture, check_first_layer_saes, engine, family_engine_arguments,
    family_tolerance, features, fired, generate, made_by_sae_lens, relative_error, scan_in_torch, write_sae,
)


# Beyond attention, an SAE on each family's own mixing output and one on the residual stream after it.
MIXING_SAES = {"mamba2": "blocks.1.mixer.hook_out", "lfm2": "blocks.2.conv.hook_out",
               "falcon_h1": "blocks.1.mamba.hook_out", "zamba2": "blocks.2.mixer.hook_out",
               "granitemoehybrid": "blocks.2.mixer.hook_out", "nemotron_h": "blocks.0.mixer.hook_out",
               "mamba": "blocks.1.mixer.hook_out", "jamba": "blocks.2.mixer.hook_out"}
MIXING_TRANSCODERS = {"falcon_h1": "blocks.1.mlp.hook_in", "lfm2": "blocks.1.mlp.hook_in",  # (a dense MLP in layer 1)
                      "jamba": "blocks.1.mlp.hook_in"}
LATENT_OR_LINEAR_SAE_FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_next")


class TestSAEs:
    """SAE features and feature edits, batched flavour: Llama compiled in vLLM's separate processes, the SAEs of
    SAE_KINDS (standard, jumprelu and topk SAEs, and two transcoders), each request with its own edits and top k."""

    @pytest.fixture(scope="class")
    def llm(self, models, sae_oracle):
        with engine(
            models["llama"], sites=("resid_post",), in_process=False, eager=False, batching=True,
            saes=sae_oracle.saes(), sae_top_k=SAE_TOP_K, sae_chosen_features=4,
        ) as llm:
            llm.model = models["llama"]
            yield llm

    def test_features_match_sae_lens_for_each_architecture(self, llm, sae_oracle, request):
        top_k = [{features("blocks.1.hook_resid_post"): 5}, None, {features("blocks.2.attn.hook_z"): 3}]
        extra = [tlh.request_args(llm.config, top_k=k) if k else None for k in top_k]
        outputs = generate(llm, SAE_PROMPTS, 1, extra)
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
        worst = 0.0
        for i, output in enumerate(outputs):
            rows = read[output.request_id]
            parts = (".indices", ".values", ".chosen")
            expected_names = {*llm.hook_names, *(features(h) + part for h in SAE_KINDS for part in parts)}
            assert set(rows) == expected_names, "every layer's rows, each SAE's features, no rows of hook_mlp_out"
            assert all(rows[features(h) + ".chosen"].shape == (len(SAE_PROMPTS[i]), 0) for h in SAE_KINDS)
            for hook in SAE_KINDS:
                k = (top_k[i] or {}).get(features(hook), SAE_TOP_K)
                got = rows[features(hook) + ".indices"], rows[features(hook) + ".values"]
                worst = max(worst, assert_features(*got, sae_oracle.features[hook][i], k, f"request {i} {hook}"))
            # topk fires at most 12 of 256: with 16 kept, the features are sae-lens's encode whole.
            indices, values = (rows[features("blocks.2.attn.hook_z") + part] for part in (".indices", ".values"))
            if values.shape[1] == SAE_TOP_K:
                dense = torch.zeros(len(values), 256).scatter_(1, indices.long(), values)
                assert relative_error(dense, sae_oracle.features["blocks.2.attn.hook_z"][i]) <= TOLERANCE
            assert_matches({n: rows[n] for n in llm.hook_names}, llm.model.reference(SAE_PROMPTS[i], llm.hook_names))
        print(f"\n{request.node.name}: worst relative error {worst:.2e}")

    def test_chosen_features_are_read_densely_in_the_order_asked(self, llm, sae_oracle):
        chosen = [{features("blocks.1.hook_resid_post"): [200, 3, 17, 0], features("blocks.0.hook_mlp_out"): [9]},
                  None, {features("blocks.2.attn.hook_z"): [255, 1]}]
        edit = {features("blocks.1.hook_resid_post"): {"op": "scale", "features": [3], "value": 0.5, "positions": [1]}}
        extra = [tlh.request_args(llm.config, features=chosen[0], edits=edit), None,
                 tlh.request_args(llm.config, features=chosen[2])]
        outputs = generate(llm, SAE_PROMPTS, 1, extra)
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
        for i, output in enumerate(outputs):
            for hook in SAE_KINDS:
                listed = (chosen[i] or {}).get(features(hook), [])
                got = read[output.request_id][features(hook) + ".chosen"]
                expected = sae_oracle.features[hook][i][:, listed]
                assert got.shape == expected.shape and relative_error(got, expected) <= TOLERANCE, f"{i} {hook}"
        # (the edit at position 1 does not move the features it reads: they are the hook's input's)

    def test_feature_edits_per_request_match_transformer_lens(self, llm, sae_oracle):
        edits = [
            {features("blocks.1.hook_resid_post"): {"op": "set", "features": [3, 17], "value": [4.0, 0.0], "positions": [2, 5]}},
            {features("blocks.0.hook_mlp_out"): {"op": "scale", "features": [0, 7, 9], "value": 3.0}},
            {features("blocks.2.attn.hook_z"): {"op": "add", "features": [1], "value": 2.5, "positions": [0, 4]}},
        ]
        # Features that fire where the edits land, so that each edit changes something.
        assert float(sae_oracle.features["blocks.0.hook_mlp_out"][1][:, [0, 7, 9]].abs().sum()) > 0
        extra = [tlh.request_args(llm.config, edits=e) for e in edits]
        outputs = generate(llm, SAE_PROMPTS, 1, extra)  # (the oracle's features are the prompts')
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
        for i, (output, edit) in enumerate(zip(outputs, edits)):
            ((name, feature_edit),) = edit.items()
            hook = name.removesuffix(tlh.SAE_FEATURES)
            plain = llm.model.reference(SAE_PROMPTS[i], llm.hook_names)
            expected = llm.model.reference(SAE_PROMPTS[i], llm.hook_names, sae_oracle.steered(i, hook, feature_edit))
            rows = {n: read[output.request_id][n] for n in llm.hook_names}
            assert_matches(rows, expected, f"request {i}, {name} edited")
            changed = max(relative_error(rows[n], plain[n]) for n in llm.hook_names)
            assert changed > 1e-3, f"request {i}: the edit changed nothing ({changed:.1e})"

    def test_transcoder_feature_edits_change_hook_mlp_out_as_in_transformer_lens(self, llm, sae_oracle):
        """A transcoder's feature edit, per request, at some positions or all: its layer's hook_mlp_out gets (new_f -
        old_f) @ W_dec[f], old_f sae-lens's features of the MLP's input; a third request, unedited, as without."""
        hooks = [hook for hook in SAE_KINDS if hook in TRANSCODES]  # the Llama's two transcoders
        edits = [
            {features(hooks[0]): {"op": "set", "features": fired(sae_oracle, hooks[0], 2), "value": [5.0, 0.0], "positions": [1, 6]}},
            {features(hooks[1]): {"op": "scale", "features": fired(sae_oracle, hooks[1], 3), "value": 3.0}},
            None,
        ]
        names = [*llm.hook_names, *(TRANSCODES[hook] for hook in hooks)]
        outputs = generate(llm, SAE_PROMPTS, 1, [e and tlh.request_args(llm.config, edits=e) for e in edits])
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
        for i, (output, edit) in enumerate(zip(outputs, edits)):
            rows = {n: read[output.request_id][n] for n in llm.hook_names}
            plain = llm.model.reference(SAE_PROMPTS[i], names)
            if edit is None:
                assert_matches(rows, {n: plain[n] for n in llm.hook_names}, "unedited beside transcoder edits")
                continue
            ((name, feature_edit),) = edit.items()
            hook = name.removesuffix(tlh.SAE_FEATURES)
            expected = llm.model.reference(SAE_PROMPTS[i], names, sae_oracle.steered(i, hook, feature_edit))
            assert_matches(rows, {n: expected[n] for n in llm.hook_names}, f"request {i}, {name} edited")
            assert relative_error(expected[TRANSCODES[hook]], plain[TRANSCODES[hook]]) > 1e-3, f"{name}: no change"

    def test_an_unedited_request_is_bit_exact_beside_feature_edits(self, llm):
        """The same batch twice, the second time with feature edits (that apply, at position 3) on one request: the
        other request's rows do not change by one bit, nor its features' indices, and the edited one's rows do. Its
        feature values are compared at 1e-6: the SAE's encoder over a decode step's few rows gave values one float32
        ulp apart from one generate to the next in 5 of 7 runs of this test (either way round, at the decode row
        only, the rows it encodes bit-equal), which is vLLM's CPU matmul, not the edit."""
        prompts, hook = SAE_PROMPTS[:2], "blocks.1.hook_resid_post"
        edit = {features(hook): {"op": "set", "features": [3], "value": 9.0, "positions": [3]},
                features("blocks.1.mlp.hook_in"): {"op": "set", "features": [3], "value": 9.0, "positions": [3]}}
        rows = []
        for extra in ([None, None], [None, tlh.request_args(llm.config, edits=edit)]):
            outputs = generate(llm, prompts, 2, extra)
            read = tlh.read_batched(llm, [o.request_id for o in outputs])
            rows.append([read[o.request_id] for o in outputs])
        (unedited, plain), (beside, edited) = rows
        values = [name for name in unedited if name.endswith(".values")]
        changed = [name for name in unedited if name not in values and not torch.equal(unedited[name], beside[name])]
        assert not changed, f"a feature edit elsewhere changes no bit: {changed}"
        assert all(relative_error(beside[name], unedited[name]) < 1e-6 for name in values), "nor a feature's value"
        assert not torch.equal(plain[hook][3], edited[hook][3]), "the edit applies"
        assert torch.equal(plain[hook][:3], edited[hook][:3]), "and only from its position on"

    def test_feature_edits_are_refused_where_vllm_takes_the_request(self, llm):
        bad = {"tl_vllm_hooks": json.dumps({"edits": {features("blocks.1.hook_resid_post"): {"op": "set", "features": [256], "value": 1.0}}})}
        with pytest.raises(ValueError, match=r"feature indices in \[0, 256\)"):
            generate(llm, [SAE_PROMPTS[0]], 1, [bad])


@pytest.fixture(scope="module")
def family_sae_oracles(request, sae_lens_python, models, tmp_path_factory):
    """{family: SAEOracle} for the SAE tests below of the families this session runs them on (MIXING_SAES' kinds,
    or FIRST_LAYER_SAE_KINDS), all made in one run of sae-lens."""
    tests = (test_saes_read_and_edit_a_state_space_or_convolution_familys_hooks,
             test_saes_read_and_edit_a_latent_or_linear_attention_familys_hooks)
    families = dict.fromkeys(item.callspec.params["family"] for item in request.session.items
                             if getattr(item, "function", None) in tests)
    root, oracles = tmp_path_factory.mktemp("family-saes"), {}
    for family in families:
        (root / family).mkdir()
        kinds = FIRST_LAYER_SAE_KINDS if family in LATENT_OR_LINEAR_SAE_FAMILIES else {
            MIXING_SAES[family]: ("standard", 256, None), "blocks.2.hook_resid_post": ("topk", 256, 12),
            **({MIXING_TRANSCODERS[family]: ("transcoder", 192, None)} if family in MIXING_TRANSCODERS else {})}
        oracles[family] = SAEOracle(models[family], root / family, kinds)
    made_by_sae_lens(sae_lens_python, list(oracles.values()), root)
    return oracles


@pytest.mark.parametrize("family", MIXING_SAES)
def test_saes_read_and_edit_a_state_space_or_convolution_familys_hooks(family_sae_oracles, family):
    """SAEs on the mixer output of Mamba-2, Mamba-1 and the hybrids (Falcon-H1's, Zamba2's, Granite 4.0's,
    Nemotron-H's, Jamba's) and on LFM2's short convolution's, and on the residual stream, as on any family's hooks (and
    a transcoder on the MLP where layer 1 has one): each request's top features are sae-lens's encode of
    TransformerLens's rows, and a feature edit of the mixing output (or of the transcoder, in a fourth request) moves
    every later row as run_with_hooks does with the SAE's decoder. Eager, in this process (Mamba-1's scan in torch:
    scan_in_torch)."""
    mixing, transcoder, oracle = MIXING_SAES[family], MIXING_TRANSCODERS.get(family), family_sae_oracles[family]
    model, kinds = oracle.model, oracle.kinds
    edited = [None, mixing, None, *([transcoder] if transcoder else [])]  # the hook each request edits
    edits = [hook and {features(hook): {"op": "scale", "features": fired(oracle, hook, 3), "value": 4.0}}
             for hook in edited]
    prompts = [SAE_PROMPTS[i % len(SAE_PROMPTS)] for i in range(len(edits))]
    with scan_in_torch(family), engine(model, sites=("resid_post",), in_process=True, eager=True, batching=True,
                                        saes=oracle.saes(), sae_top_k=SAE_TOP_K, **family_engine_arguments(family)) as llm:
        extra = [edit and tlh.request_args(llm.config, edits=edit) for edit in edits]
        outputs = generate(llm, prompts, 1, extra)
        read = tlh.read_batched(llm, [o.request_id for o in outputs])
    for i, (output, edit) in enumerate(zip(outputs, edits)):
        rows, prompt_index = read[output.request_id], i % len(SAE_PROMPTS)
        if edit is None:  # (an edit leaves its own SAE's features as they were, and moves the later SAEs')
            for hook in kinds:
                got = rows[features(hook) + ".indices"], rows[features(hook) + ".values"]
                assert_features(*got, oracle.features[hook][prompt_index], SAE_TOP_K, f"request {i} {hook}")
            expected = model.reference(prompts[i], llm.hook_names)
        else:
            steering = oracle.steered(prompt_index, edited[i], edit[features(edited[i])])
            expected = model.reference(prompts[i], llm.hook_names, steering)
            plain = model.reference(prompts[i], llm.hook_names)["blocks.2.hook_resid_post"]
            assert relative_error(rows["blocks.2.hook_resid_post"], plain) > 1e-3, f"request {i}: the edit moves none"
        assert_matches({n: rows[n] for n in llm.hook_names}, expected, f"request {i}")


@pytest.mark.parametrize("family", LATENT_OR_LINEAR_SAE_FAMILIES)
def test_saes_read_and_edit_a_latent_or_linear_attention_familys_hooks(family_sae_oracles, family):
    check_first_layer_saes(family_sae_oracles[family], family_tolerance(family), family_engine_arguments(family))


class TestSAEsOnePrompt:
    """The one-prompt flavour in this process, compiled: features of the armed forward and engine-wide feature
    edits by position."""

    @pytest.fixture(scope="class")
    def llm(self, models, sae_oracle):
        with engine(
            models["llama"], sites=("resid_post",), in_process=True, eager=False, saes=sae_oracle.saes(),
            sae_top_k=SAE_TOP_K,
        ) as llm:
            llm.model = models["llama"]
            yield llm

    def test_features_and_engine_wide_feature_edits_match(self, llm, sae_oracle):
        prompt = SAE_PROMPTS[1]
        first = capture(llm, prompt)
        for hook in SAE_KINDS:
            assert_features(first[features(hook) + ".indices"], first[features(hook) + ".values"],
                            sae_oracle.features[hook][1], SAE_TOP_K, hook)
        assert_matches({n: first[n] for n in llm.hook_names}, llm.model.reference(prompt, llm.hook_names))
        edit = {"op": "add", "features": [1, 2], "value": [2.0, -1.5], "positions": [1, 3]}
        tlh.set_edits(llm, {features("blocks.2.attn.hook_z"): edit})
        steered = capture(llm, prompt)
        expected = llm.model.reference(prompt, llm.hook_names, sae_oracle.steered(1, "blocks.2.attn.hook_z", edit))
        assert_matches({n: steered[n] for n in llm.hook_names}, expected, "engine-wide feature edit")
        assert not torch.equal(steered["blocks.2.hook_resid_post"], first["blocks.2.hook_resid_post"])
        hook = "blocks.1.mlp.hook_in"  # a transcoder's, engine-wide: its layer's hook_mlp_out changes
        edit = {"op": "add", "features": fired(sae_oracle, hook, 2), "value": [3.0, -1.0], "positions": [0, 2]}
        tlh.set_edits(llm, {features(hook): edit})
        transcoded = capture(llm, prompt)
        expected = llm.model.reference(prompt, llm.hook_names, sae_oracle.steered(1, hook, edit))
        assert_matches({n: transcoded[n] for n in llm.hook_names}, expected, "engine-wide transcoder feature edit")
        assert not torch.equal(transcoded["blocks.1.hook_resid_post"], first["blocks.1.hook_resid_post"])
        tlh.reset_edits(llm)
        again = capture(llm, prompt)
        assert all(torch.equal(first[n], again[n]) for n in first), "reset: every row and feature as before, bit for bit"


def test_sink_keeps_features_readable_with_safetensors_alone(models, sae_oracle, tmp_path):
    """The sink writes features as int32 indices and values per request; CaptureDataset reads them as read_batched
    gives them. Llama eager in this process."""
    from safetensors import safe_open

    sink_dir = tmp_path / "acts"
    with engine(
        models["llama"], sites=("resid_post",), in_process=True, eager=True, batching=True, sink_dir=str(sink_dir),
        saes=sae_oracle.saes(), sae_top_k=SAE_TOP_K,
    ) as llm:
        top_k = {features("blocks.1.hook_resid_post"): 4}
        outputs = generate(llm, SAE_PROMPTS[:2], 1, [tlh.request_args(llm.config, top_k=top_k), None])
        dataset = tlh.flush_sink(llm)
    for i, output in enumerate(outputs):
        rows = dataset[output.request_id]
        for hook in SAE_KINDS:
            k = 4 if i == 0 and hook == "blocks.1.hook_resid_post" else SAE_TOP_K
            assert_features(rows[features(hook) + ".indices"], rows[features(hook) + ".values"],
                            sae_oracle.features[hook][i], k, f"sink request {i} {hook}")
    (shard,) = sink_dir.glob("shard-*.safetensors")
    with safe_open(str(shard), framework="pt") as file:
        key = next(k for k in file.keys() if k.endswith(".indices"))
        assert file.get_tensor(key).dtype == torch.int32


@NO_ENGINE
class TestSAEChecks:
    """Bad SAEs, and bad feature options, are refused when the config or the request is made, naming the problem."""

    HOOK = "blocks.0.hook_resid_post"

    @pytest.mark.parametrize(
        "change, message",
        [
            (dict(architecture="gated"), r"architecture 'gated' is not implemented here; implemented: \['standard', 'jumprelu', 'topk', 'transcoder', 'skip_transcoder', 'jumprelu_transcoder', 'jumprelu_skip_transcoder'\]"),
            (dict(normalize_activations="layer_norm"), "normalize_activations 'layer_norm' is not implemented here, only 'none'"),
            (dict(rescale_acts_by_decoder_norm=True), "rescale_acts_by_decoder_norm True is not implemented here"),
            (dict(metadata={"hook_name": "blocks.3.hook_resid_post"}), "trained on 'blocks.3.hook_resid_post'"),
            (dict(d_in=64), "reads rows of 64 at blocks.0.hook_resid_post, but its rows are 128 wide"),
            (dict(architecture="topk"), "k for topk"),
        ],
    )
    def test_a_bad_sae_is_refused_by_name(self, tmp_path, change, message):
        directory = write_sae(tmp_path / "sae", **change)
        with pytest.raises(ValueError, match=message):
            tlh.configure({self.HOOK: 128}, saes={self.HOOK: directory})

    def test_missing_damaged_and_misplaced_files_are_refused(self, tmp_path):
        with pytest.raises(ValueError, match="expected a directory holding cfg.json"):
            tlh.configure({}, saes={self.HOOK: str(tmp_path / "none")})
        directory = write_sae(tmp_path / "sae")
        Path(directory, "sae_weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        with pytest.raises(ValueError, match="is not a readable safetensors file"):
            tlh.configure({}, saes={self.HOOK: directory})
        Path(directory, "cfg.json").write_text("{")
        with pytest.raises(ValueError, match=r"cfg.json: "):
            tlh.configure({}, saes={self.HOOK: directory})
        write_sae(tmp_path / "sae2", architecture="jumprelu")
        Path(tmp_path / "sae2" / "cfg.json").write_text(json.dumps({"architecture": "jumprelu", "d_in": 128, "d_sae": 96}))
        with pytest.raises(ValueError, match=r"must hold W_enc of shape \[128, 96\]"):
            tlh.configure({}, saes={self.HOOK: str(tmp_path / "sae2")})
        with pytest.raises(ValueError, match="an SAE reads a TransformerLens hook whose rows this module can edit"):
            tlh.configure({}, saes={"blocks.0.ln2.hook_normalized": write_sae(tmp_path / "sae3", "blocks.0.ln2.hook_normalized")})
        with pytest.raises(ValueError, match="sae_top_k: 64 is more than the 32 features"):
            tlh.configure({}, saes={self.HOOK: write_sae(tmp_path / "sae4", d_sae=32)})

    @pytest.mark.parametrize(
        "options, message",
        [
            (dict(edits={"F": {"op": "set", "features": [64], "value": 1.0}}), r"1 to 8 distinct feature indices in \[0, 64\)"),
            (dict(edits={"F": {"op": "set", "features": [1, 1], "value": 1.0}}), "distinct feature indices"),
            (dict(edits={"F": {"op": "set", "features": list(range(9)), "value": 1.0}}), "1 to 8 distinct"),
            (dict(edits={"F": {"op": "set", "features": [True], "value": 1.0}}), "distinct feature indices"),
            (dict(edits={"F": {"op": "set", "features": [2], "value": float("nan")}}), "NaN or infinite"),
            (dict(edits={"F": {"op": "set", "features": [2], "value": True}}), "a finite number or a list of 1"),
            (dict(edits={"F": {"op": "set", "features": [2, 3], "value": [1.0, 2.0, 3.0]}}), "a list of 2, one per feature"),
            (dict(edits={"F": {"op": "suppress", "features": [2], "value": 1.0}}), "takes no 'value'"),
            (dict(edits={"F": {"op": "set", "feature": [2], "value": 1.0}}), "keys must be 'op' plus optional"),
            (dict(top_k={"F": 0}), r"must be an int in \[1, 16\] \(sae_top_k\)"),
            (dict(top_k={"F": 17}), r"must be an int in \[1, 16\]"),
            (dict(top_k={"blocks.1.hook_resid_post.hook_sae_acts_post": 3}), "features name: k"),
            (dict(features={"F": [1, 2, 3, 4, 5]}), r"up to 4 \(sae_chosen_features\) distinct feature indices in \[0, 64\)"),
            (dict(features={"F": [64]}), r"distinct feature indices in \[0, 64\)"),
            (dict(features={"F": [2, 2]}), "distinct feature indices"),
            (dict(features={"F": [-1]}), "distinct feature indices"),
            (dict(features={"F": 3}), "distinct feature indices"),
            (dict(features={"F": [[1]]}), "distinct feature indices"),
            (dict(features={"F": [True]}), "distinct feature indices"),
            (dict(features={"blocks.1.hook_resid_post.hook_sae_acts_post": [1]}), r"features name: \[feature, ...\]"),
        ],
    )
    def test_bad_feature_options_are_refused_in_the_driver(self, tmp_path, options, message):
        config = tlh.configure(
            {self.HOOK: 128}, enable_batching=True, saes={self.HOOK: write_sae(tmp_path / "s")}, sae_top_k=16,
            sae_chosen_features=4,
        )
        name = features(self.HOOK)
        options = {key: {name if k == "F" else k: v for k, v in value.items()} for key, value in options.items()}
        with pytest.raises(ValueError, match=message):
            tlh.request_args(config, **options)

    def test_gemma_scope_2_transcoders_read_the_mlps_input(self, tmp_path):
        """SAELens names Gemma Scope 2's transcoders' input blocks.L.hook_mlp_in, which TransformerLens 4.3 means as
        ln2's input; their hf_hook_name, the pre-MLP norm's output, is mlp.hook_in, where they are taken."""
        hook, out = "blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out"
        metadata = {"hook_name": "blocks.0.hook_mlp_in", "hook_name_out": out,
                    "hf_hook_name": "model.layers.0.pre_feedforward_layernorm.output"}
        directory = write_sae(tmp_path / "gs2", architecture="jumprelu_skip_transcoder", metadata=metadata)
        spec = tlh.configure({out: 128}, saes={hook: directory}).sae(hook)
        assert (spec.writes, spec.d_out, spec.apply_b_dec_to_input) == (out, 128, False)
        del metadata["hf_hook_name"]
        undescribed = write_sae(tmp_path / "plain", architecture="jumprelu_transcoder", metadata=metadata)
        with pytest.raises(ValueError, match="trained on 'blocks.0.hook_mlp_in', not 'blocks.0.mlp.hook_in'"):
            tlh.configure({}, saes={hook: undescribed})

    @pytest.mark.parametrize(
        "hook, change, message",
        [
            ("blocks.0.mlp.hook_in", dict(metadata={"hook_name": "blocks.0.mlp.hook_in", "hook_name_out": "blocks.1.hook_mlp_out"}),
             "reads 'blocks.0.mlp.hook_in' and writes 'blocks.1.hook_mlp_out'"),
            ("blocks.0.hook_resid_post", {}, "a transcoder reads a hook of a layer before its hook_mlp_out"),
            ("hook_embed", {}, "this one reads 'hook_embed'"),
            ("blocks.0.mlp.hook_in", dict(apply_b_dec_to_input=True), "a transcoder's b_dec is of its output"),
            ("blocks.0.mlp.hook_in", dict(d_out=None), r"d_out for a transcoder"),
            ("blocks.0.mlp.hook_in", dict(d_out=64), "writes rows of 64 at blocks.0.hook_mlp_out, but its rows are 128"),
        ],
    )
    def test_a_transcoder_that_does_not_write_its_layers_mlp_output_is_refused(self, tmp_path, hook, change, message):
        directory = write_sae(tmp_path / "t", hook, architecture="transcoder", **change)
        with pytest.raises(ValueError, match=message):
            tlh.configure({"blocks.0.hook_mlp_out": 128}, saes={hook: directory})

    def test_chosen_features_need_the_batched_flavour_and_room(self, tmp_path):
        saes = {self.HOOK: write_sae(tmp_path / "s")}
        with pytest.raises(ValueError, match="above 0 only with enable_batching=True"):
            tlh.configure({}, saes=saes, sae_chosen_features=2)
        with pytest.raises(ValueError, match="sae_chosen_features: 65 is more than the 64 features"):
            tlh.configure({}, saes=saes, enable_batching=True, sae_chosen_features=65)
        config = tlh.configure({}, saes=saes, enable_batching=True)
        with pytest.raises(ValueError, match=r"configured with sae_chosen_features > 0 \(here 0\)"):
            tlh.request_args(config, features={features(self.HOOK): [1]})

    def test_the_config_travels_with_its_saes(self, tmp_path):
        config = tlh.CaptureConfig({}, saes={self.HOOK: write_sae(tmp_path / "s")}, sae_top_k=8, enable_batching=True)
        assert tlh.CaptureConfig.from_json(config.to_json()) == config
        assert config.sae(self.HOOK).d_sae == 64 and config.saes[self.HOOK] == str(tmp_path / "s")
