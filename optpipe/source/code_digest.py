"""What identifies a factory's code in the export's cache key: its module and every module of the user's own
code it imports, each file's digest.

Only the factory's file had been hashed. A model split across files (net.py importing `from blocks import Block`,
as YOLO's models/yolo.py imports models/common.py) kept its key when blocks.py changed: the next compile reused
the old export, evaluated and reported ok, and the artifacts computed a model the user no longer had.

The imports are found by the standard library's `modulefinder`, which reads the code without running it,
searching only the folder the factory is imported from: the standard library and installed packages are not
read, the versions of the installed distributions it imports are in the key. An import the code makes at run time
(importlib, exec) is not seen: docs/models.md says so.
"""
from __future__ import annotations

import site
from functools import lru_cache
from importlib import metadata
import sysconfig
from modulefinder import ModuleFinder
from pathlib import Path

from optpipe.core.artifact import sha256_file


def code_digests(module_name: str, origin: Path) -> dict[str, str]:
    """{file relative to the import root: sha256} for the factory's module and the local modules it imports; for
    an installed package, its module and the distribution's version (scanning transformers' imports read 2894
    files in 15 s; an installed package changes by a reinstall, which its version names)."""
    root = _import_root(module_name, origin)
    own = {origin.name: sha256_file(origin)}
    if root in _installed_roots():
        return own | _distributions([module_name])
    finder = ModuleFinder(path=[str(root)])
    try:
        finder.import_hook(module_name)
    except (ImportError, SyntaxError, ValueError, OSError):  # the import itself fails later, with its own line
        return own
    files = {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    local = sorted(f for f in files if f.is_file() and f.is_relative_to(root))
    digests = {f.relative_to(root).as_posix(): sha256_file(f) for f in local} or own
    return digests | _distributions(name for name in finder.badmodules)  # what it imports from installed packages


def _import_root(module_name: str, origin: Path) -> Path:
    """The sys.path folder the module is imported from: `a.b` in root/a/b.py or root/a/b/__init__.py."""
    depth = module_name.count(".") + (1 if origin.name == "__init__.py" else 0)
    return origin.resolve().parents[depth]


def _installed_roots() -> set[Path]:
    paths = sysconfig.get_paths()
    return {Path(p).resolve() for p in (*site.getsitepackages(), paths["purelib"], paths["platlib"])}


@lru_cache(maxsize=1)
def _module_owners() -> dict[str, list[str]]:
    """Top-level module -> its distributions: read once per process (0.14 s, every installed package's metadata); the
    export's key and eager's figures each ask for it."""
    return metadata.packages_distributions()


def _distributions(module_names) -> dict[str, str]:
    """{'distribution NAME': version} of the installed distributions these modules come from (none: the standard
    library's, or modules not installed)."""
    owners = _module_owners()
    names = {dist for module in module_names for dist in owners.get(module.partition(".")[0], [])}
    return {f"distribution {name}": metadata.version(name) for name in sorted(names)}

#: A file a factory kwarg names, read whole for its digest up to this size (a model config, a vocabulary).
KWARGS_FILE_BYTES = 1 << 30


def kwargs_files(kwargs: dict, source) -> dict[str, str]:
    """{kwarg value: sha256} for each string among the factory's kwargs that names a file: a model config the
    factory reads (`cfg: yolov5s.yaml`) is the model as much as its code. Relative to the recipe's folder or to
    the working directory, where the factory opens it; folders are not read (a value '/' is not a model). A file above
    KWARGS_FILE_BYTES is judged as make judges one, by size and modification time: a kwarg naming a data archive of
    100 GB is not read through on every compile."""
    found = {}
    for value in _strings(kwargs):
        for path in (source.resolve(value), Path(value).expanduser()):
            try:
                if path.is_file():
                    stat = path.stat()
                    found[value] = sha256_file(path) if stat.st_size <= KWARGS_FILE_BYTES else f"{stat.st_size}:{stat.st_mtime_ns}"
                    break
            except OSError:  # a name too long, or a file that cannot be read: the factory says so itself
                break
    return found


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in _strings(item)]
    return []
