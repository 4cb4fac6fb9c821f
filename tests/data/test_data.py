"""Data loaders and tokenisers: format and error handling on small files written here, and small slices of
the real datasets in ../shared/data (skipped, with the reason, where that folder is absent)."""

from __future__ import annotations

import tarfile

import pytest
import torch

from clusterformer.data import (
    ByteTokenizer,
    WordTokenizer,
    kfold_indices,
    load_20news,
    load_classification_task,
    load_imdb,
    load_labeled_file,
    resolve_data_dir,
)
from shared_data import SHARED, needs_data


def test_labeled_file_latin1_nel_bytes_tsv_and_names(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"0 caf\xe9 is fine\n1 two\x85parts stay one line\n\n1 last\n")  # Latin-1 with a NEL byte
    texts, labels, names = load_labeled_file(path)
    assert texts == ["café is fine", "two\x85parts stay one line", "last"] and labels == [0, 1, 1]
    assert names == ["0", "1"]
    tsv = tmp_path / "b.tsv"
    tsv.write_text("pos\tgood film\nneg\tbad one\npos\tfine\n", encoding="utf-8")
    texts, labels, names = load_labeled_file(tsv)
    assert names == ["neg", "pos"] and labels == [1, 0, 1] and texts[0] == "good film"


@pytest.mark.parametrize(("content", "match"), [
    (b" no label here\n", "expected 'label<space>text'"), (b"", "holds no examples"), (b"0 a\n3 b\n", "must be 0..C-1"),
])
def test_labeled_file_errors_name_the_file(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as exc:
        load_labeled_file(path)
    assert "bad.txt" in str(exc.value)


def test_missing_and_corrupt_files_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="expected a file"):
        load_labeled_file(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_data_dir(tmp_path / "absent")
    (tmp_path / "20news").mkdir()
    (tmp_path / "20news" / "20news-bydate.tar.gz").write_bytes(b"not a tar file")
    with pytest.raises(ValueError, match=r"not a readable \.tar\.gz"):
        load_20news(tmp_path)
    with pytest.raises(ValueError, match="expected the archive"):
        load_imdb(tmp_path)
    with pytest.raises(ValueError, match="unknown classification task"):
        load_classification_task("sst2", tmp_path)


def test_data_dir_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERFORMER_DATA", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    other = tmp_path / "x"
    other.mkdir()
    assert resolve_data_dir(other) == other
    monkeypatch.delenv("CLUSTERFORMER_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "clusterformer" / "data").mkdir(parents=True)
    assert resolve_data_dir() == tmp_path / "clusterformer" / "data"


def test_tar_loader_reads_label_folders(tmp_path):
    root = tmp_path / "imdb"
    root.mkdir()
    with tarfile.open(root / "aclImdb_train_test.tar.gz", "w:gz") as archive:
        for split in ("train", "test"):
            for label, text in (("neg", "awful"), ("pos", "great <br />film"), ("unsup", "ignored")):
                src = tmp_path / f"{split}{label}.txt"
                src.write_text(text, encoding="utf-8")
                archive.add(src, arcname=f"aclImdb/{split}/{label}/1_1.txt")
    data = load_imdb(tmp_path)
    assert sorted(zip(data.train_labels, data.train_texts, strict=True)) == [(0, "awful"), (1, "great <br />film")]
    assert data.num_classes == 2 and len(data.test_texts) == 2


def test_kfold_indices_partition():
    folds = kfold_indices(23, 10, seed=3)
    tests = [set(t) for _, t in folds]
    assert set().union(*tests) == set(range(23)) and sum(len(t) for t in tests) == 23
    for train, test in folds:
        assert not set(train) & set(test) and len(train) + len(test) == 23
    assert folds == kfold_indices(23, 10, seed=3) and folds != kfold_indices(23, 10, seed=4)
    with pytest.raises(ValueError, match="k must be <= n"):
        kfold_indices(3, 5, seed=0)


def test_word_and_byte_tokenizers():
    tok = WordTokenizer.train(["the film was good", "The film, was bad!"], vocab_size=100)
    ids, pad = tok.encode(["the film was great", "good"], max_len=8)
    assert ids.shape == (2, 4) and torch.equal(pad, ids == 0)
    assert ids[0, 3].item() == 1  # "great" is unknown
    assert ids[1, 1:].eq(0).all() and not pad[1, 0]
    again = WordTokenizer.from_str(tok.to_str())
    assert torch.equal(again.encode(["the film was great"], 8)[0], ids[:1])
    bytes_ids, bytes_pad = ByteTokenizer().encode(["ab", "é"], max_len=3)
    assert bytes_ids.tolist() == [[98, 99], [196, 170]] and not bytes_pad.any()
    with pytest.raises(ValueError, match="max_len"):
        ByteTokenizer().encode(["a"], max_len=0)


def test_wordpiece_splits_a_word_outside_the_vocabulary_into_pieces_where_words_give_unk():
    """The subword vocabulary BERT pretrains with: a word never seen in training is read as pieces of the
    vocabulary (decoded back to the word), where the word-level vocabulary of the same texts reads [UNK]."""
    texts = ["the films were playing", "a player plays the film", "playing films, played films"] * 3
    words = WordTokenizer.train(texts, vocab_size=200, pairs=True, masked=True)
    pieces = WordTokenizer.train(texts, vocab_size=200, pairs=True, masked=True, subword=True)
    assert (words.kind, pieces.kind) == ("word", "wordpiece")
    unseen = ["the players filmed"]  # neither "players" nor "filmed" is a training word
    word_ids, _ = words.encode(unseen, max_len=16)
    piece_ids, piece_pad = pieces.encode(unseen, max_len=16)
    assert (word_ids == 1).sum().item() == 2  # both unknown words are [UNK]
    real = piece_ids[0][~piece_pad[0]].tolist()
    assert 1 not in real and len(real) > 3  # no [UNK]: the two words are split into known pieces
    assert pieces._tok.decode(real) == "the players filmed"
    specials = pieces.mlm_specials()
    assert (specials.mask, specials.cls, specials.sep) == (3, 4, 2) == (words.mlm_specials().mask,
                                                                         words.mlm_specials().cls,
                                                                         words.mlm_specials().sep)
    vocab = pieces._tok.get_vocab()  # ids independent of the trainer's hash order: specials, then sorted pieces
    assert sorted(vocab, key=vocab.get)[5:] == sorted(set(vocab) - {"[PAD]", "[UNK]", "[SEP]", "[MASK]", "[CLS]"})
    again = WordTokenizer.from_str(pieces.to_str())  # a checkpoint restores the subwords, not words
    assert again.kind == "wordpiece" and torch.equal(again.encode(unseen, 16)[0], piece_ids)
    stream = pieces.stream(unseen + unseen, sep=specials.sep)
    assert stream.tolist() == [*real, specials.sep, *real]


@needs_data
@pytest.mark.parametrize(("name", "size", "classes"), [("mr", 10662, 2), ("cr", 3775, 2), ("subj", 10000, 2),
                                                       ("mpqa", 10606, 2)])
def test_real_sentence_tasks(name, size, classes):
    data = load_classification_task(name, SHARED)
    assert len(data.train_texts) == size and data.num_classes == classes and not data.test_texts
    assert all("\n" not in t for t in data.train_texts) and sum(1 for t in data.train_texts if t) > size - 10
    small = load_classification_task(name, SHARED, limit=50)
    assert len(small.train_texts) == 50 and len(set(small.train_labels)) == 2  # the slice mixes both classes
    most = load_classification_task(name, SHARED, limit=size - 1)  # beyond half the file: no silent cap
    assert len(most.train_texts) == size - 1 and len(set(most.train_labels[:50])) == 2


@needs_data
def test_real_20news_and_imdb_slices():
    news = load_20news(SHARED, limit_per_class=3)
    assert news.num_classes == 20 and len(news.train_texts) == 60 and len(news.test_texts) == 60
    assert news.label_names[0] == "alt.atheism" and news.label_names[-1] == "talk.religion.misc"
    assert "Subject:" in news.train_texts[0]
    imdb = load_imdb(SHARED, limit_per_class=4)
    assert sorted(imdb.train_labels) == [0] * 4 + [1] * 4 and len(imdb.test_texts) == 8


def test_download_verifies_checksums_against_a_local_server(tmp_path, monkeypatch):
    """Downloads run against a local HTTP server (the only network a test can rely on)."""
    import functools
    import hashlib
    import http.server
    import threading

    from clusterformer.data import download as dl

    served = tmp_path / "served"
    served.mkdir()
    (served / "good.txt").write_bytes(b"0 fine\n1 great\n")
    (served / "tampered.txt").write_bytes(b"0 evil\n")
    digest = hashlib.sha256(b"0 fine\n1 great\n").hexdigest()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        monkeypatch.setitem(dl.SOURCES, "toy", [("toy/train.all", base + "good.txt", "sha256", digest)])
        monkeypatch.setitem(dl.SOURCES, "bad", [("bad/train.all", base + "tampered.txt", "sha256", digest)])
        monkeypatch.setitem(dl.SOURCES, "gone", [("gone/x", base + "missing.txt", "sha256", digest)])
        dest = tmp_path / "data"
        lines = []
        assert dl.download("toy", dest, log=lines.append) == [dest / "toy" / "train.all"]
        assert load_labeled_file(dest / "toy" / "train.all")[1] == [0, 1]
        assert dl.download("toy", dest, log=lines.append) and "checksum ok" in lines[-1]  # kept, not refetched
        with pytest.raises(ValueError, match="expected " + digest):
            dl.download("bad", dest, log=lines.append)
        assert not (dest / "bad" / "train.all").exists() and not list((dest / "bad").iterdir())
        with pytest.raises(ValueError, match="could not download"):
            dl.download("gone", dest, log=lines.append)
        with pytest.raises(ValueError, match="unknown dataset"):
            dl.download("enwik8", dest)
    finally:
        server.shutdown()


@needs_data
def test_download_table_matches_the_project_copies():
    """The checksums in the download table are those of the files the project's loaders were tested on."""
    import hashlib

    from clusterformer.data.download import SOURCES

    for name, files in SOURCES.items():
        if name in ("20news", "imdb"):  # fetched from the original distributions; the copies were repacked
            continue
        for rel, _, algorithm, expected in files:
            assert hashlib.new(algorithm, (SHARED / rel).read_bytes()).hexdigest() == expected, rel
