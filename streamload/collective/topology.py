"""Where a rank sits in a job with data (DP), tensor (TP), context (CP) and pipeline (PP)
parallelism, and the loader's gloo group over its DP peers.

Only DP ranks receive distinct data: balancing, exactly-once and the mixture work over the DP
degree. Every other rank of a DP rank's group (its TP peers, CP peers and pipeline stages)
receives the same step, shaped for its role (`streamload.stage_view`).

Two ways to describe the layout:
- `Parallel(tp=2, cp=1, pp=1)` over the default process group, laid out as Megatron-LM lays
  ranks out: TP fastest, then CP, then DP, then PP (rank = ((pp·DP + dp)·CP + cp)·TP + tp).
- a `torch.distributed.DeviceMesh` whose dimension names come from DIMS; the DP degree is the
  product of the "dp*" dimensions (torchtitan's "batch" mesh), in mesh order.

Two deliveries (`Parallel.delivery`):
- "broadcast" (default): the ranks of the first (PP, CP, TP) coordinate run the loader over
  their DP group, and each broadcasts its step to the other ranks of its DP rank (`peers.py`).
  Sources are read once per DP rank.
- "replicate": every rank runs the DP-level loader of its own (TP, CP, PP) coordinate, on a gloo
  group of the ranks that share that coordinate. The plans are a pure function of the data, the
  seed and the DP degree, so the peers of one DP rank build the same step without a word
  between them; every rank reads the sources.
tests/test_topology.py checks that both give every rank the same view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import msgspec
import numpy as np

from ..errors import ConfigError

DIMS = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp")


class Parallel(msgspec.Struct, frozen=True, kw_only=True):
    """The job's parallel layout over the default process group (Megatron's order)."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    # What a middle pipeline stage receives: the rows' attention metadata (cu_seqlens,
    # max_seqlen), or nothing at all.
    pipeline_middle: Literal["metadata", "nothing"] = "metadata"
    # "broadcast": one rank per DP rank builds the step and broadcasts it to the others;
    # "replicate": every rank builds the same step from the same plan (`peers.py`).
    delivery: Literal["broadcast", "replicate"] = "broadcast"

    def __post_init__(self):
        for key in ("tp", "cp", "pp"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError.at(key, f"must be an integer >= 1, got {value!r}",
                                     where="parallel.")
        for key, choices in (("pipeline_middle", ("metadata", "nothing")),
                             ("delivery", ("broadcast", "replicate"))):
            if getattr(self, key) not in choices:
                raise ConfigError.at(key, f"must be one of {choices}, got "
                                     f"{getattr(self, key)!r}", where="parallel.")


@dataclass(frozen=True)
class Topology:
    """This rank's coordinates, and every DP group (the global ranks sharing one (PP, CP, TP)
    coordinate, in DP order; the same list on every rank, so groups are created alike)."""
    dp: int
    tp: int
    cp: int
    pp: int
    dp_rank: int
    tp_rank: int
    cp_rank: int
    pp_rank: int
    dp_groups: tuple[tuple[int, ...], ...]
    group_index: int                       # this rank's DP group in `dp_groups`
    pipeline_middle: str = "metadata"
    delivery: str = "broadcast"

    @property
    def broadcast(self) -> bool:
        """One rank per DP rank builds the step (the first (PP, CP, TP) coordinate's) and
        broadcasts it to the others."""
        return self.delivery == "broadcast" and not self.flat

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def flat(self) -> bool:
        """Every rank is a DP rank: the loader as without a topology."""
        return self.tp == self.cp == self.pp == 1

    @classmethod
    def from_parallel(cls, parallel: Parallel, world: int, rank: int) -> "Topology":
        """`parallel`'s layout of the default group (Megatron's order)."""
        per_dp = parallel.tp * parallel.cp * parallel.pp
        if world % per_dp:
            raise ConfigError.at(
                "parallel", f"tp={parallel.tp} x cp={parallel.cp} x pp={parallel.pp} = "
                f"{per_dp} does not divide the world size {world}")
        dp = world // per_dp
        ranks = np.arange(world).reshape(parallel.pp, dp, parallel.cp, parallel.tp)
        return cls._from_array(ranks, ("pp", "dp", "cp", "tp"), rank, parallel)

    @classmethod
    def from_mesh(cls, mesh, rank: int, options: Optional[Parallel] = None) -> "Topology":
        """`mesh`'s layout; `options`: its delivery and pipeline_middle (tp, cp, pp come from
        the mesh)."""
        names = tuple(mesh.mesh_dim_names or ())
        if len(names) != mesh.ndim:
            raise ConfigError.at("mesh", "the DeviceMesh needs a name for every dimension "
                                 f"(mesh_dim_names), from {DIMS}")
        unknown = [n for n in names if n not in DIMS]
        if unknown:
            raise ConfigError.at("mesh", f"unknown dimension name(s) {unknown}; "
                                 f"the loader knows {DIMS}")
        if len(set(names)) != len(names):
            raise ConfigError.at("mesh", f"dimension names repeat: {names}")
        if not any(n.startswith("dp") for n in names):
            raise ConfigError.at("mesh", f"no data-parallel dimension in {names}: name one "
                                 "'dp', 'dp_replicate' or 'dp_shard'")
        return cls._from_array(np.asarray(mesh.mesh.cpu().numpy()), names, rank,
                               options or Parallel())

    @classmethod
    def _from_array(cls, ranks: np.ndarray, names: tuple[str, ...], rank: int,
                    options: Parallel) -> "Topology":
        """`ranks`: global rank at each mesh coordinate, axes named `names`."""
        dp_axes = [i for i, n in enumerate(names) if n.startswith("dp")]
        other = [i for i in range(len(names)) if i not in dp_axes]
        # Rows: one per coordinate of the other dimensions; columns: the DP index, the dp*
        # dimensions raveled in mesh order.
        groups = np.transpose(ranks, other + dp_axes).reshape(-1, int(np.prod(
            [ranks.shape[i] for i in dp_axes])))
        where = np.argwhere(ranks == rank)
        if where.shape[0] != 1:
            raise ConfigError.at("mesh", f"rank {rank} is not in the mesh {ranks.tolist()}")
        coordinate = dict(zip(names, where[0].tolist()))
        size = dict(zip(names, ranks.shape))
        group_index, dp_rank = (int(v) for v in np.argwhere(groups == rank)[0])
        return cls(dp=groups.shape[1], tp=size.get("tp", 1), cp=size.get("cp", 1),
                   pp=size.get("pp", 1), dp_rank=dp_rank, tp_rank=coordinate.get("tp", 0),
                   cp_rank=coordinate.get("cp", 0), pp_rank=coordinate.get("pp", 0),
                   dp_groups=tuple(tuple(int(r) for r in g) for g in groups),
                   group_index=group_index, pipeline_middle=options.pipeline_middle,
                   delivery=options.delivery)


def topology_for(parallel: Optional[Parallel], mesh) -> Optional[Topology]:
    """The Loader's topology: from `mesh` (with `parallel` for its options only) or `parallel`;
    None without either."""
    if isinstance(parallel, dict):   # keyed 'parallel.tp', misspelt fields named
        from ..config import from_table
        parallel = from_table(parallel, Parallel, "parallel")
    if parallel is not None and mesh is not None and (parallel.tp, parallel.cp, parallel.pp) != (1, 1, 1):
        raise ConfigError.at("parallel", "with mesh=, the mesh gives tp, cp and pp; parallel= "
                             "may only set delivery and pipeline_middle")
    if parallel is None and mesh is None:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError.at("parallel" if mesh is None else "mesh",
                             "needs torch.distributed initialized (init_process_group) first")
    if mesh is not None:
        return Topology.from_mesh(mesh, dist.get_rank(), parallel)
    return Topology.from_parallel(parallel, dist.get_world_size(), dist.get_rank())
