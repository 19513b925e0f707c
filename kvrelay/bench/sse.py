"""Incremental Server-Sent Events parsing (the subset OpenAI-compatible servers send).

Events are separated by a blank line; `data:` lines of one event join with "\n"; lines
starting with ":" are comments; other fields (event:, id:, retry:) are ignored. Text may
arrive split anywhere, including inside a line or between "\r" and "\n".
"""
from __future__ import annotations

import re

_EOL = re.compile(r"\r\n|\r|\n")


class SSEParser:
    """Feed text as it arrives; get back the `data` of every event completed so far."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        events: list[str] = []
        while True:
            line, ending = self._next_line()
            if ending is None:
                return events
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value.removeprefix(" "))

    def flush(self) -> list[str]:
        """The last event when the stream ended without its blank line."""
        events = self.feed("\n\n") if (self._buffer or self._data) else []
        self._buffer = ""
        return events

    def _next_line(self) -> tuple[str, str | None]:
        m = _EOL.search(self._buffer)
        if m is None or (m.group() == "\r" and m.end() == len(self._buffer)):
            return "", None                         # no full line yet ("\r" may precede "\n")
        line, self._buffer = self._buffer[:m.start()], self._buffer[m.end():]
        return line, m.group()
