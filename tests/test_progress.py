from __future__ import annotations

import io

from kvcached.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal():
    out = FakeTty()
    p = Progress(4, "rebuilding", stream=out)
    for _ in range(4):
        p.update()
    p.finish("4 chunks")
    text = out.getvalue()
    assert "\rrebuilding: [" in text and "4/4" in text and text.endswith("\n")


def test_timed_lines_otherwise(caplog):
    out = io.StringIO()
    p = Progress(3, "rebuilding", stream=out, every_s=0.0)
    with caplog.at_level("INFO", logger="kvcached"):
        for _ in range(3):
            p.update()
        elapsed = p.finish("3 chunks")
    assert out.getvalue() == ""  # nothing drawn on a non-terminal
    msgs = [r.getMessage() for r in caplog.records]
    assert any("rebuilding: 2/3 after" in m for m in msgs)
    assert msgs[-1].startswith("rebuilding: 3 chunks in ") and elapsed >= 0
