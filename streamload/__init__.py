"""streamload: stream many sources, balance compute cost across data-parallel ranks."""
import logging as _logging

# The "streamload" logger is quiet unless the application configures logging (INFO: what a
# loader reads and its memory budget; WARNING: steps running short, sources with fewer shards
# than ranks, sources running out).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
from .collective.topology import Parallel
from .config import LoaderConfig, Source
from .errors import (ConfigError, DataError, DistributedError, StorageError, StreamloadError,
                     UsageError)
from .configfile import LoaderSpec, load_config
from .plan.cost import CostModel
from .plan.quota_mixer import MixtureState
from .plan.mix_spec import LengthQuota, Mixture, MixPoint
from .storage.retry import RetryPolicy
from .tokenizer import HFTokenizer

__all__ = ["Loader", "Source", "Batch", "MicroBatch", "CostModel", "LoaderConfig", "RetryPolicy",
           "HFTokenizer", "Mixture", "MixPoint", "LengthQuota", "MixtureState", "LoaderSpec",
           "load_config", "StreamloadError", "ConfigError", "StorageError", "DataError",
           "DistributedError", "UsageError", "Parallel"]
__version__ = "0.1.0"

# Loader, Batch and MicroBatch need torch, which takes seconds to import: they are imported on
# first use, so `streamload --version`, `inspect`, `plan` and `report` (and `import streamload`)
# do not import it (tests/test_cli_imports.py).
_NEED_TORCH = {"Loader": ".loader", "Batch": ".batch", "MicroBatch": ".batch"}


def __getattr__(name: str):
    module = _NEED_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_NEED_TORCH))
