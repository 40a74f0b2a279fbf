"""A report page read back: its sections, images, SQL blocks and numbers (`actdb report`)."""

from __future__ import annotations

from html.parser import HTMLParser


class ReportPage(HTMLParser):
    """Sections, images, SQL blocks and numbers of the report page."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[str] = []
        self.numbers: dict[str, tuple[str, str]] = {}  # key -> (data-value, shown text)
        self.sql: list[str] = []
        self.links: list[str] = []
        self._in: tuple[str, str] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.sections.append(a["data-section"])
        if tag == "img":
            self.images.append(a["src"])
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]
        if tag == "span" and a.get("class") == "num":
            self._in = ("num", a["data-key"] + "\0" + a["data-value"])
        if tag == "pre" and a.get("class") == "sql":
            self._in = ("sql", "")
        self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._in and tag in ("span", "pre"):
            kind, info = self._in
            text = "".join(self._text)
            if kind == "num":
                key, value = info.split("\0")
                self.numbers[key] = (value, text)
            else:
                self.sql.append(text)
            self._in = None
