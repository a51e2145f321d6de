"""Vision-language models on the Dynamo path, opaque parts and all (issue 13).

Tiny configs of the architectures LLM-compression tools test (:mod:`tests.vlm_models`), prepared with
realistic multimodal inputs. Dynamo cannot capture four of them whole (Pixtral's and Qwen's vision
towers size tensors from tensor values, Mistral3's feature selection mutates a dict behind a
mappingproxy): values read from data are decided from the example where that captures more layers
(Pixtral, Qwen2-VL, Qwen2.5-VL, Mistral3), and only the parts Dynamo still cannot trace stay opaque
(Qwen's rope and window index helpers, which hold no layer). Each model must verify with every
language-model decoder layer's Linears (and every Linear outside the stated opaque parts) as
``call_module``s of the user's own layers. The opaque parts are stated exactly, so that a change in
what becomes opaque shows here. Llama4 is built with the output field its released forward reads
(:func:`tests.vlm_models.llama4`); the model as released is the zoo's error-path test.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import fxprep

from . import vlm_models, vlm_models_more
from .helpers import assert_unchanged, module_snapshot

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# model -> (tracer, opaque parts (report.leaves keys), the module paths those parts run)
EXPECTED: dict[str, tuple[str, set[str], tuple[str, ...]]] = {
    # image_sizes slice the patch grid (`embed[..., :size[0] // p]`): with the opaque-leaf fallback the
    # whole vision tower was opaque; deciding those sizes from the example (checked in the graph)
    # captures every layer (fxprep.capture.dynamo.values)
    "llava_pixtral": ("dynamo+values", set(), ()),
    # `lengths.tolist()` splits the vision attention per image: decided from the example, so the
    # attentions' qkv/proj are captured; only the rope index (itertools.groupby, no layers) stays opaque
    "qwen2_vl": ("dynamo+values", {"model.get_rope_index"}, ()),
    # the window index (`cu_seqlens_tmp.tolist()`, where PyTorch's own real-tensor check fails on a
    # guard) and the rope index (itertools.groupby) stay opaque, neither holds a layer; the vision
    # attentions split by the window index's output, which the values capture takes from the opaque
    # part run on the real inputs, so their qkv/proj are captured too
    "qwen2_5_vl": ("dynamo+values", {"model.visual.get_vision_window_index", "model.get_rope_index"}, ()),
    # select_hidden_states binds a signature (a mappingproxy read) after merge_with_config_defaults wrote
    # into the root forward's **kwargs, which Dynamo refuses: traced from a root whose kwargs are the
    # trace's own (export.fresh_kwargs_root), then Pixtral's sizes decided as for Llava
    "mistral3": ("dynamo+values", set(), ()),
    "idefics3": ("dynamo", set(), ()),
    "mllama": ("dynamo", set(), ()),
    "gemma3": ("dynamo", set(), ()),
    "llama4": ("dynamo", set(), ()),
}
# tests.vlm_models_more: the first two in the default suite, the rest in the zoo
MORE: dict[str, tuple[str, set[str], tuple[str, ...]]] = {
    # the vision attention splits by cu_seqlens (decided, as for Qwen2-VL); the position-embedding
    # interpolation indices stay opaque with the rope index, neither holding a layer. The deepstack
    # merge (a boolean-mask index) is traced: it was opaque while torch's real-value cross-check
    # guarded on its view's storage offset
    "qwen3_vl": ("dynamo+values", {"model.visual.get_vision_interpolation_indices_and_weights", "model.get_rope_index"}, ()),
    # anyres: the best tiling and unpadding are computed from image_sizes in Python helpers, which
    # stay opaque (no layers); every tower, projector and LM layer is captured
    "llava_next": ("dynamo+leaves", {"model.image_size_to_num_patches", "model.get_anyres_image_grid_shape",
                                     "model.pack_image_features"}, ()),
    "qwen3_vl_moe": ("dynamo+values", {"model.visual.get_vision_interpolation_indices_and_weights", "model.get_rope_index"}, ()),
    # as Qwen3-VL, and its linear-attention layer's chunked scan runs eagerly so that the length stays free
    "qwen3_5": ("dynamo+values", {"model.visual.get_vision_interpolation_indices_and_weights", "model.get_rope_index",
                                  "model.language_model.layers.0.linear_attn.torch_chunk_gated_delta_rule"}, ()),
    "glm4v": ("dynamo+values", {"model.get_rope_index"}, ()),
    "llava_onevision": ("dynamo+leaves", {"model.image_size_to_num_patches", "model.get_anyres_image_grid_shape",
                                          "model.unpad_image"}, ()),
    "internvl": ("dynamo", set(), ()),
    "paligemma": ("dynamo", set(), ()),
    "smolvlm": ("dynamo", set(), ()),
    "aya_vision": ("dynamo", set(), ()),
    "gemma3n": ("dynamo", set(), ()),
    "lfm2_vl": ("dynamo", set(), ()),
}
MORE_DEFAULT = ["qwen3_vl", "llava_next"]


def _language_layers(model: nn.Module) -> str:
    """The path of the language model's decoder-layer list."""
    for name, module in model.named_modules():
        if name.endswith(("language_model.layers", "language_model.model.layers", "text_model.layers")):
            assert isinstance(module, nn.ModuleList)
            return name
    raise AssertionError("no language-model layers found")


