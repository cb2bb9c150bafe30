"""What the engine does differently for a hybrid model (attention layers beside recurrent ones:
LFM2's short convolutions, Mamba2, gated DeltaNet).

Each running sequence holds one state slot (``cache/state_pool.py``) on every rank; prefix caching
keeps snapshots of the states every ``state_checkpoint_blocks`` KV blocks. By default that is the
fewest blocks whose K/V (all attention layers, this dtype) weigh at least one snapshot (all
recurrent layers' states, float32): snapshots then take at most half of the cache. A prompt that
shares a prefix resumes from the deepest checkpoint whose blocks are all cached.

Mesh: pipeline stages hold their own layers' states; SP ranks each keep the whole state (a long
chunk is spread over them, ``parallel/spread.py``: ring attention and state passing; shorter ones
and decode are computed on every SP rank), the K/V striped over them; tensor parallelism splits
the recurrent layers by heads (``parallel/tp.py``), each TP rank keeping its own heads' state.
Requests and prefixes migrate with their state (``engine/migrate.py``); snapshots move to the host
and disk tiers with their blocks and come back with them (``cache/tiers.py``); ``compile_decode``
runs the recurrent layers as an opaque op in its graphs (``parallel/compiled.py``).
"""

from __future__ import annotations

import torch

from ..cache.kv_cache import bytes_per_block
from ..cache.state_pool import STATE_DTYPE, STATE_DTYPES, state_bytes
from ..parallel.kvmove import model_states


def is_hybrid(cfg) -> bool:
    """Whether the model has layers that keep a recurrent state."""
    return cfg.layer_kinds is not None and any(
        k not in ("attention", "mlp") for k in cfg.layer_kinds
    )


def slot_bytes(cfg, state_dtype: torch.dtype = STATE_DTYPE) -> int:
    """Bytes of one sequence's recurrent state over the whole model (float32 by default)."""
    return state_bytes(model_states(cfg), state_dtype)


def checkpoint_blocks(cfg, block_size: int, dtype: torch.dtype, state_dtype=STATE_DTYPE) -> int:
    """The default ``state_checkpoint_blocks``: the fewest KV blocks (all attention layers) whose
    bytes reach one snapshot's."""
    block = bytes_per_block(len(cfg.kv_layers()), block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    return max(1, -(-slot_bytes(cfg, state_dtype) // max(block, 1)))


def check_hybrid(cfg, c, dtype: torch.dtype) -> dict:
    """``EngineShape``'s state fields for ``cfg`` under config ``c`` (empty for a dense model):
    a slot per running sequence and the checkpoint interval (0: no snapshots); ``ValueError``
    naming a bad ``state_checkpoint_blocks`` (or one given for a dense model)."""
    every, name = c.state_checkpoint_blocks, c.state_dtype
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"state_checkpoint_blocks must be an int >= 1, got {every!r}")
    if name not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {name!r}")
    if not is_hybrid(cfg):
        for knob, value, default in (("state_checkpoint_blocks", every, None),
                                     ("state_dtype", name, "float32")):  # fmt: skip
            if value != default:
                raise ValueError(
                    f"{knob} applies to hybrid models; {cfg.model_type!r} has no recurrent layers"
                )
        return {}
    every = every or checkpoint_blocks(cfg, c.block_size, dtype, STATE_DTYPES[name])
    return dict(
        state_slots=c.max_num_seqs,
        checkpoint_blocks=every if c.enable_prefix_caching else 0,
        state_dtype=name,
    )
