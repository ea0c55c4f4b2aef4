"""A pytest plugin (`-p gpu_trace`, with this directory on the path): each test's start and
outcome, and a failure's report, appended to the file `GRAPHDRAFT_TEST_TRACE` names as they
happen, so a process that dies mid-run (a CUDA device-side assert aborts it before pytest prints
its failure reports) leaves which test it died in and the reports of the failures before it.

Lines: ``start <nodeid>``; ``<outcome> <nodeid>`` (passed / failed / skipped: a test's call
phase, or a setup / teardown phase that failed or skipped); after a ``failed`` line, the
report's last lines indented by two spaces. Nothing is written when the variable is unset."""

from __future__ import annotations

import os

_REPORT_LINES = 80


def _write(text: str) -> None:
    path = os.environ.get("GRAPHDRAFT_TEST_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)


def pytest_runtest_logstart(nodeid, location):
    _write(f"start {nodeid}\n")


def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.failed or report.skipped):
        return
    text = f"{report.outcome} {report.nodeid}\n"
    if report.failed:
        lines = report.longreprtext.splitlines()[-_REPORT_LINES:]
        text += "".join(f"  {ln}\n" for ln in lines)
    _write(text)
