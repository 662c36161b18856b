"""cpattn for PyTorch: autograd over cpattn's CPU flash kernels and context-parallel strategies.

    o = cpattn.torch.attention(q, k, v, causal=True, segment_ids=None, scale=None)
        q [B, S, Hq, D], k and v [B, S, Hkv, D]: float32 or bfloat16 CPU tensors (o has their dtype);
        segment_ids [B, S] int32 or int64 (packed documents: a token sees only its own document).

    attn = cpattn.torch.ContextParallelAttention(group=None, strategy="ulysses", causal=True, load_balance=False)
    o_local = attn(q_local, k_local, v_local, segment_ids=None)
        group: a torch.distributed process group (gloo; None: the default group), or comm=: an mpi4py
        communicator (MPI.COMM_WORLD or one from Split); each process passes its own shard of the sequence in
        the strategy's layout (attn.local_positions(S) says which tokens) and gets its O shard, with autograd.
        Every process of the group must call it, with the same shapes.

    o_local = cpattn.torch.context_parallel_sdpa(q, k, v, is_causal=True, group=None)
        torch.nn.functional.scaled_dot_product_attention's arguments and [B, H, S, D] layout, on shards.
"""

import datetime as _datetime
import operator as _operator
import sys as _sys
import time as _time

import numpy as _np
import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

from . import _cpattn
from ._cpattn import CommunicationError, ConfigError  # noqa: F401  (re-exported)

__all__ = ["attention", "ContextParallelAttention", "context_parallel_sdpa", "CommunicationError", "ConfigError"]


def _to_numpy(t, name):
    """(array, "") for a tensor the kernels take, else (None, why): float32 as float32, bfloat16 as its 16-bit
    words; no copy where the tensor allows one. Never raises: under MPI the reason joins the agreement."""
    try:
        return _tensor_to_numpy(t, name)
    except Exception as e:  # a tensor numpy cannot view (sparse, a lazy negation or conjugate, ...)
        return None, f"{name}: cannot be read as an array ({type(e).__name__}: {e})"


def _tensor_to_numpy(t, name):
    if not isinstance(t, _torch.Tensor):
        return None, f"{name}: expected a torch.Tensor, got {type(t).__name__}"
    if t.device.type != "cpu":
        return None, f"{name}: tensor on {t.device}; cpattn runs on the CPU (valid: a CPU tensor)"
    if t.dtype not in (_torch.float32, _torch.bfloat16):
        return None, f"{name}: dtype {t.dtype} is not supported; valid: torch.float32, torch.bfloat16"
    t = t.detach()
    if t.dtype == _torch.bfloat16:
        if t.dim() > 0 and t.stride(-1) != 1:
            t = t.contiguous()
        return t.view(_torch.int16).numpy().view(_np.uint16), ""
    return t.numpy(), ""


def _to_torch(a):
    if a.dtype == _np.uint16:
        return _torch.from_numpy(a.view(_np.int16)).view(_torch.bfloat16)
    return _torch.from_numpy(a)


def _segments(segment_ids):
    if segment_ids is None:
        return None, ""
    if not isinstance(segment_ids, _torch.Tensor) or segment_ids.dtype not in (_torch.int32, _torch.int64):
        return None, "segment_ids: expected an int32 or int64 torch.Tensor [B, S]"
    try:
        return segment_ids.detach().cpu().numpy(), ""
    except Exception as e:
        return None, f"segment_ids: cannot be read as an array ({type(e).__name__}: {e})"


def _config_error(reasons):
    """ConfigError for reasons found in Python, with `errors` as the C++ side gives it."""
    e = ConfigError("\n".join(reasons))
    e.errors = [{"field": r.split(":")[0], "fields": [r.split(":")[0]], "value": "", "message": r} for r in reasons]
    return e


def _check(*pairs):
    """Raises ConfigError with every reason a single process found (the one-process level)."""
    reasons = [why for _, why in pairs if why]
    if reasons:
        raise _config_error(reasons)
    return [a for a, _ in pairs]


