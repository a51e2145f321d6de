"""The BoundOp call path: each template compiled once, making exactly the call ``fill_template`` describes.

The speed is measured in ``benchmarks/scale_bench.py``; here only that the compiled call is the same
call (same arguments, same containers, keyword arguments as keywords), survives copies, pickles and
changes of ``args``, and that every op of a prepared graph still computes what it did.
"""

from __future__ import annotations

import copy
import operator
import pickle
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxprep import ops


def _record(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    return args, kwargs


_leaf = st.one_of(
    st.integers(0, 3).map(ops.Slot), st.integers(-5, 5), st.none(), st.sampled_from([torch.float32, "x", 1.5]),
)


def _tree(children: Any) -> Any:
    return st.one_of(
        st.tuples(children, children), st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "not an identifier", "class"]), children, max_size=2),
        st.builds(slice, children, children, children),
    )


_template = st.recursive(_leaf, _tree, max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(args=st.lists(_template, max_size=3),
       kwargs=st.dictionaries(st.sampled_from(["dim", "keepdim", "not-an-identifier", "lambda"]), _template, max_size=2))
def test_compiled_call_is_the_filled_call(args: list[Any], kwargs: dict[str, Any]) -> None:
    inputs = tuple(object() for _ in range(4))
    op = ops.BoundOp(_record, tuple(args), kwargs)
    got_args, got_kwargs = op(*inputs)
    want_args, want_kwargs = ops.fill_template(tuple(args), inputs), ops.fill_template(kwargs, inputs)
    assert got_args == want_args and got_kwargs == want_kwargs
    _same_structure(got_args, want_args)
    _same_structure(got_kwargs, want_kwargs)


def _same_structure(got: Any, want: Any) -> None:
    """The same objects in the same places, in containers of the same types."""
    assert type(got) is type(want)
    if type(want) in (tuple, list):
        for g, w in zip(got, want):
            _same_structure(g, w)
    elif type(want) is dict:
        for k in want:
            _same_structure(got[k], want[k])
    elif type(want) is slice:
        for attr in ("start", "stop", "step"):
            _same_structure(getattr(got, attr), getattr(want, attr))
    else:
        assert got is want or got == want


def test_method_calls_and_state() -> None:
    x = torch.arange(12.0).view(3, 4)
    transpose = ops.Functional(ops.method_call("transpose"), (ops.Slot(0), 0, 1), {})
    assert torch.equal(transpose(x), x.t())
    cat = ops.Concat(torch.cat, ([ops.Slot(0), ops.Slot(1)],), {"dim": -1})
    assert cat(x, x).shape == (3, 8)
    cat.kwargs = {"dim": 0}  # the call follows its attributes
    assert cat(x, x).shape == (6, 4)
    for twin in (copy.deepcopy(cat), pickle.loads(pickle.dumps(cat))):
        assert twin(x, x).shape == (6, 4) and "_call" not in twin.__getstate__()
    add = ops.Add(operator.add, (ops.Slot(0), 1.5), {})
    assert torch.equal(add(x), x + 1.5) and add.args == (ops.Slot(0), 1.5) and add.num_inputs == 1
