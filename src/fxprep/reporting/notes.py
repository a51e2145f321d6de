"""The longer texts ``prepare_model`` writes into its report (:class:`fxprep.reporting.report.Report` notes).

Kept apart so that :func:`fxprep.api._prepare` reads as its stages, not as paragraphs of prose;
each function says when its note is written. Tests match on parts of these texts: change them with
care.
"""

from __future__ import annotations

from ..core.inputs import ExampleInputs


def opaque_parts(count: int, dynamo: bool) -> str:
    """``count`` parts of the model run eagerly as opaque calls (the opaque-leaf fallback):
    what was recorded from the example, and what other inputs need to be checked."""
    if dynamo:
        return (f"{count} part(s) could not be captured by Dynamo and run eagerly as opaque calls (see 'kept as "
                f"leaves'); their outputs were recorded from the example inputs: sizes that followed the data stay "
                f"symbolic, but Python values they return (ints, list lengths, None-ness) are the example's, so "
                f"inputs giving different ones need verify_inputs=[...] to be checked.")
    return (f"{count} part(s) could not be traced and run eagerly as opaque calls (see 'kept as "
            f"leaves'); their output structure (list lengths, None-ness) was recorded from the example "
            f"inputs, so inputs giving a differently-structured result need verify_inputs=[...] to be checked.")


def static_shapes(example: ExampleInputs) -> str:
    """Dynamo captured with static shapes: the graph holds for inputs shaped like ``example``."""
    return (f"Dynamo captured with static shapes: the graph is valid for inputs shaped like the example "
            f"({example.describe()}). Pass dynamic=... (or tracer='fx') to run it on other sizes.")


def decided_values(decided: list[str]) -> str:
    """The graph reads values from data at the places ``decided`` (:func:`fxprep.decisions.summary`)."""
    return (f"The graph reads values from data (.item(), .tolist(), sizes from tensors) at {len(decided)} place(s) of "
            f"the model's code; what the capture took from the example's values there is checked on every call (an "
            f"input deciding otherwise raises InputMismatch): " + "; ".join(decided))


def baked_values(names: list[str]) -> str:
    """The Python values the graph took from the model's attributes and globals (:mod:`fxprep.runtime.guard`)."""
    return (f"The prepared module checks at each call that the {len(names)} Python value(s) its graph took "
            f"from the model's attributes and globals are unchanged ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}) and raises InputMismatch otherwise: the graph holds them "
            f"as constants.")


def baked_unchecked(assumed: list[str]) -> str:
    """Values the graph may hold that no call checks (:mod:`fxprep.runtime.baked`: too large, or not plain data)."""
    return (f"ASSUMED: the graph may hold these {len(assumed)} value(s) of the model's attributes or globals as "
            f"constants, and they are too large or not plain data to check at each call: "
            f"{'; '.join(assumed[:4])}{'; ...' if len(assumed) > 4 else ''}. Verification passed with them as they "
            f"are; prepare the model again after changing them.")


INPUT_CHECKS = ("The prepared module checks every call against the inputs it was captured for (structure, "
                "None-ness and, where Dynamo specialised them, shapes) and raises InputMismatch otherwise.")


def state_not_reproduced(names: list[str]) -> str:
    """State a call of the original leaves other than a call of the prepared module: said loudly."""
    shown = ", ".join(names[:8]) + ("..." if len(names) > 8 else "")
    return (f"WARNING: state not reproduced: a call of the original leaves {shown} other than a call of the "
            f"prepared module does (a counter or running value the original's forward updates and the graph "
            f"does not, or the reverse). Outputs matched on this call; later calls may not.")
