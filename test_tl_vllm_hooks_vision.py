"""Multimodal checkpoints (a text model beside vision or audio towers) against TransformerLens, as
test_families.py compares the text families, with the helpers in conftest.py.

Runs in the environment scripts/vision_env.sh builds, where torchvision imports: vLLM's native
multimodal classes import transformers' image processors, which import torchvision, and
TransformerLens 4.3's Qwen-VL adapters require it (test_families.py runs this file there,
test_multimodal_checkpoints_in_the_vision_environment). For every multimodal record, in the
batched flavour (in the one-prompt flavour too where it is among base.ONE_PROMPT_FAMILIES): every
hook of its text model on text prompts (vLLM with language_model_only=True, the towers not built),
unedited and under an edit at each site, a 300-token prompt chunked among them; and an image prompt
through the towers of each of IMAGE_FAMILIES.
"""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np
import pytest
import torch

import conftest as base
import test_attention_and_logits
import test_families
import tl_vllm_hooks as tlh

assert importlib.util.find_spec("torchvision") is not None, (
    "test_tl_vllm_hooks_vision.py runs where torchvision imports: the python that scripts/vision_env.sh prints"
)

MULTIMODAL = base.MULTIMODAL
# vLLM runs the text model alone (no tower is built) and reads the checkpoint's tokenizer.
TEXT_ONLY = dict(language_model_only=True, skip_tokenizer_init=False)
# Each record shares its text family's engine arguments and tolerances (see conftest.py).
TEXT_FAMILY = {"gemma4_mm": "gemma4", "gemma4_unified": "gemma4", "llama4_mm": "llama4"}


def engine_arguments(family: str) -> dict:
    text_only = TEXT_ONLY if family in MULTIMODAL else {}
    return {**text_only, **base.family_engine_arguments(TEXT_FAMILY.get(family, family))}


def tolerance(family: str):
    return base.family_tolerance(TEXT_FAMILY.get(family, family))


def unedited_tolerance(family: str):
    return base.unedited_tolerance(TEXT_FAMILY.get(family, family))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return base.Models(tmp_path_factory.mktemp("models"))


# The multimodal records, and the text families whose vLLM class needs torchvision (base.VISION_TEXT_FAMILIES).
HERE_FAMILIES = MULTIMODAL + base.VISION_TEXT_FAMILIES


@pytest.fixture(scope="class", params=HERE_FAMILIES)
def family_llm(request, models):
    model = models[request.param]
    with base.engine(model, sites=model.sites, in_process=True, eager=True, batching=True,
                     **engine_arguments(request.param)) as llm:
        llm.model = model
        llm.tolerance, llm.unedited_tolerance = tolerance(request.param), unedited_tolerance(request.param)
        yield llm


class TestMultimodalFamilies(test_families.TestFamilies):
    """TestFamilies on each multimodal checkpoint's text model: batched flavour, every site the
    bridge runs, unedited (a 300-token prompt chunked over three steps among the requests) and
    under an edit at each site, one request per site, and one layer's edits composed."""


@pytest.fixture(scope="class", params=[family for family in base.ONE_PROMPT_FAMILIES if family in HERE_FAMILIES])
def one_prompt_flavour_llm(request, models):
    model = models[request.param]
    with base.engine(model, sites=model.sites, in_process=True, eager=True, **engine_arguments(request.param)) as llm:
        llm.model = model
        llm.tolerance = tolerance(request.param)
        yield llm


class TestMultimodalFamiliesOnePromptFlavour(test_families.TestFamiliesOnePromptFlavour):
    """TestFamiliesOnePromptFlavour on the multimodal records among base.ONE_PROMPT_FAMILIES."""


@base.NO_ENGINE
@pytest.mark.parametrize("family", MULTIMODAL)
def test_each_multimodal_checkpoint_places_exactly_the_hooks_transformer_lens_runs(models, family):
    """test_each_family_places_exactly_the_hooks_transformer_lens_runs, for every multimodal record
    (test_families.py checks those whose checkpoint and bridge need no torchvision): the bridge
    booted on the multimodal checkpoint, text prompts."""
    test_families.test_each_family_places_exactly_the_hooks_transformer_lens_runs(models, family)


@base.NO_ENGINE
@pytest.mark.parametrize("family", MULTIMODAL)
def test_each_multimodal_checkpoint_refuses_attention_scores_exactly_where_transformer_lens_gives_the_pattern(
    models, family
):
    """test_attention_scores_are_refused_exactly_where_transformer_lens_gives_the_pattern_there, for every multimodal
    record."""
    test_attention_and_logits.test_attention_scores_are_refused_exactly_where_transformer_lens_gives_the_pattern_there(models, family)


