"""File I/O shared by the commands: atomic output (a reader never sees a half-written file, a failed write leaves
nothing behind, with one-line errors, and nothing but a regular file the user may write is ever replaced) and the text, YAML and JSON readers whose errors are one line: unreadable,
not UTF-8, malformed, or nested too deeply (the limits: docs/inputs.md)."""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import yaml

from moeplan.errors import MoeplanError, OutputError


def _strict(loader: type) -> type:
    """``loader`` refusing a mapping that states one key twice (YAML 1.2 forbids it; PyYAML keeps the last value
    without a word). A merge (``<<: *anchor``) may still be overridden by the mapping's own keys, as YAML's merge
    rule says."""

    class Strict(loader):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: set = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        duplicate = key in seen
                    except TypeError:  # an unhashable key: the constructor says so below
                        continue
                    if duplicate:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Strict


_LOADER = _strict(getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml's safe loader when built in: plans are large
_PURE_LOADER = _strict(yaml.SafeLoader)


def loads_json(text: str) -> object:
    """``json.loads`` of ``text`` where an object that states one key twice raises ValueError ("duplicate key
    'k'"), as every moeplan reader treats it (the last value used to win in silence)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket"}


def _existing(path: Path, field: str) -> tuple[Path, os.stat_result | None]:
    """The file a write to ``path`` replaces — a symlink's target (the link stays) — and its status (None: no file
    yet). Raises OutputError (one line) for a folder, anything but a regular file (devices, FIFOs, sockets: ``-o
    /dev/null`` must not turn the device into a file) and a read-only file (root included: its mode says
    read-only, so moeplan does not replace it)."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = target.stat()
    except FileNotFoundError:
        return target, None
    except OSError as e:
        raise OutputError(f"{field}={str(path)!r}: cannot write ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{field}={str(path)!r}: is a folder; name a file")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{field}={str(path)!r}: is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}; "
                          f"moeplan writes only regular files")
    if not st.st_mode & 0o222 or not os.access(target, os.W_OK):
        raise OutputError(f"{field}={str(path)!r}: is read-only (mode {stat.filemode(st.st_mode)}); moeplan does not "
                          f"replace it")
    return target, st


def check_output(path: str | Path, *, field: str = "output") -> None:
    """Raise OutputError (one line naming ``field`` and ``path``) unless a file can be written at ``path``: its
    folder exists and is writable, and ``path`` is a regular file that may be written or no file yet (a symlink:
    its target). Commands call it before their work, so a long compile does not end in a refusal."""
    target, _ = _existing(Path(path), field)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{field}={str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{field}={str(path)!r}: folder {str(folder)!r} is not writable")


def write_atomic(path: str | Path, data: str | bytes, *, field: str = "output") -> None:
    """Write ``data`` to ``path``: a temp file in the same folder, then a rename. A symlink is written through (its
    target replaced, the link kept); an existing file keeps its mode, a new one follows the umask (``mkstemp``
    alone would create 0600). Raises OutputError (one line naming ``field``, the path and the reason) when it
    cannot, or for a target :func:`check_output` refuses; nothing is left behind then."""
    target, st = _existing(Path(path), field)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    except OSError as e:
        raise OutputError(f"{field}={str(path)!r}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OutputError(f"{field}={str(path)!r}: cannot write ({e.strerror or e})") from None
        raise


MAX_INPUT_BYTES = 256 * 2**20
"""Largest file moeplan reads as text: 256 MiB (a plan of the 718B on 6144 devices is a few MiB)."""


def read_text(path: str | Path, *, field: str, error: type[MoeplanError]) -> str:
    """The UTF-8 text of ``path``. Raises ``error`` with one line, ``{field}='{path}': ...``, when the file cannot be
    read, is not a regular file (a FIFO would block the read forever, ``/dev/zero`` fill the memory; a symlink is
    followed), is larger than :data:`MAX_INPUT_BYTES` or is not UTF-8 text."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise error(f"{field}={str(path)!r}: is {kind}; moeplan reads only regular files")
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except OSError as e:
        raise error(f"{field}={str(path)!r}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise error(f"{field}={str(path)!r}: larger than {MAX_INPUT_BYTES // 2**20} MiB; moeplan's files are far "
                    f"smaller (docs/inputs.md)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{field}={str(path)!r}: not a text file (byte {e.start} is not UTF-8)") from None


MAX_DEPTH = 10_000
"""Nesting depth up to which libyaml's loader is used; a deeper document can overflow its C stack (a crash, not an
exception), so it goes to PyYAML's pure-Python loader, whose recursion limit raises instead."""
MAX_NESTING = 64
"""Deepest nesting of lists and mappings a document may have (moeplan's files nest at most about 8 deep)."""
MAX_NODES = 10_000_000
"""Most lists, mappings and values a document may expand to: YAML aliases can share one node many times over."""


def _depth_bound(text: str) -> int:
    """An upper bound on the nesting depth of a YAML document: each flow level opens a bracket, and each block level
    starts at least one column right of its parent, so a line's block levels fit in its prefix of indentation and
    ``-``/``?``/``:`` indicators, plus one for a mapping after them. A long comment or scalar does not count (a
    20 MB comment line sent the file to the pure-Python loader: about a minute)."""
    prefix = max((len(line) - len(line.lstrip(" \t-?:")) for line in text.splitlines()), default=0)
    return text.count("[") + text.count("{") + prefix + 1


def _shape(doc: object) -> tuple[int, int] | None:
    """(nesting depth, nodes once aliases are expanded) of a loaded document, or None when a list or mapping
    contains itself (a YAML alias inside its own anchor). Iterative, each shared node visited once."""
    memo: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()  # the nodes whose children are being visited: the current node's ancestors
    stack: list[tuple[object, bool]] = [(doc, False)]
    while stack:
        node, done = stack.pop()
        kids = [k for k in (node.values() if isinstance(node, dict) else node) if isinstance(k, (dict, list))]
        if done:
            open_.discard(id(node))
            memo[id(node)] = (1 + max((memo[id(k)][0] for k in kids), default=0),
                              1 + len(node) + sum(memo[id(k)][1] for k in kids))
        elif id(node) in open_:
            return None
        elif id(node) not in memo:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in kids)
    return memo.get(id(doc), (0, 1))


