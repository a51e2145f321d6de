"""Nothing baked unseen (issue 63): what a forward reads that is not an input, a parameter or a buffer
is checked at each call of the prepared module, or named in the report as assumed.

Before, a forward that read a list attribute, a dict attribute or a module-level config object gave
the old result after the user changed it, under both tracers, while verification said "passed" and
the report said nothing (scalars were checked since issue 28)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import fxprep


@dataclasses.dataclass
class _Config:
    scale: float = 2.0
    widths: list[int] = dataclasses.field(default_factory=lambda: [4, 4])


CONFIG = _Config()  # a module-level config object the forward reads
NAMESPACE = types.SimpleNamespace(offset=0.5, table={"a": 1.0})
# a config module of the user's own (``import config``; ``config.BIAS``)
config_module = types.ModuleType("fxprep_test_config")
config_module.__file__ = __file__
config_module.BIAS = 0.25


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.weights = [1.0, 2.0]  # a list attribute
        self.table = {"gain": 3.0}  # a dict attribute
        self.settings = _Config()  # a config object as an attribute (nested: its list)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.weights[1] + self.table["gain"]
        y = y * CONFIG.scale + NAMESPACE.offset + NAMESPACE.table["a"] + config_module.BIAS
        return y[:, : self.settings.widths[1]]


def _changes(model: _Reads) -> list[tuple[str, object, object]]:
    """(what, change, undo) for each kind of value the forward reads."""
    return [
        ("model.weights", lambda: model.weights.__setitem__(1, 5.0), lambda: model.weights.__setitem__(1, 2.0)),
        ("model.weights", lambda: model.weights.append(9.0), lambda: model.weights.pop()),
        ("model.table", lambda: model.table.__setitem__("gain", 1.0), lambda: model.table.__setitem__("gain", 3.0)),
        ("model.settings", lambda: model.settings.widths.__setitem__(1, 2), lambda: model.settings.widths.__setitem__(1, 4)),
        ("CONFIG", lambda: setattr(CONFIG, "scale", 9.0), lambda: setattr(CONFIG, "scale", 2.0)),
        ("NAMESPACE", lambda: NAMESPACE.table.__setitem__("a", 2.0), lambda: NAMESPACE.table.__setitem__("a", 1.0)),
        ("model.table", lambda: setattr(model, "table", {"gain": 3.0, "other": 1.0}), lambda: setattr(model, "table", {"gain": 3.0})),
        ("fxprep_test_config.BIAS", lambda: setattr(config_module, "BIAS", 1.0), lambda: setattr(config_module, "BIAS", 0.25)),
    ]


@pytest.mark.parametrize("tracer", ["dynamo", "fx"])
def test_a_changed_container_or_config_object_is_caught_not_silently_ignored(tracer):
    model = _Reads().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x, tracer=tracer, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    for what, change, undo in _changes(model):
        change()
        try:
            with pytest.raises(fxprep.InputMismatch, match=rf"{what}.* at capture, now"):
                gm(x)
        finally:
            undo()
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x))  # changed back: the graph holds again


class _LargeTable(nn.Module):
    """A list too large to check at each call: named in the report as assumed, with its value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = [float(i) for i in range(10_000)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.table[3]


@pytest.mark.parametrize("tracer", ["dynamo", "fx"])
def test_a_value_too_large_to_check_is_named_in_the_report_as_assumed(tracer):
    gm = fxprep.prepare_model(_LargeTable().eval(), example_inputs=torch.randn(2, 4), tracer=tracer, progress=False)
    report = fxprep.get_report(gm)
    assert report.verification.status == "passed"
    assert any(a.startswith("model.table = [0.0, 1.0") for a in report.verification.assumed), report.verification
    assert "assuming unchanged" in report.to_text() and "model.table = [0.0, 1.0" in report.to_text()
    assert any(n.startswith("ASSUMED:") and "model.table" in n for n in report.notes)


class _Cached(nn.Module):
    """A forward that fills a cache dict (timm's attention-bias caches): state, not a setting."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cache: dict[str, torch.Tensor] = {}
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and not isinstance(x, torch.fx.Proxy):
            self.cache["last"] = x.detach()
            self.seen.append(1)
        return self.fc(x)


@pytest.mark.parametrize("tracer", ["dynamo", "fx"])
def test_containers_the_forward_changes_are_state_not_checked(tracer):
    model = _Cached().eval()
    x = torch.randn(2, 4)
    gm = fxprep.prepare_model(model, example_inputs=x, tracer=tracer, progress=False)
    model(x)
    model(x)  # the eager model fills its cache: the prepared module is not refused for it
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_a_transformers_config_read_by_the_forward_is_checked():
    """A tiny Llama reads its config in its forward: an eager call between two calls of the prepared
    module changes nothing (no false alarm); a setting the graph holds, changed, is refused."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 8))
    gm = fxprep.prepare_model(model, example_inputs={"input_ids": ids}, progress=False)
    with torch.no_grad():
        model(input_ids=ids)
        first = gm(input_ids=ids).logits
        model(input_ids=ids)
        torch.testing.assert_close(gm(input_ids=ids).logits, first)
    eps = model.config.rms_norm_eps
    model.config.rms_norm_eps = 0.5
    try:
        with pytest.raises(fxprep.InputMismatch, match=r"model\..*config"):
            gm(input_ids=ids)
    finally:
        model.config.rms_norm_eps = eps
