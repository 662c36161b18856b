"""cpattn: context-parallel attention from Python.

numpy level (float32 arrays [B, S, H, D]; uint16 arrays are taken as bfloat16 words):
    o, lse = cpattn.attention(q, k, v, causal=True, segment_ids=None, scale=None, window=None, softcap=None,
                              sinks=None)
    dq, dk, dv = cpattn.attention_backward(q, k, v, o, lse, do, causal=True, segment_ids=None, scale=None,
                                           window=None, softcap=None, sinks=None)   # with sinks: + dsinks
    (window: a sliding window, LEFT or (LEFT, RIGHT), flash-attention's window_size; softcap: Gemma 2's logit
    soft-cap; sinks: a float32 array [Hq] of attention-sink logits, gpt-oss's)
    cpattn.validate(**config), cpattn.plan(**config): the documents of `cpattn validate --json` and
    `cpattn plan --json` (keywords: the program's flags with underscores, q_heads for --q-heads).

PyTorch level: cpattn.torch (attention with autograd; ContextParallelAttention over an mpi4py communicator).

Errors: cpattn.ConfigError (a ValueError) for configurations, shapes and dtypes, with every broken rule in its
message and in its `errors` list; cpattn.CommunicationError when a collective fails. Importing cpattn does not
initialise MPI.
"""

import json as _json

from . import _cpattn
from ._cpattn import (
    CommunicationError,
    ConfigError,
    attention,
    attention_backward,
    local_positions,
    simd_target,
)

__all__ = [
    "CommunicationError",
    "ConfigError",
    "attention",
    "attention_backward",
    "local_positions",
    "plan",
    "simd_target",
    "validate",
]


def _document(command, config):
    flags = []
    for name, value in config.items():
        if value is None:
            continue
        if name == "config" and isinstance(value, (list, tuple)):  # several files, merged in order
            flags += [(name, path) for path in value]
            continue
        if isinstance(value, (list, tuple)):  # segments=[61440, 4096] -> "61440,4096"
            value = ",".join(str(x) for x in value)
        flags.append((name, value))
    _, document = _cpattn._run_document(command, flags)
    return _json.loads(document)


def validate(**config):
    """`cpattn validate --json` as a dict: {"valid": True, "ranks": [...], ...} or {"valid": False,
    "errors": [...]} listing every broken rule. Unknown keywords and values a flag cannot take raise
    ConfigError."""
    return _document("validate", config)


def plan(**config):
    """`cpattn plan --json` as a dict (every strategy planned, "recommended" among them)."""
    return _document("plan", config)