def _checked(doc: object, *, field: str, path: str | Path, kind: str, error: type[MoeplanError]) -> object:
    """``doc`` if its nesting and size are within :data:`MAX_NESTING` and :data:`MAX_NODES`; else ``error``."""
    if not isinstance(doc, (dict, list)):
        return doc
    shape = _shape(doc)
    if shape is None:
        raise error(f"{field}={str(path)!r}: malformed {kind} (a list or mapping contains itself through an alias)")
    if shape[0] > MAX_NESTING or shape[1] > MAX_NODES:
        raise error(f"{field}={str(path)!r}: malformed {kind} (nested deeper than {MAX_NESTING} levels or expanding "
                    f"to more than {MAX_NODES:,} values)")
    return doc


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def read_yaml(path: str | Path, *, field: str, error: type[MoeplanError]) -> object:
    """The YAML document in ``path``, read with a safe loader (nothing in it is executed). Raises ``error`` with one
    line, ``{field}='{path}': ...``, when the file cannot be read, is not UTF-8 text or is not YAML (a value its
    tag cannot hold, such as the date 2024-13-45, and a mapping stating one key twice, included), or nests deeper
    than :data:`MAX_NESTING`."""
    text = read_text(path, field=field, error=error)
    try:
        doc = yaml.load(text, Loader=_LOADER if _depth_bound(text) <= MAX_DEPTH else _PURE_LOADER)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: a scalar its tag cannot hold (int(), date() raise it)
        raise error(f"{field}={str(path)!r}: malformed YAML ({_first_line(e)})") from None
    except RecursionError:
        raise error(f"{field}={str(path)!r}: malformed YAML (nested too deeply)") from None
    return _checked(doc, field=field, path=path, kind="YAML", error=error)


def read_json(path: str | Path, *, field: str, error: type[MoeplanError]) -> object:
    """The JSON document in ``path`` (RFC 8259; Python's ``NaN``/``Infinity`` extensions are read as floats, which
    validation then refuses). Raises ``error`` with one line as :func:`read_yaml`, an object stating one key twice
    included."""
    text = read_text(path, field=field, error=error)
    try:
        doc = loads_json(text)
    except ValueError as e:  # JSONDecodeError is one; _unique_pairs raises it for a key stated twice
        raise error(f"{field}={str(path)!r}: malformed JSON ({_first_line(e)})") from None
    except RecursionError:
        raise error(f"{field}={str(path)!r}: malformed JSON (nested too deeply)") from None
    return _checked(doc, field=field, path=path, kind="JSON", error=error)
