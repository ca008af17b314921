"""The loader's collectives, on its own gloo group (never the trainer's NCCL group).

Every call blocks, so the runtime runs them on one dedicated daemon thread (`CollectiveThread`)
and the event loop keeps fetching meanwhile. With one rank, `LocalComm` does the same work
without torch.distributed.
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional, Protocol, TypeVar

import numpy as np

from ..errors import DistributedError
from ..pipeline.workers import DaemonExecutor

T = TypeVar("T")


class Comm(Protocol):
    rank: int
    world: int

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]: ...
    def broadcast(self, array: Optional[np.ndarray], size: int) -> np.ndarray: ...
    def all_to_all(self, sends: list[np.ndarray], dtype,
                   recv_sizes: list[int]) -> list[np.ndarray]: ...

    def gather(self, array: np.ndarray) -> Optional[list[Optional[np.ndarray]]]: ...

    def scatter(self, arrays: Optional[list[np.ndarray]]) -> np.ndarray: ...


class LocalComm:
    rank, world = 0, 1

    def all_gather(self, array):
        return [array]

    def gather(self, array):
        return [array]

    def scatter(self, arrays):
        return arrays[0]

    def broadcast(self, array, size):
        return array

    def all_to_all(self, sends, dtype, recv_sizes):
        return [np.asarray(sends[0], dtype=dtype)]


MIN_GATHER_CAPACITY = 1024


class GlooComm:
    """Collectives on the loader's gloo group. Buffers are filled in NumPy and received into
    `torch.empty`: a torch fill or copy of a large tensor runs on torch's OpenMP threads, whose
    spin-waiting afterwards doubled the loader's CPU time per step (measured at 2 ranks)."""
    def __init__(self, group, rank: int, world: int, timeout_s: float):
        self.group, self.rank, self.world, self.timeout_s = group, rank, world, timeout_s
        self.gather_capacity = MIN_GATHER_CAPACITY   # values per rank in all_gather's 1st round
        self.next_gather_capacity = MIN_GATHER_CAPACITY   # rank 0, gather: from the sizes seen
        self.scatter_capacity = MIN_GATHER_CAPACITY  # values per rank in scatter's 1st round

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:   # gloo reports timeouts and closed peers as RuntimeError
            raise DistributedError(
                f"rank {self.rank}: collective {what} failed (another rank may have died or "
                f"stalled for more than {self.timeout_s:g} s): {exc}") from exc

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's int64 array, whatever their lengths: one collective in the steady state.

        Each rank sends its length and its first `gather_capacity` values in one fixed-size
        message; only a rank's values past that go in a second round (padded to the longest).
        The capacity for the next call is twice the longest array seen now: every rank computes
        it from the same gathered lengths, so they agree without a word."""
        import torch
        import torch.distributed as dist
        array = np.ascontiguousarray(array, dtype=np.int64)
        n, cap = array.shape[0], self.gather_capacity

        def gather():
            message = _head_message(array, cap)
            out = [torch.empty(1 + cap, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(out, torch.from_numpy(message), group=self.group)
            sizes = [int(o[0]) for o in out]
            longest = max(sizes)
            self.gather_capacity = max(MIN_GATHER_CAPACITY, 2 * longest)
            heads = [o[1:1 + min(size, cap)].numpy() for o, size in zip(out, sizes)]
            if longest <= cap:
                return heads
            rest = np.zeros(longest - cap, dtype=np.int64)
            rest[:max(n - cap, 0)] = array[cap:]
            tails = [torch.empty(longest - cap, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(tails, torch.from_numpy(rest), group=self.group)
            return [np.concatenate([head, tail[:max(size - cap, 0)].numpy()])
                    for head, tail, size in zip(heads, tails, sizes)]
        return self._run("all_gather", gather)

    def gather(self, array: np.ndarray) -> Optional[list[Optional[np.ndarray]]]:
        """Every rank's int64 array on rank 0 (None elsewhere), in one fixed-size message of
        `gather_capacity` values. An array longer than that arrives as None: rank 0 raises the
        capacity (`scatter` tells every rank) and the caller gathers again."""
        import torch
        import torch.distributed as dist
        array = np.ascontiguousarray(array, dtype=np.int64)
        cap = self.gather_capacity

        def gather():
            message = _head_message(array, cap)
            out = ([torch.empty(1 + cap, dtype=torch.int64) for _ in range(self.world)]
                   if self.rank == 0 else None)
            dist.gather(torch.from_numpy(message), out, group=self.group, group_dst=0)
            if self.rank != 0:
                return None
            sizes = [int(o[0]) for o in out]
            self.next_gather_capacity = max(MIN_GATHER_CAPACITY, 2 * max(sizes))
            return [o[1:1 + size].numpy() if size <= cap else None
                    for o, size in zip(out, sizes)]
        return self._run("gather", gather)

    def scatter(self, arrays: Optional[list[np.ndarray]]) -> np.ndarray:
        """Rank 0's `arrays[r]` on rank r, whatever their lengths: one collective in the steady
        state. Each message holds the array's length, the longest one's, the next gather
        capacity (rank 0 saw every rank's length) and the first `scatter_capacity` values; the
        values past that go in a second round, padded to the longest."""
        import torch
        import torch.distributed as dist
        cap = self.scatter_capacity

        def scatter():
            head = torch.empty(3 + cap, dtype=torch.int64)
            parts = None
            if self.rank == 0:
                longest = max(a.shape[0] for a in arrays)
                parts = []
                for a in arrays:
                    message = np.zeros(3 + cap, dtype=np.int64)
                    message[:3] = (a.shape[0], longest, self.next_gather_capacity)
                    message[3:3 + min(a.shape[0], cap)] = a[:cap]
                    parts.append(torch.from_numpy(message))
            dist.scatter(head, parts, group=self.group, group_src=0)
            n, longest, self.gather_capacity = (int(v) for v in head[:3])
            self.scatter_capacity = max(MIN_GATHER_CAPACITY, 2 * longest)
            out = head[3:3 + min(n, cap)].numpy()
            if longest <= cap:
                return out
            tail = torch.empty(longest - cap, dtype=torch.int64)
            rests = None
            if self.rank == 0:
                rests = []
                for a in arrays:
                    rest = np.zeros(longest - cap, dtype=np.int64)
                    rest[:max(a.shape[0] - cap, 0)] = a[cap:]
                    rests.append(torch.from_numpy(rest))
            dist.scatter(tail, rests, group=self.group, group_src=0)
            return np.concatenate([out, tail[:max(n - cap, 0)].numpy()])
        return self._run("scatter", scatter)

    def broadcast(self, array: Optional[np.ndarray], size: int) -> np.ndarray:
        """Rank 0's `array` (None elsewhere), zero-padded to `size`, which every rank knows (so
        there is no size to broadcast first)."""
        import torch
        import torch.distributed as dist

        def bcast():
            if self.rank == 0:
                if array.shape[0] > size:
                    raise ValueError(f"broadcast of {array.shape[0]} values, more than size {size}")
                padded = np.zeros(size, dtype=np.int64)
                padded[:array.shape[0]] = array
                data = torch.from_numpy(padded)
            else:
                data = torch.empty(size, dtype=torch.int64)
            dist.broadcast(data, group=self.group, group_src=0)   # the group's rank 0
            return data.numpy()
        return self._run("broadcast", bcast)

    def broadcast_bytes(self, payload: Optional[bytes], src: int) -> bytes:
        """Group rank `src`'s `payload` (None elsewhere), of a size only `src` knows: the size,
        then the bytes."""
        import torch
        import torch.distributed as dist

        def bcast():
            size = torch.tensor([len(payload) if self.rank == src else 0], dtype=torch.int64)
            dist.broadcast(size, group=self.group, group_src=src)
            if self.rank == src:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            else:
                data = torch.empty(int(size[0]), dtype=torch.uint8)
            dist.broadcast(data, group=self.group, group_src=src)
            return payload if self.rank == src else data.numpy().tobytes()
        return self._run("broadcast", bcast)

    def all_to_all(self, sends: list[np.ndarray], dtype,
                   recv_sizes: list[int]) -> list[np.ndarray]:
        """sends[r] goes to rank r; returns what each rank sent here, `recv_sizes[r]` elements
        from rank r (the caller knows them: every rank knows the plan and every length)."""
        import torch
        import torch.distributed as dist

        def exchange():
            flat = torch.from_numpy(np.concatenate([np.asarray(s, dtype=dtype) for s in sends]))
            out = torch.empty(int(sum(recv_sizes)), dtype=flat.dtype)
            dist.all_to_all_single(out, flat, [int(n) for n in recv_sizes],
                                   [int(s.shape[0]) for s in sends], group=self.group)
            return np.split(out.numpy(), np.cumsum(recv_sizes)[:-1])
        return self._run("all_to_all", exchange)


def connect(timeout_s: float, topology=None) -> Comm:
    """LocalComm when torch.distributed is not initialized (or world size 1); otherwise a new
    gloo group over the same ranks, or, with a `collective.topology.Topology`, over this rank's
    DP group (the ranks sharing its (PP, CP, TP) coordinate). Every rank must construct its
    Loader in the same order, because creating a group is itself collective."""
    try:
        import torch.distributed as dist
    except ImportError:   # pragma: no cover - torch without distributed
        return LocalComm()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalComm()
    timeout = datetime.timedelta(seconds=timeout_s)
    if topology is None:
        group = dist.new_group(backend="gloo", timeout=timeout)
        return GlooComm(group, dist.get_rank(), dist.get_world_size(), timeout_s)
    if topology.dp == 1:   # every DP group is one rank: nothing to agree on
        return LocalComm()
    mine = None
    for index, ranks in enumerate(topology.dp_groups):   # every rank creates every group
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
        if index == topology.group_index:
            mine = group
    return GlooComm(mine, topology.dp_rank, topology.dp, timeout_s)


def connect_broadcast(timeout_s: float, topology) -> "tuple[Optional[Comm], GlooComm]":
    """`delivery="broadcast"`: the loader's group over the leaders (the DP group of the first
    (PP, CP, TP) coordinate; None on every other rank), and this rank's peer group: every rank
    of its DP rank, the leader among them. Every rank creates every group, in the same order."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    leaders = topology.dp_groups[0]
    leading = topology.group_index == 0
    comm: Optional[Comm] = LocalComm() if leading else None
    if topology.dp > 1:
        group = dist.new_group(ranks=list(leaders), backend="gloo", timeout=timeout)
        if leading:
            comm = GlooComm(group, topology.dp_rank, topology.dp, timeout_s)
    peers = None
    me = dist.get_rank()
    for d in range(topology.dp):
        ranks = sorted(g[d] for g in topology.dp_groups)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if d == topology.dp_rank:
            peers = GlooComm(group, ranks.index(me), len(ranks), timeout_s)
            peers.leader = ranks.index(leaders[d])
    return comm, peers


def collective_thread() -> DaemonExecutor:
    """One daemon thread that runs blocking collectives in order, awaitable from the loop
    (`await thread.run(fn)`). Gloo's own timeout bounds a wait on a dead peer."""
    return DaemonExecutor(1, "streamload-collectives")


def _head_message(array: np.ndarray, cap: int) -> np.ndarray:
    """A gather's fixed-size message: the array's length, then its first `cap` values."""
    message = np.zeros(1 + cap, dtype=np.int64)
    message[0] = array.shape[0]
    message[1:1 + min(array.shape[0], cap)] = array[:cap]
    return message
