"""Errors that say how to fix them: S3 credentials name the endpoint and every way to give
credentials (never the credentials), bad records their line and on_error="skip", a missing field
the fields present, misspelt options the option meant, and only streamload errors are raised.

Real parts throughout (a moto S3 server, files, the Loader); a mock only injects what moto cannot
produce: it accepts any credentials, so a rejected key is injected into the client call."""
from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
from botocore.exceptions import ClientError

import streamload as sl
from streamload.config import make_config
from streamload.configfile import parse_config
from streamload.errors import DataError, StreamloadError
from streamload.formats import write_jsonl
from streamload.storage import RetryPolicy
from streamload.storage.s3 import S3Store

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.002,
                   request_timeout_s=5.0)
# Every way to give credentials, another endpoint or anonymous access, by name.
HOW_TO_FIX = ['storage_options={"key": ..., "secret": ...}', '"profile"', "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", '"endpoint_url"', "AWS_ENDPOINT_URL_S3"]


def run(sources, **options):
    options.setdefault("micro_batch_tokens", 256)
    options.setdefault("micro_batches", 1)
    options.setdefault("epochs", 1)
    with sl.Loader(sources, **options) as loader:
        return [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]


def read(options, uri, *, fault=None):
    """store.read_range(uri, 0, 3) with `options`, its get_object failing with `fault` if given;
    the StorageError it raises, or the bytes."""
    async def go():
        async with S3Store(options, retry=FAST) as store:
            if fault is not None:
                client = await store._get_client()

                async def rejected(**kwargs):
                    raise fault
                client.get_object = rejected
            return await store.read_range(uri, 0, 3)
    return asyncio.run(go())


def _client_error(code: str, status: int = 403) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "injected"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.fixture
def public_object(s3_bucket):
    """(uri of an object anyone may read, uri of one only its owner may)."""
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="public.jsonl", Body=b'{"text": "hi"}\n',
                      ACL="public-read")
    client.put_object(Bucket=bucket, Key="private.jsonl", Body=b'{"text": "hi"}\n')
    return f"s3://{bucket}/public.jsonl", f"s3://{bucket}/private.jsonl"


def no_credentials(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)


# --- S3 credentials -------------------------------------------------------------------------

def test_no_credentials_names_the_endpoint_and_every_way_to_give_them(
        public_object, storage_options, monkeypatch):
    no_credentials(monkeypatch)   # a real NoCredentialsError: nothing in the chain
    _, private = public_object
    with pytest.raises(sl.StorageError) as info:
        read(storage_options, private)
    message = str(info.value)
    assert message.startswith(f"no S3 credentials found for {private}.")
    assert f"Endpoint: {storage_options['endpoint_url']}." in message
    for name in HOW_TO_FIX + ['{"anon": True}']:
        assert name in message, (name, message)
    assert info.value.uri == private


def test_no_credentials_through_the_loader(public_object, storage_options, monkeypatch):
    no_credentials(monkeypatch)
    _, private = public_object
    with pytest.raises(sl.StorageError, match=r"no S3 credentials found .*AWS_ACCESS_KEY_ID"):
        run([sl.Source(private)], storage_options=storage_options)


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"])
def test_rejected_credentials_say_where_they_came_from_never_what_they_are(
        public_object, storage_options, code):
    _, private = public_object
    secret = "SECRET-" + uuid.uuid4().hex
    options = {**storage_options, "key": "AKIA-" + uuid.uuid4().hex, "secret": secret}
    with pytest.raises(sl.StorageError) as info:
        read(options, private, fault=_client_error(code))
    message = str(info.value)
    assert message.startswith(f"S3 rejected the credentials used for {private} ({code}).")
    assert f"Endpoint: {storage_options['endpoint_url']}. Credentials: from storage_options." \
        in message
    for name in HOW_TO_FIX:
        assert name in message, (name, message)
    assert secret not in message and options["key"] not in message


