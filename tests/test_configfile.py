"""TOML configuration files: a full file parses into sources, options and a mixture; every
kind of mistake is a ConfigError that names the file, the key path and the problem."""
from __future__ import annotations

import os
import re
import textwrap
from typing import Literal

import pytest

from streamload.config import LoaderConfig, Source
from streamload.configfile import LoaderSpec, load_config, parse_config
from streamload.errors import ConfigError
from streamload.plan.mix_spec import LengthQuota, MixPoint
from streamload.storage.retry import RetryPolicy

pytestmark = pytest.mark.core

FULL = """
[loader]
micro_batch_tokens = 8192
micro_batches = 4
seed = 7
epochs = 1
planner = "balanced"
tokenizer = "mypkg.tok:encode"

[cost]
a = 0.0002
b = 1.0
document_masking = false

[retry]
max_attempts = 3

[storage]
endpoint_url = "http://127.0.0.1:9000"

[mixture]
by = "tokens"
schedule_unit = "steps"
interpolate = "linear"

[[mixture.schedule]]
at = 0
weights = { web = 0.7, code = 0.3, books = 0.0 }

[[mixture.schedule]]
at = 5000
weights = { web = 0.4, code = 0.3, books = 0.3 }

[[mixture.quota]]
source = "books"
min_length = 4096
fraction = 0.2

[[source]]
name = "web"
uri = "s3://bucket/web/"
weight = 0.7
text_field = "content"

[[source]]
uri = "data/code/"
format = "jsonl"

[[source]]
uri = "/abs/books/*.jsonl.zst"
storage_options = { anon = true }
"""

MINIMAL = """
[[source]]
uri = "s3://bucket/web/"
"""


def write(tmp_path, text, name="train.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_full_file(tmp_path):
    path = write(tmp_path, FULL)
    spec = load_config(path)
    assert isinstance(spec, LoaderSpec) and spec.path == str(path)
    assert [s.name for s in spec.sources] == ["web", "code", "books"]
    web, code, books = spec.sources
    assert web == Source("s3://bucket/web/", weight=0.7, name="web", text_field="content")
    assert code.uri == os.path.join(str(tmp_path), "data", "code") + "/"   # relative to the file
    assert code.format == "jsonl" and code.weight == 1.0
    assert books.uri == "/abs/books/*.jsonl.zst" and books.storage_options == {"anon": True}
    assert spec.options == {"micro_batch_tokens": 8192, "micro_batches": 4, "seed": 7,
                            "epochs": 1, "planner": "balanced", "cost_a": 0.0002, "cost_b": 1.0,
                            "document_masking": False, "retry": RetryPolicy(max_attempts=3)}
    config = spec.config()
    assert isinstance(config, LoaderConfig) and config.cost_a == 0.0002
    assert spec.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert spec.tokenizer == "mypkg.tok:encode"
    m = spec.mixture
    assert m.by == "tokens" and m.interpolate == "linear" and m.schedule_unit == "steps"
    assert m.schedule == (MixPoint(at=0, weights={"web": 0.7, "code": 0.3, "books": 0.0}),
                          MixPoint(at=5000, weights={"web": 0.4, "code": 0.3, "books": 0.3}))
    assert m.quotas == (LengthQuota(source="books", min_length=4096, fraction=0.2),)


def test_minimal_file(tmp_path):
    spec = load_config(write(tmp_path, MINIMAL))
    assert [s.name for s in spec.sources] == ["web"]
    assert spec.options == {} and spec.storage_options is None and spec.tokenizer is None
    assert spec.mixture.schedule == () and spec.mixture.weights is None


def test_mixture_weights_table(tmp_path):
    spec = load_config(write(tmp_path, MINIMAL + """
[[source]]
uri = "s3://bucket/code/"

[mixture]
by = "samples"
weights = { web = 3, code = 1 }
"""))
    assert spec.mixture.by == "samples" and spec.mixture.weights == {"web": 3.0, "code": 1.0}


def test_source_policies(tmp_path):
    spec = load_config(write(tmp_path, MINIMAL + 'on_exhausted = "restart"\nrepeat = 2\n'))
    assert spec.sources[0].on_exhausted == "restart" and spec.sources[0].repeat == 2


class GrownSource(Source, kw_only=True):
    """Source with a field it does not have (yet)."""
    priority: Literal["low", "high"] = "low"
    passes: int = 1


def test_any_field_source_gains_is_read(tmp_path, monkeypatch):
    """Keys come from Source's own fields: fields added to Source work in files at once."""
    import streamload.configfile as configfile

    monkeypatch.setattr(configfile, "Source", GrownSource)
    spec = load_config(write(tmp_path, MINIMAL + 'priority = "high"\npasses = 3\n'))
    assert spec.sources[0].priority == "high" and spec.sources[0].passes == 3
    path = write(tmp_path, MINIMAL + 'priority = "later"\n')
    with pytest.raises(ConfigError, match=re.escape(
            f"{path}: source[0].priority: must be one of 'low', 'high', got 'later'")):
        load_config(path)


def test_tokenizer_is_imported_on_request(tmp_path):
    spec = load_config(write(tmp_path, '[loader]\ntokenizer = "os.path:basename"\n' + MINIMAL))
    assert spec.load_tokenizer().fn is os.path.basename     # a per-document callable
    assert load_config(write(tmp_path, MINIMAL)).load_tokenizer() is None
    path = write(tmp_path, '[loader]\ntokenizer = "no_such_module_xyz:encode"\n' + MINIMAL)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: loader.tokenizer: cannot import")):
        load_config(path).load_tokenizer()
    path = write(tmp_path, '[loader]\ntokenizer = "os:sep"\n' + MINIMAL)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: loader.tokenizer: 'os:sep': ")
                       + ".*must be a callable"):
        load_config(path).load_tokenizer()


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: cannot read the configuration file"):
        load_config(tmp_path / "nope.toml")


