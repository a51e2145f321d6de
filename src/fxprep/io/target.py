"""Where a save goes: written into a fresh directory beside the target, then renamed into place.

Writing file by file into the target directory goes wrong in three ways: a link planted there
(``weights.safetensors -> ~/.bashrc``) is written through, a save that fails half-way leaves a
directory that looks like a save but is not, and files of an earlier save that the new one does not
write stay behind. So :func:`staged` hands out a new, empty directory next to the target (created
here, so nothing in it can be a planted link), and only when every file is written renames it to
the target: readers see the old save or the new one, never a mix. A target that exists is replaced
only when it is empty or, with ``overwrite=True``, an fxprep save holding nothing but fxprep's
files; an existing file, a link or any other directory is refused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import SerializationError
from .format import CHECKED_FILES, MANIFEST, is_save

SAVE_FILES = frozenset({MANIFEST, *CHECKED_FILES})


def check_target(target: Path, overwrite: bool) -> bool:
    """Raise unless ``target`` may receive a save; returns whether it exists (and will be replaced)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise SerializationError(f"cannot save to {target}: {err}") from err
    if stat.S_ISLNK(st.st_mode):
        raise SerializationError(
            f"cannot save to {target}: it is a symbolic link, and fxprep.save never writes through links. "
            f"Give the real directory's path."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SerializationError(
            f"cannot save to {target}: it is an existing file, not a directory. A save is a directory; "
            f"choose a new path."
        )
    try:
        names = set(os.listdir(target))
    except OSError as err:
        raise SerializationError(f"cannot save to {target}: {err}") from err
    if not names:
        return True
    if not (names <= SAVE_FILES and is_save(target)):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise SerializationError(
            f"cannot save to {target}: it is a directory that is not an fxprep save (it holds {shown}), and "
            f"fxprep.save replaces only an empty directory or its own earlier save. Choose a new or empty directory."
        )
    if not overwrite:
        raise SerializationError(
            f"cannot save to {target}: it already holds an fxprep save. Pass overwrite=True to replace it whole."
        )
    return True


def _sibling(target: Path, tag: str) -> Path:
    """A new directory next to ``target``, made by this process (mkdir fails on anything already there)."""
    for _ in range(100):
        path = target.parent / f".{target.name}.fxprep-{tag}-{secrets.token_hex(6)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise SerializationError(f"cannot create a temporary directory next to {target}.")


@contextlib.contextmanager
def staged(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh directory to write a save into; on success it becomes ``target``, on any
    failure it is removed and ``target`` is left as it was."""
    check_target(target, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fresh = _sibling(target, "new")
    except OSError as err:
        raise SerializationError(f"cannot save to {target}: {err}") from err
    try:
        yield fresh
        _move_into_place(fresh, target, overwrite)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise


def _move_into_place(fresh: Path, target: Path, overwrite: bool) -> None:
    try:
        if not check_target(target, overwrite):  # checked again: the target may have changed meanwhile
            os.rename(fresh, target)
            return
        old = target.parent / f".{target.name}.fxprep-old-{secrets.token_hex(6)}"
        os.rename(target, old)
        try:
            os.rename(fresh, target)
        except OSError:
            os.rename(old, target)
            raise
    except OSError as err:
        raise SerializationError(f"cannot save to {target}: {err}") from err
    shutil.rmtree(old, ignore_errors=True)  # never follows links: a planted one is removed, not its target


def write_new(path: Path, text: str) -> None:
    """Write a file that must not exist yet (in a directory :func:`staged` created)."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
