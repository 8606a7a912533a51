"""report.html's figures: a bare matplotlib Figure, saved as an inline SVG (text kept as text, stable ids).
Shared by html.py's plots and serving_view.py's."""
from __future__ import annotations

import io
import re


def figure(width: float, height: float):
    # A bare Figure, not pyplot: no global state, no GUI backend.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def svg(fig, name: str) -> str:
    import matplotlib

    buffer = io.StringIO()
    # Text stays text (searchable, small) and ids are stable across renders of the same data.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "optpipe"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):].strip()  # drop the XML declaration and DOCTYPE: inline SVG in HTML
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)  # RDF boilerplate, links to purl.org
    return f"<figure class='plot' id='plot-{name}'>{text}</figure>"