def _sinks_to_numpy(sinks):
    """A sinks tensor [Hq] (any float dtype) as the float32 array the kernels take; the extension checks its
    shape."""
    if not isinstance(sinks, _torch.Tensor):
        raise _config_error([f"sinks: expected a torch.Tensor [Hq], got {type(sinks).__name__}"])
    if not sinks.is_floating_point() or sinks.device.type != "cpu":
        raise _config_error([f"sinks: expected a floating-point CPU tensor [Hq], got {sinks.dtype} on "
                             f"{sinks.device}"])
    return sinks.detach().float().contiguous().numpy()


class _Attention(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_ids, causal, scale, threads, window, softcap, sinks):
        qa, ka, va, seg = _check(_to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v"), _segments(segment_ids))
        sa = None if sinks is None else _sinks_to_numpy(sinks)
        o, lse = _cpattn.attention(qa, ka, va, causal=causal, segment_ids=seg, scale=scale, threads=threads,
                                   window=window, softcap=softcap, sinks=sa)
        o = _to_torch(o)
        ctx.save_for_backward(q, k, v, o)
        ctx.lse, ctx.seg, ctx.causal, ctx.scale, ctx.threads = lse, seg, causal, scale, threads
        ctx.window, ctx.softcap, ctx.sinks = window, softcap, sa
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return o

    @staticmethod
    @_once_differentiable
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        qa, ka, va, oa, da = _check(
            _to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v"), _to_numpy(o, "o"), _to_numpy(do, "do")
        )
        grads = _cpattn.attention_backward(
            qa, ka, va, oa, ctx.lse, da, causal=ctx.causal, segment_ids=ctx.seg, scale=ctx.scale,
            threads=ctx.threads, window=ctx.window, softcap=ctx.softcap, sinks=ctx.sinks,
        )
        dsinks = None if ctx.sinks is None else _torch.from_numpy(grads[3]).to(ctx.sinks_dtype)
        # one gradient per argument of forward: None for segment_ids, causal, scale, threads, window, softcap
        return _to_torch(grads[0]), _to_torch(grads[1]), _to_torch(grads[2]), None, None, None, None, None, None, dsinks


def attention(q, k, v, causal=True, segment_ids=None, scale=None, threads=None, window=None, softcap=None,
              sinks=None):
    """Attention over cpattn's flash kernels with autograd. q [B, S, Hq, D]; k, v [B, S, Hkv, D] (Hq a
    multiple of Hkv: GQA and MQA without repeating K/V); float32 or bfloat16, o in the same dtype. scale:
    default 1/sqrt(D). threads: kernel threads (default: every hardware thread). window: a sliding window as
    flash-attention's window_size: LEFT (causal: query i sees keys i-LEFT..i) or (LEFT, RIGHT) (keys
    i-LEFT..i+RIGHT; None for an unbounded side), always within a document of segment_ids. softcap: logit
    soft-capping (Gemma 2): logits x become softcap * tanh(x / softcap) before the softmax. sinks: a tensor
    [Hq] of attention-sink logits (gpt-oss: one more logit per head in the softmax's denominator, no value);
    it receives .grad."""
    return _Attention.apply(q, k, v, segment_ids, causal, scale, threads, window, softcap, sinks)


class _ContextParallel(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, q, k, v, segment_ids, forward_only, sinks):
        arrays = [_to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v"), _segments(segment_ids)]
        sa = None
        if sinks is not None:
            try:
                sa = _sinks_to_numpy(sinks)
            except Exception as e:  # joins the agreement: every rank raises
                arrays.append((None, str(e)))
        # A reason found here does not raise here: it goes into the agreement every rank makes, so every
        # rank raises.
        why = "; ".join(w for _, w in arrays if w)
        qa, ka, va, seg = (a for a, _ in arrays[:4])
        o, _, saved = impl.forward(qa, ka, va, seg, why, forward_only, sa)
        ctx.impl, ctx.saved_forward = impl, saved
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return _to_torch(o)

    @staticmethod
    @_once_differentiable
    def backward(ctx, do):
        if ctx.saved_forward is None:
            raise RuntimeError("ContextParallelAttention: backward ran twice on one forward (its state is freed "
                               "after the first; retain_graph is not supported)")
        da, why = _to_numpy(do, "do")
        saved, ctx.saved_forward = ctx.saved_forward, None  # freed once used: no state outlives its backward
        dq, dk, dv, dsinks = ctx.impl.backward(saved, da, why)
        # this rank's share of the sinks' gradient: the training's all-reduce sums the shares, as it sums
        # every parameter's over the context-parallel group
        ds = None if dsinks is None else _torch.from_numpy(dsinks).to(ctx.sinks_dtype)
        return None, _to_torch(dq), _to_torch(dk), _to_torch(dv), None, None, ds


def _global_rank(group, rank):
    dist = _torch.distributed
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, rank)
    return dist.distributed_c10d._get_global_rank(group, rank)  # torch < 2.0


class _GroupPending:
    """A step's messages in flight: wait() completes them, then copies what arrived into cpattn's buffers. A
    failure names the peer and the direction of the message it stopped at."""

    def __init__(self, works, landed):
        self._works, self._landed = works, landed

    def wait(self, timeout_seconds):
        deadline = _time.monotonic() + timeout_seconds  # one timeout for the step, not one per message
        for work, peer, what in self._works:
            timeout = _datetime.timedelta(seconds=max(0.001, deadline - _time.monotonic()))
            try:
                done = work.wait(timeout)
            except RuntimeError as e:
                raise RuntimeError(f"{what} rank {peer[0]} (global rank {peer[1]}): {e}") from None
            if done is False:
                raise RuntimeError(f"{what} rank {peer[0]} (global rank {peer[1]}): no progress within "
                                   f"{timeout_seconds:g} s (a peer is stopped or gone)")
        for (view, tensor), peer in self._landed:
            sent = int.from_bytes(tensor[:_HEADER].numpy().tobytes(), "little")
            if sent != len(view):
                raise RuntimeError(f"receiving from rank {peer[0]} (global rank {peer[1]}): a message of {sent} "
                                   f"bytes where {len(view)} were expected (the ranks disagree on a call's size)")
            if len(view):
                _torch.frombuffer(view, dtype=_torch.uint8).copy_(tensor[_HEADER:])
        self._works, self._landed = [], []


_HEADER = 8  # each message's length in bytes, little-endian, before its bytes


class _GroupTransport:
    """Point-to-point bytes over a torch.distributed process group (isend/irecv, which gloo has), the one thing
    cpattn's transport backend needs: its collectives, and every strategy, run on it. Each message travels in
    a tensor of its own (sends copied out of cpattn's buffers, receives copied in once complete), so that a
    failing rank's buffers are never touched after it gave them up, behind its length (_HEADER bytes): a
    message shorter than its receiver expects, which gloo would deliver without a word, is an error naming
    both sizes (a longer one is gloo's own error)."""

    def __init__(self, group):
        dist = _torch.distributed
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.name = f"torch.distributed ({dist.get_backend(group)})"
        self._global = [_global_rank(group, r) for r in range(self.size)]

    def start(self, sends, recvs, tag):
        dist = _torch.distributed
        works, landed = [], []
        for peer, view in recvs:
            t = _torch.empty(_HEADER + len(view), dtype=_torch.uint8)
            work = dist.irecv(t, src=self._global[peer], group=self.group, tag=tag)
            works.append((work, (peer, self._global[peer]), "receiving from"))
            landed.append(((view, t), (peer, self._global[peer])))
        for peer, view in sends:
            t = _torch.empty(_HEADER + len(view), dtype=_torch.uint8)
            t[:_HEADER] = _torch.frombuffer(bytearray(len(view).to_bytes(_HEADER, "little")), dtype=_torch.uint8)
            if len(view):
                t[_HEADER:] = _torch.frombuffer(view, dtype=_torch.uint8)
            work = dist.isend(t, dst=self._global[peer], group=self.group, tag=tag)
            works.append((work, (peer, self._global[peer]), "sending to"))
        return _GroupPending(works, landed)


def _transport_of(group):
    dist = _torch.distributed
    if not dist.is_available():
        raise _config_error(["group: this torch has no torch.distributed"])
    if not dist.is_initialized():
        raise _config_error(["group: torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group('gloo') first (env:// as torchrun or "
                             "python3 -m cpattn.launch sets it), or pass comm= an mpi4py communicator"])
    if group is None:
        group = dist.group.WORLD
    elif group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):  # what new_group gives non-members
        raise _config_error(["group: this process is not a member of the group it passed (new_group gives its "
                             "non-members a placeholder)"])
    elif not isinstance(group, dist.ProcessGroup):
        raise _config_error([f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}"])
    if dist.get_rank(group) < 0:
        raise _config_error(["group: this process is not a member of the group it passed"])
    return _GroupTransport(group)


class ContextParallelAttention(_torch.nn.Module):
    """Attention over the processes of a torch.distributed process group (`group`, gloo; None: the default
    group) or of an mpi4py communicator (`comm`): each passes its shard of the sequence [B, S/cp, H, D] and
    gets its shard of O, with autograd.

    strategy: "ulysses" (KV heads replicated in grouped order when there are fewer than ranks), "all_gather",
    "ring" or "hybrid" (ulysses inside groups of ulysses_degree ranks, a ring across them). window: a sliding
    window as attention()'s (LEFT, or (LEFT, RIGHT) without the causal mask); softcap: attention()'s. load_balance:
    the dual-chunk-swap layout (local_positions says which tokens a rank holds). Other options: layout
    ("contiguous", "dual_chunk_swap", or for all_gather, ring and hybrid "per_document" (each document's dual
    chunk swap) or "solver" (chunks dealt by their cost under the mask), both cut by `documents`, the packed
    row's document lengths, the same on every rank), scale (default 1/sqrt(D)), threads (kernel threads per process;
    default the machine's hardware threads over the communicator's size), remat, timeout (seconds any wait
    for another rank may take; default 600: past it MPI ends the job, a process group's ranks raise
    CommunicationError).

    Each object keeps its own state: objects with different head counts or strategies work side by side, and
    one object serves any number of calls before their backward (each forward's state lives in its autograd
    graph).
    """

    def __init__(self, comm=None, strategy="ulysses", causal=True, load_balance=False, layout=None,
                 ulysses_degree=None, scale=None, threads=None, remat=False, timeout=None, group=None, window=None,
                 softcap=None, documents=None):
        super().__init__()
        options = dict(strategy=strategy, causal=causal, window=window, softcap=softcap, load_balance=load_balance,
                       layout=layout, documents=documents,
                       ulysses_degree=ulysses_degree, scale=scale, threads=threads, remat=remat, timeout=timeout)
        self.strategy = strategy
        if comm is None:
            # Every option is read and agreed on by the ranks in the extension, over the group's messages.
            self._impl = _cpattn._ContextParallel(_transport_of(group), options)
            return
        if group is not None:
            raise _config_error(["group: give a process group or comm= an mpi4py communicator, not both"])
        if not hasattr(comm, "py2f"):
            if _torch.distributed.is_available() and isinstance(comm, _torch.distributed.ProcessGroup):
                raise _config_error(["comm: a torch.distributed ProcessGroup goes in group=, not comm"])
            raise _config_error([f"comm: expected an mpi4py communicator, got {type(comm).__name__}"])
        if not getattr(_cpattn, "with_mpi", False):
            raise _config_error(["comm: this cpattn was built without MPI"])
        mpi = _sys.modules.get(type(comm).__module__)
        if mpi is not None and hasattr(mpi, "Is_initialized") and (not mpi.Is_initialized() or mpi.Is_finalized()):
            # py2f itself would end the process (MPI_Comm_c2f before MPI_Init is fatal in Open MPI)
            raise _config_error(["comm: MPI is not initialised (or already finalised): with mpi4py.rc.initialize "
                                 "= False, call MPI.Init_thread() before making ContextParallelAttention"])
        # Every option is read (as the program's flags are) and agreed on by the ranks in the extension.
        self._impl = _cpattn._ContextParallel(comm.py2f(), options)

    @property
    def rank(self):
        return self._impl.rank

    @property
    def cp(self):
        return self._impl.size

    @property
    def comm_wait_seconds(self):
        """The ring's (ring, hybrid) seconds waiting on its K/V and dK/dV transfers, of the shape that ran
        last, since that shape's last forward began (after a forward and its backward: both; a second forward
        before the backward starts the count again); 0 for the strategies without a ring."""
        return self._impl.comm_wait_seconds

    def local_positions(self, seq_len):
        """The global positions of this rank's tokens (for RoPE, and to cut its shard out of a whole row)."""
        return _torch.from_numpy(self._impl.local_positions(seq_len))

    def shard(self, x, dim=1):
        """This rank's shard of a whole-sequence tensor (sequence along `dim`), in the strategy's layout."""
        return x.index_select(dim, self.local_positions(x.shape[dim]))

    def forward(self, q, k, v, segment_ids=None, sinks=None):
        """sinks: a tensor [Hq] of attention-sink logits, the same on every rank; its .grad receives this
        rank's share of the gradient (the shares of the group add up to it, as every parameter's do)."""
        # No graph to build (no_grad, or no input needs a gradient): the forward keeps no state for a backward.
        needs_grad = _torch.is_grad_enabled() and any(
            isinstance(t, _torch.Tensor) and t.requires_grad for t in (q, k, v, sinks)
        )
        return _ContextParallel.apply(self._impl, q, k, v, segment_ids, not needs_grad, sinks)


_SDPA_OBJECTS = []  # (group, options, ContextParallelAttention), most recent first; at most _SDPA_KEPT
_SDPA_KEPT = 16


def context_parallel_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                          segment_ids=None, group=None, strategy="ulysses", load_balance=False, layout=None,
                          ulysses_degree=None, threads=None, timeout=None, window=None, softcap=None, sinks=None,
                          documents=None):
    """torch.nn.functional.scaled_dot_product_attention's arguments and layout, context-parallel over a
    torch.distributed process group (None: the default group): query [B, Hq, S/cp, D], key and value
    [B, Hkv, S/cp, D] (GQA: Hq a multiple of Hkv), each process its shard of the sequence in the layout of
    `load_balance`/`layout` (with `documents` for per_document and solver; ContextParallelAttention.local_positions
    says which tokens); returns this shard
    of the output, [B, Hq, S/cp, D], with autograd. A model's attention call changes in one line:

        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = cpattn.torch.context_parallel_sdpa(q, k, v, is_causal=True, group=cp_group)

    attn_mask and dropout_p are not supported (packed documents: segment_ids [B, S/cp]; a sliding window:
    window=LEFT with is_causal, or (LEFT, RIGHT), as ContextParallelAttention's; softcap; sinks: a tensor [Hq]
    whose .grad gets this rank's share of the gradient). One
    ContextParallelAttention per (group, options) is made on first use (a collective: every process of the
    group makes the same calls) and kept."""
    reasons = []
    if attn_mask is not None:
        reasons.append("attn_mask: not supported; causal masking is is_causal=True, packed documents "
                       "segment_ids=[B, S/cp]")
    if dropout_p != 0.0:
        reasons.append(f"dropout_p: {dropout_p!r} is not supported; valid: 0.0")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, _torch.Tensor) or t.dim() != 4:
            reasons.append(f"{name}: expected a 4-dimensional torch.Tensor [B, H, S, D]")
    if reasons:
        raise _config_error(reasons)
    if documents is not None and not isinstance(documents, (str, bytes)):
        try:  # a copy of the lengths (the cache below compares them; a list changed in place must not match)
            documents = tuple(_operator.index(n) for n in documents)
        except (TypeError, ValueError):
            pass  # the extension names what is wrong with them
    options = dict(strategy=strategy, causal=is_causal, window=window, softcap=softcap, load_balance=load_balance,
                   layout=layout, documents=documents,
                   ulysses_degree=ulysses_degree, scale=scale,
                   threads=threads, timeout=timeout)
    dist = _torch.distributed
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD  # today's default group: a group made again after a re-init is another
    attn = None
    for i, (g, o, a) in enumerate(_SDPA_OBJECTS):
        if g is group and o == options:
            attn = a
            _SDPA_OBJECTS.insert(0, _SDPA_OBJECTS.pop(i))
            break
    if attn is None:
        attn = ContextParallelAttention(group=group, **options)
        _SDPA_OBJECTS.insert(0, (group, options, attn))
        del _SDPA_OBJECTS[_SDPA_KEPT:]
    out = attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), segment_ids=segment_ids,
               sinks=sinks)
    return out.transpose(1, 2)
