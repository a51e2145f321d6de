"""``control_flow="rewrite"``: data-dependent ``if`` statements captured without editing the model.

A Python ``if`` on a tensor stops every tracer. With the option, such a site is rewritten in the
method's source (compiled anew and bound to the instances only while capturing) into ``torch.where``
or ``torch.cond``, and every site is reported. Files, in the order a site goes through them:
:mod:`.session`, :mod:`.sites`, :mod:`.source`, :mod:`.analysis`, :mod:`.transform`,
:mod:`.runtime`, :mod:`.join`, :mod:`.fx_branch`, :mod:`.branches`.

See docs/concepts/control-flow.md (the option, and "Under the hood" for each file's part).
"""