def test_access_denied_names_the_environment_as_the_credentials_source(
        public_object, storage_options):
    _, private = public_object   # the s3_server fixture's credentials are in the environment
    with pytest.raises(sl.StorageError) as info:
        read(storage_options, private, fault=_client_error("AccessDenied"))
    message = str(info.value)
    assert message.startswith(f"access denied to {private} (AccessDenied).")
    assert "Credentials: from the environment (AWS_ACCESS_KEY_ID)." in message
    assert "bucket policy" in message and "testing" not in message   # the fixture's keys


def test_anonymous_access_reads_a_public_object_without_credentials(
        public_object, storage_options, monkeypatch):
    no_credentials(monkeypatch)
    public, private = public_object
    anon = {**storage_options, "anon": True}
    assert read(anon, public) == b'{"t'
    # anon wins over keys shared by every source (the Loader's storage_options).
    assert read({**anon, "key": "AKIA-X", "secret": "s", "profile": "absent"}, public) == b'{"t'
    assert run([sl.Source(public)], storage_options=anon) == ["public/public.jsonl/0"]
    with pytest.raises(sl.StorageError) as info:   # a real 403: the bucket is not public
        read(anon, private)
    message = str(info.value)
    assert message.startswith(f"access denied to {private} for an anonymous request")
    assert 'drop "anon"' in message and "AWS_ACCESS_KEY_ID" in message


def test_anonymous_option_is_checked():
    with pytest.raises(sl.ConfigError, match=r"anon: must be True or False, got 'yes'"):
        S3Store({"anon": "yes"})
    with pytest.raises(sl.ConfigError, match=r"did you mean 'endpoint_url'\?") as info:
        S3Store({"endpont_url": "http://127.0.0.1:1"})
    assert info.value.key == "endpont_url"


def test_a_missing_profile_and_a_bad_endpoint_are_streamload_errors(public_object,
                                                                    storage_options):
    _, private = public_object
    with pytest.raises(sl.StorageError, match=r"cannot load S3 credentials for .*ProfileNotFound"
                                              r".*AWS_PROFILE"):
        read({**storage_options, "profile": "no-such-profile"}, private)
    with pytest.raises(sl.ConfigError, match=r"endpoint_url: .*localhost:9000.*http\(s\)://"):
        read({"endpoint_url": "localhost:9000"}, private)


def test_the_s3_endpoint_variable_comes_before_the_general_one(public_object, s3_server,
                                                               monkeypatch):
    public, _ = public_object
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    assert read({}, public) == b'{"t'


# --- bad records: line, record, on_error="skip" -----------------------------------------------

