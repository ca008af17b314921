"""streamload: stream many sources, balance compute cost across data-parallel ranks."""
import logging as _logging

# The "streamload" logger is quiet unless the application configures logging (INFO: what a
# loader reads and its memory budget; WARNING: steps running short, sources with fewer shards
# than ranks, sources running out).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
from .batch import Batch, MicroBatch
from .collective.topology import Parallel
from .config import LoaderConfig, Source
from .errors import (ConfigError, DataError, DistributedError, StorageError, StreamloadError,
                     UsageError)
from .loader import Loader
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
