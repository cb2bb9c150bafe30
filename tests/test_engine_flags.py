"""``EngineConfig``'s fields and ``ringkv generate`` / ``ringkv serve``'s engine flags are written
once (``ringkv/engine/flags.py``): every field says whether it is a flag, and each flag agrees
with its field (default, type, a value parsed end to end into the config)."""

import dataclasses
import typing

import pytest

from ringkv.__main__ import _parser
from ringkv.engine import flags
from ringkv.engine.core import EngineConfig

# settings a command line cannot give (objects, or not offered as flags): Python only
PYTHON_ONLY = {
    "tokenizer",
    "device",
    "gpu_memory_utilization",
    "num_blocks",
    "enable_prefix_caching",
    "hash_fn",
    "paged_backend",
    "timeout",
}


def engine_actions(command: str) -> dict:
    sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {a.dest: a for a in sub._actions if a.dest in names}


def sample(f: dataclasses.Field) -> tuple:
    """``(argv values, the field value they give)`` for field ``f``'s flag."""
    if f.metadata["unit"] is not None:
        return ["0.5"], f.metadata["unit"] // 2
    if f.metadata["choices"]:  # (compile_decode: auto / true / false; its default auto)
        value = next(c for c in f.metadata["choices"] if c not in (f.default, str(f.default)))
        return [value], value
    if isinstance(f.default, bool):
        return [], not f.default
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if f.metadata["nargs"]:
        return ["3", "5"], [3, 5]
    if (typing.get_args(hint) or (hint,))[0] is int:  # int or Optional[int]
        return ["3"], 3
    return ["bfloat16"], "bfloat16"  # a string (dtype, kv_cache_dtype, kv_disk)


def test_every_field_declares_its_flag():
    """Each field carries its help and whether it is a flag; the Python-only ones are known, so
    a new field makes its author decide."""
    for f in dataclasses.fields(EngineConfig):
        assert "help" in f.metadata and "cli" in f.metadata, f.name
    python_only = {f.name for f in dataclasses.fields(EngineConfig) if not flags.has_flag(f)}
    assert python_only == PYTHON_ONLY


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_each_flag_agrees_with_its_field(command):
    actions = engine_actions(command)
    fields = [f for f in dataclasses.fields(EngineConfig) if flags.has_flag(f)]
    assert sorted(actions) == sorted(f.name for f in fields)
    base = [command, "--model", "m"] + (["--prompt", "p"] if command == "generate" else [])
    defaults = flags.from_args(EngineConfig, _parser().parse_args(base))
    assert defaults == EngineConfig()  # no flag given: the field's default
    for f in fields:
        a = actions[f.name]
        assert a.option_strings == [flags.flag(f)] and a.help == f.metadata["help"]
        assert a.default == f.default, f.name
        argv, want = sample(f)
        config = flags.from_args(
            EngineConfig, _parser().parse_args(base + [a.option_strings[0]] + argv)
        )
        assert getattr(config, f.name) == want, f.name
        assert dataclasses.replace(config, **{f.name: f.default}) == EngineConfig(), f.name


def test_sizes_are_gib_on_the_command_line_and_bytes_in_the_config():
    args = _parser().parse_args(
        ["generate", "--model", "m", "--prompt", "p", "--kv-cache-memory", "1.5"]
        + ["--kv-host-memory", "0", "--kv-disk", "d", "--kv-disk-size", "2"]
    )
    c = flags.from_args(EngineConfig, args)
    assert (c.kv_cache_memory, c.kv_host_memory, c.kv_disk_size) == (3 << 29, 0, 2 << 30)