IMAGE_TEXT = "t5 t6 {} t7 t8"
# The multimodal text models whose image path vLLM's CPU runs, each through its towers (vLLM's native class).
# Gemma 3's differs from TransformerLens's at the image positions, where measured (2026-12-07, vLLM 0.32): vLLM's CPU
# attends causally among an image's tokens. Gemma 3 is an mm_prefix model (its image tokens see each other), which
# vLLM's CPU attention backend does not support, and vLLM's CPU platform picks it unchecked; transformers, given the
# processor's token_type_ids, attends bidirectionally within the image. Rows differ from blocks.0's attention on, by up
# to 1.07 a row (blocks.1.attn.hook_attn_scores; ln_final.hook_normalized 0.57); against a causal reference (the
# bridge without token_type_ids) every hook matched, within 1.9e-6 a row. (Gemma's hook_embed, what layer 0 receives,
# is refused on its multimodal records: see the test.)
IMAGE_FAMILIES = ("gemma3_mm", "mistral3", "qwen2_5_vl", "qwen3_vl", "llama4_mm", "llava")
# Compared with the bridge run without token_type_ids (attending causally, as vLLM's CPU does), after the check that
# the bidirectional run differs from layer 0's attention on (above).
CAUSAL_AMONG_IMAGE_TOKENS = ("gemma3_mm",)


def image():
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(56, 56, 3) * 255).astype("uint8"))


def image_piece(processor) -> str:
    """The text of one image in a prompt, as the checkpoint's processor expects it: its image token (Gemma 3's
    <start_of_image>, which its processor expands to the image's soft tokens between their delimiters), inside the
    vision delimiters where the tokenizer has them (Qwen-VL's chat template writes <|vision_start|><|image_pad|>
    <|vision_end|>)."""
    tokenizer = processor.tokenizer
    start, end = (getattr(tokenizer, f"vision_{side}_token", None) for side in ("start", "end"))
    return f"{start}{processor.image_token}{end}" if start and end else processor.image_token


def image_token_id(config) -> int:
    """The id of the tokens whose embeddings the image features replace."""
    return next(getattr(config, key) for key in ("image_token_id", "image_token_index")
                if getattr(config, key, None) is not None)


@contextlib.contextmanager
def contiguous_patches(family: str):
    """For the block's length, on the CPU, vLLM's Llama 4 vision tower gives its patch embedding's linear layer the
    unfolded patches contiguous; nothing for the other families, or on a GPU. vLLM's Llama4UnfoldConvolution hands
    it nn.Unfold's output permuted ([tiles, patches, channels * patch²], stride(-1) = patches), which vLLM's CPU GEMM
    (oneDNN's onednn_mm) refuses: "RuntimeError: Expected a.stride(-1) == 1 to be true, but got false" (vLLM 0.32,
    2026-12-07). The same numbers, laid out contiguously (as base.scan_in_torch gives RowParallelLinear's input)."""
    if family != "llama4_mm" or torch.cuda.is_available():
        yield
        return
    from vllm.model_executor.models.mllama4 import Llama4UnfoldConvolution

    saved = Llama4UnfoldConvolution.forward

    def forward(self, hidden_states):
        return self.linear(self.unfold(hidden_states).permute(0, 2, 1).contiguous())[0]

    Llama4UnfoldConvolution.forward = forward
    try:
        yield
    finally:
        Llama4UnfoldConvolution.forward = saved


