"""Build the English training corpus for ferrum's tiny model from pinned Debian doc packages.

Usage: python tools/build_corpus.py --out .device_carry/corpus [--debs DIR]

Each package is fetched with `apt-get download NAME=VERSION` (run `apt-get update` first) unless
its .deb is already in --debs. The HTML pages named by each source's globs are reduced to their
prose (paragraphs, list items, headings, definitions; code blocks, tables and navigation dropped),
paragraphs are deduplicated across the whole corpus, and every page becomes one document. About
2% of the documents, chosen by a hash of their path, form the held-out split.

Writes train.jsonl and heldout.jsonl (one {"source", "path", "text"} object per line) and
manifest.json (packages, versions, licenses, document and character counts).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    license: str
    globs: tuple[str, ...]
    excludes: tuple[str, ...] = ()


SOURCES: tuple[Source, ...] = (
    Source(
        "python3.11-doc",
        "3.11.2-6+deb12u9",
        "PSF-2.0 (Python Software Foundation License)",
        ("usr/share/doc/python3.11/html/*.html", "usr/share/doc/python3.11/html/*/*.html"),
        ("*/genindex*", "*/py-modindex*", "*/search.html", "*/_static/*", "*/whatsnew/changelog*"),
    ),
    Source(
        "python-django-doc",
        "3:3.2.25-0+deb12u7",
        "BSD-3-Clause",
        ("usr/share/doc/python-django-doc/html/*.html", "usr/share/doc/python-django-doc/html/*/*"),
        ("*/genindex*", "*/py-modindex*", "*/search.html", "*/_static/*", "*/releases/*"),
    ),
    Source(
        "postgresql-doc-15",
        "15.20-0+deb12u1",
        "PostgreSQL License (MIT-style)",
        ("usr/share/doc/postgresql-doc-15/html/*.html",),
        ("*/release-*", "*/bookindex.html"),
    ),
    Source(
        "sqlite3-doc",
        "3.40.1-2+deb12u2",
        "public domain (SQLite documentation)",
        ("usr/share/doc/sqlite3/*.html", "usr/share/doc/sqlite3/*/*.html"),
        ("*/releaselog/*", "*/changes.html", "*/chronology.html", "*/doclist.html"),
    ),
    Source(
        "rust-doc",
        "1.63.0+dfsg1-2",
        "MIT OR Apache-2.0",
        tuple(
            f"usr/share/doc/rust-doc/html/{book}/*"
            for book in (
                "book",
                "reference",
                "nomicon",
                "rust-by-example",
                "edition-guide",
                "embedded-book",
                "rustc",
                "rustdoc",
            )
        ),
        ("*/print.html", "*/404.html", "*/toc.html"),
    ),
)

HELDOUT_PERCENT = 2
MIN_PARAGRAPH_CHARS = 30
MIN_DOCUMENT_CHARS = 200

_BLOCK_TAGS = frozenset(
    {"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "div", "br"}
)
_KEPT_TAGS = frozenset({"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote"})
_SKIPPED_TAGS = frozenset({"script", "style", "pre", "table", "nav", "head", "header", "footer"})
_SKIPPED_CLASSES = frozenset(
    {
        "sphinxsidebar",
        "related",
        "footer",
        "navheader",
        "navfooter",
        "toc",
        "sidebar",
        "menu",
        "nav-chapters",
        "headerlink",
        "highlight",
        "menu_overlay",
        "fancy_toc",
        "codeblock",
        "toctree-wrapper",
        "admonition-title",
    }
)
_SPACE_RE = re.compile(r"\s+")


class _ProseExtractor(HTMLParser):
    """Collects the text of prose blocks; text inside a skipped subtree never reaches `blocks`."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._parts: list[str] = []
        self._skip_tag: str | None = None
        self._skip_depth = 0
        self._kept_depth = 0

    def _flush(self) -> None:
        text = _SPACE_RE.sub(" ", "".join(self._parts)).strip()
        self._parts = []
        if text:
            self.blocks.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth += 1
            return
        classes = set()
        for name, value in attrs:
            if name == "class" and value:
                classes.update(value.split())
            if name == "role" and value == "navigation":
                classes.add("sidebar")
        if tag in _SKIPPED_TAGS or classes & _SKIPPED_CLASSES:
            if tag not in ("br", "img", "hr", "meta", "link", "input"):
                self._skip_tag = tag
                self._skip_depth = 1
            return
        if tag in _BLOCK_TAGS:
            self._flush()
        if tag in _KEPT_TAGS:
            self._kept_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skip_tag = None
            return
        if tag in _BLOCK_TAGS:
            if self._kept_depth > 0:
                self._flush()
            else:
                self._parts = []
        if tag in _KEPT_TAGS and self._kept_depth > 0:
            self._kept_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._skip_tag is None and self._kept_depth > 0:
            self._parts.append(data)

    def close(self) -> None:
        super().close()
        if self._kept_depth > 0:
            self._flush()


