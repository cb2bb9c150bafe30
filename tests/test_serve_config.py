"""``ServeConfig``: the ``ringkv serve`` / ``ringkv router`` flags, their environment fallbacks
and the replicas' command lines all come from its fields, and say what the hand-written
argparse options, ``args.x or os.environ.get(...)`` and ``_FRONT_ONLY`` said before."""

from __future__ import annotations

import dataclasses

import pytest

from ringkv.__main__ import _parser, main
from ringkv.serve import ServeConfig, serve

DEFAULTS = dict(
    host="127.0.0.1",
    port=8000,
    model_name=None,
    log_level="warning",
    max_request_bytes=None,
    instance_id=None,
    max_waiting=None,
    request_timeout=None,
    replicas=None,
    api_key=None,
    protect_metrics=False,
    admin=False,
    admin_key=None,
    routing="kv",
    balance=16,
    migration=True,
    kv_pull=True,
    kv_pull_policy=None,
    migration_threshold=0.1,
)

EVERY_FLAG = [
    "--host", "0.0.0.0", "--port", "9001", "--served-model-name", "smol", "--log-level", "info",
    "--max-request-bytes", "1000", "--instance-id", "a", "--max-waiting", "3",
    "--request-timeout", "1.5", "--replicas", "2", "--api-key", "k", "--protect-metrics",
    "--admin", "--admin-key", "ak", "--routing", "round-robin", "--balance", "4",
    "--no-migration", "--migration-threshold", "0.25", "--no-kv-pull", "--kv-pull-policy", "always",
]  # fmt: skip

# The old _FRONT_ONLY table: the flags a replica's command line drops, and their arities.
FRONT_ONLY = {
    "--replicas": 1,
    "--host": 1,
    "--port": 1,
    "--admin": 0,
    "--admin-key": 1,
    "--routing": 1,
    "--balance": 1,
    "--no-migration": 0,
    "--no-kv-pull": 0,  # (a flag of the front since issue #44)
    "--migration-threshold": 1,
    "--instance-id": 1,
    "--api-key": 1,
    "--protect-metrics": 0,
}
KEPT = {
    "--served-model-name": "x",
    "--log-level": "info",
    "--max-request-bytes": "10",
    "--max-waiting": "4",
    "--request-timeout": "5",
    "--kv-pull-policy": "always",  # (an instance's, since issue #44)
}


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch):
    monkeypatch.delenv("RINGKV_API_KEY", raising=False)
    monkeypatch.delenv("RINGKV_ADMIN_KEY", raising=False)
    monkeypatch.delenv("RINGKV_KV_PULL_POLICY", raising=False)


def config(*argv: str) -> ServeConfig:
    return ServeConfig.from_args(_parser().parse_args(list(argv)))


def test_defaults_are_the_old_flags_defaults():
    assert dataclasses.asdict(ServeConfig()) == DEFAULTS
    assert dataclasses.asdict(config("serve", "--model", "m")) == DEFAULTS
    assert dataclasses.asdict(config("router")) == DEFAULTS


def test_every_serve_flag_parses_to_its_field():
    c = config("serve", "--model", "m", *EVERY_FLAG)
    assert dataclasses.asdict(c) == dict(
        host="0.0.0.0",
        port=9001,
        model_name="smol",
        log_level="info",
        max_request_bytes=1000,
        instance_id="a",
        max_waiting=3,
        request_timeout=1.5,
        replicas=2,
        api_key="k",
        protect_metrics=True,
        admin=True,
        admin_key="ak",
        routing="round-robin",
        balance=4,
        migration=False,
        kv_pull=False,
        kv_pull_policy="always",
        migration_threshold=0.25,
    )
    assert config("serve", "--model", "m", "--port=7", "--balance=2").port == 7


def test_router_has_the_front_flags_only():
    argv = ["router", "--upstream", "http://a:1", "--upstream", "http://b:2", "--port", "1"]
    args = _parser().parse_args(argv + ["--no-migration", "--max-request-bytes", "5"])
    assert args.upstream == ["http://a:1", "http://b:2"]
    c = ServeConfig.from_args(args)
    assert (c.port, c.migration, c.max_request_bytes) == (1, False, 5)
    for flag in ("--served-model-name", "--instance-id", "--max-waiting", "--replicas"):
        with pytest.raises(SystemExit) as e:
            _parser().parse_args(["router", flag, "1"])
        assert e.value.code == 2