def test_a_bad_jsonl_record_names_its_line_and_how_to_skip_it(tmp_path):
    (tmp_path / "web").mkdir()
    lines = [b'{"text": "fine %d"}' % i for i in range(41)] + [b'{"text": broken']
    (tmp_path / "web" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(sl.DataError) as info:
        run([sl.Source(str(tmp_path / "web"))])
    message = str(info.value)
    assert message.startswith("source 'web', shard 'a.jsonl', record 41 (line 42): invalid JSON")
    assert message.endswith('To skip bad records and count them in stats(), set '
                            'on_error="skip".')
    assert (info.value.record, info.value.line) == (41, 42)
    ids = run([sl.Source(str(tmp_path / "web"))], on_error="skip")   # record ids unchanged
    assert sorted(ids, key=lambda i: int(i.rsplit("/", 1)[1])) == \
        [f"web/a.jsonl/{i}" for i in range(41)]


def test_a_missing_field_lists_the_fields_present(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "x", "id": 1}\n{"text": "y", "id": 2}\n')
    with pytest.raises(sl.DataError) as info:
        run([sl.Source(str(tmp_path / "a.jsonl"), text_field="body")])
    assert "record 0 (line 1): missing field 'body'; fields present: 'text', 'id'; set the " \
           "source's text_field to the field that holds the text." in str(info.value)
    with pytest.raises(sl.DataError, match=r"fields present: 'text', 'id'; did you mean "
                                           r"text_field='text'\?"):
        run([sl.Source(str(tmp_path / "a.jsonl"), text_field="txt")])
    (tmp_path / "b.jsonl").write_bytes(b"{}\n")
    with pytest.raises(sl.DataError, match=r"missing field 'text'; the record has no fields"):
        run([sl.Source(str(tmp_path / "b.jsonl"))])


def test_other_formats_errors_say_how_to_skip_too(tmp_path):
    np.save(tmp_path / "t.tokens.npy", np.array([1, 2, 3, -1], dtype=np.int32))   # signed ids
    np.save(tmp_path / "t.offsets.npy", np.array([0, 2, 4], dtype=np.int64))
    with pytest.raises(sl.DataError) as info:
        run([sl.Source(str(tmp_path / "t.tokens.npy"))])
    message = str(info.value)
    assert "record 1: negative token id" in message and "(line" not in message
    assert message.endswith('set on_error="skip".')


def test_the_skip_hint_is_given_where_skip_would_skip():
    assert str(DataError("bad", source="s", shard="x", record=3)) == \
        "source 's', shard 'x', record 3: bad. To skip bad records and count them in stats(), " \
        'set on_error="skip".'
    assert str(DataError("corrupt", source="s", shard="x", skippable=True)).endswith(
        'To skip the rest of a bad shard and count it in stats(), set on_error="skip".')
    # Errors that on_error="skip" does not skip do not offer it.
    assert str(DataError("the tokenizer failed", source="s", shard="x")) == \
        "source 's', shard 'x': the tokenizer failed"


def test_a_corrupt_compressed_shard_says_how_to_skip_it(tmp_path):
    (tmp_path / "z.jsonl.gz").write_bytes(b"not gzip at all" * 10)
    with pytest.raises(sl.DataError, match=r"shard 'z\.jsonl\.gz': corrupt gzip data.*To skip "
                                           r"the rest of a bad shard"):
        run([sl.Source(str(tmp_path / "z.jsonl.gz"))])


# --- misspelt options and keys ---------------------------------------------------------------

def test_unknown_loader_option_suggests_the_one_meant():
    with pytest.raises(sl.ConfigError) as info:
        sl.Loader([sl.Source("/tmp/x")], micro_batch_token=4096)
    assert str(info.value) == ("unknown option 'micro_batch_token'; did you mean "
                               "'micro_batch_tokens'?")
    assert info.value.key == "micro_batch_token"
    with pytest.raises(sl.ConfigError, match=r"did you mean 'storage_options'\?"):
        sl.Loader([sl.Source("/tmp/x")], storage_option={})   # a Loader argument
    with pytest.raises(sl.ConfigError, match=r"unknown option 'zzzz'; known: autoscale, "):
        make_config(zzzz=1)


def test_a_retry_dict_is_checked_field_by_field():
    with pytest.raises(sl.ConfigError) as info:
        make_config(retry={"max_attemps": 3})   # was silently ignored
    assert str(info.value) == "retry.max_attemps: unknown field; did you mean 'max_attempts'?"
    with pytest.raises(sl.ConfigError) as info:
        make_config(retry={"max_attempts": "x"})
    assert info.value.key == "retry.max_attempts" and "$" not in str(info.value)
    with pytest.raises(sl.ConfigError) as info:
        make_config(retry={"max_attempts": 0})
    assert str(info.value) == "retry.max_attempts: must be >= 1, got 0"
    assert make_config(retry={"max_attempts": 3}).retry == RetryPolicy(max_attempts=3)


def test_a_struct_given_as_a_dict_is_checked_with_the_paths_the_user_wrote():
    from streamload.collective.topology import Parallel
    from streamload.config import check_fields, from_table

    cases = [({"tpp": 2}, "parallel.tpp", "unknown field; did you mean 'tp'?"),
             ({"tp": 0}, "parallel.tp", "must be an integer >= 1, got 0"),
             ({"tp": "2"}, "parallel.tp", "Expected int, got str"),
             ({"delivery": "bcast"}, "parallel.delivery",
              "must be one of 'broadcast', 'replicate', got 'bcast'")]
    for values, key, problem in cases:
        with pytest.raises(sl.ConfigError) as info:
            from_table(values, Parallel, "parallel")
        assert (info.value.key, info.value.problem) == (key, problem)
        assert str(info.value) == f"{key}: {problem}"
    assert from_table({"tp": np.int64(2)}, Parallel, "parallel") == Parallel(tp=2)
    with pytest.raises(sl.ConfigError, match=r"^mixture\.schedule\[0\]\.weights\.web: must be a "
                                             r"finite number >= 0"):
        from_table({"schedule": [{"at": 0, "weights": {"web": -1}}]}, sl.Mixture, "mixture")
    with pytest.raises(sl.ConfigError, match=r"^mixture\.wieghts: unknown field; did you mean "
                                             r"'weights'\?"):
        check_fields({"wieghts": {"web": 1}}, sl.Mixture, "mixture")


@pytest.mark.parametrize("text, key, meant", [
    ('[loader]\nplaner = "naive"\n', "loader.planer", "planner"),
    ("[mixtures]\n", "mixtures", "mixture"),
    ("[cost]\ndocument_mask = true\n", "cost.document_mask", "document_masking"),
    ('[mixture]\nschedule_units = "steps"\n', "mixture.schedule_units", "schedule_unit"),
    ('[[source]]\nuri = "a.jsonl"\ntext_feild = "body"\n', "source[0].text_feild", "text_field"),
])
def test_unknown_toml_keys_suggest_the_one_meant(text, key, meant):
    with pytest.raises(sl.ConfigError) as info:
        parse_config(text + '[[source]]\nuri = "b.jsonl"\n', "train.toml")
    assert str(info.value) == f"train.toml: {key}: unknown key; did you mean {meant!r}?"
    assert info.value.key == key


# --- only streamload errors --------------------------------------------------------------------

def test_an_empty_text_field_is_a_config_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    with pytest.raises(sl.ConfigError, match="text_field: must be a non-empty string"):
        run([sl.Source(str(tmp_path / "a.jsonl"), text_field="")])


def test_the_demo_error_is_a_streamload_error():
    from streamload.commands.demo.run import DemoError
    assert issubclass(DemoError, StreamloadError) and issubclass(DemoError, RuntimeError)


def test_an_unknown_protocol_is_a_config_error_naming_the_one_meant():
    with pytest.raises(sl.ConfigError, match=r"gcss:// URIs: Protocol not known: gcss; did you "
                                             r"mean gcs://\?"):
        run([sl.Source("gcss://bucket/web/")])


def test_a_mixture_or_parallel_dict_is_checked_like_the_struct(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    source = sl.Source(str(tmp_path / "a.jsonl"))
    with pytest.raises(sl.ConfigError, match=r"^mixture\.wieghts: unknown field; did you mean "
                                             r"'weights'\?"):
        run([source], mixture={"wieghts": {"a": 1}})   # was silently ignored
    with pytest.raises(sl.ConfigError, match=r"^mixture\.by: must be 'tokens' or 'samples'"):
        run([source], mixture={"by": 3})                # was a msgspec.ValidationError at $.by
    with pytest.raises(sl.ConfigError, match=r"^mixture: must be a Mixture or a dict"):
        run([source], mixture=[("a", 1)])
    with pytest.raises(sl.ConfigError, match=r"^parallel\.tpp: unknown field; did you mean "
                                             r"'tp'\?"):
        run([source], parallel={"tpp": 2})
    with pytest.raises(sl.ConfigError, match=r"^parallel\.tp: Expected int, got str"):
        run([source], parallel={"tp": "2"})


def test_load_state_dict_after_iterating_is_a_usage_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"] * 4)
    with sl.Loader([sl.Source(str(tmp_path / "a.jsonl"))], micro_batch_tokens=64) as loader:
        next(iter(loader))
        state = loader.state_dict()
        with pytest.raises(sl.UsageError, match="before iterating") as info:
            loader.load_state_dict(state)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, sl.StreamloadError)


def test_the_writers_raise_config_errors(tmp_path):
    from streamload.formats import write_token_shard

    with pytest.raises(sl.ConfigError) as info:
        write_jsonl(tmp_path / "a.jsonl", ["x"], compression="bz2")
    assert info.value.key == "compression"
    with pytest.raises(sl.ConfigError) as info:
        write_token_shard(tmp_path / "t", [np.array([1.5])])
    assert info.value.key == "docs[0]"
