"""Submissions as they arrive: a student tree, a zip of it, or a zip of a folder that holds it;
and ``pack``, the student's side, writing the zip the grader wants.

The tree is the folder holding ``minipar/``: the path itself, else the shallowest such folder
below it when it is the only one at its depth (a zipped folder, the commonest way to hand in,
puts the tree one level down). A zip is unpacked into a temporary folder first; a submission
that holds no tree, two trees, or a zip that is empty, corrupt, unsafe or too big, gives the
reason instead, and ``assignments.unscored`` turns it into results scoring every task 0 with it,
so Gradescope always gets a results.json the student can read.

    with submission.opened("hw2.zip") as (tree, reason):
        results = grade(tree) if tree else assignments.unscored(tasks, f"not graded: {reason}")
    pack("hw2", "hw2.zip")    # (files, bytes): the tree less LEFT_OUT, under hw2/
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
# Never part of a hand-in, wherever they sit: virtual environments (any folder holding a
# pyvenv.cfg too), caches, build output, version control, macOS's resource forks. ``pack``
# leaves them out of the zip it writes and ``unzip`` out of a zip it is given, counted in
# neither limit: the tree's README creates .venv/ inside the tree.
LEFT_OUT = {".venv", "venv", ".tox", ".nox", "site-packages", "node_modules", "__pycache__",
            ".pytest_cache", ".mypy_cache", ".ruff_cache", ".ipynb_checkpoints", "build", "dist",
            ".git", ".hg", ".svn", "__MACOSX", ".eggs"}
LEFT_OUT_FILES = (".pyc", ".pyo", ".zip", ".DS_Store")  # a zip inside a hand-in is never graded
PACK = "minipar assignment pack"  # the command that writes the zip the grader wants


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
                 if child.is_dir() and not child.is_symlink() and child.name not in LEFT_OUT
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
        parts = [_parts(m.filename) for m in members]
        venvs = {p[:-1] for p in parts if p and p[-1] == "pyvenv.cfg"}
        members = [m for m, p in zip(members, parts) if p and not left_out(p, venvs)]
        # the sizes a member declares bound what zipfile unpacks from it
        _within_limits(path.name, {m.filename: m.file_size for m in members
                                   if not m.is_dir()})
        root = into.resolve()
        for member in members:
            parts = _parts(member.filename)
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


def _parts(name):
    """A member's path as parts, Windows' backslashes read as folders."""
    return pathlib.PurePosixPath(name.replace("\\", "/")).parts


def left_out(parts, venvs=()):
    """Whether the file at ``parts`` (its path, split) never belongs to a hand-in: under a
    LEFT_OUT folder, an egg-info or one of ``venvs`` (the folders holding a pyvenv.cfg), or a
    LEFT_OUT_FILES file."""
    folders = parts[:-1]
    return (any(f in LEFT_OUT or f.endswith(".egg-info") for f in folders)
            or parts[-1].endswith(LEFT_OUT_FILES)
            or any(folders[:i] in venvs for i in range(1, len(folders) + 1)))


def _within_limits(name, sizes):
    """Unusable when the files ``sizes`` ({path: bytes}) pass MAX_BYTES or MAX_FILES, naming
    the folders that hold the most and the command that leaves them out."""
    total = sum(sizes.values())
    if total <= MAX_BYTES and len(sizes) <= MAX_FILES:
        return
    folders = {}
    for member, size in sizes.items():
        parts = _parts(member)
        key = "/".join(parts[:2]) + ("/" if len(parts) > 2 else "")
        count, held = folders.get(key, (0, 0))
        folders[key] = (count + 1, held + size)
    most = sorted(folders.items(), key=lambda item: -item[1][1])[:3]
    named = ", ".join(f"{key} {held / 2**20:.0f} MB in {count} files"
                      for key, (count, held) in most)
    raise Unusable(f"{name} unpacks to {total / 2**20:.0f} MB in {len(sizes)} files, over the "
                   f"{MAX_BYTES // 2**20} MB / {MAX_FILES} limit; the most is in {named}: "
                   f"write the zip with `{PACK}`, which leaves out virtual environments, "
                   f"caches and build folders")


def pack(tree, out):
    """Write the zip of ``tree`` the grader wants to ``out``: the tree's files under its
    folder's name, less what is LEFT_OUT; (files, bytes) written. Unusable, with nothing
    written, when the zip would pass the limits the grader holds it to."""
    tree, out = pathlib.Path(tree).resolve(), pathlib.Path(out).resolve()
    files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    venvs = {p.relative_to(tree).parts[:-1] for p in files if p.name == "pyvenv.cfg"}
    files = [p for p in files if p != out and not left_out(p.relative_to(tree).parts, venvs)]
    _within_limits(out.name, {p.relative_to(tree).as_posix(): p.stat().st_size for p in files})
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, f"{tree.name}/{path.relative_to(tree).as_posix()}")
    os.replace(partial, out)
    return len(files), out.stat().st_size
