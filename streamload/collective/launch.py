"""What the launcher's environment says about this process: is it one of several ranks?

torchrun (and launchers that follow its env:// convention) put RANK, LOCAL_RANK and WORLD_SIZE
into every process's environment. A Loader built in such a process while torch.distributed is
not initialized would find no process group, run as a single rank, and read the whole data set
on every rank: a run that trains on the wrong data and says nothing. `check_launch` refuses it.

It raises rather than calling `init_process_group` itself, because the default group belongs
to the trainer: the trainer picks its backend (NCCL), timeout and device, and a second
`init_process_group` (the trainer's own, after the loader's) fails with "trying to initialize
the default process group twice".
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

from ..errors import UsageError

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _number(value: Optional[str]) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:   # not a launcher's value
        return 0


def launched_ranks(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The launcher's variables, when they say this process is one of several ranks
    (WORLD_SIZE > 1, or a RANK or LOCAL_RANK above 0); {} otherwise."""
    values = {name: environ[name] for name in LAUNCH_VARIABLES if name in environ}
    several = (_number(values.get("WORLD_SIZE")) > 1 or _number(values.get("RANK")) > 0
               or _number(values.get("LOCAL_RANK")) > 0)
    return values if several else {}


def check_launch(environ: Mapping[str, str] = os.environ) -> None:
    """Raise UsageError when the environment says this is one of several ranks and
    torch.distributed is not initialized. Call it before deciding the loader's world."""
    values = launched_ranks(environ)
    if not values:
        return
    try:
        import torch.distributed as dist
        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:   # pragma: no cover - torch without distributed
        initialized = False
    if initialized:
        return
    said = ", ".join(f"{name}={value}" for name, value in values.items())
    raise UsageError(
        f"the environment says this process is one of several ranks ({said}, as torchrun "
        "sets), but torch.distributed is not initialized, so the Loader would run as one rank "
        "and every process would read the whole data set. Call "
        "torch.distributed.init_process_group(...) on every rank before building the Loader "
        "(the trainer's own group, e.g. init_process_group('nccl'); the loader makes a gloo "
        "group of its own from it)")


def members_per_node(ranks: Sequence[int],
                     environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """How many consecutive members of a group (its global `ranks`, in the group's order)
    share each node, when the group spans more than one node with more than one member and
    the same count on each. A node: LOCAL_WORLD_SIZE consecutive global ranks (torchrun sets
    it; under SLURM, srun plus torchrun does). None: one node, one member per node, uneven
    nodes, or not known."""
    size = _number(environ.get("LOCAL_WORLD_SIZE"))
    if size < 2:
        return None
    nodes = [r // size for r in ranks]
    k = nodes.count(nodes[0]) if nodes else 0
    if not 1 < k < len(ranks) or len(ranks) % k:
        return None
    runs = [nodes[i:i + k] for i in range(0, len(ranks), k)]
    if any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        return None
    return k
