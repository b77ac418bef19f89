"""Mapper files: Python files that define `mapper`, and what their `Function`s need to be found.

A `Function` names its callable by module ('my_mapper:double'). A user who defines that callable in
the mapper file itself, or in a module next to it, should not have to set PYTHONPATH. So loading a
mapper file (read once: a FIFO or `<(...)` works too) registers it as a module under its own name
(when that name is free) and makes its folder importable; `import_context` then describes both for
worker processes, which `install_import_context` reproduces before they re-plan.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
import types
from typing import Any

from ..errors import MapperError, WorkbenchError

# A mapper file is a few kilobytes of code; this only stops `--mapper /dev/zero` from filling memory.
MAX_MAPPER_BYTES = 16 << 20

# Mapper files loaded in this process: module name -> (path, folder or None, source text).
_LOADED: dict[str, tuple[str, str | None, str]] = {}
# Folders of regular mapper files made importable in this process, in load order.
_FOLDERS: list[str] = []


def _read_once(path: str) -> tuple[str, bool]:
    """The file's text and whether it is a regular file (then its folder holds importable neighbours)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise MapperError(f"Cannot load mapper file {path}: no such file. Write one with mapper.to_code() or check the path.", file=path) from None
    except OSError as exc:
        raise MapperError(f"Cannot load mapper file {path}: {exc.strerror or exc}. Check the path.", file=path) from None
    if stat.S_ISDIR(info.st_mode):
        raise MapperError(
            f"Cannot load mapper file {path}: it is a directory, not a regular file. Pass the Python file that defines `mapper`.", file=path
        )
    regular = stat.S_ISREG(info.st_mode)
    if not regular and not (stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode) or stat.S_ISSOCK(info.st_mode)):
        raise MapperError(f"Cannot load mapper file {path}: it is not a regular file, a pipe or a device. Pass a Python file.", file=path)
    try:
        with open(path, "rb") as handle:  # one read: a pipe (`--mapper <(...)`) cannot be read twice
            data = handle.read(MAX_MAPPER_BYTES + 1)
    except OSError as exc:
        raise MapperError(f"Cannot load mapper file {path}: it cannot be read ({exc.strerror or exc}). Check its permissions.", file=path) from None
    if len(data) > MAX_MAPPER_BYTES:
        raise MapperError(
            f"Cannot load mapper file {path}: it holds more than {MAX_MAPPER_BYTES >> 20} MiB, far more than a mapper. "
            "Pass the Python file that defines `mapper`.", file=path
        )
    try:
        return data.decode("utf-8"), regular
    except UnicodeDecodeError as exc:
        raise MapperError(f"Cannot load mapper file {path}: it is not UTF-8 text (byte {exc.start}). Pass a Python file.", file=path) from None


