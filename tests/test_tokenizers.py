"""Real tokenizers: a Hugging Face `tokenizers.Tokenizer` (one batch call per range, on threads or
in processes), per-document callables, and tokenizers that fail on a record."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from streamload import pieces
from corpus import texts
from streamload.formats import write_jsonl

tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.timeout(120)


def bpe_tokenizer(training_texts):
    """A byte-level BPE trained here (no download), with a BOS added by its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>", "<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """root/web/part-00{0,1}.jsonl with known texts, some with non-ASCII characters."""
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(5)
    docs = {}
    for i in range(2):
        shard = [t + (" naïve Zürich 東京" if k % 3 == 0 else "") for k, t in
                 enumerate(texts(rng, 40, median=300))]
        path = root / "web" / f"part-{i:03d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, shard)
        docs.update({f"web/{path.name}/{r}": text for r, text in enumerate(shard)})
    return root, docs, bpe_tokenizer(list(docs.values()))


def delivered(loader) -> dict[str, list[int]]:
    """document id -> its tokens (the pieces of a split document joined in their order)."""
    parts: dict[str, dict[tuple[int, int], list[int]]] = {}
    for batch in loader:
        for mb in batch.micro_batches:
            tokens, bounds = mb.tokens.tolist(), mb.cu_seqlens.tolist()
            for sample, a, b in zip(mb.sample_ids, bounds, bounds[1:]):
                doc, k, offset = pieces.parse(sample)
                assert (k, offset) not in parts.setdefault(doc, {}), f"{sample} twice"
                parts[doc][(k, offset)] = tokens[a:b]
    return {doc: [t for key in sorted(p) for t in p[key]] for doc, p in parts.items()}


@pytest.mark.parametrize("tokenize_in", ["threads", "processes"])
@pytest.mark.parametrize("form", ["tokenizer", "wrapped"])
def test_a_hugging_face_tokenizer_gives_its_own_ids_for_every_document(corpus, tokenize_in, form):
    root, docs, tok = corpus
    eos = tok.token_to_id("<eos>")
    if form == "tokenizer":   # passed as is: the library's add_special_tokens=True, so a BOS
        tokenizer = tok
        expected = {k: tok.encode(t).ids for k, t in docs.items()}
    else:
        tokenizer = sl.HFTokenizer(tok, add_special_tokens=False, eos_id=eos)
        expected = {k: tok.encode(t, add_special_tokens=False).ids + [eos] for k, t in docs.items()}
    with sl.Loader([sl.Source(str(root / "web"))], micro_batch_tokens=64, micro_batches=2,
                   epochs=1, tokenizer=tokenizer, tokenize_in=tokenize_in,
                   tokenizer_processes=2) as loader:
        got = delivered(loader)
    assert got == expected
    assert any(len(ids) > 64 for ids in expected.values()), "some documents must be split"


def test_a_transformers_fast_tokenizer_gives_what_it_gives_itself(corpus):
    """`transformers.AutoTokenizer` returns such a tokenizer; the loader uses its backend."""
    transformers = pytest.importorskip("transformers")
    root, docs, tok = corpus
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    expected = {k: fast(t)["input_ids"] for k, t in docs.items()}   # its own call, as a user would
    assert any(ids[0] == tok.token_to_id("<bos>") for ids in expected.values())
    with sl.Loader([sl.Source(str(root / "web"))], micro_batch_tokens=64, micro_batches=2,
                   epochs=1, tokenizer=fast) as loader:
        assert delivered(loader) == expected


def failing_tokenizer(text: str) -> list[int]:
    if "Zürich" in text and len(text) % 2 == 0:
        raise ValueError("cannot handle this one")
    return [ord(c) % 1000 for c in text]


def test_a_document_the_tokenizer_fails_on_is_named_or_skipped_and_counted(corpus):
    root, docs, _ = corpus
    bad = sorted(k for k, t in docs.items() if "Zürich" in t and len(t) % 2 == 0)
    assert bad
    source = sl.Source(str(root / "web"))
    with pytest.raises(sl.DataError) as err:
        with sl.Loader([source], micro_batch_tokens=256, epochs=1,
                       tokenizer=failing_tokenizer) as loader:
            list(loader)
    message = str(err.value)
    assert "web" in message and "part-00" in message and "cannot handle this one" in message
    assert any(f"{k.split('/')[1]}" in message and f"record {k.rsplit('/', 1)[1]}" in message
               for k in bad), message
    with sl.Loader([source], micro_batch_tokens=256, epochs=1, tokenizer=failing_tokenizer,
                   on_error="skip") as loader:
        got = delivered(loader)
        web = loader.stats()["sources"]["web"]
    assert web["skipped_records"] == len(bad)
    assert all("cannot handle this one" in r for r in web["skip_reasons"])
    assert set(got) == set(docs) - set(bad)
    assert all(got[k] == failing_tokenizer(docs[k]) for k in got)