def complex_buffers_restored(module: torch.nn.Module) -> None:
    """Llama 4's vision rotary, freqs_ci, is a complex buffer that no checkpoint holds (transformers computes it at
    init), and a module cast to a real dtype keeps only its real part ("Casting complex values to real discards the
    imaginary part": tools.tiny_model's .to(torch.float32), so the bridge's copy of it too). Its queries and keys are
    then scaled by the cosines, never rotated; vLLM computes the rotary from the config: the image features differed
    by up to 2.0e-4 a row (2026-12-07). Recomputed here, in every vision rotary of the module."""
    for rotary in module.modules():
        if isinstance(getattr(rotary, "freqs_ci", None), torch.Tensor) and hasattr(rotary, "_compute_freqs_ci"):
            rotary.freqs_ci = rotary._compute_freqs_ci(rotary.config).to(rotary.freqs_ci.device)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_an_image_prompt_matches_transformer_lens_at_every_position(models, family):
    """A multimodal checkpoint with its towers (vLLM's native class, without language_model_only), one prompt of
    text around an image written as its processor expects it: vLLM's prompt ids are the processor's, and the text
    model's rows at every position, image positions included, equal TransformerLens's bridge run on the same
    input_ids and the processor's other outputs (pixel_values, image_grid_thw, image_sizes, token_type_ids, ...),
    within the family's tolerance.

    At image positions hook_embed is the embedding of the image placeholder token (in vLLM as in
    TransformerLens: the image features replace it after the embedding), so the text model's input
    there, the image features, is blocks.0.hook_resid_pre, not hook_embed (Gemma 3's aside: see IMAGE_FAMILIES)."""
    from transformers import AutoProcessor
    from vllm import SamplingParams

    model = models[family]
    processor = AutoProcessor.from_pretrained(str(model.path))
    text = IMAGE_TEXT.format(image_piece(processor))
    inputs = processor(images=image(), text=text, return_tensors="pt")
    token_ids = inputs.pop("input_ids")[0].tolist()
    image_id = image_token_id(model.hf.config)
    image_positions = [p for p, t in enumerate(token_ids) if t == image_id]
    assert image_positions, f"no image token in {token_ids}"
    arguments = {**base.family_engine_arguments(TEXT_FAMILY.get(family, family)), "skip_tokenizer_init": False}
    with contiguous_patches(family), base.engine(model, sites=model.sites, in_process=True, eager=True,
                                                 **arguments) as llm:
        tlh.open_capture(llm)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image()}}], params, use_tqdm=False)
        assert list(outputs[0].prompt_token_ids) == token_ids, "vLLM's prompt ids are not the processor's"
        captured = tlh.read_captures(llm, len(token_ids))
    # (in the reference's fp32: Llama 4's image processor gives bf16 pixel values, which vLLM casts to its dtype)
    inputs = {key: value.float() if value.is_floating_point() else value for key, value in inputs.items()}
    complex_buffers_restored(model.bridge.original_model)
    if family in CAUSAL_AMONG_IMAGE_TOKENS:  # (see IMAGE_FAMILIES: bidirectional, then causal)
        bidirectional = model.reference(token_ids, llm.hook_names, **inputs)
        with pytest.raises(AssertionError, match="attn.hook_attn_scores"):
            base.assert_matches(captured, bidirectional, f"{family} image prompt", base.PerRow(0.1))
        inputs.pop("token_type_ids")
    expected = model.reference(token_ids, llm.hook_names, **inputs)
    worst = base.assert_matches(captured, expected, f"{family} image prompt", tolerance(family))
    text_input = captured["blocks.0.hook_resid_pre"][image_positions]
    if "embed" in tlh.FAMILIES[family].refused:
        # Its reason (Gemma's hook_embed would be layer 0's input): TransformerLens's hook_embed is not the image
        # features there.
        bridge = model.reference(token_ids, ["hook_embed"], **inputs)["hook_embed"][image_positions]
        assert base.relative_error(text_input, bridge) > 0.1, "the bridge's hook_embed is the image features"
        embedded = bridge
    else:
        embedded = captured["hook_embed"][image_positions]
        row = model.hf.get_input_embeddings().weight[image_id]  # the placeholder's embedding row: nothing scales it
        assert torch.allclose(embedded, row.expand(len(image_positions), -1))
    assert torch.equal(embedded, embedded[:1].expand_as(embedded)), "image positions' hook_embed differ"
    assert base.relative_error(text_input, embedded) > 0.1, "no image features"
    print(f"\n{family} image prompt: {len(token_ids)} positions ({len(image_positions)} image), "
          f"worst relative error {worst:.2e}")


@base.NO_ENGINE
@pytest.mark.parametrize("family", [family for family in MULTIMODAL if tlh.FAMILIES[family].refused])
def test_each_multimodal_checkpoint_refuses_each_site_for_the_reason_its_record_gives(models, family):
    """test_each_refused_site_is_refused_for_the_reason_its_record_gives, for every multimodal record."""
    test_families.test_each_refused_site_is_refused_for_the_reason_its_record_gives(models, family)


def test_saes_read_and_edit_a_linear_attention_familys_hooks(sae_lens_python, models, tmp_path):
    """SAEs and a transcoder on Qwen 3.5's first layer (Gated DeltaNet, then a dense MLP), as
    base.check_first_layer_saes checks them on DeepSeek's."""
    oracle = base.SAEOracle(models["qwen3_5"], tmp_path, base.FIRST_LAYER_SAE_KINDS)
    base.made_by_sae_lens(sae_lens_python, [oracle], tmp_path)
    base.check_first_layer_saes(oracle, tolerance("qwen3_5"), engine_arguments("qwen3_5"))
