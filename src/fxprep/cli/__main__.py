"""``python -m fxprep.cli``: the ``fxprep`` command, where the console script is not on the PATH."""

from . import console_main

console_main()
