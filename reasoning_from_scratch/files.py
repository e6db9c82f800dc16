"""Files written safely and read with errors that name them: atomic writes (a crash mid-write
leaves the old file or none, never a truncated one) and JSON reading. The lowest layer: every
module that writes or reads files imports from here, and this module imports nothing of ours."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

PathLike = str | Path


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temp path in the same directory; on success os.replace it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates 0600 files; give the result the usual permissions (0666 minus umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # atomic on POSIX and Windows when on the same filesystem
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def remove_stale_temp_files(directory: PathLike) -> list[Path]:
    """Remove the temp files that `atomic_path` left in `directory` when its process was killed
    mid-write (".<name>.<random>.tmp"; the file they were for is whole); returns them."""
    stale = [p for p in Path(directory).glob(".*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write bytes to `path` atomically (fsync'd temp file + rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write UTF-8 text to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_save_safetensors(tensors: dict, path: PathLike, metadata: dict | None = None):
    """Save CPU-contiguous copies of `tensors` as a safetensors file, atomically. A failed write
    (a full disk) raises OSError, as Python's own writes do, not safetensors' SafetensorError."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata={"format": "pt", **(metadata or {})})
        except SafetensorError as err:  # e.g. "I/O error: No space left on device (os error 28)"
            code = re.search(r"os error (\d+)", str(err))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))),
                          str(path)) from err


def read_json(path: str | Path) -> dict:
    """Read a JSON file; errors name the file (and line for syntax errors)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def free_space(path: PathLike) -> str:
    """The free space on the filesystem holding `path` (or its nearest existing parent),
    e.g. "1.2 GB free on /scratch" ("free space unknown" if it cannot be read)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= size:
            return f"{free / size:.1f} {unit} free on {path}"
    return f"{free} bytes free on {path}"