def test_the_command_lines_list_the_same_flags():
    def flags(command):
        sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]
        return {s for a in sub._actions for s in a.option_strings if s.startswith("--")}

    engine = {
        "--help", "--model", "--dtype", "--kv-cache-memory", "--tp", "--pp", "--sp",
        "--pp-layers", "--block-size", "--max-model-len", "--max-num-seqs",
        "--max-num-batched-tokens", "--kv-cache-dtype", "--sp-prefill-min-tokens",
        "--compile-decode", "--kv-host-memory", "--kv-disk", "--kv-disk-size",
        "--state-checkpoint-blocks",
        "--state-dtype",
    }  # fmt: skip
    front = set(FRONT_ONLY) - {"--replicas", "--instance-id"}
    serve_flags = engine | set(FRONT_ONLY) | set(KEPT)
    assert len(serve_flags) == 39  # 38 and --help
    assert flags("serve") == serve_flags
    shared = {"--help", "--host", "--port", "--log-level", "--max-request-bytes", "--upstream"}
    assert flags("router") == front | shared


def test_environment_fallbacks(monkeypatch):
    monkeypatch.setenv("RINGKV_API_KEY", "env-api")
    monkeypatch.setenv("RINGKV_ADMIN_KEY", "env-admin")
    for command in (["serve", "--model", "m"], ["router"]):
        c = config(*command)
        assert (c.api_key, c.admin_key) == ("env-api", "env-admin")
        c = config(*command, "--api-key", "flag-api", "--admin-key=flag-admin")
        assert (c.api_key, c.admin_key) == ("flag-api", "flag-admin")
        c = config(*command, "--api-key", "", "--admin-key", "")  # empty: the environment's
        assert (c.api_key, c.admin_key) == ("env-api", "env-admin")
    monkeypatch.setenv("RINGKV_API_KEY", "")
    monkeypatch.delenv("RINGKV_ADMIN_KEY")
    c = config("serve", "--model", "m")
    assert (c.api_key, c.admin_key) == ("", None)
    monkeypatch.setenv("RINGKV_KV_PULL_POLICY", "always")
    assert config("serve", "--model", "m").kv_pull_policy == "always"
    assert config("serve", "--model", "m", "--kv-pull-policy", "cost").kv_pull_policy == "cost"


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            ["serve", "--model", "m", "--replicas", "3", "--tp", "2", "--port", "8000", "--admin"],
            ["--model", "m", "--tp", "2"],
        ),
        (
            ["--model=m", "--replicas=2", "--api-key=k", "--max-waiting", "4", "--no-migration"],
            ["--model=m", "--max-waiting", "4"],
        ),
        (
            ["serve", "--model", "m", "--pp-layers", "2", "2", "--routing", "kv", "--host", "h"]
            + ["--served-model-name", "x", "--migration-threshold=0.2", "--protect-metrics"]
            + ["--balance", "3", "--instance-id", "i", "--admin-key", "k2", "--log-level"]
            + ["info", "--request-timeout", "5", "--max-request-bytes", "10", "--pp", "2"],
            ["--model", "m", "--pp-layers", "2", "2", "--served-model-name", "x", "--log-level"]
            + ["info", "--request-timeout", "5", "--max-request-bytes", "10", "--pp", "2"],
        ),
    ],
)
def test_replica_argv_drops_the_front_flags(argv, expected):
    assert ServeConfig.replica_argv(argv) == expected


def test_replica_argv_drops_exactly_the_old_front_only_flags():
    for flag, arity in FRONT_ONLY.items():
        value = ["v"] * arity
        assert ServeConfig.replica_argv(["serve", "--model", "m", flag, *value]) == ["--model", "m"]
        assert ServeConfig.replica_argv([flag + "=v", "--tp", "2"]) == ["--tp", "2"]
    for flag, value in KEPT.items():
        assert ServeConfig.replica_argv(["serve", flag, value]) == [flag, value]
        assert ServeConfig.replica_argv([flag + "=" + value]) == [flag + "=" + value]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--port", "x"], "argument --port: invalid int value: 'x'"),
        (["--request-timeout", "soon"], "argument --request-timeout: invalid float value: 'soon'"),
        (["--routing", "random"], "argument --routing: invalid choice: 'random'"),
        (["--balance", "1.5"], "argument --balance: invalid int value: '1.5'"),
        (["--admin", "yes"], "unrecognized arguments: yes"),
        (["--served-model-name"], "argument --served-model-name: expected one argument"),
    ],
)
def test_bad_values_exit_2_with_argparse_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "m", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_replicas_exit_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path), "--replicas", "0"]) == 2
    assert "ringkv: --replicas must be >= 1, got 0" in capsys.readouterr().err
    missing = str(tmp_path / "nothing")
    assert main(["serve", "--model", missing, "--replicas", "2"]) == 2
    assert f"ringkv: no model at {missing!r}" in capsys.readouterr().err


def test_serve_refuses_unknown_settings_before_starting():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bogus'\]"):
        serve(None, bogus=1)
    with pytest.raises(TypeError, match="config must be a ServeConfig, got dict"):
        serve(None, {"port": 1})
