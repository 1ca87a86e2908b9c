"""``EngineConfig``: every engine setting once, reachable and checked the same way by every path.

The keyword (``LLMEngine(model, **settings)``), the CLI flag (``python -m mie serve``; ``generate``
has the same flags, and takes ``--seed`` as its request's sampling seed too, whose range is
``SamplingParams``') and the Ray replicas' settings (``serve --replicas``, built in the driver)
must accept and refuse the same values with the same message (a value outside a named choice's
list is refused by the flag's parser, which lists the same choices); the CLI's flags, their help and
docs/engine.md's table are generated from, or checked against, the dataclass's fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import typing
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import backend_named, require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import EngineConfig, LLMEngine, Model, cli
from mie.engine import config as config_module
from mie.kernels import select_kernels

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
HINTS = typing.get_type_hints(EngineConfig)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- one check, three paths -----------------------------------------------------------------------
class Reached(RuntimeError):
    """Raised where the engine would load its model, or the driver start Ray: the settings
    were accepted. Carries the ``EngineConfig`` that got there."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__("settings accepted")
        self.config = config


def by_keyword(name: str, value: object) -> tuple:
    """``LLMEngine(STORIES, name=value)``: ("accepted", config) or ("refused", message)."""
    with mock.patch.object(LLMEngine, "_load", lambda engine, *_: stop(engine.config)):
        try:
            LLMEngine(STORIES, **{name: value})
        except Reached as reached:
            return "accepted", reached.config
        except ValueError as exc:
            return "refused", str(exc)
    raise AssertionError("neither accepted nor refused")


def by_cli(argv: list[str]) -> tuple:
    """``python -m mie`` with ``argv``, in process, stopped where it would load the model (or
    start Ray): ("accepted", config) or ("refused", its one error line's message)."""
    from mie.serve import cluster

    reached: list[EngineConfig] = []

    def keep(config: EngineConfig) -> None:
        reached.append(config)
        stop(config)

    err = io.StringIO()
    with (
        mock.patch.object(LLMEngine, "_load", lambda engine, *_: keep(engine.config)),
        mock.patch.object(cluster.Cluster, "start", lambda cluster: keep(cluster.settings.engine)),
        contextlib.redirect_stderr(err),
    ):
        try:
            status = cli.main(argv)
        except SystemExit as exit:  # argparse: the text is not of the flag's type or choices
            assert exit.code == 2, err.getvalue()
            return "not parsed", err.getvalue().splitlines()[-1]
    assert status == 1, err.getvalue()
    if reached:
        return "accepted", reached[0]
    return "refused", err.getvalue().removeprefix("mie: error: ").rstrip("\n")


def stop(config: EngineConfig) -> None:
    raise Reached(config)


def cli_flags(name: str, value: object) -> list[str] | None:
    """How ``name=value`` is spelled on the command line; None when it cannot be: a float, an
    int for a named choice or a text for an integer (argparse parses a flag's text into its
    type), None for a setting whose default is a value."""
    kinds = typing.get_args(HINTS[name]) or (HINTS[name],)
    if value is None:
        return [] if FIELDS[name].default is None else None
    if bool in kinds:
        return [flag(name) if value else "--no-" + flag(name)[2:]] if type(value) is bool else None
    if type(value) in kinds:
        return [f"{flag(name)}={value}"]
    return None


