"""Hot reload of the dispatcher's latency profile.

A profile given as a file path is watched: every ``interval_s`` the watcher compares the file's
(inode, mtime_ns, size) with the version it last read, and on SIGHUP it re-reads at once. A
changed file is read, parsed and validated in full in a worker thread (never on the request
path), then handed to ``apply``, which swaps the models in with one attribute assignment
(:attr:`kairos.extproc.dispatcher.Dispatcher.policies`): the next decision reads the new models, a
decision already running finishes on the ones it started with.

A file that does not parse or validate (a writer caught mid-write, invalid JSON, a schema error,
a non-finite coefficient) is logged with the reason, counted in
``kairos_dispatcher_profile_reloads_total{outcome="error"}``, and changes nothing: the models in
use stay. Each bad version is reported once; the next change of the file is read again, so a
writer that finishes its write heals the dispatcher by itself. Writers should still replace the
file atomically (write a temporary file, then rename it over the profile).

Packaged profiles (a name, not a path) are part of the installed code and never change: they
get no watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kairos.common.aio import cancel_and_wait
from kairos.common.errors import ProfileError
from kairos.core.latency import LatencyModels, parse_profile, profile_path, read_profile_text
from kairos.extproc.metrics import DispatcherMetrics

log = logging.getLogger(__name__)

DIGEST_CHARS = 16  # hex characters of the sha256 shown in the info metric and the logs


class FileSignature(NamedTuple):
    """What tells a changed file from the one last read, without reading it."""

    inode: int  # an atomic rename brings a new inode even when mtime and size match
    mtime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileSignature:
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True, slots=True)
class LoadedProfile:
    """A validated profile and where it came from."""

    models: LatencyModels
    digest: str  # sha256 of the file's bytes, first DIGEST_CHARS hex characters
    source: str  # the file path, or "packaged:<name>"

    @property
    def label(self) -> str:
        return f"{self.models.name} ({self.digest})"


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def parse_version(data: bytes, source: str) -> LoadedProfile:
    """Parse and validate one version of a profile file's bytes."""
    models = parse_profile(data, source)  # checks its numbers (kairos.core.latency.check_operating_range)
    return LoadedProfile(models, digest_of(data), source)


def read_file_version(path: Path) -> tuple[FileSignature, bytes]:
    """The file's bytes and the signature of the very file read (fstat of the open descriptor,
    so a rename racing the read cannot pair one file's bytes with another's signature)."""
    with path.open("rb") as f:
        signature = FileSignature.of(os.fstat(f.fileno()))
        return signature, f.read()


def load_initial(name_or_path: str) -> tuple[LoadedProfile, FileSignature | None]:
    """The profile the dispatcher starts with, and the signature of its file (None when it is
    a packaged profile). Raises :class:`ProfileError`: a bad profile at start-up is fatal."""
    path = profile_path(name_or_path)
    if path is None:
        text, source = read_profile_text(name_or_path)
        return parse_version(text.encode(), source), None
    if not path.is_file():
        raise ProfileError(f"profile file {path} does not exist")
    try:
        signature, data = read_file_version(path)
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {path}: {exc}") from exc
    return parse_version(data, str(path)), signature


class ProfileWatcher:
    """Watches one profile file and hands each new valid version to ``apply``.

    ``apply`` runs on the event loop, must be quick and must swap the models in one assignment;
    if it raises, the version counts as an error and the old models stay. ``interval_s`` = 0
    turns the periodic check off (SIGHUP, via :meth:`request_reload`, still reloads).
    """

    def __init__(
        self,
        path: Path,
        current: LoadedProfile,
        signature: FileSignature | None,
        apply: Callable[[LoadedProfile], None],
        metrics: DispatcherMetrics,
        interval_s: float = 1.0,
    ) -> None:
        if interval_s < 0 or not math.isfinite(interval_s):
            raise ValueError(f"interval_s must be a finite number >= 0, got {interval_s}")
        self.path = path
        self.current = current
        self.interval_s = interval_s
        self._apply = apply
        self._metrics = metrics
        self._signature = signature  # of the last version read, good or bad
        self._missing = False  # the file was gone at the last check (reported once)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kairos-profile-watch")
            log.info(
                "watching profile file %s for changes (%s; SIGHUP reloads at once); in use: %s",
                self.path,
                f"every {self.interval_s:g} s" if self.interval_s > 0 else "periodic check off",
                self.current.label,
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    def request_reload(self) -> None:
        """Re-read the file at once, changed or not (the SIGHUP handler)."""
        log.info("SIGHUP: re-reading profile file %s", self.path)
        self._wake.set()

    async def _run(self) -> None:
        timeout = self.interval_s if self.interval_s > 0 else None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            force = self._wake.is_set()
            self._wake.clear()
            try:
                await self.check(force=force)
            except Exception:  # a bug must not end the watching; the models in use stay
                log.exception("profile watch of %s failed unexpectedly; keeping %s", self.path, self.current.label)

    # -- one check -------------------------------------------------------------------------------
    async def check(self, force: bool = False) -> str:
        """Look at the file once. Returns what happened: ``unchanged`` (same signature, or same
        content), ``ok`` (a new version is in use), ``error`` (rejected, the old one stays)."""
        if not force:
            try:
                signature = FileSignature.of(await asyncio.to_thread(os.stat, self.path))
            except OSError as exc:
                return self._gone(exc)
            if signature == self._signature and not self._missing:
                return "unchanged"
        try:
            signature, data = await asyncio.to_thread(read_file_version, self.path)
        except OSError as exc:
            return self._gone(exc)
        if self._missing:
            self._missing = False
            log.info("profile file %s is back", self.path)
        self._signature = signature
        try:
            # Parsing a profile is cheap, but it is no business of the event loop's.
            loaded = await asyncio.to_thread(parse_version, data, str(self.path))
        except ProfileError as exc:
            return self._rejected(exc.message)
        if loaded.digest == self.current.digest:
            log.info(
                "profile file %s re-read: its content is the one in use, %s; nothing to swap", self.path, loaded.label
            )
            return "unchanged"
        try:
            self._apply(loaded)
        except Exception as exc:
            log.exception("profile file %s: swapping in %s failed", self.path, loaded.label)
            return self._rejected(f"{self.path}: the dispatcher could not use it ({type(exc).__name__}: {exc})")
        old, self.current = self.current, loaded
        self._metrics.profile_reloads.labels(outcome="ok").inc()
        self._metrics.set_profile(loaded.models.name, loaded.digest, loaded.source)
        note = (
            f"; it describes {loaded.models.model} on {loaded.models.hardware}, was {old.models.model} on "
            f"{old.models.hardware}"
            if (loaded.models.model, loaded.models.hardware) != (old.models.model, old.models.hardware)
            else ""
        )
        log.info("profile reloaded from %s: now %s, was %s%s", self.path, loaded.label, old.label, note)
        return "ok"

    def _rejected(self, reason: str) -> str:
        self._metrics.profile_reloads.labels(outcome="error").inc()
        log.error(
            "profile reload rejected: %s; still using %s (fix or rewrite the file; it is re-read when it changes)",
            reason,
            self.current.label,
        )
        return "error"

    def _gone(self, exc: OSError) -> str:
        if self._missing:
            return "unchanged"
        self._missing = True
        return self._rejected(f"cannot read {self.path}: {exc.strerror or exc}")
