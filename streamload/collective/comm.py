"""The loader's collectives, on its own gloo group (never the trainer's NCCL group).

Every call blocks, so the runtime runs them on one dedicated daemon thread (`CollectiveThread`)
and the event loop keeps fetching meanwhile. With one rank, `LocalComm` does the same work
without torch.distributed.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, TypeVar

import numpy as np

from ..errors import DistributedError
from ..pipeline.workers import DaemonExecutor
from .launch import members_per_node

T = TypeVar("T")


class Comm(Protocol):
    rank: int
    world: int

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]: ...
    def broadcast(self, array: Optional[np.ndarray], size: int) -> np.ndarray: ...
    def all_to_all(self, sends: list[np.ndarray], dtype,
                   recv_sizes: list[int]) -> list[np.ndarray]: ...
    def all_to_all_flat(self, flat: np.ndarray, send_sizes, recv_sizes) -> np.ndarray: ...

    def gather(self, array: np.ndarray) -> Optional[list[Optional[np.ndarray]]]: ...

    def scatter(self, arrays: Optional[list[np.ndarray]]) -> np.ndarray: ...


MIN_GATHER_CAPACITY = 1024
WORD = 8   # bytes per int64 value


class Traffic:
    """The control plane's bytes through this rank (gather and scatter, both levels), as the
    messages are sized (padding included): what `stats()["control_plane"]` reports."""
    def __init__(self):
        self.sent = self.received = self.rounds = 0

    def snapshot(self) -> dict:
        return {"bytes_sent": self.sent, "bytes_received": self.received,
                "collectives": self.rounds}


class LocalComm:
    rank, world = 0, 1
    path, nodes = "local", None

    def __init__(self):
        self.traffic = Traffic()

    def layout(self) -> dict:
        return {"path": self.path}

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

    def all_to_all_flat(self, flat, send_sizes, recv_sizes):
        return flat


@dataclass(frozen=True)
class Nodes:
    """The two-level gather's layout: nodes of `size` consecutive ranks, this rank's `node` and
    its index in it (`local`; 0: the node's leader), the node's group, and the leaders'
    group (None on the other ranks)."""
    size: int
    count: int
    node: int
    local: int
    group: object
    leaders: object


class GlooComm:
    """Collectives on the loader's gloo group. Buffers are filled in NumPy and received into
    `torch.empty`: a torch fill or copy of a large tensor runs on torch's OpenMP threads, whose
    spin-waiting afterwards doubled the loader's CPU time per step (measured at 2 ranks).

    With `nodes` (more than one node), `gather` and `scatter` go through one leader per node:
    a rank's summary goes to its node's leader, each leader sends its node's to rank 0 in one
    message, and the replies come back the same way. Rank 0 then receives one message per
    node, and no message crosses nodes more than once."""
    def __init__(self, group, rank: int, world: int, timeout_s: float,
                 nodes: Optional[Nodes] = None):
        self.group, self.rank, self.world, self.timeout_s = group, rank, world, timeout_s
        self.nodes = nodes
        self.gather_capacity = MIN_GATHER_CAPACITY   # values per rank in all_gather's 1st round
        self.next_gather_capacity = MIN_GATHER_CAPACITY   # rank 0, gather: from the sizes seen
        self.scatter_capacity = MIN_GATHER_CAPACITY  # values per rank in scatter's 1st round
        # two levels: the leaders' messages (a node's summaries, a node's replies)
        self.leader_capacity = self.next_leader_capacity = MIN_GATHER_CAPACITY
        self.leader_scatter_capacity = MIN_GATHER_CAPACITY
        self.traffic = Traffic()

    @property
    def path(self) -> str:
        """How `gather` and `scatter` go: "gather" (to rank 0), or "node_gather" (through one
        leader per node)."""
        return "gather" if self.nodes is None else "node_gather"

    def layout(self) -> dict:
        out = {"path": self.path}
        if self.nodes is not None:
            out.update(nodes=self.nodes.count, node_size=self.nodes.size, node=self.nodes.node,
                       leader=self.nodes.local == 0)
        return out

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
            self._all_gathered(message.nbytes)
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
            self._all_gathered(rest.nbytes)
            return [np.concatenate([head, tail[:max(size - cap, 0)].numpy()])
                    for head, tail, size in zip(heads, tails, sizes)]
        return self._run("all_gather", gather)

    def _all_gathered(self, nbytes: int) -> None:
        """An all_gather's logical bytes: this rank's message to, and one from, every other."""
        self.traffic.rounds += 1
        self.traffic.sent += (self.world - 1) * nbytes
        self.traffic.received += (self.world - 1) * nbytes

    def gather(self, array: np.ndarray) -> Optional[list[Optional[np.ndarray]]]:
        """Every rank's int64 array on rank 0 (None elsewhere), in one fixed-size message of
        `gather_capacity` values. An array longer than that arrives as None: rank 0 raises the
        capacity (`scatter` tells every rank) and the caller gathers again."""
        array = np.ascontiguousarray(array, dtype=np.int64)
        if self.nodes is not None:
            return self._run("gather", lambda: self._node_gather(array))

        def gather():
            got = _gather_fixed(self.group, self.rank, self.world, array, self.gather_capacity,
                                self.traffic)
            if got is None:
                return None
            arrays, sizes = got
            self.next_gather_capacity = max(MIN_GATHER_CAPACITY, 2 * max(sizes))
            return arrays
        return self._run("gather", gather)

    def _node_gather(self, array: np.ndarray) -> Optional[list[Optional[np.ndarray]]]:
        """The two-level gather: to the node's leader, then each node's (packed) to rank 0."""
        nodes = self.nodes
        got = _gather_fixed(nodes.group, nodes.local, nodes.size, array, self.gather_capacity,
                            self.traffic)
        if got is None:   # not a leader
            return None
        arrays, sizes = got
        packed = _pack(arrays, sizes)
        got = _gather_fixed(nodes.leaders, nodes.node, nodes.count, packed,
                            self.leader_capacity, self.traffic)
        if got is None:   # a leader other than rank 0
            return None
        out, longest, unseen = [], 0, False
        for message in got[0]:
            if message is None:   # the node's message outgrew the leaders' capacity
                out += [None] * nodes.size
                unseen = True
                continue
            node_arrays, node_sizes = _unpack(message)
            out += node_arrays
            longest = max(longest, *node_sizes)
        # (a node not seen: its ranks' lengths unknown, so the capacity does not shrink)
        self.next_gather_capacity = max(MIN_GATHER_CAPACITY, 2 * longest,
                                        self.gather_capacity if unseen else 0)
        self.next_leader_capacity = max(MIN_GATHER_CAPACITY, 2 * max(got[1]))
        return out

    def scatter(self, arrays: Optional[list[np.ndarray]]) -> np.ndarray:
        """Rank 0's `arrays[r]` on rank r, whatever their lengths: one collective in the steady
        state. Each message holds the array's length, the longest one's, the next gather
        capacity (rank 0 saw every rank's length) and the first `scatter_capacity` values; the
        values past that go in a second round, padded to the longest."""
        if self.nodes is not None:
            return self._run("scatter", lambda: self._node_scatter(arrays))

        def scatter():
            mine, longest, (self.gather_capacity,) = _scatter_fixed(
                self.group, self.rank, arrays, self.scatter_capacity,
                [self.next_gather_capacity], self.traffic)
            self.scatter_capacity = max(MIN_GATHER_CAPACITY, 2 * longest)
            return mine
        return self._run("scatter", scatter)

    def _node_scatter(self, arrays: Optional[list[np.ndarray]]) -> np.ndarray:
        """The two-level scatter: each node's replies (packed) to its leader, then to each."""
        nodes = self.nodes
        members = None
        if nodes.local == 0:
            parts = None
            if self.rank == 0:
                parts = [_pack(arrays[n * nodes.size:(n + 1) * nodes.size])
                         for n in range(nodes.count)]
            packed, longest, (gather_cap, self.leader_capacity) = _scatter_fixed(
                nodes.leaders, nodes.node, parts, self.leader_scatter_capacity,
                [self.next_gather_capacity, self.next_leader_capacity], self.traffic)
            self.leader_scatter_capacity = max(MIN_GATHER_CAPACITY, 2 * longest)
            self.next_gather_capacity = gather_cap   # what the node's ranks are told next
            members = _unpack(packed)[0]
        mine, longest, (self.gather_capacity,) = _scatter_fixed(
            nodes.group, nodes.local, members, self.scatter_capacity,
            [self.next_gather_capacity], self.traffic)
        self.scatter_capacity = max(MIN_GATHER_CAPACITY, 2 * longest)
        return mine

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
            self.traffic.rounds += 1
            if self.rank == 0:
                self.traffic.sent += (self.world - 1) * size * WORD
            else:
                self.traffic.received += size * WORD
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
        flat = np.concatenate([np.asarray(s, dtype=dtype) for s in sends])
        out = self.all_to_all_flat(flat, [s.shape[0] for s in sends], recv_sizes)
        return np.split(out, np.cumsum(recv_sizes)[:-1])

    def all_to_all_flat(self, flat: np.ndarray, send_sizes, recv_sizes) -> np.ndarray:
        """`flat` holds what goes to each rank, one after the other (`send_sizes[r]` elements
        to rank r); returns what every rank sent here, one after the other (`recv_sizes[r]`
        from rank r)."""
        import torch
        import torch.distributed as dist
        recv = [int(n) for n in np.asarray(recv_sizes).tolist()]
        send = [int(n) for n in np.asarray(send_sizes).tolist()]

        def exchange():
            data = torch.from_numpy(np.ascontiguousarray(flat))
            out = torch.empty(sum(recv), dtype=data.dtype)
            dist.all_to_all_single(out, data, recv, send, group=self.group)
            return out.numpy()
        return self._run("all_to_all", exchange)


def connect(timeout_s: float, topology=None, by_node: bool = False) -> Comm:
    """LocalComm when torch.distributed is not initialized (or world size 1); otherwise a new
    gloo group over the same ranks, or, with a `collective.topology.Topology`, over this rank's
    DP group (the ranks sharing its (PP, CP, TP) coordinate). `by_node`: when the group spans
    more than one node (`launch.members_per_node`), `gather` and `scatter` go through one
    leader per node, on groups of their own (`node_layout`). Every rank must construct its
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
        rank, world = dist.get_rank(), dist.get_world_size()
        nodes = node_layout([range(world)], 0, rank, timeout) if by_node else None
        return GlooComm(group, rank, world, timeout_s, nodes)
    if topology.dp == 1:   # every DP group is one rank: nothing to agree on
        return LocalComm()
    mine = None
    for index, ranks in enumerate(topology.dp_groups):   # every rank creates every group
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
        if index == topology.group_index:
            mine = group
    nodes = node_layout(topology.dp_groups, topology.group_index, topology.dp_rank,
                        timeout) if by_node else None
    return GlooComm(mine, topology.dp_rank, topology.dp, timeout_s, nodes)


def node_layout(groups, mine: Optional[int], member: int, timeout) -> Optional[Nodes]:
    """The two-level gather's groups for each of `groups` (each its global ranks, in group
    order) that spans more than one node (`launch.members_per_node`): one per node, and the
    nodes' leaders' (every rank creates every group, in the same order). This rank's `Nodes`
    in group `mine` (None: in none), where it is member `member`; None when that group is on
    one node."""
    import torch.distributed as dist
    out = None
    for index, ranks in enumerate(groups):
        ranks = list(ranks)
        k = members_per_node(ranks)
        if k is None:
            continue
        count = len(ranks) // k
        per_node = [dist.new_group(ranks=ranks[n * k:(n + 1) * k], backend="gloo",
                                   timeout=timeout) for n in range(count)]
        leaders = dist.new_group(ranks=ranks[::k], backend="gloo", timeout=timeout)
        if index == mine:
            node, local = divmod(member, k)
            out = Nodes(k, count, node, local, per_node[node], leaders if local == 0 else None)
    return out


def connect_broadcast(timeout_s: float, topology,
                      by_node: bool = False) -> "tuple[Optional[Comm], GlooComm]":
    """`delivery="broadcast"`: the loader's group over the leaders (the DP group of the first
    (PP, CP, TP) coordinate; None on every other rank; through one leader per node with
    `by_node`, as `connect`), and this rank's peer group: every rank of its DP rank, the leader
    among them. Every rank creates every group, in the same order."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    leaders = topology.dp_groups[0]
    leading = topology.group_index == 0
    comm: Optional[Comm] = LocalComm() if leading else None
    if topology.dp > 1:
        group = dist.new_group(ranks=list(leaders), backend="gloo", timeout=timeout)
        nodes = node_layout([leaders], 0 if leading else None, topology.dp_rank,
                            timeout) if by_node else None
        if leading:
            comm = GlooComm(group, topology.dp_rank, topology.dp, timeout_s, nodes)
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


