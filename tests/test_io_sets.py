"""Sets of numbers and strings save and load (a transformers model's ``_keep_in_fp32_modules``,
held by an opaque part's owner: CPM-Ant's mask method); sets of anything else are refused."""

from __future__ import annotations

import pytest
import torch

import fxprep
from fxprep.io.decode import Decoder
from fxprep.io.encode import Encoder
from fxprep.io.trust import TrustPolicy
from tests.helpers_io import tiny_causal_lm_round_trip


def test_sets_of_numbers_and_strings_round_trip() -> None:
    for value in ({"lm_head", "norm"}, frozenset({1, 2.5, None}), set()):
        saved = Encoder("a test value")(value)
        back = Decoder(TrustPolicy())(saved)
        assert back == value and type(back) is type(value)


def test_a_set_of_other_values_is_refused_at_save_and_at_load() -> None:
    with pytest.raises(fxprep.SerializationError, match="only numbers and strings|other than numbers"):
        Encoder("a test value")({(1, 2)})
    with pytest.raises(fxprep.SerializationError, match="only numbers and strings"):
        Decoder(TrustPolicy())({"$": "set", "v": [{"$": "tuple", "v": [1]}]})
    with pytest.raises(fxprep.SerializationError, match="malformed 'set'"):
        Decoder(TrustPolicy())({"$": "set", "v": "abc"})


def test_cpmant_saves_and_loads() -> None:
    ids = torch.randint(3, 99, (1, 8))
    model, loaded = tiny_causal_lm_round_trip("cpmant", ids)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids)[0], model(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)