def test_a_tokenizer_giving_no_ids_makes_an_empty_document_not_an_error(tmp_path):
    """A Python tokenizer returns [] for a text it has nothing for; np.asarray([]) is float64,
    which is no reason to refuse it: the document is empty, counted, and the rest arrive."""
    write_jsonl(tmp_path / "web" / "part-000.jsonl", ["alpha", "-", "gamma", "--", "delta"])
    def tokenizer(text):
        return [] if text.startswith("-") else [ord(c) for c in text]
    with sl.Loader([sl.Source(str(tmp_path / "web"))], micro_batch_tokens=64, epochs=1,
                   tokenizer=tokenizer) as loader:
        got = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        web = loader.stats()["sources"]["web"]
    assert sorted(got) == [f"web/part-000.jsonl/{r}" for r in (0, 2, 4)]
    assert web["empty_documents"] == 2 and web["skipped_records"] == 0


class ShortBatch:
    def encode_texts(self, texts):
        return [[1, 2, 3] for _ in texts[1:]]


class NegativeInt32:
    def encode_texts(self, texts):
        return [np.array([5, -1, 7], dtype=np.int32) for _ in texts]


@pytest.mark.parametrize("tokenizer, error", [
    (ShortBatch(), r"returned \d+ results for \d+ documents"),
    (NegativeInt32(), r"record 0: token id -1 is outside"),   # int32 ids are checked too
])
def test_what_a_bad_batch_tokenizer_returns_is_an_error_naming_the_shard(corpus, tokenizer, error):
    root, _, _ = corpus
    with pytest.raises(sl.DataError, match=error) as err:
        with sl.Loader([sl.Source(str(root / "web"))], micro_batch_tokens=256, epochs=1,
                       tokenizer=tokenizer) as loader:
            list(loader)
    assert "web" in str(err.value) and "part-00" in str(err.value)


@pytest.mark.parametrize("bad", [42, "gpt2"])
def test_a_tokenizer_that_is_none_of_the_accepted_kinds_is_refused(corpus, bad):
    root, _, _ = corpus
    with pytest.raises(sl.ConfigError, match="tokenizer"):
        sl.Loader([sl.Source(str(root / "web"))], tokenizer=bad)


def test_hf_tokenizer_refuses_a_bad_eos_id(corpus):
    _, _, tok = corpus
    with pytest.raises(sl.ConfigError, match="eos_id"):
        sl.HFTokenizer(tok, eos_id=-1)


EXIT_SCRIPT = """
import sys
import streamload as sl
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
with sl.Loader([sl.Source(sys.argv[1])], micro_batch_tokens=64, micro_batches=2, epochs=None,
               tokenizer=tok, transform_workers=2, shard_prefetch=4) as loader:
    for step, batch in enumerate(loader):
        if step == 2:
            break
print("closed")
"""


def test_the_process_exits_cleanly_right_after_closing_a_loader_with_a_hf_tokenizer(corpus, tmp_path):
    """Closing waits for the transform threads' tokenizer calls: a daemon thread stopped inside
    `encode_batch` at interpreter exit aborts the process ("FATAL: exception not rethrown")."""
    import subprocess
    import sys
    _, _, tok = corpus
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(9)   # ranges that take the tokenizer a while (~0.1 s each)
    for i in range(2):
        write_jsonl(tmp_path / "long" / f"part-{i}.jsonl", texts(rng, 400, median=2500, sigma=0.3))
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "long"),
                              str(tmp_path / "tok.json")], capture_output=True, text=True,
                             timeout=90)
        assert run.returncode == 0 and "closed" in run.stdout, run.stderr[-2000:]
        assert "FATAL" not in run.stderr


def run_briefly_in_processes(root: str) -> None:
    with sl.Loader([sl.Source(root)], micro_batch_tokens=64, micro_batches=2, epochs=None,
                   tokenizer=failing_tokenizer, on_error="skip", tokenize_in="processes",
                   tokenizer_processes=2) as loader:
        for step, _ in enumerate(loader):
            if step == 2:
                break


def test_a_multiprocessing_child_with_tokenizer_processes_exits_after_closing(corpus):
    """The tokenizer pool is shut down and waited for: a pool left running keeps a
    multiprocessing child from exiting (it joins its own children first)."""
    from distributed import start_process   # forked with torch imported: no fresh import
    root, _, _ = corpus
    child = start_process(run_briefly_in_processes, str(root / "web"), daemon=False)
    child.join(180)
    alive = child.is_alive()
    if alive:
        child.kill()
        child.join()
    assert not alive and child.exitcode == 0