def html_to_paragraphs(html: str) -> list[str]:
    """Prose paragraphs of an HTML page, whitespace-normalised, in document order."""
    parser = _ProseExtractor()
    parser.feed(html)
    parser.close()
    return parser.blocks


def _is_english_prose(paragraph: str) -> bool:
    if len(paragraph) < MIN_PARAGRAPH_CHARS:
        return False
    ascii_letters = sum(c.isascii() and c.isalpha() for c in paragraph)
    spaces = paragraph.count(" ")
    # Mostly letters and several words: drops signatures, symbol lists and non-English text.
    return ascii_letters >= 0.6 * len(paragraph) and spaces >= 4


def fetch_deb(source: Source, debs_dir: Path) -> Path:
    """The .deb of `source` in `debs_dir`, downloaded with apt-get when missing."""
    version_in_name = source.version.replace(":", "%3a")
    name = f"{source.package}_{version_in_name}_all.deb"
    path = debs_dir / name
    if not path.exists():
        subprocess.run(
            ["apt-get", "download", f"{source.package}={source.version}"],
            cwd=debs_dir,
            check=True,
        )
    if not path.exists():
        raise FileNotFoundError(f"apt-get download did not produce {path}")
    return path


def iter_deb_files(deb: Path, source: Source) -> Iterator[tuple[str, str]]:
    """(path, text) of each file in `deb` that matches the source's globs and no exclude."""
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if not member.isfile() or not name.endswith(".html"):
                    continue
                if not any(fnmatch.fnmatch(name, g) for g in source.globs):
                    continue
                if any(fnmatch.fnmatch(name, g) for g in source.excludes):
                    continue
                handle = tar.extractfile(member)
                if handle is not None:
                    yield name, handle.read().decode("utf-8", errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"dpkg-deb failed on {deb} with exit code {proc.returncode}")


def is_heldout(path: str) -> bool:
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def build(out_dir: Path, debs_dir: Path) -> dict[str, object]:
    out_dir.mkdir(parents=True, exist_ok=True)
    debs_dir.mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = set()
    splits: dict[str, list[dict[str, str]]] = {"train": [], "heldout": []}
    stats: list[dict[str, object]] = []
    for source in SOURCES:
        deb = fetch_deb(source, debs_dir)
        num_docs = 0
        num_chars = 0
        for path, html in iter_deb_files(deb, source):
            kept = []
            for paragraph in html_to_paragraphs(html):
                if not _is_english_prose(paragraph):
                    continue
                key = hashlib.sha1(paragraph.lower().encode()).digest()
                if key in seen:
                    continue
                seen.add(key)
                kept.append(paragraph)
            text = "\n\n".join(kept)
            if len(text) < MIN_DOCUMENT_CHARS:
                continue
            split = "heldout" if is_heldout(path) else "train"
            splits[split].append({"source": source.package, "path": path, "text": text})
            num_docs += 1
            num_chars += len(text)
        stats.append(
            {
                "package": source.package,
                "version": source.version,
                "license": source.license,
                "documents": num_docs,
                "characters": num_chars,
            }
        )
        print(f"{source.package}={source.version}: {num_docs} documents, {num_chars:,} chars")
    for split, docs in splits.items():
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    manifest: dict[str, object] = {
        "sources": stats,
        "train_documents": len(splits["train"]),
        "heldout_documents": len(splits["heldout"]),
        "train_characters": sum(len(d["text"]) for d in splits["train"]),
        "heldout_characters": sum(len(d["text"]) for d in splits["heldout"]),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".device_carry/corpus"))
    parser.add_argument("--debs", type=Path, default=Path(".device_carry/debs"))
    args = parser.parse_args()
    manifest = build(args.out, args.debs)
    print(json.dumps({k: v for k, v in manifest.items() if k != "sources"}, indent=2))


if __name__ == "__main__":
    main()
