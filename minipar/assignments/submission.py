"""Submissions as they arrive: a student tree, a zip of it, or a zip of a folder that holds it.

The tree is the folder holding ``minipar/``: the path itself, else the shallowest such folder
below it when it is the only one at its depth (a zipped folder, the commonest way to hand in,
puts the tree one level down). A zip is unpacked into a temporary folder first; a submission
that holds no tree, two trees, or a zip that is empty, corrupt, unsafe or too big, gives the
reason instead, and ``assignments.unscored`` turns it into results scoring every task 0 with it,
so Gradescope always gets a results.json the student can read.

    with submission.opened("hw2.zip") as (tree, reason):
        results = grade(tree) if tree else assignments.unscored(tasks, f"not graded: {reason}")
"""
import contextlib
import os
import pathlib
import shutil
import stat
import tempfile
import zipfile
import zlib

MAX_BYTES = 200 * 2**20  # unpacked size of a zip: a tree with its lessons is about 2 MB
MAX_FILES = 20_000
MAX_DEPTH = 4  # folders searched below the submission for the tree
# never the tree: macOS's resource forks, version control, virtual environments' packages
SKIPPED = {"__MACOSX", "site-packages", "node_modules"}


class Unusable(Exception):
    """A submission that cannot be graded; its text is the reason the student reads."""


@contextlib.contextmanager
def opened(path):
    """``(tree, None)`` for the tree that ``path`` (a folder or a zip) holds, or ``(None,
    reason)``; a zip's unpacked copy lives until the block ends."""
    with tempfile.TemporaryDirectory(prefix="minipar-submission-") as scratch:
        # readable by all: a grader that runs the student's code as another user reads it there
        os.chmod(scratch, 0o755)
        try:
            found, reason = locate(pathlib.Path(path), pathlib.Path(scratch)), None
        except Unusable as err:
            found, reason = None, str(err)
        yield found, reason


def locate(path, scratch):
    """The folder holding ``minipar/`` in ``path``, unpacking a zip (or a folder's one zip, as
    an upload may arrive) into ``scratch``; Unusable with the reason otherwise."""
    if not path.exists():
        raise Unusable(f"{path}: no such file or folder")
    if path.is_file():
        return find(unzip(path, scratch), f"the zip {path.name}")
    found = find(path, str(path))
    zips = sorted(path.glob("*.zip"))
    if found is None and len(zips) == 1:
        return locate(zips[0], scratch)
    if found is None:
        raise Unusable(f"{path} holds no minipar/ package (nor one zip of it): hand in the "
                       f"folder made by `minipar assignment make`, or a zip of it")
    return found


def find(folder, name):
    """The shallowest folder at or below ``folder`` holding ``minipar/``, None when there is
    none; two at the same depth are Unusable (which one is the submission?)."""
    level = [folder]
    for _ in range(MAX_DEPTH + 1):
        found = [d for d in level if (d / "minipar").is_dir()]
        if len(found) > 1:
            trees = ", ".join(str(d.relative_to(folder)) for d in found)
            raise Unusable(f"{name} holds {len(found)} minipar/ trees ({trees}): hand in one")
        if found:
            return found[0]
        level = [child for d in level for child in sorted(d.iterdir())
                 if child.is_dir() and not child.is_symlink() and child.name not in SKIPPED
                 and not child.name.startswith(".")]
    return None


def unzip(path, into):
    """Unpack the zip ``path`` into the folder ``into``; Unusable when it is empty, corrupt,
    bigger than MAX_BYTES or MAX_FILES, or a member would land outside ``into``. Links are
    skipped; Windows' backslashes are read as folders."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise Unusable(f"{path.name} is not a zip archive that can be read ({err})") from None
    with archive:
        members = [m for m in archive.infolist() if not stat.S_ISLNK(m.external_attr >> 16)]
        if not members:
            raise Unusable(f"{path.name} is empty: zip the folder that holds minipar/")
        # the sizes a member declares bound what zipfile unpacks from it
        size = sum(m.file_size for m in members)
        if size > MAX_BYTES or len(members) > MAX_FILES:
            raise Unusable(f"{path.name} unpacks to {size / 2**20:.0f} MB in {len(members)} "
                           f"files, over the {MAX_BYTES // 2**20} MB / {MAX_FILES} limit")
        root = into.resolve()
        for member in members:
            parts = pathlib.PurePosixPath(member.filename.replace("\\", "/")).parts
            target = root.joinpath(*parts).resolve()
            if not parts:  # the archive's own folder, "./"
                continue
            if parts[0] == "/" or ".." in parts or root not in target.parents:
                raise Unusable(f"{path.name}: member {member.filename!r} would unpack outside "
                               f"its folder")
            if member.is_dir() or member.filename.endswith(("/", "\\")):
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with archive.open(member) as source, open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink)
            except (zipfile.BadZipFile, EOFError, OSError, zlib.error,
                    NotImplementedError) as err:
                raise Unusable(f"{path.name} is corrupt at {member.filename!r} ({err})") from None
    return into