def _gather_fixed(group, rank: int, size: int, array: np.ndarray, cap: int, traffic: Traffic):
    """`array` from every rank of `group` to its rank 0, in one message of 1 + `cap` values:
    there, (arrays, sizes) with None for an array longer than `cap`; None on the others."""
    import torch
    import torch.distributed as dist
    message = _head_message(array, cap)
    out = [torch.empty(1 + cap, dtype=torch.int64) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.from_numpy(message), out, group=group, group_dst=0)
    traffic.rounds += 1
    if rank != 0:
        traffic.sent += message.nbytes
        return None
    traffic.received += (size - 1) * message.nbytes
    sizes = [int(o[0]) for o in out]
    return [o[1:1 + n].numpy() if n <= cap else None for o, n in zip(out, sizes)], sizes


def _scatter_fixed(group, rank: int, arrays: Optional[list[np.ndarray]], cap: int,
                   header: list[int], traffic: Traffic) -> tuple[np.ndarray, int, list[int]]:
    """`arrays[r]` from `group`'s rank 0 to its rank r; returns (this rank's array, the longest
    array's length, `header`'s values as rank 0 sent them). One message of the length, the
    longest, the header and `cap` values; what is past `cap` in a second round, padded to the
    longest."""
    import torch
    import torch.distributed as dist
    h = 2 + len(header)
    head = torch.empty(h + cap, dtype=torch.int64)
    parts = None
    if rank == 0:
        longest = max(a.shape[0] for a in arrays)
        parts = []
        for a in arrays:
            message = np.zeros(h + cap, dtype=np.int64)
            message[:h] = (a.shape[0], longest, *header)
            message[h:h + min(a.shape[0], cap)] = a[:cap]
            parts.append(torch.from_numpy(message))
    dist.scatter(head, parts, group=group, group_src=0)
    n, longest, *values = (int(v) for v in head[:h])
    sent = (len(arrays) - 1) * (h + cap) * WORD if rank == 0 else 0
    received = 0 if rank == 0 else (h + cap) * WORD
    out = head[h:h + min(n, cap)].numpy()
    traffic.rounds += 1
    if longest > cap:
        tail = torch.empty(longest - cap, dtype=torch.int64)
        rests = None
        if rank == 0:
            rests = []
            for a in arrays:
                rest = np.zeros(longest - cap, dtype=np.int64)
                rest[:max(a.shape[0] - cap, 0)] = a[cap:]
                rests.append(torch.from_numpy(rest))
        dist.scatter(tail, rests, group=group, group_src=0)
        traffic.rounds += 1
        sent += (len(arrays) - 1) * (longest - cap) * WORD if rank == 0 else 0
        received += 0 if rank == 0 else (longest - cap) * WORD
        out = np.concatenate([out, tail[:max(n - cap, 0)].numpy()])
    traffic.sent += sent
    traffic.received += received
    return out, longest, values


def _pack(arrays: list[Optional[np.ndarray]], sizes: Optional[list[int]] = None) -> np.ndarray:
    """A node's arrays in one: their count, each one's length (-1 - its length: it outgrew the
    gather, and is not there), then their values."""
    sizes = [a.shape[0] for a in arrays] if sizes is None else sizes
    lengths = [n if a is not None else -1 - n for a, n in zip(arrays, sizes)]
    return np.concatenate([np.array([len(arrays), *lengths], np.int64),
                           *[a.astype(np.int64) for a in arrays if a is not None]])


def _unpack(message: np.ndarray) -> tuple[list[Optional[np.ndarray]], list[int]]:
    count = int(message[0])
    at, arrays, sizes = 1 + count, [], []
    for n in message[1:1 + count].tolist():
        if n < 0:
            arrays.append(None)
            sizes.append(-1 - n)
            continue
        arrays.append(message[at:at + n])
        sizes.append(n)
        at += n
    return arrays, sizes
