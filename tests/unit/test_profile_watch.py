"""Hot reload of the latency profile: ProfileWatcher on a real file, driven by ``check()`` by hand
(exact outcomes) or by its own task (interval, SIGHUP); the swap through DispatcherConfig's
policies; the config knobs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kairos.common import contracts as c
from kairos.common.config import flag_values, load_config
from kairos.common.errors import ConfigError, ProfileError
from kairos.core.latency import DEFAULT_PROFILE, load_profile, profile_path
from kairos.extproc.config import DispatcherConfig
from kairos.extproc.main import _on_sighup, build_parser
from kairos.extproc.metrics import DispatcherMetrics
from kairos.extproc.profile_watch import LoadedProfile, ProfileWatcher, digest_of, load_initial
from tests.waiting import eventually

RELOADS = "kairos_dispatcher_profile_reloads_total"
INFO = "kairos_dispatcher_profile_info"


def profile_doc(name: str, decode_intercept: float | None = None) -> dict[str, Any]:
    """The packaged profile renamed ``name``, optionally with another decode-step intercept."""
    doc = load_profile().to_dict()
    doc["name"] = name
    if decode_intercept is not None:
        doc["models"][c.DECODE_STEP]["intercept"] = decode_intercept
    return doc


def dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=1).encode()


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Rig:
    def __init__(self, tmp_path: Path, interval_s: float = 0.0) -> None:
        self.path = tmp_path / "profile.json"
        self.path.write_bytes(dump(profile_doc("v1")))
        self.metrics = DispatcherMetrics(CollectorRegistry())
        profile, signature = load_initial(str(self.path))
        self.metrics.set_profile(profile.models.name, profile.digest, profile.source)
        self.applied: list[LoadedProfile] = []
        self.fail_apply = False
        self.watcher = ProfileWatcher(self.path, profile, signature, self.apply, self.metrics, interval_s)

    def apply(self, loaded: LoadedProfile) -> None:
        if self.fail_apply:
            raise RuntimeError("policy construction failed")
        self.applied.append(loaded)

    def reloads(self, outcome: str) -> float:
        return self.metrics.registry.get_sample_value(RELOADS, {"outcome": outcome}) or 0.0

    def info(self) -> list[dict[str, str]]:
        return [
            s.labels for m in self.metrics.registry.collect() if m.name == INFO for s in m.samples if s.value == 1.0
        ]

    @property
    def names(self) -> list[str]:
        return [p.models.name for p in self.applied]


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


# ---------------------------------------------------------------------------------------------
# The swap
# ---------------------------------------------------------------------------------------------
async def test_a_changed_file_is_swapped_in_and_shown_in_the_metrics(rig: Rig) -> None:
    assert await rig.watcher.check() == "unchanged"
    assert rig.applied == []
    data = dump(profile_doc("v2", decode_intercept=0.05))
    write_atomically(rig.path, data)
    assert await rig.watcher.check() == "ok"
    assert rig.names == ["v2"]
    assert rig.applied[0].models.decode.intercept == 0.05
    assert rig.watcher.current is rig.applied[0]
    assert (rig.reloads("ok"), rig.reloads("error")) == (1, 0)
    assert rig.info() == [{"name": "v2", "hash": digest_of(data), "source": str(rig.path)}]
    assert await rig.watcher.check() == "unchanged"  # read once per version
    assert rig.reloads("ok") == 1


async def test_a_rewrite_with_the_same_content_swaps_nothing(rig: Rig) -> None:
    write_atomically(rig.path, rig.path.read_bytes())  # new inode, same bytes
    assert await rig.watcher.check() == "unchanged"
    assert rig.applied == [] and (rig.reloads("ok"), rig.reloads("error")) == (0, 0)


async def test_a_same_size_same_mtime_rename_is_still_seen(rig: Rig) -> None:
    """The inode is part of the signature: a renamed-in file with the old mtime and size is read."""
    old = rig.path.stat()
    data = rig.path.read_bytes().replace(b'"v1"', b'"v9"')
    tmp = rig.path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(tmp, rig.path)
    assert (rig.path.stat().st_size, rig.path.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert await rig.watcher.check() == "ok"
    assert rig.names == ["v9"]


# ---------------------------------------------------------------------------------------------
# Bad files keep the old models
# ---------------------------------------------------------------------------------------------
def _schema_error(doc: dict[str, Any]) -> bytes:
    doc["models"][c.DECODE_STEP]["features"] = ["kv_tokens", "decode_tokens"]
    return dump(doc)


def _nan(doc: dict[str, Any]) -> bytes:
    doc["models"][c.MIXED_INCREMENT]["coefficients"][0] = float("nan")
    return json.dumps(doc).encode()  # json writes NaN, and json.loads reads it back


def _missing_key(doc: dict[str, Any]) -> bytes:
    del doc["models"][c.KV_TRANSFER]
    return dump(doc)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda doc: dump(doc)[: len(dump(doc)) // 2], "not valid JSON"),  # a writer caught mid-write
        (lambda doc: b"", "not valid JSON"),  # truncated, nothing written yet
        (lambda doc: b"{not json", "not valid JSON"),
        (lambda doc: b"[1, 2]", "a profile is a JSON object"),
        (lambda doc: b"\xff\xfe{}", "not valid JSON"),
        (lambda doc: dump({**doc, "schema_version": 99}), "schema_version 99"),
        (_schema_error, "features"),
        (_missing_key, "malformed profile"),
        (_nan, "non-finite numbers in ['mixed_increment.prefill_tokens']"),
    ],
    ids=["partial", "empty", "invalid-json", "not-object", "not-utf8", "version", "features", "missing", "nan"],
)
async def test_a_bad_file_is_logged_counted_once_and_the_old_models_stay(
    rig: Rig, caplog: pytest.LogCaptureFixture, make: Any, reason: str
) -> None:
    before = rig.info()
    rig.path.write_bytes(make(profile_doc("bad")))  # in place, not atomic
    with caplog.at_level(logging.ERROR, logger="kairos.extproc.profile_watch"):
        assert await rig.watcher.check() == "error"
        assert await rig.watcher.check() == "unchanged"  # the same bad version: not re-counted
    assert rig.applied == [] and rig.watcher.current.models.name == "v1"
    assert (rig.reloads("ok"), rig.reloads("error")) == (0, 1)
    assert rig.info() == before
    [record] = caplog.records
    text = record.getMessage()
    assert text.startswith(f"profile reload rejected: {rig.path}") and reason in text, text
    assert "still using v1 (" in text
    # The writer finishes: the next change is read and swapped in.
    rig.path.write_bytes(dump(profile_doc("fixed")))
    assert await rig.watcher.check() == "ok"
    assert rig.names == ["fixed"] and (rig.reloads("ok"), rig.reloads("error")) == (1, 1)


async def test_a_missing_file_keeps_the_old_models_until_it_returns(rig: Rig) -> None:
    data = rig.path.read_bytes()
    rig.path.unlink()
    assert await rig.watcher.check() == "error"
    assert await rig.watcher.check() == "unchanged"  # reported once while it stays gone
    assert rig.reloads("error") == 1
    rig.path.write_bytes(data)  # back with the content in use
    assert await rig.watcher.check() == "unchanged"
    rig.path.write_bytes(dump(profile_doc("v2")))
    assert await rig.watcher.check() == "ok"
    assert rig.names == ["v2"] and rig.reloads("error") == 1


async def test_a_version_the_dispatcher_cannot_use_is_an_error(rig: Rig) -> None:
    rig.fail_apply = True
    write_atomically(rig.path, dump(profile_doc("v2")))
    assert await rig.watcher.check() == "error"
    assert rig.watcher.current.models.name == "v1" and rig.info()[0]["name"] == "v1"
    assert (rig.reloads("ok"), rig.reloads("error")) == (0, 1)


# ---------------------------------------------------------------------------------------------
# The watcher's task: interval, disabled, SIGHUP
# ---------------------------------------------------------------------------------------------
def count_checks(rig: Rig) -> list[bool]:
    """Record each check() the watcher's own task makes (its ``force`` flag), in a list."""
    calls: list[bool] = []
    check = rig.watcher.check

    async def counted(force: bool = False) -> str:
        calls.append(force)
        return await check(force=force)

    rig.watcher.check = counted  # type: ignore[method-assign]
    return calls