def _module_name(path: str, regular: bool) -> str | None:
    """The name the file can be imported as, or None when that name belongs to another module."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if not regular or not stem.isidentifier():
        return None
    if stem in _LOADED:
        return stem  # a mapper file loaded earlier under this name: the newer one replaces it, as a re-import would
    if stem in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and (spec.origin is None or os.path.realpath(spec.origin) != os.path.realpath(path)):
        return None  # e.g. a mapper file called json.py must not replace the json module
    return stem


def _add_folder(folder: str) -> None:
    if folder not in sys.path:
        sys.path.append(folder)  # after everything else: a neighbour never shadows an installed package
    if folder not in _FOLDERS:
        _FOLDERS.append(folder)


def _execute(path: str, source: str, name: str | None) -> types.ModuleType:
    module = types.ModuleType(name or "__workbench_mapper__")
    module.__file__ = path
    try:
        code = compile(source, path, "exec")
    except SyntaxError as exc:
        raise MapperError(f"Cannot load mapper file {path}: syntax error at line {exc.lineno}: {exc.msg}. Fix the file.", file=path) from None
    if name is not None:
        sys.modules[name] = module  # before running: the file's own Functions resolve to this very module
    try:
        exec(code, module.__dict__)  # noqa: S102 - the mapper file is the user's own code, as with `python file.py`
    except BaseException as exc:
        if name is not None:
            sys.modules.pop(name, None)
        if isinstance(exc, WorkbenchError):
            raise MapperError(f"Cannot load mapper file {path}: {exc.message}", file=path) from None
        if isinstance(exc, Exception):
            raise MapperError(f"Cannot load mapper file {path}: running it raised {type(exc).__name__}: {exc}. Fix the file.", file=path) from None
        raise
    return module


def load_mapper_file(path: str | os.PathLike) -> Any:
    """The `mapper` a Python file defines (the file is executed: it is the user's own code).

    Any readable path works (a regular file, a FIFO, `/dev/fd/N` from `<(...)`); it is read once. For a
    regular file, its folder becomes importable and the file itself importable under its own name, so a
    `Function` can name a callable defined there ('my_mapper:double'), here and in every worker.
    """
    path = os.fspath(path)
    source, regular = _read_once(path)
    name = _module_name(path, regular)
    if regular:
        _add_folder(os.path.dirname(os.path.abspath(path)))
    module = _execute(path, source, name)
    if name is not None:
        _LOADED[name] = (path, os.path.dirname(os.path.abspath(path)), source)
    mapper = module.__dict__.get("mapper")
    if mapper is None or not hasattr(mapper, "bind"):
        found = "no name `mapper`" if mapper is None else f"`mapper` is a {type(mapper).__name__}, not a mapper"
        raise MapperError(
            f"Cannot load mapper file {path}: it defines {found}. Assign a workbench mapper to `mapper` "
            "(e.g. `mapper = M.Sequential(...)`, as mapper.to_code() writes).",
            file=path,
        )
    return mapper


def _function_modules(mapper: Any) -> set[str]:
    from .function import Function

    names: set[str] = set()
    if mapper is None or not hasattr(mapper, "leaves"):
        return names
    for leaf in mapper.leaves():
        if isinstance(leaf, Function):
            for reference in (leaf.fn, leaf.infer):
                if reference:
                    names.add(reference.partition(":")[0].partition(".")[0])
    return names


def import_context(mapper: Any) -> dict[str, Any]:
    """What a worker needs to import `mapper`'s functions: mapper-file folders and the mapper files they name.

    JSON-ready: {"path": [folders], "modules": [{"name", "file", "source"}]}; empty when nothing is needed.
    """
    used = _function_modules(mapper)
    if not used:
        return {}
    modules = [{"name": name, "file": _LOADED[name][0], "source": _LOADED[name][2]} for name in sorted(used & set(_LOADED))]
    folders = list(_FOLDERS)
    folders += [folder for folder in _module_folders(used - set(_LOADED)) if folder not in folders]
    return {"path": folders, "modules": modules}


def _module_folders(names: set[str]) -> list[str]:
    """The sys.path folders these top-level modules were found in here. A notebook that ran
    `sys.path.insert(0, "src")` imports `src/mymod.py`; a worker process (started with the usual path) would not
    find it, so its folder travels with the job and is appended to the worker's path (never shadowing anything)."""
    folders: list[str] = []
    for name in sorted(names):
        if name in ("__main__", "__mp_main__"):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:  # a package: the folder that holds it
            found = [os.path.dirname(os.path.abspath(location)) for location in spec.submodule_search_locations]
        elif spec.origin and os.path.isfile(spec.origin):
            found = [os.path.dirname(os.path.abspath(spec.origin))]
        else:
            continue  # built in: every process has it
        folders += [folder for folder in found if folder not in folders]
    return folders


def install_import_context(context: dict[str, Any] | None) -> None:
    """Reproduce `import_context` in this process: folders importable, mapper files registered as modules."""
    if not context:
        return
    for folder in context.get("path", []):
        _add_folder(folder)
    for entry in context.get("modules", []):
        name = entry["name"]
        if name in sys.modules:
            continue
        _execute(entry["file"], entry["source"], name)
        _LOADED[name] = (entry["file"], os.path.dirname(os.path.abspath(entry["file"])), entry["source"])


def code_digest(mapper: Any) -> str | None:
    """A digest of the code `mapper`'s Functions run ("" when none), or None when some of it cannot be read.

    A mapper's JSON names functions, not their bodies: a finished conversion is only the same conversion
    again if the code behind those names is unchanged too.
    """
    import hashlib

    if mapper is None:
        return ""
    if not hasattr(mapper, "leaves"):
        return None  # a Binding or another object: its code is unknown
    from .function import Function

    modules = sorted({ref.partition(":")[0] for leaf in mapper.leaves() if isinstance(leaf, Function)
                      for ref in (leaf.fn, leaf.infer) if ref})
    if not modules:
        return ""
    digest = hashlib.sha256()
    for name in modules:
        top = name.partition(".")[0]
        if top in _LOADED and name == top:
            text = _LOADED[top][2].encode()
        else:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                return None
            if spec is None or not spec.origin or not os.path.isfile(spec.origin):
                return None
            try:
                with open(spec.origin, "rb") as handle:
                    text = handle.read()
            except OSError:
                return None
        digest.update(f"{name}\n{len(text)}\n".encode() + text)
    return digest.hexdigest()