def values(name: str) -> st.SearchStrategy:
    """Values, good and bad, for the setting ``name``: of its own kind, near its edges, and
    of the wrong kind."""
    choices = FIELDS[name].metadata["choices"] or ()
    return st.one_of(
        st.integers(min_value=-3, max_value=40),
        st.integers(min_value=2**60, max_value=2**70),
        st.sampled_from([*choices, None, True, False, "auto", "", "7", "int4", 1.5]),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", max_size=8),
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_keyword_the_flag_and_the_ray_settings_accept_and_refuse_alike(data):
    require_module("ray")
    name = data.draw(st.sampled_from(sorted(FIELDS)), label="setting")
    value = data.draw(values(name), label="value")
    keyword = by_keyword(name, value)
    try:  # the one place: the engine's refusal is EngineConfig's own
        expected = ("accepted", EngineConfig(**{name: value}))
    except ValueError as exc:
        expected = ("refused", str(exc))
    assert keyword == expected
    flags = cli_flags(name, value)
    if flags is None:
        return
    serve = ["serve", "--model", str(STORIES), "--port", "0"]
    for argv in ([*serve, *flags], [*serve, "--replicas", "2", *flags]):
        got = by_cli(argv)
        if got[0] == "not parsed":  # a value outside a named choice's list: argparse's usage
            assert expected[0] == "refused"  # error, naming the list EngineConfig's field holds
            assert f"invalid choice: {value!r} (choose from" in got[1], got
            assert all(repr(choice) in got[1] for choice in FIELDS[name].metadata["choices"])
        else:
            assert got == expected


def test_a_numpy_integer_is_stored_as_the_python_int():
    config = EngineConfig(block_size=np.int64(8), num_blocks=np.uint16(3), seed=np.int8(5))
    assert (config.block_size, config.num_blocks, config.seed) == (8, 3, 5)
    assert all(type(v) is int for v in (config.block_size, config.num_blocks, config.seed))


def test_an_unknown_keyword_names_itself_and_the_closest_settings():
    with pytest.raises(TypeError, match=r"no setting 'max_num_seq' \(did you mean max_num_seqs"):
        LLMEngine(STORIES, max_num_seq=4)
    with pytest.raises(TypeError, match="no setting 'gpu_memory_utilization'"):
        LLMEngine(STORIES, gpu_memory_utilization=0.9)
    with pytest.raises(TypeError, match="given twice, as prefix_caching and enable_prefix"):
        EngineConfig.from_settings(prefix_caching=True, enable_prefix_caching=False)


def test_prefix_caching_keeps_its_older_spelling():
    assert EngineConfig.from_settings(prefix_caching=False).enable_prefix_caching is False
    engine = LLMEngine(STORIES, num_blocks=8, prefix_caching=False)
    assert engine.scheduler.prefix_cache is None


def test_a_config_or_keywords_not_both():
    engine = LLMEngine(STORIES, config=EngineConfig(num_blocks=8, max_num_seqs=2))
    assert (engine.pool.num_blocks, engine.max_num_seqs) == (8, 2)
    with pytest.raises(TypeError, match="not both"):
        LLMEngine(STORIES, config=EngineConfig(), num_blocks=8)


# -- the CLI's flags are the fields ---------------------------------------------------------------
def subcommand_help(command: str) -> str:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    return " ".join(commands.choices[command].format_help().split())


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_setting_has_a_flag_with_its_help(command):
    help_text = subcommand_help(command)
    for name, field in FIELDS.items():
        assert field.metadata["help"], name
        assert flag(name) in help_text, name
        assert " ".join(field.metadata["help"].split()) in help_text, name
        if isinstance(field.default, bool):
            assert "--no-" + flag(name)[2:] in help_text, name


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_new_setting_gets_its_flag_without_touching_the_cli(command, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class WithANewSetting(EngineConfig):
        new_knob: int = config_module.setting(3, config_module._positive, "a knob added later")

    monkeypatch.setattr(config_module, "EngineConfig", WithANewSetting)
    assert "--new-knob NEW_KNOB a knob added later (default: 3)" in subcommand_help(command)


def test_no_enable_prefix_caching_turns_the_prefix_cache_off():
    base = ["generate", "--model", str(STORIES), "--prompt", "x", "--num-blocks", "8"]
    parser = cli.build_parser()
    assert cli.make_engine(parser.parse_args(base)).scheduler.prefix_cache is not None
    off = cli.make_engine(parser.parse_args([*base, "--no-enable-prefix-caching"]))
    assert off.scheduler.prefix_cache is None


# -- docs/engine.md's table -----------------------------------------------------------------------
def test_the_docs_table_lists_exactly_the_settings_with_their_defaults():
    text = (ROOT / "docs" / "engine.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| `([^`]+)` \| (.+) \|$", text, flags=re.M)
    expected = [
        (
            name,
            ("--[no-]" + name.replace("_", "-")) if isinstance(f.default, bool) else flag(name),
            repr(f.default),
            f.metadata["help"],
        )
        for name, f in FIELDS.items()
    ]
    assert rows == expected


# -- a built Model must compute with the engine's backend ------------------------------------------
@pytest.mark.parametrize("model_backend, engine_backend", [("python", "fast"), ("fast", "python")])
def test_a_model_with_the_other_backends_kernels_is_refused(model_backend, engine_backend):
    backend_named("fast")  # both backends: skipped without the build, failed under CI
    model = Model.from_pretrained(STORIES, kernels=select_kernels(model_backend))
    with pytest.raises(
        ValueError,
        match=f"this Model computes with the {model_backend} backend's kernels and the engine "
        f"runs the {engine_backend} backend",
    ):
        LLMEngine(model, backend=engine_backend, num_blocks=8)
    with pytest.raises(ValueError, match="kernels"):  # a Backend object is held to it too
        LLMEngine(model, backend=backend_named(engine_backend), num_blocks=8)
    engine = LLMEngine(model, backend=model_backend, num_blocks=8)  # its own: accepted
    assert engine.backend.name == model_backend
