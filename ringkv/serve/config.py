"""``ServeConfig``: every ``ringkv serve`` / ``ringkv router`` setting that is not the engine's.

The engine's settings are ``EngineConfig``'s (``ringkv.engine``). This dataclass is the one
place the serving knobs are written down: each field carries its default and its help
(``engine/flags.py``'s ``knob``, as ``EngineConfig``'s do), and from the fields come, once,

- the command line flags (``add_arguments``: ``--served-model-name`` for ``model_name``,
  ``--no-migration`` for ``migration``, ``--no-kv-pull`` for ``kv_pull``, ``--`` and the
  name with dashes for the rest);
- the environment fallbacks (``from_args``: a field's ``env`` variable, read when its flag
  is not given or empty: ``RINGKV_API_KEY``, ``RINGKV_ADMIN_KEY``, ``RINGKV_KV_PULL_POLICY``);
- the replicas' command lines (``replica_argv``): a front started by
  ``ringkv serve --replicas N`` passes each replica its own command line less the flags of
  the fields not marked ``replica`` (the front's own: a replica gets its host, port and
  instance id from the front, and the keys through the environment).

Fields marked ``router`` are flags of ``ringkv router`` too (a front's settings).
``serve(llm, config)`` reads the instance's fields; ``replicas``, ``routing``, ``balance``,
``kv_pull``, ``migration`` and ``migration_threshold`` configure a front only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence

from ..engine import flags


# a field of ServeConfig: flags.knob with the metadata this config reads (``router``: a
# ``ringkv router`` flag too; ``replica``: passed on to each replica; ``env``: a fallback variable)
_knob = functools.partial(flags.knob, env=None, router=False, replica=False)


@dataclass(kw_only=True)
class ServeConfig:
    """How ``ringkv serve`` serves an engine (and how a front routes): see the module docstring.
    ``serve(llm, ServeConfig(port=8001, api_key=KEY))``."""

    host: str = _knob("127.0.0.1", "address to listen on", router=True)
    port: int = _knob(8000, "port to listen on", router=True)
    model_name: Optional[str] = _knob(
        None,
        "the model name clients use (default: --model)",
        flag="--served-model-name",
        replica=True,
    )
    log_level: str = _knob("warning", "uvicorn's log level", router=True, replica=True)
    max_request_bytes: Optional[int] = _knob(
        None,
        "request bodies larger than this get a 413 (default: 16 MiB)",
        router=True,
        replica=True,
    )
    instance_id: Optional[str] = _knob(None, "its name in x-ringkv-instance (default: host:port)")
    max_waiting: Optional[int] = _knob(
        None,
        "requests past this many waiting get a 429 with Retry-After (default: no limit)",
        replica=True,
    )
    request_timeout: Optional[float] = _knob(
        None,
        "seconds after which a request is aborted and its blocks freed (default: none)",
        replica=True,
    )
    replicas: Optional[int] = _knob(
        None, "start N engine instances (each with the engine options) behind a routing front"
    )
    api_key: Optional[str] = _knob(
        None,
        "/v1/* needs Authorization: Bearer KEY (default $RINGKV_API_KEY; none: open)",
        env="RINGKV_API_KEY",
        router=True,
    )
    protect_metrics: bool = _knob(False, "/metrics needs the API key too", router=True)
    admin: bool = _knob(
        False,
        "turn on the admin endpoints (/admin/* on a front, /internal/* on an instance)",
        router=True,
    )
    admin_key: Optional[str] = _knob(
        None,
        "admin endpoints on, behind this key (x-ringkv-admin-key header; "
        "default $RINGKV_ADMIN_KEY)",
        env="RINGKV_ADMIN_KEY",
        router=True,
    )
    routing: str = _knob(
        "kv",
        "a front's routing: the longest cached prefix (kv), or the baselines",
        choices=("kv", "round-robin", "least-loaded"),
        router=True,
    )
    balance: int = _knob(
        16,
        "kv routing: an instance holding this many more requests than the least busy one is "
        "passed over",
        router=True,
    )
    migration: bool = _knob(
        True,
        "a front never moves running requests by itself",
        flag="--no-migration",
        router=True,
    )
    kv_pull: bool = _knob(
        True,
        "a front never asks an instance to pull a cached prefix from another (it recomputes)",
        flag="--no-kv-pull",
        router=True,
    )
    kv_pull_policy: Optional[str] = _knob(
        None,
        "how an instance answers a front's pull hint: by its cost model (measured link and "
        "prefill rates: cost) or always pulling (default $RINGKV_KV_PULL_POLICY, else cost)",
        choices=("cost", "always"),
        env="RINGKV_KV_PULL_POLICY",
        replica=True,
    )
    migration_threshold: float = _knob(
        0.1,
        "a front moves a request when two instances' loads (max of KV usage and requests / "
        "max-num-seqs) differ by more than this",
        router=True,
    )

    @staticmethod
    def flag(f: dataclasses.Field) -> str:
        """The command line flag of field ``f``."""
        return flags.flag(f)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, command: str = "serve") -> None:
        """Add the flags of ``ringkv <command>`` (``serve``: every field; ``router``: the fields
        marked ``router``) to ``parser``; each one's ``dest`` is its field's name."""
        flags.add_arguments(cls, parser, lambda f: command != "router" or f.metadata["router"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeConfig":
        """The config of a parsed ``ringkv serve`` / ``ringkv router`` command line (fields it
        has no flag for keep their defaults), each field with an ``env`` variable falling back
        to it when the flag is not given or empty."""
        values = flags.values(cls, args)
        for f in fields(cls):
            if f.metadata["env"]:
                values[f.name] = values.get(f.name) or os.environ.get(f.metadata["env"])
        return cls(**values)

    @classmethod
    def replica_argv(cls, argv: Sequence[str]) -> List[str]:
        """A replica's ``ringkv serve`` arguments: ``argv`` (a command line, with or without the
        leading ``serve``) less the flags of the fields not marked ``replica``, each with its
        value (``--port 1`` or ``--port=1``). Every other argument stays as it was."""
        front = {
            cls.flag(f): 0 if isinstance(f.default, bool) else 1
            for f in fields(cls)
            if not f.metadata["replica"]
        }
        out, i = [], 0
        while i < len(argv):
            name = argv[i].split("=", 1)[0]
            if name in front:
                i += 1 + (front[name] if "=" not in argv[i] else 0)
                continue
            out.append(argv[i])
            i += 1
        return out[1:] if out and out[0] == "serve" else out