def check_vlm(name: str) -> None:
    torch.manual_seed(0)
    builder = vlm_models.BUILDERS.get(name) or vlm_models_more.BUILDERS[name]
    model, inputs = builder()  # never called: as a user builds it and prepares it
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    # transformers installs output-capturing hooks on a model's first call: fxprep's runs must not
    # leave them behind (nor its flag), or the user's next call installs them a second time
    assert_unchanged(model, before)
    ran: set[str] = set()  # the Linears the forward runs (Gemma3 skips SigLIP's pooling head)
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: ran.add(n))
               for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(**inputs, use_cache=False)
    for handle in handles:
        handle.remove()
    report = gm.fxprep_report
    # toolkits deep-copy what they are given (AIMET's QuantSim does): the report must not hold a
    # failed tracer's live error (its frames' globals are modules, which cannot be copied)
    clone = copy.deepcopy(gm)
    with torch.no_grad():
        torch.testing.assert_close(clone(**inputs)[0], gm(**inputs)[0])
    tracer, opaque, hidden = EXPECTED[name] if name in EXPECTED else MORE[name]
    assert report.verification.status == "passed", report.verification
    assert report.tracer == tracer
    assert set(report.leaves) == opaque
    for reason in report.leaves.values():
        assert reason.startswith("opaque: ") and ".py:" in reason
        assert "custom op" not in reason  # none of these models has one (words in torch's stack are not the cause)
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    layers = _language_layers(model)
    lm_linears = [n for n, m in model.named_modules() if n.startswith(f"{layers}.") and isinstance(m, nn.Linear)]
    assert len(lm_linears) >= 8
    assert set(lm_linears) <= ran
    for path in sorted(ran):
        if any(path == h or path.startswith(f"{h}.") for h in hidden):
            continue  # runs inside an opaque part
        module = model.get_submodule(path)
        if type(module) is not nn.Linear and path in called and gm.get_submodule(path) is not module:
            # Llama4's router (Linear + top-k, traced into): its F.linear is a Linear at the router's own path
            assert isinstance(gm.get_submodule(path), nn.Linear) and gm.get_submodule(path).weight is module.weight
            continue
        assert path in called and gm.get_submodule(path) is module, path


@pytest.mark.parametrize("name", list(EXPECTED) + MORE_DEFAULT)
def test_vlm(name: str) -> None:
    check_vlm(name)


@pytest.mark.zoo
@pytest.mark.parametrize("name", [n for n in MORE if n not in MORE_DEFAULT])
def test_vlm_zoo(name: str) -> None:
    check_vlm(name)


@pytest.mark.zoo
def test_a_released_model_that_fails_on_every_call_is_reported_as_the_models_failure() -> None:
    """transformers 5.24's Llama4ForConditionalGeneration fails in its own forward (it reads
    ``image_outputs`` off its language model's output, which has none; :mod:`tests.vlm_models`
    builds the zoo's Llama4 with that field added). fxprep must say the model itself failed, not
    crash inside a tracer."""
    model, inputs = vlm_models.llama4(as_released=True)
    with torch.no_grad():
        try:
            model(**inputs, use_cache=False)
        except AttributeError:
            pass
        else:  # a transformers whose Llama4 runs: nothing to report
            gm = fxprep.prepare_model(model, example_inputs=inputs)
            assert gm.fxprep_report.verification.status == "passed"
            return
    with pytest.raises(fxprep.ModelError, match="The model itself failed"):
        fxprep.prepare_model(model, example_inputs=inputs)


