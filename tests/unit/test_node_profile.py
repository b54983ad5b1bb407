"""The profile ``kairos up --backend vllm`` routes with: when one is fitted to the nodes, what the
cache is keyed by, when a cached fit is reused, and what the start-up line says."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kairos.common import defaults
from kairos.common.contracts import Role
from kairos.common.errors import ProfileError
from kairos.core.latency import LatencyModels, load_profile
from kairos.launcher import node_profile as np_
from kairos.launcher.vllm_node import VllmNodeSpec
from tests.builders import make_models

HOST = {"machine": "x86_64", "cpu": "Example CPU @ 2.0GHz", "cpus": 2, "vllm": "0.32.0", "torch": "2.13.0+cpu"}
MODEL = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128}
ENGINE = {"device": "cpu", "load_format": "dummy", "dtype": "float32", "omp_threads": "1"}


def facts(**changes: Any) -> dict[str, Any]:
    parts = {"model": MODEL, "engine": ENGINE, "host": HOST}
    for part, change in changes.items():
        parts[part] = {**parts[part], **change}
    return np_.key_facts(parts["model"], parts["engine"], parts["host"])


def fitted(the_facts: dict[str, Any], mape: float = 0.2) -> LatencyModels:
    """A profile as a fit on start leaves it: measured MAPEs and the facts it was keyed by."""
    models = make_models()
    return dataclasses.replace(
        models,
        name="tiny-cpu-fit",
        provenance={"kind": "measured", np_.CACHE_KEY: json.loads(json.dumps(the_facts))},
        decode=dataclasses.replace(models.decode, mape=mape),
        prefill=dataclasses.replace(models.prefill, mape=mape / 2),
        mixed=dataclasses.replace(models.mixed, mape=mape * 2),
    )


@pytest.mark.parametrize(
    ("flag", "configured", "fit"),
    [
        (None, defaults.PROFILE, True),  # nobody chose: the packaged A100 profile never fits CPU vLLM nodes
        (defaults.PROFILE, defaults.PROFILE, False),  # --profile forces even the packaged one
        ("mine.json", defaults.PROFILE, False),
        (None, "mine.json", False),  # the config file or the environment chose one
    ],
)
def test_vllm_nodes_get_a_fitted_profile_unless_one_was_chosen(flag: str | None, configured: str, fit: bool) -> None:
    assert np_.wants_fitted_profile(flag, configured) is fit


def test_the_cache_is_the_workdir_given_else_the_users_cache() -> None:
    assert np_.profile_cache_dir(Path("/w"), {"HOME": "/home/u"}) == Path("/w/profiles")
    assert np_.profile_cache_dir(None, {"HOME": "/home/u"}) == Path("/home/u/.cache/kairos/profiles")
    assert np_.profile_cache_dir(None, {"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == Path("/c/kairos/profiles")


def test_the_key_changes_with_every_fact_step_times_depend_on_and_with_nothing_else() -> None:
    key = np_.profile_key(facts())
    assert np_.profile_key(facts()) == key and len(key) == 16
    reordered = {k: facts()[k] for k in reversed(list(facts()))}
    assert np_.profile_key(reordered) == key
    others = [
        facts(model={"hidden_size": 256}),
        facts(engine={"omp_threads": "2"}),
        facts(engine={"dtype": "bfloat16"}),
        facts(host={"cpu": "Other CPU"}),
        facts(host={"cpus": 16}),
        facts(host={"vllm": "0.33.0"}),
    ]
    assert len({key, *(np_.profile_key(f) for f in others)}) == 1 + len(others)


def test_the_key_covers_the_collection_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    key = np_.profile_key(facts())
    monkeypatch.setattr(np_, "PLAN_VERSION", np_.PLAN_VERSION + 1)
    assert np_.profile_key(facts()) != key
    monkeypatch.undo()
    longer = dataclasses.replace(np_.PLANS[Role.DECODE], duration_s=60.0)
    monkeypatch.setitem(np_.PLANS, Role.DECODE, longer)
    assert np_.profile_key(facts()) != key


def test_every_plan_measures_each_model_on_two_runs_at_least() -> None:
    from kairos.profiling.plan import plan_phases

    prefill, decode = (plan_phases(np_.PLANS[role]) for role in (Role.PREFILL, Role.DECODE))
    assert len(prefill) >= 2  # prefill_step: held out by run
    assert sum(p.kind == "trace" for p in decode) >= 2 and sum(p.kind == "micro" for p in decode) >= 2


def test_engine_facts_are_the_nodes_own_settings() -> None:
    spec = VllmNodeSpec("d0", Role.DECODE, "/py", Path("/m"), "tiny", 1, 2, 3)
    assert np_.engine_facts(spec) == ENGINE  # the CPU recipe: float32, one OpenMP thread
    gpu = dataclasses.replace(spec, device="gpu", load_format="auto")
    assert np_.engine_facts(gpu) == {"device": "gpu", "load_format": "auto", "dtype": "auto", "omp_threads": "default"}


def test_descriptions_name_the_model_and_the_host() -> None:
    assert np_.describe_model("tiny", facts()) == "tiny (LlamaForCausalLM, 2 layers, hidden 128, float32)"
    assert np_.describe_host(ENGINE, HOST) == (
        "vllm 0.32.0 (torch 2.13.0+cpu) on cpu: 2 x Example CPU @ 2.0GHz (x86_64), 1 OpenMP thread(s) per engine"
    )


def startup(tmp_path: Path, the_facts: dict[str, Any] | None = None) -> np_.StartUpProfile:
    return np_.StartUpProfile(tmp_path / "cache", the_facts or facts(), tmp_path / "work" / "profile.json", "tiny")


def never(*_: Any) -> LatencyModels:
    raise AssertionError("fitted although a cached fit was there")


def test_a_first_start_fits_and_caches_and_the_next_reuses_the_fit(tmp_path: Path) -> None:
    first = startup(tmp_path)
    assert first.name == f"tiny-cpu-{np_.profile_key(facts())[:8]}"
    assert first.prepare() is None
    assert load_profile(first.live).name == defaults.PROFILE  # the nodes start on it until the fit lands
    choice = first.finish(None, lambda: fitted(facts()))
    assert (choice.origin, choice.cache_file, choice.path) == (np_.FITTED, first.cache_file, first.live)
    assert choice.fit_s is not None and load_profile(first.live).name == "tiny-cpu-fit"
    assert first.cache_file == tmp_path / "cache" / f"{np_.profile_key(facts())}.json"

    again = startup(tmp_path)
    again.live.unlink()
    found = again.prepare()
    assert found is not None and load_profile(again.live) == found  # live before the engines start
    choice = again.finish(found, never)
    assert (choice.origin, choice.fit_s, choice.models.name) == (np_.CACHED, None, "tiny-cpu-fit")


def test_a_cached_fit_of_other_facts_or_a_broken_file_is_not_reused(tmp_path: Path) -> None:
    from kairos.profiling.fit import write_profile

    mine = startup(tmp_path)
    other = fitted(facts(host={"cpus": 16}))
    write_profile(other, mine.cache_file)  # a digest collision, or a file copied by hand
    assert np_.cached(mine.cache_file, mine.facts) is None and mine.prepare() is None
    mine.cache_file.write_text("{not json")
    assert np_.cached(mine.cache_file, mine.facts) is None
    write_profile(fitted(facts()), mine.cache_file)
    assert np_.cached(mine.cache_file, mine.facts) is not None


def test_a_failed_fit_routes_with_the_packaged_default_says_why_and_caches_nothing(tmp_path: Path) -> None:
    first = startup(tmp_path)
    first.prepare()

    def fails() -> LatencyModels:
        raise ProfileError("collect: all 12 requests failed")

    choice = first.finish(None, fails)
    assert choice.cache_file is None and not first.cache_file.exists()
    assert choice.models.name == load_profile(first.live).name == defaults.PROFILE
    assert choice.describe() == (
        f"profile {defaults.PROFILE} (the packaged default: the fit on start failed: collect: all 12 requests "
        "failed): held-out MAPE decode_step -, prefill_step -, mixed_increment -"
    )


def test_the_start_up_line_says_the_profile_its_origin_and_its_held_out_mape(tmp_path: Path) -> None:
    choice = np_.ProfileChoice(fitted(facts()), tmp_path / "p.json", np_.FITTED, Path("/c/k.json"), 27.6)
    assert choice.describe() == (
        "profile tiny-cpu-fit (fitted to these nodes on start in 28 s; /c/k.json): held-out MAPE decode_step 20.0%, "
        "prefill_step 10.0%, mixed_increment 40.0%"
    )
    copied = dataclasses.replace(
        choice.models,
        provenance={"copied_from_base": {"profile": defaults.PROFILE, "models": ["prefill_step", "kv_transfer"]}},
    )
    assert np_.mape_summary(copied) == (
        f"decode_step 20.0%, prefill_step copied from {defaults.PROFILE}, mixed_increment 40.0%"
    )


@pytest.mark.parametrize(
    ("flag", "backend", "remote", "line"),
    [
        (None, "emulated", False, "profile P (the packaged default; the emulated nodes run this same profile)"),
        ("P", "vllm", False, "profile P (given by --profile; not fitted to these nodes)"),
        (
            None,
            "emulated",
            True,
            "profile P (the packaged default; the nodes run elsewhere: `kairos profile collect` + `fit` on them, "
            "then --profile FILE)",
        ),
    ],
)
def test_the_start_up_line_of_a_profile_not_fitted_says_who_chose_it(
    flag: str | None, backend: str, remote: bool, line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults, "PROFILE", "P")
    assert np_.describe_given("P", flag, backend, remote) == line
    assert np_.describe_given("other.json", None, "vllm", False).startswith(
        "profile other.json (set in the config or environment;"
    )
