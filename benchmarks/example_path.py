"""Follow the capture's inputs through fxprep at run time (issue 30, "one capture request").

Runs ``check_traceability`` on a small model whose ``forward`` branches on data (Dynamo fails, so the
opaque-part fallback runs too) under :func:`sys.setprofile`, and records every call of a function in
``fxprep`` that receives the capture's inputs: an argument that is an ``ExampleInputs`` or a
``CaptureRequest``. Prints the files those calls pass through and how often the path *enters* a file
(a carrying call whose nearest carrying caller is in another file): entries beyond one per file are
returns to a file the path had left. Returns made inside the opaque-part fallback are counted apart:
the fallback captures the model again with the failing parts opaque, so it goes back through the
files the first capture went through by design. Run it against any checkout::

    PYTHONPATH=path/to/src python benchmarks/example_path.py [-v]    # -v: the path, entry by entry
"""

from __future__ import annotations

import collections
import inspect
import sys
from pathlib import Path

import torch
from torch import nn

# The opaque-part fallback's captures (fxprep.capture.cascade.capture_with_opaque_parts): each captures
# the model again with the failing parts opaque.
FALLBACKS = {"capture_dynamo_leaves", "capture_deciding_values", "capture_hybrid"}


class Gate(nn.Module):
    """A block whose ``forward`` branches on data: Dynamo and fx stop here."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if y.sum() > 0:  # data-dependent
            return self.linear(y)
        return y


class Branchy(nn.Module):
    """A small net with one data-dependent block: the opaque-part fallback makes it opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gate = Gate()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.stem(x).mean((2, 3))))


def main() -> None:
    import fxprep
    from fxprep.core.inputs import ExampleInputs

    carriers: tuple[type, ...] = (ExampleInputs,)
    try:
        from fxprep.capture.request import CaptureRequest

        carriers += (CaptureRequest,)
    except ImportError:  # a checkout from before the request
        pass
    root = str(Path(fxprep.__file__).parent) + "/"
    entries: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    stack: list[tuple[object, str, bool]] = []  # (frame, file, inside a retry) of the carrying calls now running
    retries: collections.Counter[str] = collections.Counter()  # returns made inside the fallback
    path: list[str] = []  # each entry, indented by its depth among the carrying calls
    resumed: set[object] = set()  # generator frames already entered

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if event == "call":
            file = frame.f_code.co_filename
            if not file.startswith(root) or frame in resumed:
                return
            if frame.f_code.co_flags & inspect.CO_GENERATOR:  # a context manager's exit resumes it: one entry
                resumed.add(frame)
            # the carrier's own methods (self) are not the path
            if not any(isinstance(v, carriers) for k, v in frame.f_locals.items() if k != "self"):
                return
            rel = file[len(root):]
            calls[rel] += 1
            callers = set()  # the live call chain: a return the profiler missed must not leave a frame behind
            caller = frame.f_back
            while caller is not None:
                callers.add(id(caller))
                caller = caller.f_back
            while stack and id(stack[-1][0]) not in callers:
                stack.pop()
            retry = frame.f_code.co_name in FALLBACKS or (bool(stack) and stack[-1][2])
            if not stack or stack[-1][1] != rel:
                entries[rel] += 1
                if retry and entries[rel] > 1:
                    retries[rel] += 1
                path.append(f"{'  ' * len(stack)}{rel} {frame.f_code.co_name}{'  (fallback)' if retry else ''}")
            stack.append((frame, rel, retry))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    model = Branchy().eval()
    torch.manual_seed(0)
    example = torch.randn(2, 3, 16, 16)
    sys.setprofile(profile)
    try:
        report = fxprep.check_traceability(model, example, draft_export=False, control_flow=False)
    finally:
        sys.setprofile(None)
    print(f"fxprep at {root}")
    print(f"check_traceability: {report.to_text().splitlines()[1].strip()}")
    returns = sum(entries.values()) - len(entries)
    print(f"files the capture's inputs pass through: {len(entries)}; entries: {sum(entries.values())}; "
          f"returns to a file left before: {returns} ({sum(retries.values())} inside the opaque-part fallback, "
          f"{returns - sum(retries.values())} outside)")
    for rel, n in sorted(entries.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:3d} entries ({retries[rel]} in the fallback), {calls[rel]:4d} calls  {rel}")
    if "-v" in sys.argv:
        print("the path (each entry into a file, indented by depth):")
        print("\n".join("  " + p for p in path))


if __name__ == "__main__":
    main()