def test_an_excluded_vision_tower_is_one_call_and_the_rest_is_captured() -> None:
    """The issue's first complaint: ``modules_to_exclude=[model.visual]`` did not change Dynamo's
    error, which came from inside the excluded tower. Excluded, the tower is one ``call_module`` of
    the user's object (its inner layers are not counted as hidden, so no values capture is paid
    for), and every language-model Linear is in the graph."""
    torch.manual_seed(0)
    model, inputs = vlm_models.qwen2_5_vl()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=inputs, modules_to_exclude=[model.model.visual])
    report = gm.fxprep_report
    assert report.verification.status == "passed"
    assert report.leaves["model.visual"] == "modules_to_exclude"
    assert set(report.leaves) == {"model.visual", "model.get_rope_index"}  # the rope index: no layers
    assert "dynamo+values" not in [a.tracer for a in report.attempts]
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert "model.visual" in called and gm.get_submodule("model.visual") is model.model.visual
    assert not any(c.startswith("model.visual.") for c in called)
    lm = [n for n, m in model.named_modules() if n.startswith("model.language_model.") and isinstance(m, nn.Linear)]
    assert len(lm) >= 8 and set(lm) <= called
    assert_unchanged(model, before)


def test_verify_prepared_leaves_a_never_called_vlm_untouched() -> None:
    """verify_prepared runs the user's model too: transformers' first-call hooks are installed once
    for it and taken out after, as in prepare_model."""
    torch.manual_seed(0)
    model, inputs = vlm_models.llava_pixtral()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    assert fxprep.verify_prepared(gm, inputs).status == "passed"
    assert_unchanged(model, before)


def test_transformers_output_recorders_do_not_keep_a_layer_whole() -> None:
    """transformers' output-capturing hooks only append a layer's output to a list the traced graph
    returns anyway: such a layer is traced into (its Linears become graph nodes); a hook of the
    user's still keeps the layer one call so that it runs."""
    from fxprep.capture.common import LeafPolicy

    torch.manual_seed(0)
    model, inputs = vlm_models.llava_pixtral()
    with torch.no_grad():
        model(**inputs, use_cache=False)  # transformers installs its recorders on the first call
    layer = model.model.vision_tower.transformer.layers[0]
    assert layer._forward_hooks  # the recorders are there
    assert LeafPolicy().reason(layer) is None
    handle = layer.register_forward_hook(lambda m, i, o: None)
    try:
        assert LeafPolicy().reason(layer) == "has forward hooks"
    finally:
        handle.remove()


def test_without_a_reference_run_a_never_called_vlm_is_captured_the_same_way() -> None:
    """``verify=False`` and ``check_traceability`` run no reference before Dynamo, so transformers'
    hook installer (a lock Dynamo cannot trace) was reached inside the capture and the whole vision
    tower became opaque for it: the model is run once, as a user's first call would, and captured
    again; the result and the check agree with a verified prepare, and the model is left as given."""
    torch.manual_seed(0)
    model, inputs = vlm_models.llava_pixtral()
    before = module_snapshot(model)
    gm = fxprep.prepare_model(model, example_inputs=inputs, verify=False)
    tracer, opaque, _ = EXPECTED["llava_pixtral"]
    assert gm.fxprep_report.tracer == tracer and set(gm.fxprep_report.leaves) == opaque
    assert_unchanged(model, before)
    check = fxprep.check_traceability(model, example_inputs=inputs)
    assert check.hybrid_ok and set(check.opaque) == opaque
    assert "Unsupported context manager" not in str(check)
    assert_unchanged(model, before)


def test_a_vlm_captured_deciding_values_exports_to_onnx_and_to_aimet_style_tuples(tmp_path) -> None:
    """Llava-Pixtral's graph (dynamo+values) holds the decisions' checks and transformers'
    ``torch._check_tensor_all`` (``_is_all_true``, which no ONNX exporter knows): exported with the
    torch.export-based exporter and run in onnxruntime, it matches. Prepared AIMET's way
    (``return_dict=False``), the original's tuple has the KV cache at ``out[1]``, before the image
    features; the prepared one has no cache, and verification says so instead of failing."""
    import warnings

    from fxprep.compat import aimet as compat

    torch.manual_seed(0)
    model, inputs = vlm_models.llava_pixtral()
    gm = fxprep.prepare_model(model, example_inputs=inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxprep.FxprepWarning)  # no fallback to the TorchScript exporter
        diff = fxprep.export_onnx(gm, inputs, tmp_path / "llava.onnx")
    assert diff < 1e-4
    tupled = compat.prepare_model(model, example_inputs=inputs)
    verification = tupled.fxprep_report.verification
    assert verification.status == "passed"
    assert "out[1] returned by the original only" in verification.detail, verification.detail
