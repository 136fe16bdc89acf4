"""File I/O shared by the commands: atomic output (a reader never sees a half-written file, and a failed write leaves
nothing behind) and the YAML reader whose errors are one line."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from moeplan.errors import MoeplanError

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's safe loader when built in: plans are large


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path``: a temp file in the same folder, then a rename. Permissions follow the umask
    (``mkstemp`` alone would create 0600). Raises OSError as the file system does."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_yaml(path: str | Path, *, field: str, error: type[MoeplanError]) -> object:
    """The YAML document in ``path``, read with a safe loader (nothing in it is executed). Raises ``error`` with one
    line, ``{field}='{path}': ...``, when the file cannot be read, is not UTF-8 text or is not YAML."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{field}={str(path)!r}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{field}={str(path)!r}: not a text file (byte {e.start} is not UTF-8)") from None
    try:
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as e:
        raise error(f"{field}={str(path)!r}: malformed YAML ({str(e).splitlines()[0]})") from None
