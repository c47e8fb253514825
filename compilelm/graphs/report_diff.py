"""A side-by-side HTML diff of a graph before and after a pass, folded to the changed regions
(`compile --dump`'s report.html). Lines are compared without FX's trailing `;  x = None`
bookkeeping, so a pass that only renames or frees nothing shows no change there."""

from __future__ import annotations

import difflib
import html
import re

_FREES = re.compile(r";\s+(\w+ = )+None$")
_DIGITS = re.compile(r"\d+")


def _key(line: str) -> str:
    return _FREES.sub("", line.rstrip())


def diff_stats(before: str, after: str) -> tuple[int, int]:
    """(lines removed, lines added)."""
    a, b = [_key(x) for x in before.splitlines()], [_key(x) for x in after.splitlines()]
    removed = added = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            removed, added = removed + i2 - i1, added + j2 - j1
    return removed, added


def folded_diff(before: str, after: str, context: int = 2, max_rows: int = 600) -> str:
    """`<table class="diff">`: line numbers and text of both sides, changed rows marked, one
    `<tbody>` per changed region (with `context` lines around it); "" when nothing changed. A
    region that repeats one shown before up to numbers (the same rewrite in every layer) is
    counted on that one instead of shown again."""
    a_lines, b_lines = before.splitlines(), after.splitlines()
    a, b = [_key(x) for x in before.splitlines()], [_key(x) for x in after.splitlines()]
    groups = list(difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context))
    if not groups:
        return ""
    shown: dict[tuple, list] = {}  # the region's shape -> [its first group, how many]
    for group in groups:
        shape = tuple((tag, *(_DIGITS.sub("#", x) for x in a[i1:i2] + b[j1:j2])) for tag, i1, i2, j1, j2 in group)
        shown.setdefault(shape, [group, 0])[1] += 1
    out, rows = ['<table class="diff"><colgroup><col class="ln"><col><col class="ln"><col></colgroup>'], 0
    for group, count in shown.values():
        if rows >= max_rows:
            out.append('<tbody><tr><td colspan="4" class="fold">… more changed regions: see the files</td></tr>'
                       "</tbody>")
            break
        first = group[0]
        again = f" (and {count - 1} more like it, up to numbers)" if count > 1 else ""
        out.append(f'<tbody><tr><td colspan="4" class="fold">@@ before line {first[1] + 1}, '
                   f'after line {first[3] + 1}{again}</td></tr>')
        for tag, i1, i2, j1, j2 in group:
            for k in range(max(i2 - i1, j2 - j1)):
                i, j = i1 + k, j1 + k
                out.append(_row(tag, (i + 1, a_lines[i]) if i < i2 else None, (j + 1, b_lines[j]) if j < j2 else None))
                rows += 1
        out.append("</tbody>")
    out.append("</table>")
    return "".join(out)


def _row(tag: str, left, right) -> str:
    cls = {"equal": "", "replace": "chg", "delete": "del", "insert": "add"}[tag]

    def cells(side, mark):
        if side is None:
            return '<td class="ln"></td><td class="empty"></td>'
        return f'<td class="ln">{side[0]}</td><td class="{mark if cls else ""}">{html.escape(side[1])}</td>'

    return f"<tr>{cells(left, 'old')}{cells(right, 'new')}</tr>"
