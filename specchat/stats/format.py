"""Numbers and tables as the Stats tab and the CLI show them."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# Formatting shared by the CLI and the Stats tab, so both show the same numbers.

def models_label(target: str | None, draft: str | None) -> str:
    return f"{target or '?'} + {draft}" if draft else (target or "?")


def fmt_speedup(value: float | None, sign: str = "x") -> str:
    """A speedup to two decimals ("1.11x"; the page writes "1.11×"); "—" without one. Every
    view rounds through here, so they show the same figure."""
    return f"{value:.2f}{sign}" if value is not None else "—"


ESTIMATED = "est"  # a figure's basis when it is estimated from its turn's own steps


def fmt_figure(value: float | None, basis: str = "", low: float | None = None,
               high: float | None = None, sign: str = "x") -> str:
    """A turn's speedup as every view shows it: "2.47x" when measured against a plain run of
    the same prompt (A/B), "≈2.10x est. (1.80–2.50x)" when estimated from the turn's own
    steps, with its band; "—" without a figure (stats/speedup.py defines both)."""
    if value is None:
        return "—"
    if basis != ESTIMATED:
        return fmt_speedup(value, sign)
    band = f" ({low:.2f}–{high:.2f}{sign})" if low is not None and high is not None else ""
    return f"≈{value:.2f}{sign} est.{band}"


def fmt_mean(value: float | None, basis: str = "", sign: str = "x") -> str:
    """A conversation's geometric mean: "2.47x" over A/B pairs, "≈1.80x est." over
    estimates; "—" without one."""
    if value is None or basis != ESTIMATED:
        return fmt_speedup(value, sign)
    return f"≈{value:.2f}{sign} est."


def fmt_percent(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "-"


def fmt_number(value: float | None, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def fmt_date(iso: str | None) -> str:
    """'2026-05-01T12:34:56+00:00' -> '2026-05-01 12:34 UTC'."""
    return f"{iso[:10]} {iso[11:16]} UTC" if iso else ""


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in lines)


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