def test_bad_toml_names_the_line(tmp_path):
    path = write(tmp_path, '[loader]\nseed = 1\nmicro_batches = = 4\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: invalid TOML: ") + r".*line 3"):
        load_config(path)


SOURCES_2 = """
[[source]]
name = "web"
uri = "s3://b/web/"
[[source]]
name = "books"
uri = "s3://b/books/"
"""


def replace(text, old, new):
    assert old in text, old
    return text.replace(old, new, 1)


@pytest.mark.parametrize("text, key, problem", [
    # top level and [loader]
    ("[model]\nx = 1\n" + MINIMAL, "model", "unknown key; known: loader, cost"),
    ("[loader]\nmicro_batchs = 4\n" + MINIMAL, "loader.micro_batchs",
     "unknown key; did you mean 'micro_batches'?"),
    ("[loader]\nzzz = 4\n" + MINIMAL, "loader.zzz", "unknown key; known: micro_batch_tokens, "),
    ("[mixtures]\nby = 'tokens'\n" + MINIMAL, "mixtures", "unknown key; did you mean 'mixture'?"),
    ("[retry]\nmax_attempt = 2\n" + MINIMAL, "retry.max_attempt",
     "unknown key; did you mean 'max_attempts'?"),
    ('[loader]\nmicro_batches = "4"\n' + MINIMAL, "loader.micro_batches", "Expected int, got str"),
    ("[loader]\nmicro_batches = 0\n" + MINIMAL, "loader.micro_batches", "must be an integer >= 1"),
    ("[loader]\nepochs = true\n" + MINIMAL, "loader.epochs", "Expected int | null, got bool"),
    ('[loader]\non_error = "ignore"\n' + MINIMAL, "loader.on_error",
     "must be one of 'raise', 'skip', got 'ignore'"),
    ('[loader]\nplanner = "fast"\n' + MINIMAL, "loader.planner",
     "must be one of 'naive', 'balanced', 'lookahead', got 'fast'"),
    ("[loader]\ncost_a = 0.1\n" + MINIMAL, "loader.cost_a", "goes in [cost] a"),
    ("[loader]\nmicro_batch_tokens = 8192\nbuffer_tokens = 4096\n" + MINIMAL,
     "loader.buffer_tokens", "must be >= micro_batch_tokens (8192)"),
    ("[loader]\ntokenizer = 3\n" + MINIMAL, "loader.tokenizer", "must be a string 'module:attribute'"),
    ("loader = 3\n" + MINIMAL, "loader", "must be a table, got an integer"),
    # [cost], [retry]
    ("[cost]\na = -1.0\n" + MINIMAL, "cost.a", "must be a finite number >= 0"),
    ("[cost]\nc = 1.0\n" + MINIMAL, "cost.c", "unknown key; known: a, b, document_masking"),
    ('[cost]\ndocument_masking = "yes"\n' + MINIMAL, "cost.document_masking", "Expected bool"),
    ("[retry]\nmax_attempts = 0\n" + MINIMAL, "retry.max_attempts", "must be >= 1"),
    ("[retry]\nattempts = 2\n" + MINIMAL, "retry.attempts", "unknown key"),
    # [[source]]
    ("[loader]\nseed = 1\n", "source", "no sources: add at least one [[source]]"),
    ('[source]\nuri = "s3://b/web/"\n', "source", "must be an array of tables"),
    (SOURCES_2 + '[[source]]\nname = "code"\n', "source[2].uri", "missing"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\nweight = -2'),
     "source[1].weight", "must be a finite number >= 0, got -2.0"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\nwieght = 2'),
     "source[1].wieght", "unknown key; did you mean 'weight'?"),
    (replace(replace(SOURCES_2, 'name = "books"', 'name = "books"\nweight = 0'),
             'uri = "s3://b/web/"', 'uri = "s3://b/web/"\nweight = 0'),
     "source", "every source's weight is 0; at least one must be positive"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\nweight = "high"'),
     "source[1].weight", "Expected float, got str"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\ncolour = "red"'),
     "source[1].colour", "unknown key; known: uri, weight"),
    (replace(SOURCES_2, 'name = "books"', 'name = "web"'),
     "source[1].name", "duplicate source name 'web' (also source[0])"),
    (replace(SOURCES_2, 'name = "books"', 'name = "a/b"'), "source[1].name", "must be non-empty"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\nformat = "csv"'),
     "source[1].format", "must be one of 'jsonl', 'tokens', 'parquet'"),
    (replace(SOURCES_2, 'uri = "s3://b/web/"', 'uri = ""'), "source[0].uri", "must not be empty"),
    # [mixture]
    (SOURCES_2 + "[mixture]\nmode = 1\n", "mixture.mode", "unknown key; known: by, weights"),
    (SOURCES_2 + "[mixture]\nweigths = { web = 1 }\n", "mixture.weigths",
     "unknown key; did you mean 'weights'?"),
    (SOURCES_2 + '[mixture]\nby = "bytes"\n', "mixture.by", "must be 'tokens' or 'samples'"),
    (SOURCES_2 + '[mixture]\ninterpolate = "cubic"\n', "mixture.interpolate",
     "must be 'linear' or 'step'"),
    (SOURCES_2 + "[mixture]\nweights = { web = 1 }\n", "mixture.weights",
     "missing source(s) books"),
    (SOURCES_2 + "[mixture]\nweights = { web = 1, books = -1 }\n", "mixture.weights.books",
     "must be a finite number >= 0, got -1.0"),
    (SOURCES_2 + "[mixture]\nweights = { web = 1, books = 1, math = 1 }\n",
     "mixture.weights.math", "unknown source 'math'; sources: web, books"),
    (SOURCES_2 + "[mixture]\nweights = [1, 2]\n", "mixture.weights", "must be a table"),
    (SOURCES_2 + "[[mixture.schedule]]\nat = 0\nweights = { web = 1, books = 0 }\n"
                 "[[mixture.schedule]]\nat = 10\nweights = { web = 1, books = -0.5 }\n",
     "mixture.schedule[1].weights.books", "must be a finite number >= 0"),
    (SOURCES_2 + "[[mixture.schedule]]\nat = 0\nweights = { web = 1, math = 1, books = 0 }\n",
     "mixture.schedule[0].weights.math", "unknown source 'math'"),
    (SOURCES_2 + "[[mixture.schedule]]\nat = 10\nweights = { web = 1, books = 0 }\n"
                 "[[mixture.schedule]]\nat = 5\nweights = { web = 1, books = 1 }\n",
     "mixture.schedule[1].at", "points must be in increasing order of `at`: 5.0 follows 10.0"),
    (SOURCES_2 + "[[mixture.schedule]]\nweights = { web = 1, books = 0 }\n",
     "mixture.schedule[0].at", "missing"),
    (SOURCES_2 + '[[mixture.schedule]]\nat = "start"\nweights = { web = 1, books = 0 }\n',
     "mixture.schedule[0].at", "Expected float, got str"),
    (SOURCES_2 + "[[mixture.schedule]]\nat = 0\nweights = { web = 0, books = 0 }\n",
     "mixture.schedule[0].weights", "every source's weight is 0"),
    (SOURCES_2 + "[mixture]\nweights = { web = 1, books = 1 }\n"
                 "[[mixture.schedule]]\nat = 0\nweights = { web = 1, books = 0 }\n",
     "mixture.weights", "give either weights or a schedule"),
    (SOURCES_2 + '[mixture]\nschedule = "linear"\n', "mixture.schedule",
     "must be an array of tables"),
    (SOURCES_2 + '[[mixture.quota]]\nsource = "math"\nfraction = 0.1\n',
     "mixture.quota[0].source", "unknown source 'math'"),
    (SOURCES_2 + "[[mixture.quota]]\nfraction = 1.5\n", "mixture.quota[0].fraction",
     "must be a number in (0, 1]"),
    (SOURCES_2 + "[[mixture.quota]]\nmin_length = 100\n", "mixture.quota[0].fraction", "missing"),
    (SOURCES_2 + '[[mixture.quota]]\nmin_length = "long"\nfraction = 0.1\n',
     "mixture.quota[0].min_length", "Expected int, got str"),
    (SOURCES_2 + "[[mixture.quota]]\nmin_length = 100\nmax_length = 50\nfraction = 0.1\n",
     "mixture.quota[0].max_length", "must be an integer > min_length (100)"),
    (SOURCES_2 + "[[mixture.quota]]\nmin_length = 100\nfraction = 0.1\n"
                 '[[mixture.quota]]\nsource = "books"\nmin_length = 10\nmax_length = 200\n'
                 "fraction = 0.1\n",
     "mixture.quota[1]", "overlaps quotas[0]"),
    (SOURCES_2 + "[[mixture.quota]]\nmin_length = 8192\nfraction = 0.1\n",
     "mixture.quota[0].min_length", "8192 is more than micro_batch_tokens (4096)"),
    (SOURCES_2 + '[[mixture.quota]]\nsource = "books"\nfraction = 0.6\n',
     "mixture.quota[0].fraction", "0.6 of every step from source 'books', but its share is only 0.5"),
    (SOURCES_2 + "[[mixture.quota]]\nfraction = 0.5\nbucket = 1\n", "mixture.quota[0].bucket",
     "unknown key; known: source, min_length, max_length, fraction"),
])
def test_errors_name_file_key_and_problem(tmp_path, text, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert problem in message, message
    assert info.value.key == key                      # carried, not parsed from the message
    assert problem in info.value.problem and not info.value.problem.startswith(f"{key}:")


@pytest.mark.parametrize("text, key", [
    ('[loader]\nplanner = "bogus"\n' + MINIMAL, "loader.planner"),
    ("[loader]\nlookahead = 0\n" + MINIMAL, "loader.lookahead"),
    ("[cost]\nb = -1.0\n" + MINIMAL, "cost.b"),
    (replace(SOURCES_2, 'name = "books"', 'name = "books"\nweight = -1'), "source[1].weight"),
    (SOURCES_2 + "[[mixture.quota]]\nfraction = 0.7\n[[mixture.quota]]\nsource = \"web\"\n"
                 "max_length = 10\nfraction = 0.1\n", "mixture.quota[1]"),
])
def test_config_error_carries_the_key_path(tmp_path, text, key):
    """The file's key path is the error's `key`; the option's own check supplies the problem
    (one rule, one message: the same as for keyword options, under another key)."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.key == key
    assert str(info.value).endswith(f"{key}: {info.value.problem}")


def test_keyword_options_and_the_file_share_one_check(tmp_path):
    import streamload as sl
    from streamload.config import make_config

    with pytest.raises(ConfigError) as info:
        sl.Loader([sl.Source("/tmp/x")], planner="bogus")
    assert info.value.key == "planner"
    assert str(info.value) == "planner: must be one of 'naive', 'balanced', 'lookahead', got 'bogus'"
    with pytest.raises(ConfigError) as from_file:
        load_config(write(tmp_path, '[loader]\nplanner = "bogus"\n' + MINIMAL))
    assert from_file.value.problem == info.value.problem
    for option, value in (("lookahead", 0), ("cost_a", float("nan")), ("planner", 3)):
        with pytest.raises(ConfigError) as info:
            make_config(**{option: value})
        assert info.value.key == option
    with pytest.raises(ConfigError) as info:
        Source("s3://b/web/", weight=-1)
    assert info.value.key == "weight"
    assert info.value.problem == "must be a finite number >= 0, got -1.0"


def test_parse_config_without_a_file():
    spec = parse_config(MINIMAL, "inline.toml")
    assert spec.path == "inline.toml"
    with pytest.raises(ConfigError, match=r"^inline\.toml: source: no sources"):
        parse_config("", "inline.toml")


def test_numpy_numbers_are_accepted_as_plain_numbers_in_keywords():
    """Keyword options convert NumPy scalars as a config file's values do (`_plain_number`):
    a step size computed with NumPy is an int, not 'Expected int, got numpy.int64'."""
    import numpy as np
    from streamload.config import make_config
    config = make_config(micro_batch_tokens=np.int64(4096), micro_batches=np.int32(2),
                         step_overhead=np.float32(0.25))
    assert (config.micro_batch_tokens, config.micro_batches) == (4096, 2)
    assert type(config.micro_batch_tokens) is int and config.step_overhead == 0.25
    with pytest.raises(ConfigError, match="micro_batches"):
        make_config(micro_batches=np.bool_(True))
