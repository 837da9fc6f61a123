"""Compiled kernels kept on disk, so that a new process loads them (milliseconds) instead of compiling
(about a second per variant on a CPU, a few on the GPU host).

Where: ``$CUTE_KDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/cute_kda``, else ``~/.cache/cute_kda``;
``CUTE_KDA_DISK_CACHE=0`` keeps compiled kernels in memory only. Deleting the folder is always safe.

What: the DSL exports a TVM-FFI compiled function as a host object file (``export_to_c``: host code
with the kernels' cubin embedded) and loads it back in another process
(``cute.runtime.load_module(path, enable_tvm_ffi=True)``: JIT-linked, no recompile). One entry is
``<fingerprint>/<cache name>-<key hash>.o`` plus a ``.json`` record beside it that names the full
key and the SHA-256 of the object's bytes (and, for reading only, how many seconds the compile took). The
fingerprint (:func:`source_fingerprint`) covers the sources that decide the compiled code (``cute_kda/kernels``,
``cute_kda/layouts``, the launchers in ``cute_kda/ops``, ``numerics.py``, ``workspace.py``, ``dsl.py``), the DSL and
TVM-FFI versions, the Python version and the target architecture; an edit to any of them starts a new folder.

Trust: an entry is loaded only when its record parses, names this key and this fingerprint, and the
object's size and digest match the record, so a truncated or foreign file is never handed to the
loader. Anything else is a miss: the entry is compiled again and rewritten.

Concurrency: a miss takes an exclusive ``flock`` on the entry's ``.lock`` file, looks again (another
process may have just written it) and only then compiles; files are written to a private temporary
name and renamed into place (object first, then the record that vouches for it), so readers, which
take no lock, see a complete old entry, a complete new one, or a mismatch they treat as a miss.
Several processes warming the same cache therefore compile each variant once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterator

CACHE_DIR_ENV = "CUTE_KDA_CACHE_DIR"
DISK_CACHE_ENV = "CUTE_KDA_DISK_CACHE"
EXPORT_NAME = "cute_kda_entry"  # the symbol each object file exports (one function per file)
RECORD_FORMAT = 1
LOCK_TIMEOUT_S = 300.0  # longer than any single compile; past it the process compiles without the disk

PACKAGE = Path(__file__).resolve().parents[1]
FINGERPRINTED = ("kernels", "layouts", "ops", "numerics.py", "workspace.py", "dsl.py")


def cache_root() -> Path | None:
    """The cache folder, or None when ``CUTE_KDA_DISK_CACHE=0`` turns the disk side off."""
    if os.environ.get(DISK_CACHE_ENV, "1") == "0":
        return None
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cute_kda"


def _source_files() -> list[Path]:
    files: list[Path] = []
    for name in FINGERPRINTED:
        path = PACKAGE / name
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else [])
    return files


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """SHA-256 over the sources and versions that decide compiled code (computed once per process)."""
    import cutlass
    import tvm_ffi

    from ..dsl import TARGET_ARCH

    digest = hashlib.sha256()
    for stamp in (f"python {sys.version_info.major}.{sys.version_info.minor}", f"cutlass-dsl {cutlass.__version__}",
                  f"tvm-ffi {tvm_ffi.__version__}", f"arch {os.environ.get('CUTE_DSL_ARCH', TARGET_ARCH)}"):
        digest.update(stamp.encode() + b"\0")
    for path in _source_files():
        content = path.read_bytes()
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0")
        digest.update(len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()


@dataclass(frozen=True)
class Entry:
    """The files of one cached compile: object, record, lock; ``key_text`` names the key in full."""

    obj: Path
    record: Path
    lock: Path
    key_text: str
    fingerprint: str


def entry_for(root: Path, name: str, key: Hashable) -> Entry:
    key_text = f"{name}:{key!r}"
    fingerprint = source_fingerprint()
    stem = f"{name}-{hashlib.sha256(key_text.encode()).hexdigest()[:24]}"
    folder = root / fingerprint[:20]
    return Entry(folder / f"{stem}.o", folder / f"{stem}.json", folder / f"{stem}.lock", key_text, fingerprint)


def _verified_bytes(entry: Entry) -> bytes | None:
    """The object's bytes if the record vouches for them, else None (missing, torn or foreign)."""
    try:
        record = json.loads(entry.record.read_text())
        data = entry.obj.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    expected = {"format": RECORD_FORMAT, "key": entry.key_text, "fingerprint": entry.fingerprint,
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if any(record.get(field) != value for field, value in expected.items()):
        return None
    return data


def load(entry: Entry) -> Any | None:
    """The compiled function of a verified entry, or None (then the caller compiles)."""
    if _verified_bytes(entry) is None:
        return None
    try:
        from ..dsl import cute

        return cute.runtime.load_module(str(entry.obj), enable_tvm_ffi=True)[EXPORT_NAME]
    except Exception:  # noqa: BLE001 - a verified file the loader refuses is still only a miss
        return None


def discard(entry: Entry) -> None:
    """Remove an entry's object and record (call with the entry's lock held)."""
    for path in (entry.record, entry.obj):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def exportable(compiled: Any) -> bool:
    """Whether ``compiled`` is a TVM-FFI compiled function (the only kind this cache reloads; the
    reloaded function is the positional-only TVM-FFI entry, which is how the launchers call it)."""
    try:
        from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase
    except ImportError:
        return False
    return isinstance(compiled, TVMFFIJitCompiledFunctionBase)


def store(entry: Entry, compiled: Any, compile_s: float) -> bool:
    """Write ``compiled`` as ``entry`` (call with the entry's lock held); False if it cannot be. ``compile_s``, the
    seconds its compile took, goes into the record (what a fresh run spent compiling: the records' sum)."""
    if not exportable(compiled):
        return False
    tmp = entry.obj.with_name(f"{entry.obj.name}.export.{os.getpid()}.{time.monotonic_ns()}.o")
    try:
        compiled.export_to_c(object_file_path=str(tmp), function_name=EXPORT_NAME)
        data = tmp.read_bytes()
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"cute_kda: could not save {entry.key_text} to the disk cache ({error}); it will "
                      "compile again in the next process", RuntimeWarning, stacklevel=3)
        return False
    finally:
        if tmp.exists():
            tmp.unlink()
    record = {"format": RECORD_FORMAT, "key": entry.key_text, "fingerprint": entry.fingerprint,
              "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "created": time.time(),
              "compile_s": round(compile_s, 2)}
    _write_atomically(entry.obj, data)
    _write_atomically(entry.record, json.dumps(record, indent=1).encode())
    return True


@contextmanager
def locked(entry: Entry, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold the entry's exclusive lock; yields False (not locked) if the folder is unusable or the
    lock is not had within ``timeout_s`` (default :data:`LOCK_TIMEOUT_S`) — then the caller compiles
    without touching the files."""
    timeout_s = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        entry.lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(entry.lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        warnings.warn(f"cute_kda: disk cache folder {entry.lock.parent} is not usable ({error}); compiling "
                      f"without it (set {CACHE_DIR_ENV} or {DISK_CACHE_ENV}=0)", RuntimeWarning, stacklevel=3)
        yield False
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    warnings.warn(f"cute_kda: timed out waiting for {entry.lock}; compiling without the disk "
                                  "cache", RuntimeWarning, stacklevel=3)
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
