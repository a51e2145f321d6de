"""``control_flow="rewrite"``: data-dependent ``if``\\ s captured without editing the model.

A Python ``if`` on a tensor (``if x.sum() > 0: return self.linear(x) else: return torch.zeros(10)``)
stops every tracer. With the option, fxprep rewrites such a site in the method's *source* (never the
user's file or class: the rewritten method is compiled anew and bound to the instances only while
capturing) into ``torch.where`` (both sides computed) when both branches are side-effect-free tensor
expressions whose results join, or ``torch.cond`` (the branches traced as subgraphs whose leaf
layers are the user's own modules), and reports every site: where, what it was, what it became,
why, and which inputs ran which branch. Loops whose trip count depends on a tensor, and branches
that cannot be made pure, stay what they are without the option (diagnosed; the smallest opaque
part).

Files, in the order a site goes through them: :mod:`.session` (the capture loop and its decisions),
:mod:`.sites` (where a site is, what was decided),
:mod:`.source` (a method's AST in, a compiled and bound function out), :mod:`.analysis` (what a
site's branches do), :mod:`.transform` (the AST rewrite), :mod:`.runtime` (what rewritten code
calls; the eager recorder), :mod:`.join` (the `torch.where` join and its checks), :mod:`.fx_branch` (a site met by the fx tracer), :mod:`.branches`
(the passes run inside ``torch.cond`` branches after capture). The ``cond`` a prepared graph
calls is :func:`fxprep.cond.cond`; Dynamo's own ``torch.cond`` subgraphs are re-lifted in
:mod:`fxprep.capture.dynamo.cond`.
"""
