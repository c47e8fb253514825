"""A dump's report.html read with the standard library's HTML parser: every element's text by
id, every link, every attribute that could fetch something."""

from __future__ import annotations

from html.parser import HTMLParser

_VOID = {"br", "col", "meta", "img", "hr", "input", "link", "wbr"}


class Page(HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.text: dict[str, str] = {}  # id -> the text inside that element
        self.tags: dict[str, str] = {}  # id -> its tag
        self.links: list[str] = []  # every href
        self.fetches: list[str] = []  # src=, <link href>, url(...) in style: what a browser would load
        self._open: list[tuple[str, str | None]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "href" in attrs and tag == "a":
            self.links.append(attrs["href"])
        if "src" in attrs or tag == "link" or "url(" in (attrs.get("style") or ""):
            self.fetches.append(f"<{tag} {attrs}>")
        if tag in _VOID:
            return
        if attrs.get("id"):
            self.text[attrs["id"]] = ""
            self.tags[attrs["id"]] = tag
        self._open.append((tag, attrs.get("id")))

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, ident in self._open:
            if ident:
                self.text[ident] += data


def read_report(root) -> Page:
    """report.html of the dump at `root`, checked to be self-contained and to link only to
    anchors it has and files the dump has."""
    import os
    from urllib.parse import unquote

    with open(os.path.join(root, "report.html")) as f:
        page = Page(f.read())
    assert page.fetches == [], page.fetches  # nothing loaded from anywhere
    for href in page.links:
        assert "://" not in href, href
        if href.startswith("#"):
            assert unquote(href[1:]) in page.text, f"no element {href}"
        else:
            assert os.path.exists(os.path.join(root, unquote(href))), f"no file {href}"
    return page