async def periodic_checks_pass(tmp_path: Path, checks: int = 10) -> None:
    """A positive signal that a watcher had its chance to check: a second watcher on its own file,
    every 10 ms, has made ``checks`` checks (>= 0.1 s of loop time, however slow the machine)."""
    (tmp_path / "control").mkdir(exist_ok=True)
    control = Rig(tmp_path / "control", interval_s=0.01)
    made = count_checks(control)
    await control.watcher.start()
    try:
        await eventually(lambda: len(made) >= checks, what=f"{checks} checks of a 10 ms watcher")
    finally:
        await control.watcher.stop()


async def test_the_periodic_check_picks_a_change_up(tmp_path: Path) -> None:
    rig = Rig(tmp_path, interval_s=0.02)
    await rig.watcher.start()
    try:
        write_atomically(rig.path, dump(profile_doc("v2")))
        await eventually(lambda: rig.names == ["v2"])
    finally:
        await rig.watcher.stop()


async def test_interval_zero_disables_the_periodic_check_but_not_sighup(tmp_path: Path) -> None:
    rig = Rig(tmp_path, interval_s=0.0)
    await rig.watcher.start()
    try:
        checks = count_checks(rig)
        write_atomically(rig.path, dump(profile_doc("v2")))
        await periodic_checks_pass(tmp_path)
        assert checks == [] and rig.applied == [] and rig.reloads("ok") == 0
        rig.watcher.request_reload()
        await eventually(lambda: rig.names == ["v2"])
        assert checks == [True]  # the one SIGHUP-style check, forced
    finally:
        await rig.watcher.stop()


