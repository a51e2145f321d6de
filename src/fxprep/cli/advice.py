"""The library's advice in the command line's terms: ``--dynamic batch``, not ``dynamic='batch'``.

The report's notes and the errors are written once, for :func:`fxprep.prepare_model`'s keyword
options (``Pass dynamic=... (or tracer='fx')``). On the command line that advice names options the
user cannot type; the flags that set them are known, so the command rewrites each option it has a
flag for when it prints (:func:`in_flag_terms`) instead of the library keeping two texts of every
note. An option without a flag (``concrete_args``) is left as written: it is advice for Python;
except the one asking to confirm ``use_cache=False`` with ``concrete_args``, which a command-line
user can neither give nor needs (the command prepares transformers models without a cache): dropped.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

_Q = r"""(['"])"""  # a quote, matched again by \1 or (?P=q)


def _dynamic_dict(m: re.Match[str]) -> str:
    """``dynamic={'input_ids': {1: 'seq'}}`` -> ``--dynamic input_ids:1=seq``; as written if it is not a literal."""
    try:
        value = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return "--dynamic NAME:DIM=SYMBOL"
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        return "--dynamic NAME:DIM=SYMBOL"
    return " ".join(f"--dynamic {name}:" + ",".join(f"{d}={s}" for d, s in dims.items()) for name, dims in value.items())


def _excluded(flag: str) -> Callable[[re.Match[str]], str]:
    def render(m: re.Match[str]) -> str:
        names = [n.strip().removeprefix("model.") for n in m.group(1).split(",") if n.strip()]
        names = [n if n and n != "..." else "NAME" for n in names] or ["NAME"]
        return " ".join(f"{flag} {n}" for n in names)

    return render


#: (pattern, replacement) in the order tried; each pattern names a keyword of prepare_model (or of
#: load_weights / fxprep.save that the command sets from a flag)
RULES: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    (re.compile(r" ?Pass concrete_args=\{'use_cache': False\} to say you expect it\."), ""),
    (re.compile(r"\bdynamic=False\b"), "--static"),
    (re.compile(rf"\bdynamic={_Q}batch\1"), "--dynamic batch"),
    (re.compile(r"\bdynamic=(\{(?:[^{}]|\{[^{}]*\})*\})"), _dynamic_dict),
    (re.compile(r"\bdynamic=\.\.\."), "--dynamic ..."),
    (re.compile(rf"\btracer={_Q}(auto|dynamo|fx)\1"), r"--tracer \2"),
    (re.compile(rf"\bcontrol_flow={_Q}rewrite\1"), "--control-flow rewrite"),
    (re.compile(r"\bverify_inputs=\[[^\]]*\]"), "--verify-input ..."),
    (re.compile(rf"\bverify={_Q}grad\1"), "--verify-grad"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
    (re.compile(r"\bmodule_classes_to_exclude=\[([^\]]*)\]"), _excluded("--exclude-class")),
    (re.compile(r"\bmodules_to_exclude=\[([^\]]*)\]"), _excluded("--exclude")),
    (re.compile(rf"\btrusted_modules=\[{_Q}([\w.]+)\1\]"), r"--trust \2"),
    (re.compile(r"\bdtype=torch\.(float32|bfloat16|float16)\b"), r"--dtype \1"),
]


def in_flag_terms(text: str) -> str:
    """``text`` with each ``prepare_model`` keyword the command has a flag for written as that flag."""
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text
