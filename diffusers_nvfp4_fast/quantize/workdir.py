"""The hidden directories a quantize run writes beside OUT (``.OUT.<random>.quantizing``, and ``.OUT.<random>.replaced``
while ``overwrite`` swaps an old OUT out), who owns them, and their removal (docs/checkpoints.md, "The quantize
command"): on failure, Ctrl-C, SIGTERM and SIGHUP by the run itself; after SIGKILL or a power loss by the next run for
the same OUT, which finds each one's recorded process gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OWNER_FILE = ".quantize-owner.json"  # removed before the directory becomes OUT
SUFFIXES = (".quantizing", ".replaced")
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

logger = logging.getLogger("diffusers_nvfp4_fast")


class Terminated(SystemExit):
    """SIGTERM / SIGHUP arrived during a quantize run. Raised from the signal handler so that the run's cleanup runs;
    uncaught, the process exits with the conventional status 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def _raise_terminated(signum: int, _frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP raise ``Terminated`` instead of ending the process on the spot. Only signals still at
    their default action are taken over (a handler of the application, or ``nohup``'s ignore, is kept), and only in
    the main thread (Python runs signal handlers there only)."""
    taken: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in TERMINATING:
            if signal.getsignal(signum) is signal.SIG_DFL:
                taken[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, before in taken.items():
            signal.signal(signum, before)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Inside: SIGINT, SIGTERM and SIGHUP wait until the block ends (POSIX), so that the renames which swap OUT are
    never cut in half."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *TERMINATING})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def new_work_dir(out_dir: Path, suffix: str = ".quantizing") -> Path:
    """An empty hidden directory beside ``out_dir`` (same filesystem, so the final rename is atomic), holding a record
    of this process (pid, host) and of ``out_dir``."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=suffix, dir=out_dir.parent))
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "out": str(out_dir.resolve()), "started": time.time()}
    (work / OWNER_FILE).write_text(json.dumps(owner) + "\n")
    return work


@contextlib.contextmanager
def work_dir_for(out_dir: Path) -> Iterator[Path]:
    """``new_work_dir(out_dir)`` inside; removed after (whatever ended the block, a second signal included)."""
    work = new_work_dir(out_dir)
    try:
        yield work
    finally:
        with signals_deferred():
            shutil.rmtree(work, ignore_errors=True)


def swap_into_place(work_dir: Path, out_dir: Path) -> None:
    """Rename ``work_dir`` to ``out_dir``. An existing ``out_dir`` is moved into a ``.replaced`` directory first, put
    back if the rename fails, and deleted after it succeeds; signals wait until the renames are done."""
    old = new_work_dir(out_dir, ".replaced") if out_dir.exists() else None
    replaced = False
    try:
        with signals_deferred():
            if old is not None:
                os.replace(out_dir, old / out_dir.name)
            try:
                os.replace(work_dir, out_dir)
            except OSError:
                if old is not None:
                    os.replace(old / out_dir.name, out_dir)
                raise
            replaced = True
    finally:
        if old is not None and (replaced or not (old / out_dir.name).exists()):
            shutil.rmtree(old, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (Linux reads it without changing it; elsewhere it is set and put back at once)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def seal(work_dir: Path) -> None:
    """Make ``work_dir`` ready to become OUT: drop the owner record, and give it and its contents the modes that
    ``os.makedirs`` and ``open`` give under the current umask (``tempfile.mkdtemp`` makes it owner-only)."""
    (work_dir / OWNER_FILE).unlink(missing_ok=True)
    umask = current_umask()
    for root, dirs, files in os.walk(work_dir):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)
    os.chmod(work_dir, 0o777 & ~umask)


def _megabytes(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 1e6


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (POSIX; elsewhere every process counts as running)."""
    if os.name != "posix" or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs, as another user
        pass
    return False


def _owner(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def _work_dirs_of(out_dir: Path) -> Iterator[Path]:
    if not out_dir.parent.is_dir():
        return
    prefix = f".{out_dir.name}."
    for path in out_dir.parent.iterdir():
        if path.name.startswith(prefix) and path.name.endswith(SUFFIXES) and path.is_dir() and not path.is_symlink():
            yield path


def remove_stale_work_dirs(out_dir: Path) -> list[Path]:
    """Remove the work directories of ``out_dir`` whose recorded process no longer runs on this host (a run killed
    by SIGKILL or a power loss); log one line for each, and one for each left alone because its owner cannot be
    told (no record, another host) or because it holds the only copy of a previous OUT. Returns the removed paths."""
    removed = []
    for path in _work_dirs_of(out_dir):
        owner = _owner(path)
        if owner is not None and owner.get("out") != str(out_dir.resolve()):
            continue  # a work directory of another OUT whose name starts the same way
        why_kept = _why_kept(path, owner, out_dir)
        if why_kept is not None:
            logger.warning("diffusers-nvfp4-fast quantize: left %s (%.1f MB) alone: %s", path, _megabytes(path),
                           why_kept)
        elif owner is not None and _process_gone(owner["pid"]):
            size = _megabytes(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.warning("diffusers-nvfp4-fast quantize: removed stale work directory %s (%.1f MB) of process %s, "
                           "which no longer runs", path, size, owner["pid"])
    return removed


def _why_kept(path: Path, owner: dict[str, Any] | None, out_dir: Path) -> str | None:
    """Why ``path`` must not be removed although its process may be gone, or None."""
    if owner is None:
        return (f"it has no owner record ({OWNER_FILE}), so it may belong to a run still writing {out_dir}; delete "
                "it if none is")
    if owner.get("host") != socket.gethostname():
        return (f"it belongs to process {owner['pid']} on host {owner.get('host')}, which this host cannot check; "
                "delete it if that run has ended")
    if (path / out_dir.name).exists() and not out_dir.exists():
        return f"it holds the previous {out_dir.name}, which a failed run moved aside; move it back to {out_dir}"
    return None