async def test_sighup_reloads_at_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path, interval_s=3600.0)  # the periodic check would never come in time
    await rig.watcher.start()
    assert _on_sighup(rig.watcher, rig.watcher.current)
    try:
        write_atomically(rig.path, dump(profile_doc("v2")))
        os.kill(os.getpid(), signal.SIGHUP)
        await eventually(lambda: rig.names == ["v2"])
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await rig.watcher.stop()


async def test_stop_ends_the_task(tmp_path: Path) -> None:
    rig = Rig(tmp_path, interval_s=0.01)
    checks = count_checks(rig)
    await rig.watcher.start()
    await eventually(lambda: checks, what="a first periodic check")
    await rig.watcher.stop()
    made = len(checks)
    write_atomically(rig.path, dump(profile_doc("v2")))
    await periodic_checks_pass(tmp_path)  # ten periods of the stopped watcher's 10 ms
    assert len(checks) == made and rig.applied == []


# ---------------------------------------------------------------------------------------------
# Start-up, packaged profiles, config
# ---------------------------------------------------------------------------------------------
def test_packaged_profiles_have_no_file_to_watch() -> None:
    assert profile_path(DEFAULT_PROFILE) is None
    profile, signature = load_initial(DEFAULT_PROFILE)
    assert signature is None
    assert profile.source == f"packaged:{DEFAULT_PROFILE}" and profile.models == load_profile()
    assert len(profile.digest) == 16


def test_a_bad_profile_at_start_up_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    with pytest.raises(ProfileError, match="does not exist"):
        load_initial(str(path))
    doc = profile_doc("x")
    doc["models"][c.DECODE_STEP]["intercept"] = float("inf")
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"non-finite numbers in \['decode_step.intercept'\]"):
        load_initial(str(path))


def test_the_swap_rebuilds_both_policies_on_the_new_models(tmp_path: Path) -> None:
    config = load_config(DispatcherConfig, overrides={"model_dir": "unused", "policy": "kairos", "alpha": 1.5})
    models = load_initial(DEFAULT_PROFILE)[0].models
    policies = config.policies(models)
    assert policies.policy.models is models and policies.keep_policy.models is models  # type: ignore[attr-defined]
    assert policies.policy.label.startswith("kairos(alpha=1.5") and policies.keep_policy.label == "pd"


def test_reload_settings_come_from_flags_and_are_checked() -> None:
    args = build_parser().parse_args(["--model-dir", "m", "--profile-reload-s", "0.25", "--ttft-feedback-window", "50"])
    config = load_config(DispatcherConfig, overrides=flag_values(args, DispatcherConfig), environ={})
    assert (config.profile_reload_s, config.ttft_feedback_window) == (0.25, 50)
    default = DispatcherConfig(model_dir="m")
    assert (default.profile_reload_s, default.ttft_feedback_window) == (1.0, 200)
    with pytest.raises(ConfigError, match="profile_reload_s"):
        DispatcherConfig(model_dir="m", profile_reload_s=-1)
    with pytest.raises(ConfigError, match="ttft_feedback_window"):
        DispatcherConfig(model_dir="m", ttft_feedback_window=-1)


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        ("llmd:threshold=2048", "llmd(threshold=2048)"),
        ("dynamo:mode=either", "dynamo(mode=either,isl=2048,ratio=0.7,busy=4,kv=0.5)"),
        ("aibrix", "aibrix(high=1,low=0.25)"),
    ],
)
def test_the_dispatcher_builds_the_fields_deciders(spec: str, label: str) -> None:
    policies = DispatcherConfig(model_dir="unused", policy=spec).policies(load_initial(DEFAULT_PROFILE)[0].models)
    assert policies.policy.label == label and policies.keep_policy.label == "pd"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("oracle", "true state"),
        ("aibrix:theta=1", "bad parameter 'theta=1'"),
        ("kairos:alpha=1.5,prefix=off,gate=off", "set alpha= as alpha, gate= as deflect_gate_share"),
    ],
)
def test_the_dispatcher_refuses_a_policy_it_cannot_run_at_startup(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        DispatcherConfig(model_dir="m", policy=spec)
