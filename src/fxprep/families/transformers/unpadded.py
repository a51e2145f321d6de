"""A padding mask a transformers model fills with ones itself, passed to the mask builders as none.

Several transformers models fill ``attention_mask`` with ones when none is given, and under a trace
the mask builder then materialises a mask eager skips. During capture (:mod:`.methods`) such a
method runs a copy that remembers it filled the mask and calls the builder through :func:`unpadded`,
which passes ``attention_mask=None`` where that is plainly the same mask. Encoder-decoder models
that skip the fill under ``is_torchdynamo_compiling()`` get eager's branch back.

See docs/checkpoints.md ("Under the hood") for the exact conditions.
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

_BUILDERS = ("create_causal_mask", "create_bidirectional_mask", "create_sliding_window_causal_mask",
             "create_chunked_causal_mask", "create_bidirectional_sliding_window_mask",
             "create_recurrent_attention_mask")
HELPER = "_fxprep_unpadded"
_FLAG = "_fxprep_ones_"
_COMPILING = "is_torchdynamo_compiling"


def wanted(code: types.CodeType) -> bool:
    """Whether a function's code may hold the pattern (a cheap test before its source is parsed)."""
    return "ones" in code.co_names and (any(name in code.co_names for name in _BUILDERS)
                                        or _COMPILING in code.co_names)


def _compiling_clause(test: ast.expr, namespace: dict[str, Any]) -> ast.expr | None:
    """For ``X is None and not is_torchdynamo_compiling()`` (transformers' own function, by
    identity), the ``X is None`` part; None for any other test."""
    utils = sys.modules.get("transformers.utils")
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2):
        return None
    first, second = test.values
    if (isinstance(second, ast.UnaryOp) and isinstance(second.op, ast.Not) and isinstance(second.operand, ast.Call)
            and isinstance(second.operand.func, ast.Name) and second.operand.func.id == _COMPILING
            and not second.operand.args and utils is not None
            and namespace.get(_COMPILING) is getattr(utils, _COMPILING, object())):
        return first
    return None


def _sizes_only(statements: list[ast.stmt], name: str) -> bool:
    """Whether a branch only computes sizes (names, constants, arithmetic) and ``name``'s ones."""
    for statement in statements:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)):
            return False
        if statement.targets[0].id == name:
            continue
        if not all(isinstance(n, (ast.Name, ast.Constant, ast.BinOp, ast.operator, ast.expr_context))
                   for n in ast.walk(statement.value)):
            return False
    return True


def _ones_filled(tree: ast.FunctionDef, namespace: dict[str, Any]) -> dict[str, tuple[ast.If, ast.expr]]:
    """``name -> (the if, its test without the compiling clause)`` for each ``if name is None:
    name = torch.ones(...)`` in the function where that assignment is the name's only one. ``if name
    is None and not is_torchdynamo_compiling()`` counts when the branch computes nothing but sizes
    and the ones (the caller cuts its test to ``name is None``: Switch Transformers' and LongT5's
    encoders index the mask they leave as None under a trace, and fail)."""
    stores: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stores[node.id] = stores.get(node.id, 0) + 1
    found: dict[str, tuple[ast.If, ast.expr]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = _compiling_clause(node.test, namespace) or node.test
        if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1
                and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value is None):
            continue
        name = test.left.id
        for statement in node.body:
            if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                    and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == name
                    and isinstance(statement.value, ast.Call) and ast.unparse(statement.value.func) == "torch.ones"
                    and stores.get(name) == 1):
                if test is node.test or _sizes_only(node.body, name):
                    found[name] = (node, test)
                break
    return found


def _calls_builder(call: ast.Call, namespace: dict[str, Any]) -> bool:
    """Whether ``call`` calls a mask builder whose name resolves in ``namespace`` to transformers' own."""
    masking = sys.modules.get("transformers.masking_utils")
    name = call.func.id if isinstance(call.func, ast.Name) else None
    return masking is not None and name in _BUILDERS and namespace.get(name) is getattr(masking, name, object())


def _mask_argument(call: ast.Call) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "attention_mask":
            return keyword.value
    return call.args[2] if len(call.args) > 2 else None


def rewrite(tree: ast.FunctionDef, namespace: dict[str, Any]) -> dict[str, Any] | None:
    """Rewrite ``tree`` in place (module docstring); the helpers its copy needs, or None when
    nothing in it matched."""
    found = _ones_filled(tree, namespace)
    if not found:
        return None
    cut = False
    for branch, test in found.values():
        cut = cut or test is not branch.test
        branch.test = test
    filled = {name: branch for name, (branch, _) in found.items()}
    flagged: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _calls_builder(node, namespace):
            continue
        mask = _mask_argument(node)
        if isinstance(mask, ast.Name) and mask.id in filled:
            flag = ast.Name(id=_FLAG + mask.id, ctx=ast.Load())
            node.func = ast.Call(func=ast.Name(id=HELPER, ctx=ast.Load()), args=[node.func, flag], keywords=[])
            flagged.add(mask.id)
    if not flagged:
        ast.fix_missing_locations(tree)
        return {} if cut else None
    for name in sorted(flagged):
        branch = filled[name]
        branch.body.append(ast.Assign(targets=[ast.Name(id=_FLAG + name, ctx=ast.Store())], value=ast.Constant(True)))
        start = 1 if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(
            getattr(tree.body[0], "value", None), ast.Constant) else 0
        tree.body.insert(start, ast.Assign(targets=[ast.Name(id=_FLAG + name, ctx=ast.Store())],
                                           value=ast.Constant(False)))
    ast.fix_missing_locations(tree)
    return {HELPER: unpadded}


def _parameters(builder: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(name for name, p in inspect.signature(builder).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _same_without(arguments: dict[str, Any]) -> bool:
    """Whether the builder makes the same mask from ``arguments`` with ``attention_mask=None``."""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    for name in ("cache", "past_key_values", "position_ids", "block_sequence_ids"):
        if arguments.get(name) is not None:
            return False
    keys = arguments.get("encoder_hidden_states")
    if keys is None:
        keys = arguments.get("inputs_embeds", arguments.get("input_embeds"))
    return isinstance(keys, torch.Tensor) and keys.dim() >= 2 and mask.shape[-1] == keys.shape[1]


def unpadded(builder: Callable[..., Any], ones: bool) -> Callable[..., Any]:
    """``builder`` itself, or where the method filled its mask with ones (``ones``), the builder
    given ``attention_mask=None`` whenever that makes the same mask (:func:`_same_without`)."""
    if not ones:
        return builder
    names = _parameters(builder)

    def build(*args: Any, **kwargs: Any) -> Any:
        arguments = dict(zip(names, args))
        arguments.update(kwargs)
        if _same_without(arguments):
            arguments["attention_mask"] = None
        return builder(**arguments)

    return build
